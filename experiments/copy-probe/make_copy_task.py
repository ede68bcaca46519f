"""Write the short copy task of the copy-probe experiment (docs/results/probe.md) as a text file
for ``recurformer prepare --text``.

Each document is ``sentence \\n distractor \\n Repeat above. \\n sentence``: a story's first sentence,
the rest of the story as a distractor (topped up from a story half the corpus away when shorter than
``--min-gap`` characters, cut at a word at ``--max-gap``), the marker, and the sentence again.
With ~4.3 characters per BPE token on the bundled TinyStories sample, 650 characters put the
sentence more than 130 tokens before its copy: beyond the receptive field of a 32-token window
over 4 layers (124). Documents are separated by ``<|endoftext|>``.

    python experiments/copy-probe/make_copy_task.py --out copy_sentence.txt     # also writes copy_sentence_val.txt
    recurformer prepare --text copy_sentence.txt
    recurformer probe --checkpoint RUN --text copy_sentence_val.txt

The training file holds the train stories only (``prepare`` keeps its last 5% for validation
during training); ``*_val.txt`` holds the bundled val stories, never trained on, for the probe.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from recurformer.data.prepare import EOT, REPEAT_PROMPT, bundled_corpus

SENTENCE = re.compile(r"(.+?[.!?])\s+", re.S)


def copy_documents(stories: list[str], min_gap: int, max_gap: int) -> list[str]:
    docs = []
    for i, story in enumerate(stories):
        m = SENTENCE.match(story)
        if m is None or "\n" in m.group(1):
            continue
        sentence, rest = m.group(1), story[m.end() :]
        j = i + len(stories) // 2  # far from this story's neighbours, which are documents of their own
        while len(rest) < min_gap:
            rest += "\n" + stories[j % len(stories)]
            j += 1
        if len(rest) > max_gap:
            rest = rest[: rest.rfind(" ", 0, max_gap)]
        docs.append(f"{sentence}\n{rest.strip()}\n{REPEAT_PROMPT}\n{sentence}")
    return docs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--min-gap", type=int, default=650, help="distractor characters, at least")
    ap.add_argument("--max-gap", type=int, default=900, help="distractor characters, at most")
    args = ap.parse_args()
    val_out = args.out.with_name(f"{args.out.stem}_val{args.out.suffix}")
    for corpus, path in (("tinystories_train", args.out), ("tinystories_val", val_out)):
        docs = copy_documents(bundled_corpus(corpus), args.min_gap, args.max_gap)
        path.write_text(f"\n{EOT}\n".join(docs))
        print(f"wrote {path}: {len(docs):,} documents, {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
