"""The public docs hold together: every relative link in the README, docs/, benchmarks/ and
experiments/ names a file (and, for a Markdown target with ``#anchor``, one of its headings), public
text carries no internal words (work periods, internal paper numbers, private paths), and the
one-study configs under experiments/ still load."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(
    [
        ROOT / "README.md",
        *(ROOT / "docs").rglob("*.md"),
        *(ROOT / "benchmarks").glob("*.md"),
        *(ROOT / "experiments").rglob("*.md"),
    ]
)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# work periods, issue numbers, internal paper numbers ("seed 000", "the seed's"), private paths
INTERNAL = re.compile(
    r"\bsessions? [0-9]|\bissues? [0-9]|\bseed (00[0-4]|paper|§|table)|\bseed('s|s')|/root/|/work/", re.IGNORECASE
)


def prose(page: Path) -> str:
    """A page without its code blocks (commands and comments there are neither links nor headings)."""
    return re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#{1,6} +(.+?) *$", prose(page), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def links(page: Path) -> list[str]:
    """Relative link targets (http:, https:, mailto: are not checked)."""
    return [t for t in LINK.findall(prose(page)) if not re.match(r"[a-z]+:", t)]


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
            bad.append(target)
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


def test_link_check_sees_a_broken_link(tmp_path: Path) -> None:
    page = "# Top part\n\n[ok](a.md#top-part) [file](b.md) [gone](c.md) [no heading](a.md#no)\n"
    (tmp_path / "a.md").write_text(page)
    (tmp_path / "b.md").write_text("b\n")
    assert broken_links(tmp_path / "a.md") == ["c.md", "a.md#no"]


def test_results_index_links_every_topic_page() -> None:
    index = ROOT / "docs" / "results" / "README.md"
    linked = {t.partition("#")[0] for t in links(index)}
    pages = {p.name for p in index.parent.glob("*.md")} - {"README.md"}
    assert pages and pages <= linked


def test_public_text_has_no_internal_words() -> None:
    roots = [ROOT / "README.md", ROOT / "docs", ROOT / "recurformer", ROOT / "benchmarks", ROOT / "experiments"]
    files = [
        f for r in roots for f in ([r] if r.is_file() else r.rglob("*")) if f.is_file() and "__pycache__" not in f.parts
    ]
    hits = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # binary (plots, compressed corpora)
            continue
        hits += [f"{f.relative_to(ROOT)}:{n}" for n, line in enumerate(text.splitlines(), 1) if INTERNAL.search(line)]
    assert hits == []


def test_experiment_configs_load() -> None:
    from recurformer.train import load_run_config

    configs = sorted((ROOT / "experiments").rglob("*.yaml"))
    assert configs
    for path in configs:
        assert load_run_config(str(path)).model["name"], path


def test_benchmarks_readme_lists_every_script() -> None:
    listed = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    scripts = sorted(p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh"))
    assert scripts and [s for s in scripts if f"`{s}`" not in listed] == []
