"""Regenerate the bundled corpora in ``recurformer/data/corpora/`` from a folder of source texts.

Dev-only (the library never reads the source folder). Usage::

    python scripts/make_corpora.py --src DATA_DIR

Outputs (xz-compressed UTF-8 text, documents separated by ``<|endoftext|>\\n``):

* ``tinystories_train.txt.xz`` / ``tinystories_val.txt.xz`` - lower-cased TinyStories, one story
  per document (see corpora/README.md for how the two train source files are merged).
* ``tinystories_cased_train.txt.xz`` / ``tinystories_cased_val.txt.xz`` - the TinyStories that
  exist in original case (2,316 train stories, the same 1,000 val stories), normalized alike.
* ``warpeace.txt.xz`` - War and Peace, one document (BOM stripped, CRLF -> LF).
* ``books_train.txt.xz`` / ``books_val.txt.xz`` - public-domain books, one book per document.
"""

from __future__ import annotations

import argparse
import lzma
import re
from pathlib import Path

EOT = "<|endoftext|>"
OUT = Path(__file__).resolve().parent.parent / "recurformer" / "data" / "corpora"
BOOKS_VAL = ["a_christmas_carol", "the_time_machine", "treasure_island", "the_hound_of_the_baskervilles"]


def fix_mojibake(text: str) -> str:
    """Undo UTF-8 text that was decoded as cp1252 (``â€œ`` -> ``“``), also after lower-casing.

    The ``â€`` + third-byte sequences are mapped first (the cased form before the lower-cased one so
    ``œ`` stays ``“`` rather than ``Œ``'s ZWNJ); a bare ``â€`` is ``”`` (byte 0x9d has no cp1252 char
    and was lost); other non-ASCII runs are re-decoded when that is valid UTF-8.
    """
    for lowered in (False, True):
        for b in range(0x80, 0xC0):
            try:
                ch = bytes([b]).decode("cp1252")
                fixed = bytes([0xE2, 0x80, b]).decode("utf-8")
            except UnicodeDecodeError:
                continue
            text = text.replace("â€" + (ch.lower() if lowered else ch), fixed)
    text = text.replace("â€", "”")

    def redecode(m: re.Match[str]) -> str:
        run = m.group()
        for cand in (run, run.replace("ã", "Ã").replace("â", "Â")):
            try:
                return cand.encode("cp1252").decode("utf-8")
            except (UnicodeEncodeError, UnicodeDecodeError):
                pass
        return run

    return re.sub(r"[^\x00-\x7f]+", redecode, text)


def normalize_story(story: str, lower: bool = True) -> str:
    """Lower-case (unless ``lower`` is false), one paragraph per line, no trailing spaces, no blank lines."""
    text = re.sub(r"[ \t]*\n\s*", "\n", story.strip())
    return text.lower() if lower else text


def tinystories_cased(src: Path) -> tuple[list[str], list[str]]:
    """The stories that exist in original case: the eot train file's complete stories (the first
    2,316 of the lower-case train set) and the val eot file, normalized as above but not lower-cased."""
    eot_text = fix_mojibake((src / "tinystories_train_head_cased_eot.txt").read_text(encoding="utf-8"))
    train = [normalize_story(s, lower=False) for s in eot_text.split(EOT)[:-1]]  # the last story is cut at 2 MiB
    val_text = fix_mojibake((src / "tinystories_val_head_eot.txt").read_text(encoding="utf-8"))
    return train, [normalize_story(s, lower=False) for s in val_text.split(EOT) if s.strip()]


def tinystories_train(src: Path) -> tuple[list[str], dict[str, int]]:
    eot_text = fix_mojibake((src / "tinystories_train_head_cased_eot.txt").read_text(encoding="utf-8"))
    eot_stories = [s.strip() for s in eot_text.split(EOT)][:-1]  # the last story is cut at 2 MiB
    low = fix_mojibake((src / "tinystories_train_head_lowercase.txt").read_text(encoding="utf-8"))
    # Walk the lowercase file story by story (whitespace-insensitive) to find where the eot part ends.
    pos = 0
    for story in eot_stories:
        pattern = r"\s+".join(map(re.escape, story.lower().split()))
        m = re.compile(pattern).search(low, pos)
        if m is None or m.start() - pos > 2:
            raise SystemExit(f"could not align story {story[:60]!r} in the lowercase file")
        pos = m.end()
    # In the lowercase file a story ends with a lone "\n"; paragraphs are separated by blank lines.
    rest = [s for s in re.split(r"(?<=[^\s])\n(?=[^\s])", low[pos:].strip()) if s.strip()]
    if not re.search(r"[.!?\"”]\s*$", rest[-1]):
        rest.pop()  # a story cut by the 4.2 MB mark
    stories = [normalize_story(s) for s in eot_stories + rest]
    return stories, {"from_eot_file": len(eot_stories), "from_lowercase_file": len(rest)}


def write_docs(path: Path, docs: list[str]) -> None:
    data = "".join(d + "\n" + EOT + "\n" for d in docs).encode("utf-8")
    path.write_bytes(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))
    print(f"{path.name}: {len(docs)} documents, {len(data):,} bytes -> {path.stat().st_size:,} bytes xz")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, required=True, help="folder of the source texts (see corpora/README.md)")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)

    train, counts = tinystories_train(args.src)
    print(f"tinystories train: {counts}")
    write_docs(OUT / "tinystories_train.txt.xz", train)
    val_text = fix_mojibake((args.src / "tinystories_val_head_eot.txt").read_text(encoding="utf-8"))
    write_docs(OUT / "tinystories_val.txt.xz", [normalize_story(s) for s in val_text.split(EOT) if s.strip()])

    cased_train, cased_val = tinystories_cased(args.src)
    write_docs(OUT / "tinystories_cased_train.txt.xz", cased_train)
    write_docs(OUT / "tinystories_cased_val.txt.xz", cased_val)

    wp = (args.src / "warpeace_input.txt").read_text(encoding="utf-8-sig").replace("\r\n", "\n")
    write_docs(OUT / "warpeace.txt.xz", [wp.strip()])

    books = sorted((args.src / "books").glob("*.txt"))
    read = {p.stem: p.read_text(encoding="utf-8").strip() for p in books}
    write_docs(OUT / "books_train.txt.xz", [t for name, t in read.items() if name not in BOOKS_VAL])
    write_docs(OUT / "books_val.txt.xz", [read[name] for name in BOOKS_VAL])


if __name__ == "__main__":
    main()
