"""What a trivial reader scores on the bAbI-style tasks in book text (``recurformer/data/babi.py``):
the floor a trained model must beat before its exact match means it reads the facts.

- ``last place``: the place of the last move in the row (any actor): what a model that keeps only
  the most recent place scores;
- ``any place``: a place drawn uniformly from those the row's moves name;
- ``reader``: the answer worked out from the decoded row's facts (QA1: the asked actor's last move),
  which must score 1.000 (the instrument's control: the answer is in the row).

    python experiments/memory/babi_baselines.py --task qa1 --length 256 --rows 400
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from recurformer.data import booktext  # noqa: E402
from recurformer.data.babi import ACTORS, MOVES, PLACES  # noqa: E402
from recurformer.data.synthetic import get_task, make_split  # noqa: E402
from recurformer.state import IGNORE_INDEX  # noqa: E402

MOVE = re.compile(rf" ({'|'.join(ACTORS)}) (?:{'|'.join(MOVES)}) the ({'|'.join(PLACES)})\.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="qa1", choices=["qa1"], help="the task (QA1: its reader is exact)")
    ap.add_argument("--length", type=int, default=256, help="row length in tokens")
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    t = get_task(args.task)
    d = make_split(args.task, args.rows, args.seed, t.at_length(t.params(), args.length), split="test")
    tok = booktext.tokenizer(t.params()["vocab_size"])
    last = any_place = reader = 0.0
    for x, y in zip(d.inputs.tolist(), d.targets.tolist()):
        text, answer = tok.decode(x), tok.decode([v for v in y if v != IGNORE_INDEX]).strip()
        moves = MOVE.findall(text)
        asked = re.findall(r"Where is (\w+)\? Answer:", text)[-1]
        places = {p for _, p in moves}
        last += moves[-1][1] == answer
        any_place += (answer in places) / len(places)
        reader += [p for a, p in moves if a == asked][-1] == answer
    n = args.rows
    print(f"{args.task} at {args.length} tokens, {n} test rows (seed {args.seed}): exact match")
    print(f"  last place {last / n:.3f}   any place {any_place / n:.3f}   reader {reader / n:.3f}")


if __name__ == "__main__":
    main()
