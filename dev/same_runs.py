"""Three train runs and three synth runs (one self-paced, one resumed), each file they write
fingerprinted, so that a refactor of the training loop can be checked to leave them bitwise the
same: run it on the old tree and on the new one, then compare the two fingerprint files.

    python dev/same_runs.py OUT_DIR                 # writes OUT_DIR/fingerprints.json (runs once)
    python dev/same_runs.py --compare A.json B.json # lists every file that differs

Fingerprints: a safetensors file by its tensors (name, dtype, shape, bytes); a JSON or JSONL file
by its values with the wall-clock ones left out (tokens/s, mfu, seconds, dates, the peak's source),
the states of the unseeded Python and NumPy generators left out and the run's directory written as
OUT; a text log is not fingerprinted (it holds times).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

CLOCK = ("tok_per_s", "mfu", "seconds", "time", "date", "peak", "elapsed", "wall", "started", "host", "cpu")
UNSEEDED = ("python", "numpy")  # the global Python and NumPy generators: never seeded, never used by a run

TINY = [
    "model.dim=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "train.batch_size=2",
    "train.seq_len=64",
    "train.warmup=2",
    "train.log_every=1",
    "train.eval_every=3",
    "train.eval_batches=2",
    "train.save_every=3",
    "train.precision=fp32",
    "train.loggers=[]",
]

KILL_AT_6 = """
import sys
from recurformer.tbptt import Update
from recurformer.cli import main
finish, calls = Update.finish, []
def killed(self):
    calls.append(1)
    if len(calls) == 6:
        raise SystemExit(9)
    finish(self)
Update.finish = killed
sys.exit(main(sys.argv[1:]))
"""


def run(argv: list[str], cwd: Path, code: str | None = None, expect: int = 0) -> None:
    cmd = [sys.executable, "-c", code, *argv] if code else [sys.executable, "-m", "recurformer.cli", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RECURFORMER_PROGRESS": "0"}
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if p.returncode != expect:
        sys.exit(f"{' '.join(argv)} returned {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")


def runs(out: Path) -> None:
    train = ["train", "--config", "tinystories-cpu", *sum((["--set", s] for s in TINY), [])]
    run([*train, "--set", "train.steps=6", "--set", f"train.out_dir={out}/t1"], out)
    run(
        [
            *train,
            "--set",
            "model.name=gated_deltanet",
            "--set",
            "train.steps=6",
            "--set",
            "train.grad_accum=2",
            "--set",
            "train.truncation=2",
            "--set",
            "train.state_init=noise",
            "--set",
            "train.schedule={stages: [{step: 3, seq_len: 128}]}",
            "--set",
            f"train.out_dir={out}/t2",
        ],
        out,
    )
    run([*train, "--set", "model.name=rmt", "--set", "train.steps=3", "--set", f"train.out_dir={out}/t3"], out)
    run(["train", "--resume", str(out / "t3"), "--set", "train.steps=6"], out)
    synth = ["synth", "--model", "llama", "--set", "model.dim=32", "--set", "synth.batch_size=4"]
    run(
        [
            *synth,
            "--task",
            "passkey",
            "--steps",
            "12",
            "--lrs",
            "1e-3,3e-3",
            "--n-test",
            "16",
            "--set",
            "synth.n_val=8",
            "--set",
            "synth.eval_every=4",
            "--json",
            str(out / "s1.json"),
        ],
        out,
    )
    paced = "synth.schedule={advance_below: 100.0, advance_window: 2, stages: [{step: 7, length: 8}]}"
    mqar = [
        *synth,
        "--task",
        "mqar",
        "--set",
        "task.num_pairs=2",
        "--set",
        "task.num_queries=2",
        "--set",
        "task.distance=4",
        "--set",
        "synth.context=4",
        "--set",
        "synth.chunk=8",
        "--steps",
        "10",
        "--lrs",
        "3e-3",
        "--n-test",
        "8",
        "--set",
        "synth.n_val=8",
        "--set",
        "synth.eval_every=2",
    ]
    run([*mqar, "--set", paced, "--json", str(out / "s2.json"), "--save", str(out / "s2")], out)
    run(
        [*mqar, "--set", "synth.save_every=3", "--set", "synth.truncation=2", "--save", str(out / "s3")],
        out,
        KILL_AT_6,
        expect=9,
    )
    (out / "s3-progress").mkdir()
    for f in (out / "s3" / "progress").rglob("*"):
        if f.is_file():
            target = out / "s3-progress" / f.relative_to(out / "s3" / "progress")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(f.read_bytes())
    run(["synth", "--resume", str(out / "s3"), "--json", str(out / "s3.json")], out)


def clean(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: clean(x) for k, x in v.items() if not any(c in k.lower() for c in CLOCK) and k not in UNSEEDED}
    if isinstance(v, list):
        return [clean(x) for x in v]
    return v


def fingerprint(f: Path, out: Path) -> str | None:
    if f.suffix == ".safetensors":
        from safetensors import safe_open

        h = hashlib.sha256()
        with safe_open(str(f), "pt") as st:
            for k in sorted(st.keys()):
                t = st.get_tensor(k)
                h.update(f"{k}{t.dtype}{tuple(t.shape)}".encode())
                h.update(t.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
        return h.hexdigest()
    if f.suffix == ".json":
        value = clean(json.loads(f.read_text().replace(str(out), "OUT")))
        return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()
    if f.suffix == ".jsonl":
        rows = [clean(json.loads(line)) for line in f.read_text().replace(str(out), "OUT").splitlines() if line.strip()]
        return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()
    return None


def main() -> None:
    if sys.argv[1] == "--compare":
        a, b = (json.loads(Path(p).read_text()) for p in sys.argv[2:4])
        bad = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        print(f"{len(a)} and {len(b)} files; {len(bad)} differ" + "".join(f"\n  {k}" for k in bad))
        sys.exit(1 if bad else 0)
    out = Path(sys.argv[1]).resolve()
    if not (out / "fingerprints.json").exists() and not out.exists():
        out.mkdir(parents=True)
        runs(out)
    prints = {}
    for f in sorted(out.rglob("*")):
        rel = str(f.relative_to(out))
        if (
            f.is_file()
            and not rel.startswith("prepared/")
            and rel != "fingerprints.json"
            and (fp := fingerprint(f, out)) is not None
        ):
            prints[rel] = fp
    (out / "fingerprints.json").write_text(json.dumps(prints, indent=1))
    print(f"{len(prints)} files fingerprinted in {out / 'fingerprints.json'}")


if __name__ == "__main__":
    main()
