"""Fault injection: kill a small training run at random moments, resume it, and check that it
ends bitwise equal to a run that was never interrupted.

    python scripts/fault_injection.py --signal KILL --trials 20
    python scripts/fault_injection.py --signal TERM --trials 20

Each trial starts ``recurformer train`` (a tiny Memory Attention model, a checkpoint after every
step), sends the signal at a random moment of its training, and resumes it with
``recurformer train --resume`` (or starts it again with ``--overwrite`` when it died before its
first checkpoint); with probability 1/2 the resumed run is hit again (at most 4 signals a trial).
A run that finishes before its trial's first signal is started over, so every trial is hit.
Every checkpoint write is slowed by random sleeps between its files, so that many signals land
in the middle of one. A trial survives when the final model weights and optimizer state are
bitwise equal to the uninterrupted reference, metrics.jsonl has the reference's rows (no
duplicates), no temporary directory is left behind, and with SIGTERM every stopped run exited
with 143 after writing the checkpoint it named. The last line is ``survived N/N``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's recurformer, in this process and (PYTHONPATH) in the runs it starts
MARKER_ENV = "RECURFORMER_FI_MARKER"
LEFTOVERS = (".tmp_step_", ".old_step_", ".del_step_", "latest.tmp")
CONFIG = """\
model: {name: memory_attention, dim: 32, n_layers: 1, n_heads: 2, chunk_size: 8}
data: {text_files: [%(corpus)s], tokenizer: byte, dir: %(data)s}
train: {batch_size: 2, seq_len: 16, steps: %(steps)d, warmup: 5, precision: fp32, eval_every: 10, eval_batches: 1,
        save_every: 1, keep_last: 3, log_every: 1, seed: 0}
