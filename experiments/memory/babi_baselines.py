"""What a trivial reader scores on the bAbI-style tasks in book text (``recurformer/data/babi.py``):
the floor a trained model must beat before its exact match means it reads the facts.

- ``last place``: the place of the last move in the row (any actor): what a model that keeps only
  the most recent place scores;
- ``any place``: a place drawn uniformly from those the row's moves name;
- ``reader``: the answer worked out from the decoded row's facts (QA1: the asked actor's last move),
  which must score 1.000 (the instrument's control: the answer is in the row);
- with ``--model DIR`` (saved by ``synth --save``): the model's exact match on the same rows, split
  by whether the asked actor made the last move (where ``last place`` is right) or another did (where
  it is right only by chance): a model that learned the shortcut scores high on the first, low on
  the second; one that reads the facts scores alike on both.

    python experiments/memory/babi_baselines.py --task qa1 --length 256 --rows 400 [--model DIR]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from recurformer.api import load  # noqa: E402
from recurformer.config import RecurformerError  # noqa: E402
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
    ap.add_argument("--model", help="a model saved by `recurformer synth --save`: its exact match beside them")
    args = ap.parse_args()
    t = get_task(args.task)
    d = make_split(args.task, args.rows, args.seed, t.at_length(t.params(), args.length), split="test")
    tok = booktext.tokenizer(t.params()["vocab_size"])
    right = [True] * args.rows
    if args.model:
        try:
            model, _ = load(args.model)
        except RecurformerError as e:
            sys.exit(f"babi_baselines: {e}")
        with torch.no_grad():
            pred = torch.cat([model(x).logits.argmax(-1) for x in d.inputs.split(50)])
        right = ((pred == d.targets) | (d.targets == IGNORE_INDEX)).all(1).tolist()
    last = any_place = reader = 0.0
    split: dict[bool, list[bool]] = {True: [], False: []}  # asked actor made the last move -> model right
    for x, y, ok in zip(d.inputs.tolist(), d.targets.tolist(), right):
        text, answer = tok.decode(x), tok.decode([v for v in y if v != IGNORE_INDEX]).strip()
        moves = MOVE.findall(text)
        asked = re.findall(r"Where is (\w+)\? Answer:", text)[-1]
        places = {p for _, p in moves}
        last += moves[-1][1] == answer
        any_place += (answer in places) / len(places)
        reader += [p for a, p in moves if a == asked][-1] == answer
        split[moves[-1][0] == asked].append(ok)
    n = args.rows
    print(f"{args.task} at {args.length} tokens, {n} test rows (seed {args.seed}): exact match")
    print(f"  last place {last / n:.3f}   any place {any_place / n:.3f}   reader {reader / n:.3f}")
    if args.model:
        mean = {k: sum(v) / max(len(v), 1) for k, v in split.items()}
        print(
            f"  model {sum(right) / n:.3f}: asked actor moved last {mean[True]:.3f} ({len(split[True])} rows), "
            f"another actor moved last {mean[False]:.3f} ({len(split[False])} rows)"
        )


if __name__ == "__main__":
    main()
