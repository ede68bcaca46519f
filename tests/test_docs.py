"""The public docs hold together: every relative link in the README, docs/, benchmarks/,
experiments/ and dev/ names a file (and, for a Markdown target with ``#anchor``, one of its headings), public
text carries no internal words (work periods, internal paper numbers, private paths), the
one-study configs under experiments/ still load, and the results read as a product: every claim
row of docs/results/README.md names its page, hardware and date, and every results page gives
hardware, date and a command in at most MAX_PAGE_LINES lines."""

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
        *(ROOT / "dev").rglob("*.md"),
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


def test_results_data_holds_only_what_a_page_cites() -> None:
    """Every file or folder under docs/results/data/<topic>/ is named by a page outside dev/ (a plot
    or table by the JSON beside it); superseded and A/B runs live in dev/data/, quoted by dev/LOG.md."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in PAGES if ROOT / "dev" not in p.parents)
    entries = sorted((ROOT / "docs" / "results" / "data").glob("*/*"))
    assert entries
    named = [e for e in entries if e.name in text or e.with_suffix(".json").name in text]
    assert [str(e.relative_to(ROOT)) for e in entries if e not in named] == []


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
    """Every YAML under experiments/ is a training config that loads, or a study config that loads
    by name (a synth config, checked as one in tests/synth/test_recipes.py::test_synth_config_files)."""
    from recurformer.config import load_yaml, study_configs
    from recurformer.training.config import load_run_config

    configs = sorted((ROOT / "experiments").rglob("*.yaml"))
    studies = study_configs()
    assert configs and studies
    for name, path in studies.items():
        assert load_yaml(name) == load_yaml(path) and "synth" in load_yaml(path), name
    for path in configs:
        if path not in studies.values():
            assert load_run_config(str(path)).model["name"], path


def test_benchmarks_readme_lists_every_script() -> None:
    listed = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    scripts = sorted(p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh"))
    assert scripts and [s for s in scripts if f"`{s}`" not in listed] == []


# -- the results: one row per claim, each page with hardware, date and command -----------------------

RESULTS = ROOT / "docs" / "results"
MAX_PAGE_LINES = 300  # the current table per question, room for a short new one; superseded runs go to dev/LOG.md
CLAIMS_HEADER = "| claim | number | hardware | date | page |"
DATE = re.compile(r"\b20\d\d-[01]\d(-[0-3]\d)?\b")
MACHINE = re.compile(r"AMD EPYC|x86-64|NVIDIA|\bin CI\b")  # a page names its machine, or says it is tests in CI
COMMAND = re.compile(
    r"^\s*(?:[A-Z_]+=\S*\s+)*(?:python3?|\.venv/bin/\w+|recurformer|pytest|benchmarks/|experiments/|scripts/)",
    re.MULTILINE,
)


def claim_rows(index: str) -> list[list[str]]:
    """The cells of each row of the index's claims table (the rows under ``CLAIMS_HEADER``)."""
    lines = index.split(CLAIMS_HEADER, 1)[1].splitlines()[2:]  # past the header's |---| line
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return rows


def hardware_names(index: str) -> set[str]:
    """The names of the index's Hardware table."""
    return set(re.findall(r"^\| ([\w-]+) \| ", index.split("## Hardware", 1)[1], flags=re.MULTILINE)) - {"name"}


def row_problems(row: list[str], hardware: set[str], pages: set[str]) -> list[str]:
    """What a claim row lacks: five cells, a known machine (or tests), a date, a link to a results page."""
    if len(row) != 5:
        return [f"{len(row)} cells, not 5"]
    _, _, machine, date, page = row
    problems = []
    tests = machine.startswith("tests")
    if not tests and machine.split()[0].rstrip(",") not in hardware:
        problems.append(f"hardware {machine!r} is not in the Hardware table")
    if not (DATE.fullmatch(date) or (tests and date == "–")):
        problems.append(f"date {date!r}")
    linked = {t.partition("#")[0] for t in LINK.findall(page)}
    if not linked or not linked <= pages:
        problems.append(f"page {page!r} links no results page")
    return problems


def page_problems(text: str, dated: bool = True) -> list[str]:
    """What a results page lacks: its machine, a date (``dated``: it reports measurements, not tests
    only), a command in a code block, and a length within MAX_PAGE_LINES."""
    code = "\n".join(re.findall(r"```.*?```", text, flags=re.DOTALL))
    problems = []
    if not MACHINE.search(text):
        problems.append("no hardware")
    if dated and not DATE.search(text):
        problems.append("no date")
    if not COMMAND.search(code):
        problems.append("no command")
    if len(text.splitlines()) > MAX_PAGE_LINES:
        problems.append(f"{len(text.splitlines())} lines > {MAX_PAGE_LINES}")
    return problems