"""


def child(argv: list[str]) -> int:
    """``recurformer train ARGV`` with slow checkpoint writes and a marker file once training starts."""
    import recurformer.checkpoint as ckpt
    from recurformer.cli import main
    from recurformer.training.trainer import Trainer

    real_save, real_run = ckpt.save_file, Trainer.run
    rng = random.Random()

    def slow_save(*a, **k):  # widen the window in which a signal lands mid-checkpoint
        time.sleep(rng.uniform(0, 0.05))
        real_save(*a, **k)
        time.sleep(rng.uniform(0, 0.05))

    def marked_run(self):
        Path(os.environ[MARKER_ENV]).touch()
        return real_run(self)

    ckpt.save_file = slow_save
    Trainer.run = marked_run
    return main(["train", *argv])


def launch(args: list[str], marker: Path, log: Path) -> subprocess.Popen:
    marker.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **{MARKER_ENV: str(marker)})
    with open(log, "a") as f:
        return subprocess.Popen(
            [sys.executable, __file__, "--child", *args], stdout=f, stderr=subprocess.STDOUT, env=env
        )


def wait_for(path: Path, proc: subprocess.Popen) -> None:
    """Until ``path`` exists or the process has ended."""
    while not path.exists() and proc.poll() is None:
        time.sleep(0.002)


def final_state(run: Path) -> dict:
    from safetensors.torch import load_file

    import recurformer.checkpoint as ckpt

    ck = ckpt.resolve(run)
    return {**load_file(ck / "model.safetensors"), **load_file(ck / "train_state.safetensors")}


def metric_rows(run: Path) -> list[tuple[int, str]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], "val" if "val_loss" in r else "train") for r in rows]


def trial(
    i: int,
    sig: signal.Signals,
    work: Path,
    config: Path,
    steps: int,
    duration: float,
    rng: random.Random,
    ref: dict,
    ref_rows: list,
) -> tuple[bool, int, int, int, str]:
    """(survived, signals sent, of which before the final checkpoint, of which mid-checkpoint, a
    one-line account). Each signal comes at a uniformly random moment of the training still to do
    (``duration`` is that of all of it); a run whose final checkpoint exists is not hit again."""
    import torch

    import recurformer.checkpoint as ckpt

    run, marker, log = work / f"trial{i:02d}", work / f"trial{i:02d}.started", work / f"trial{i:02d}.log"
    fresh = ["--config", str(config), "--set", f"train.out_dir={run}"]
    sent, early, mid, newest, events, problems = 0, 0, 0, 0, [], []
    proc = launch(fresh, marker, log)
    while True:
        wait_for(marker, proc)
        hit = newest < steps and (sent == 0 or (sent < 4 and rng.random() < 0.5))
        if hit:
            time.sleep(rng.uniform(0, duration * (steps - newest) / steps))
        if sent == 0 and proc.poll() == 0:  # finished before the first signal: start over, draw again
            proc = launch([*fresh, "--overwrite"], marker, log)
            continue
        if not hit or proc.poll() is not None:
            break
        proc.send_signal(sig)
        sent += 1
        rc = proc.wait()
        saved = [ckpt.step_of(c) for c in ckpt.checkpoints(run)]
        newest = saved[-1] if saved else 0
        early += newest < steps
        if sig == signal.SIGKILL:
            during = run.is_dir() and any(p.name.startswith(LEFTOVERS) for p in run.iterdir())
            mid += during
            events.append(f"killed at step {newest}{' mid-checkpoint' if during else ''}")
        else:
            last = log.read_text().strip().splitlines()[-1]
            events.append(f"stopped at step {newest}")
            finished = newest == steps  # a signal after the end: exit 0, or killed by default while exiting
            if rc != 128 + signal.SIGTERM and not (finished and rc in (0, -signal.SIGTERM)):
                problems.append(f"exit {rc} after SIGTERM")
            elif (
                last.startswith("recurformer: stopped by SIGTERM")
                and f"saved {run / f'step_{newest:06d}'};" not in last
            ):
                problems.append(f"said '{last}' but the newest checkpoint is step {newest}")
        again = ["--resume", str(run)] if saved else [*fresh, "--overwrite"]  # died before its first checkpoint
        proc = launch(again, marker, log)
    rc = proc.wait()
    if rc != 0:
        problems.append(f"the last run exited {rc} (see {log})")
    else:
        got = final_state(run)
        if got.keys() != ref.keys() or not all(torch.equal(got[k], ref[k]) for k in ref):
            problems.append("final weights/optimizer differ from the uninterrupted run")
        if metric_rows(run) != ref_rows:
            problems.append("metrics.jsonl differs from the uninterrupted run's rows")
        left = [p.name for p in run.iterdir() if p.name.startswith(LEFTOVERS)]
        if left:
            problems.append(f"left {left}")
    ok = not problems
    return ok, sent, early, mid, f"trial {i:2d}: {', '.join(events)} -> {'identical' if ok else '; '.join(problems)}"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--signal", choices=["KILL", "TERM"], default="KILL")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--steps", type=int, default=40, help="training steps of the small run")
    ap.add_argument("--seed", type=int, default=0, help="seeds the signal times")
    ap.add_argument("--work", help="working directory (default: a temporary one, removed afterwards)")
    args = ap.parse_args()
    sig = signal.Signals[f"SIG{args.signal}"]
    work = Path(args.work or tempfile.mkdtemp(prefix="recurformer-fi-"))
    work.mkdir(parents=True, exist_ok=True)
    words = "the a cat dog ran sat on mat big small red blue happy sad tree house went saw".split()
    wr = random.Random(0)
    corpus = work / "corpus.txt"
    corpus.write_text(
        "<|endoftext|>".join(" ".join(wr.choice(words) for _ in range(wr.randint(20, 80))) + "." for _ in range(200))
    )
    config = work / "config.yaml"
    config.write_text(CONFIG % {"corpus": corpus, "data": work / "data", "steps": args.steps})

    ref_run = work / "reference"
    t0 = time.perf_counter()
    proc = launch(
        ["--config", str(config), "--set", f"train.out_dir={ref_run}"],
        work / "reference.started",
        work / "reference.log",
    )
    wait_for(work / "reference.started", proc)
    t1 = time.perf_counter()
    wait_for(ref_run / f"step_{args.steps:06d}", proc)  # the signals aim at training, not at the exit after it
    duration = time.perf_counter() - t1
    if proc.wait() != 0:
        print(f"the reference run failed: see {work / 'reference.log'}")
        return 1
    print(
        f"reference: {args.steps} steps, a checkpoint after each, {duration:.1f}s of training ({t1 - t0:.1f}s start-up)"
    )
    ref, ref_rows = final_state(ref_run), metric_rows(ref_run)

    rng = random.Random(args.seed)
    survived = sent = early = mid = 0
    for i in range(1, args.trials + 1):
        ok, n, e, m, line = trial(i, sig, work, config, args.steps, duration, rng, ref, ref_rows)
        print(line, flush=True)
        survived += ok
        sent += n
        early += e
        mid += m
    during = f", {mid} in the middle of a checkpoint write" if sig == signal.SIGKILL else ""
    print(f"{sent} x SIG{args.signal} at random moments: {early} before the run's final checkpoint{during}")
    print(f"survived {survived}/{args.trials}")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if survived == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