INDEX = (RESULTS / "README.md").read_text(encoding="utf-8")
TOPIC_PAGES = sorted(p for p in RESULTS.glob("*.md") if p.name != "README.md")


def test_every_claim_row_names_its_page_hardware_and_date() -> None:
    rows = claim_rows(INDEX)
    assert 0 < len(rows) <= 25  # one row per claim, its current number only
    hardware, pages = hardware_names(INDEX), {p.name for p in TOPIC_PAGES}
    assert {row[0]: row_problems(row, hardware, pages) for row in rows if row_problems(row, hardware, pages)} == {}


@pytest.mark.parametrize("page", TOPIC_PAGES, ids=lambda p: p.name)
def test_results_page_gives_hardware_date_and_command(page: Path) -> None:
    rows = [r for r in claim_rows(INDEX) if len(r) == 5 and page.name in r[4]]
    dated = not rows or any(r[3] != "–" for r in rows)  # a page of tests only (date "–") needs no date
    assert page_problems(page.read_text(encoding="utf-8"), dated) == []


def test_results_checks_see_a_bad_row_and_a_bad_page() -> None:
    index = f"{CLAIMS_HEADER}\n|---|---|---|---|---|\n| a | 1 | m1 | 2026-11 | [p](p.md) |\n"
    index += "| no page | 1 | m1 | 2026-11 | p |\n| unknown machine, no date | 1 | m9 | soon | [p](p.md) |\n"
    index += "| four cells | 1 | m1 | [p](p.md) |\n\n## Hardware\n\n| name | machine |\n|---|---|\n| m1 | AMD EPYC |\n"
    rows = claim_rows(index)
    hardware = hardware_names(index)
    assert hardware == {"m1"} and [len(row_problems(r, hardware, {"p.md"})) for r in rows] == [0, 1, 2, 1]
    good = "# P\n\nAMD EPYC, 2026-11-27.\n\n```bash\nOMP_NUM_THREADS=2 python benchmarks/peers.py\n```\n"
    assert page_problems(good) == []
    assert page_problems(good.replace("AMD EPYC", "a machine")) == ["no hardware"]
    assert page_problems(good.replace("2026-11-27", "today")) == ["no date"]
    assert page_problems(good.replace("2026-11-27", "today"), dated=False) == []
    assert page_problems(good.replace("python benchmarks/peers.py", "done")) == ["no command"]
    long = good + "line\n" * MAX_PAGE_LINES
    assert page_problems(long) == [f"{len(long.splitlines())} lines > {MAX_PAGE_LINES}"]


# -- the README's first screen, headline numbers and layout ----------------------------------------

README = (ROOT / "README.md").read_text(encoding="utf-8")
COMMAND_1 = ".venv/bin/recurformer train --config tinystories-cpu"
NUMBER = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?(?:e-?\d+)?")  # not the 64 of float64, the 200 of H200


def headline_problems(readme: str, index: str) -> list[str]:
    """The numbers of each README headline answer that are not in the results index's rows that
    link the same page (and anchor): a headline says what the index says now, nothing older."""
    table = readme.split("## Headline results", 1)[1].split("\n\n")[1]
    problems = []
    for line in table.splitlines()[2:]:
        _, answer, page = [c.strip() for c in line.strip().strip("|").split(" | ")]
        target = LINK.findall(page)[0].removeprefix("docs/results/")
        rows = [r for r in claim_rows(index) if target in LINK.findall(r[4])]
        said = set(NUMBER.findall(" ".join(c for r in rows for c in r[:2])))
        missing = [n for n in NUMBER.findall(answer) if n not in said]
        if not rows or missing:
            problems.append(f"{target}: {missing if rows else 'no index row links it'}")
    return problems


def test_readme_command_1_is_on_its_first_screen() -> None:
    before = README[: README.index(COMMAND_1)]
    assert len(before.splitlines()) <= 15 and len(before) <= 1500


def test_readme_headline_numbers_are_the_results_index() -> None:
    assert headline_problems(README, INDEX) == []


def test_headline_check_sees_a_stale_number() -> None:
    stale = README.replace("0.984 / 1.000 / 1.000 / 1.000 on 4 of 4", "0.844 / 1.000 / 1.000 / 1.000 on 4 of 4")
    assert stale != README and headline_problems(stale, INDEX) == [
        "memory.md#writes-closed-at-initialisation-the-key-at-1024: ['0.844']"
    ]


def test_readme_layout_names_every_module() -> None:
    layout = README.split("## Layout", 1)[1].split("```")[1]
    package = ROOT / "recurformer"
    modules = [p for p in package.rglob("*.py") if p.stem not in ("__init__", "__main__") and p.parent.name != "data"]
    assert [str(p.relative_to(package)) for p in modules if not re.search(rf"\b{p.stem}\b", layout)] == []
