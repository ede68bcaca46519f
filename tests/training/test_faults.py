"""Never lose a run: reruns into a run directory, prepared-data caches, eval labels,
SIGINT/SIGTERM, resume bookkeeping, checkpoint paths, and I/O or argument faults. Every test
reproduces a fault through the CLI (or the library call it makes) with a tiny model."""

from __future__ import annotations

import errno
import importlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import recurformer
import recurformer.checkpoint as ckpt
from recurformer import RecurformerError
from recurformer.cli import main as cli
from recurformer.data import DataConfig
from recurformer.training.config import load_run_config
from recurformer.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
prep = importlib.import_module("recurformer.data.prepare")  # the module, not the function recurformer.data exports
WORDS = "the a cat dog ran sat on mat big small red blue happy sad tree house went saw".split()


def write_corpus(path: Path, seed: int, words: list[str] = WORDS) -> Path:
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 80))) + "." for _ in range(120)]
    path.write_text("<|endoftext|>".join(docs))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt", 0)
    (path.parent / "tiny.yaml").write_text("model:\n  name: memory_attention\n")
    return path


def tiny(corpus: Path, out: Path | str, data: Path | str | None, **train) -> list[str]:
    """``--config`` and ``--set`` arguments of a tiny Memory Attention run (a second per run)."""
    values = {
        "model.name": "memory_attention",
        "model.dim": 32,
        "model.n_layers": 1,
        "model.n_heads": 2,
        "model.chunk_size": 8,
        "data.dataset": "null",
        "data.text_files": f"[{corpus}]",
        "data.tokenizer": "byte",
        "train.out_dir": out,
        "train.batch_size": 2,
        "train.seq_len": 16,
        "train.steps": 6,
        "train.warmup": 2,
        "train.precision": "fp32",
        "train.eval_every": 3,
        "train.eval_batches": 1,
        "train.save_every": 3,
        "train.log_every": 1,
    }
    if data is not None:
        values["data.dir"] = data
    values.update({f"train.{k}": v for k, v in train.items()})
    return [
        "--config",
        str(corpus.parent / "tiny.yaml"),
        *(a for k, v in values.items() for a in ("--set", f"{k}={v}")),
    ]


def train(*args: str) -> int:
    return cli(["train", *args])


def last_error(capsys) -> str:
    """The last line on stderr (progress bars of the data preparation come before it)."""
    return capsys.readouterr().err.strip().splitlines()[-1]


def steps_in(run: Path) -> list[int]:
    """The steps of the checkpoints in ``run``, in order."""
    return sorted(int(d.name[5:]) for d in run.glob("step_*"))


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(ckpt.resolve(run) / "model.safetensors")


def metric_steps(run: Path) -> list[tuple[int, str]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], "val" if "val_loss" in r else "train") for r in rows]


# -- reproduction 1: a rerun into an existing run directory -----------------------------------------


def test_rerun_into_a_run_directory_is_refused_and_overwrite_replaces_it(corpus, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert train(*tiny(corpus, run, tmp_path / "data")) == 0
    before = weights(run)
    capsys.readouterr()
    assert train(*tiny(corpus, run, tmp_path / "data", steps=2, save_every=1)) == 2
    err = last_error(capsys)
    assert (
        err.startswith(f"recurformer: error: {run} already holds a run") and "--resume" in err and "--overwrite" in err
    )
    assert steps_in(run) == [3, 6] and all(torch.equal(before[k], v) for k, v in weights(run).items())
    assert train(*tiny(corpus, run, tmp_path / "data", steps=2, save_every=1), "--overwrite") == 0
    assert steps_in(run) == [1, 2] and ckpt.resolve(run).name == "step_000002"
    assert (run / ckpt.LATEST).read_text() == "step_000002"
    assert [s for s, _ in metric_steps(run)] == [1, 2, 2]  # the replaced run's rows are gone


def test_retention_orders_by_step_and_keeps_what_was_just_written(tmp_path) -> None:
    w = {"w": torch.zeros(1)}
    for step in (999_998, 999_999, 1_000_000):  # "step_1000000" sorts before "step_999998" by name
        ckpt.save_checkpoint(tmp_path, step, w, {}, None, keep_last=2)
    assert steps_in(tmp_path) == [999_999, 1_000_000]
    assert ckpt.resolve(tmp_path).name == "step_1000000"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step_1000000",
        "step_999999",
    ]  # nothing half-deleted


# -- reproduction 2: prepared data and the data source ------------------------------------------------


def test_text_files_get_their_own_prepared_data(corpus, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the default prepared/... directory is relative to the working directory
    a = write_corpus(tmp_path / "a.txt", 1, WORDS[:9])
    b = write_corpus(tmp_path / "b.txt", 2, WORDS[9:])
    assert DataConfig(text_files=[str(a)]).resolved_dir() != DataConfig(text_files=[str(b)]).resolved_dir()
    assert (
        DataConfig(text_files=[str(a)]).resolved_dir()
        != DataConfig(text_files=[str(a)], tokenizer="byte").resolved_dir()
    )
    for path, words in ((a, WORDS[:9]), (b, WORDS[9:])):
        cfg = load_run_config(None, tiny(corpus, tmp_path / path.stem, None)[3::2] + [f"data.text_files=[{path}]"])
        tr = Trainer(cfg, show_progress=False)
        read = re.findall(r"[a-z]+", tr.tokenizer.decode([int(t) for t in tr.val_tokens[:2000]]))[
            1:-1
        ]  # ends may be cut
        assert set(read) <= set(words)  # b's run reads b's tokens, not a's
    # an explicit data.dir holding other data is refused, not silently reused
    cfg = load_run_config(None, tiny(corpus, tmp_path / "c", tmp_path / "a-data")[3::2] + [f"data.text_files=[{a}]"])
    Trainer(cfg, show_progress=False)
    cfg = load_run_config(None, tiny(corpus, tmp_path / "d", tmp_path / "a-data")[3::2] + [f"data.text_files=[{b}]"])
    with pytest.raises(RecurformerError, match="a-data was made from other data"):
        Trainer(cfg, show_progress=False)


def test_naming_text_files_replaces_the_default_dataset(tmp_path) -> None:
    cfg = load_run_config(str(ROOT / "configs" / "tinystories-cpu.yaml"), ["data.text_files=my.txt"])
    assert cfg.data.dataset is None and cfg.data.text_files == ["my.txt"]
    cfg = load_run_config(str(ROOT / "configs" / "tinystories-cpu.yaml"), ["data.dataset=warpeace"])
    assert cfg.data.dataset == "warpeace" and cfg.data.text_files == []
    with pytest.raises(RecurformerError, match="both data.dataset .warpeace. and data.text_files .my.txt."):
        load_run_config(None, ["model.name=llama", "data.text_files=my.txt", "data.dataset=warpeace"])
    both = tmp_path / "both.yaml"
    both.write_text("model:\n  name: llama\ndata:\n  dataset: warpeace\n  text_files: [my.txt]\n")
    with pytest.raises(RecurformerError, match="both data.dataset .warpeace. and data.text_files"):
        load_run_config(str(both))
    assert load_run_config(None, ["model.name=llama"]).data.dataset == "tinystories-sample"


# -- reproduction 3: eval labels -----------------------------------------------------------------------


def test_eval_labels_are_unique(corpus, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert train(*tiny(corpus, run, tmp_path / "data")) == 0
    out = tmp_path / "e.json"
    common = ["--lengths", "32", "--last", "16", "--windows", "1", "--chunk", "16", "--json", str(out)]
    assert cli(["eval", "--checkpoint", str(run), str(run / "step_000003"), *common]) == 0
    assert list(json.loads(out.read_text())["results"]) == ["run step_000006", "run step_000003"]
    other = tmp_path / "other" / "run"
    shutil.copytree(run, other)
    assert cli(["eval", "--checkpoint", str(run), str(other), *common]) == 0
    assert list(json.loads(out.read_text())["results"]) == [str(run / "step_000006"), str(other / "step_000006")]
    capsys.readouterr()
    assert cli(["eval", "--checkpoint", str(run), str(run / "step_000006"), *common]) == 2
    assert "are the same checkpoint" in capsys.readouterr().err


# -- signals, resume bookkeeping ----------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_finishes_the_step_saves_and_says_how_to_resume(corpus, tmp_path, capsys, monkeypatch, sig) -> None:
    ref = tmp_path / "ref"
    assert train(*tiny(corpus, ref, tmp_path / "data")) == 0
    real = Trainer.train_step

    def step_then_signal(self, read=True):  # the signal arrives in the middle of step 2
        if self.step == 1:
            os.kill(os.getpid(), sig)
        return real(self, read)

    monkeypatch.setattr(Trainer, "train_step", step_then_signal)
    run = tmp_path / "run"
    fallback = signal.signal(signal.SIGTERM, signal.default_int_handler)  # never let SIGTERM kill pytest itself
    try:
        rc = train(*tiny(corpus, run, tmp_path / "data"))
    finally:
        signal.signal(signal.SIGTERM, fallback)
    err = last_error(capsys)
    assert rc == 128 + sig
    assert err == (
        f"recurformer: stopped by {sig.name} after step 2; saved {run / 'step_000002'}; "
        f"continue with: recurformer train --resume {run}"
    )
    assert steps_in(run) == [2]
    monkeypatch.setattr(Trainer, "train_step", real)
    assert train("--resume", str(run)) == 0
    assert f"resuming from {run / 'step_000002'} at step 2 of 6" in capsys.readouterr().out
    assert steps_in(run) == [2, 3, 6]
    assert all(torch.equal(v, weights(run)[k]) for k, v in weights(ref).items())  # bitwise the uninterrupted run
    assert metric_steps(run) == metric_steps(ref)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_stops_at_once(corpus, tmp_path, capsys, monkeypatch, sig) -> None:
    """Two signals during step 3: no step runs after them and nothing more is saved; the newest
    checkpoint (step 2) is complete and resumes."""
    real = Trainer.train_step
    ran = []

    def two_signals(self, read=True):
        if self.step == 2:
            os.kill(os.getpid(), sig)
            os.kill(os.getpid(), sig)  # the handler raises here, before the step
        ran.append(self.step)
        return real(self, read)

    monkeypatch.setattr(Trainer, "train_step", two_signals)
    run = tmp_path / "run"
    fallback = signal.signal(signal.SIGTERM, signal.default_int_handler)  # never let SIGTERM kill pytest itself
    try:
        rc = train(*tiny(corpus, run, tmp_path / "data", save_every=1))
    finally:
        signal.signal(signal.SIGTERM, fallback)
    assert (rc, last_error(capsys)) == (128 + sig, "recurformer: interrupted")
    assert ran == [0, 1] and steps_in(run) == [1, 2]
    monkeypatch.setattr(Trainer, "train_step", real)
    assert train("--resume", str(run)) == 0
    assert steps_in(run)[-1] == 6


def test_resume_truncates_metrics_refuses_mixed_histories_and_reports_a_finished_run(corpus, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert train(*tiny(corpus, run, tmp_path / "data")) == 0
    full = metric_steps(run)
    # as if killed after logging step 6 but before its checkpoint, mid-way through a metrics line
    shutil.rmtree(run / "step_000006")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')
    capsys.readouterr()
    assert train("--resume", str(run)) == 0
    assert f"resuming from {run / 'step_000003'} at step 3 of 6" in capsys.readouterr().out
    assert metric_steps(run) == full  # no duplicate rows, no torn line
    assert train("--resume", str(run)) == 0
    out = capsys.readouterr().out
    assert "is already at step 6 of train.steps=6: the run is finished" in out and "saved" not in out
    # resuming an older checkpoint while newer ones exist would mix two histories
    assert train("--resume", str(run / "step_000003")) == 2
    assert "has checkpoints after step 3 (step_000006)" in capsys.readouterr().err
    assert train("--resume", str(run / "step_000003"), "--overwrite", "--set", "train.steps=4") == 0
    assert steps_in(run) == [3, 4] and metric_steps(run)[-1] == (4, "val")


def test_a_truncated_checkpoint_names_the_one_before_it_and_a_resume_from_that_one_works(
    corpus, tmp_path, capsys
) -> None:
    run = tmp_path / "run"
    assert train(*tiny(corpus, run, tmp_path / "data", steps=9)) == 0
    weights_file = run / "step_000009" / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:1000])  # a copy cut short
    capsys.readouterr()
    assert train("--resume", str(run)) == 2
    err = last_error(capsys)
    assert err.startswith(f"recurformer: error: cannot read {weights_file}: ") and err.endswith(
        f"; {run / 'step_000006'}, the run's newest checkpoint before it, reads: "
        f"resume from it with --resume {run / 'step_000006'}"
    )
    with pytest.raises(RecurformerError, match=re.escape(f"resume from it with resume='{run / 'step_000006'}'")):
        recurformer.train(resume=run, progress=False)
    # an older readable checkpoint in between is never deleted without --overwrite, and is the one to resume
    assert train("--resume", str(run / "step_000003")) == 2
    assert last_error(capsys).endswith(
        f"has checkpoints after step 3 (step_000006, step_000009); continuing from step 3 would mix two "
        f"histories: resume the newest with --resume {run / 'step_000006'}, write elsewhere with "
        f"--set train.out_dir=DIR, or pass --overwrite to delete them"
    )
    assert steps_in(run) == [3, 6, 9]
    # the command the error gave resumes; the unreadable checkpoint after it is replaced, and said so
    assert train("--resume", str(run / "step_000006")) == 0
    assert f"at step 6 of 9, writing to {run} (deleted step_000009 after it: unreadable)" in capsys.readouterr().out
    assert steps_in(run) == [3, 6, 9] and ckpt.readable(run / "step_000009")


def test_checkpoint_paths_resolve_from_anywhere_and_resume_writes_into_the_given_run(
    corpus, tmp_path, monkeypatch, capsys
) -> None:
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(home)
    assert train(*tiny(corpus, "run", "prepared")) == 0  # relative paths, as a user types them
    monkeypatch.chdir(elsewhere)
    ev = ["--lengths", "32", "--last", "16", "--windows", "1", "--chunk", "16", "--json", "e.json"]
    assert cli(["eval", "--checkpoint", str(home / "run"), *ev]) == 0
    # a copied run (its data stayed where it was) resumes into the copy
    copy = tmp_path / "copy" / "run"
    shutil.copytree(home / "run", copy)
    before = {p.name for p in (home / "run").iterdir()}
    assert train("--resume", str(copy), "--set", "train.steps=9") == 0
    assert steps_in(copy) == [3, 6, 9] and {p.name for p in (home / "run").iterdir()} == before
    # a moved project (run and data together) still finds its data
    moved = tmp_path / "moved"
    shutil.move(home, moved)
    assert cli(["eval", "--checkpoint", str(moved / "run"), *ev]) == 0
    assert train("--resume", str(moved / "run"), "--set", "train.steps=7") == 0
    assert steps_in(moved / "run") == [3, 6, 7]
    assert "at step 6 of 7, writing to " + str(moved / "run") in capsys.readouterr().out


# -- I/O and argument faults -------------------------------------------------------------------------


def test_unwritable_run_directory_fails_before_any_work(corpus, tmp_path, capsys) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert train(*tiny(corpus, blocker / "run", tmp_path / "data")) == 2
    assert last_error(capsys) == (
        f"recurformer: error: cannot write run directory {blocker / 'run'}: {blocker} is not a directory"
    )
    assert not (tmp_path / "data").exists()  # refused before the data was prepared


def test_disk_full_during_a_checkpoint_leaves_no_partial_checkpoint(corpus, tmp_path, capsys, monkeypatch) -> None:
    real = ckpt.save_file
    calls = {"n": 0}

    def full_disk(tensors, path, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:  # the second checkpoint's weights
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(tensors, path, *a, **k)

    monkeypatch.setattr(ckpt, "save_file", full_disk)
    run = tmp_path / "run"
    assert train(*tiny(corpus, run, tmp_path / "data")) == 2
    assert last_error(capsys) == (
        f"recurformer: error: cannot write checkpoint {run / 'step_000006'}: No space left on device; "
        f"the last complete checkpoint is {run / 'step_000003'}"
    )
    assert sorted(p.name for p in run.iterdir() if p.name.startswith((".", "step_"))) == ["step_000003"]


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("trained")
    assert train(*tiny(corpus, tmp / "run", tmp / "data")) == 0
    return tmp / "run"


def test_eval_and_generate_check_their_outputs_and_arguments_first(trained, tmp_path, capsys) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    ev = ["eval", "--checkpoint", str(trained), "--lengths", "32", "--last", "16", "--windows", "1", "--chunk", "16"]
    cases = {
        (
            "--json",
            str(blocker / "e.json"),
        ): f"cannot write --json file {blocker / 'e.json'}: {blocker} is not a directory",
        ("--json", str(tmp_path / "e.json"), "--chunk", "0"): "--chunk must be >= 1, got 0",
        ("--json", str(tmp_path / "e.json"), "--batch-size", "0"): "--batch-size must be >= 1, got 0",
        ("--json", str(tmp_path / "e.json"), "--lengths", "0"): "--lengths must be positive integers, got '0'",
    }
    for extra, message in cases.items():
        assert cli([*ev, *extra]) == 2
        got = capsys.readouterr()
        assert got.err.strip() == f"recurformer: error: {message}" and "evaluating" not in got.out
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café au lait ".encode("latin-1") * 50)
    assert cli([*ev, "--json", str(tmp_path / "e.json"), "--text", str(latin1)]) == 2
    assert last_error(capsys) == (
        f"recurformer: error: text file {latin1} is not UTF-8 (byte 3: invalid continuation byte)"
    )
    assert not (tmp_path / "e.json").exists()
    gen = ["generate", "--checkpoint", str(trained), "--prompt", "the cat", "--max-new-tokens", "3"]
    assert cli([*gen, "--save-state", str(blocker / "s.safetensors")]) == 2
    got = capsys.readouterr()
    assert (
        got.err.strip()
        == f"recurformer: error: cannot write --save-state file {blocker / 's.safetensors'}: {blocker} is not a directory"
    )
    assert got.out == ""  # refused before generating


def test_non_finite_logits_from_finite_weights_are_one_line_errors(trained, tmp_path, capsys) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(ckpt.resolve(trained), broken)
    w = load_file(broken / "model.safetensors")
    w = {k: v * 1e30 if v.dim() == 2 and "tok_emb" not in k else v for k, v in w.items()}  # finite, but overflows
    assert all(bool(torch.isfinite(v).all()) for v in w.values())
    save_file(w, broken / "model.safetensors")
    out = tmp_path / "e.json"
    assert (
        cli(
            [
                "eval",
                "--checkpoint",
                str(broken),
                "--lengths",
                "32",
                "--last",
                "16",
                "--windows",
                "1",
                "--chunk",
                "16",
                "--json",
                str(out),
            ]
        )
        == 2
    )
    err = last_error(capsys)
    assert err.startswith(f"recurformer: error: {broken} gives non-finite logits (NaN/inf) at length 32 although")
    assert not out.exists()
    assert cli(["generate", "--checkpoint", str(broken), "--prompt", "the", "--max-new-tokens", "3"]) == 2
    assert last_error(capsys).endswith("non-finite logits (nan/inf) although its weights load; it cannot generate")


def test_closed_output_pipe_ends_quietly(trained) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "recurformer.cli",
            "generate",
            "--checkpoint",
            str(trained),
            "--prompt",
            "the cat",
            "--max-new-tokens",
            "50",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    proc.stdout.close()  # like `| head` that has already exited
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 128 + signal.SIGPIPE
    assert err == ""


def test_prepare_removes_its_temporary_directory_and_stale_ones(corpus, tmp_path, monkeypatch, capsys) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a process id that is no longer alive: a killed prepare's leftovers
    stale = tmp_path / f".p.tmp-{gone.pid}"
    stale.mkdir()
    (stale / "train.bin").write_bytes(b"\x00" * 10)
    running = tmp_path / f".p.tmp-{os.getppid()}"  # a prepare that is still running: left alone
    running.mkdir()

    def full_disk(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(prep, "_write_tokens", full_disk)
    assert cli(["prepare", "--text", str(corpus), "--tokenizer", "byte", "--out", str(tmp_path / "p")]) == 2
    assert (
        last_error(capsys)
        == f"recurformer: error: cannot write prepared data {tmp_path / 'p'}: No space left on device"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [running.name]
    monkeypatch.undo()
    assert cli(["prepare", "--text", str(corpus), "--tokenizer", "byte", "--out", str(tmp_path / "p")]) == 0
    assert (
        json.loads((tmp_path / "p" / "meta.json").read_text())["source_key"]
        == DataConfig(text_files=[str(corpus)], tokenizer="byte").source_key()
    )


# -- a run directory holds one model: its own checkpoints ------------------------------------------


def test_export_refuses_a_run_and_a_run_resolves_to_its_own_checkpoints(corpus, tmp_path, capsys) -> None:
    """``export --out`` into another run is refused (the flag does not change that) and leaves it
    as it was; a run directory that holds a model beside its checkpoints (an export into it, as
    earlier versions wrote) is a one-line error for every reader, never the other model."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert train(*tiny(corpus, a, tmp_path / "data")) == 0
    assert train(*tiny(corpus, b, tmp_path / "data", seed=1)) == 0
    before = sorted(p.name for p in b.iterdir())
    for extra in ([], ["--overwrite"]):
        assert cli(["export", "--checkpoint", str(a), "--out", str(b), *extra]) == 2
        assert last_error(capsys).startswith(f"recurformer: error: {b} holds a run or a training checkpoint (")
    assert sorted(p.name for p in b.iterdir()) == before
    assert cli(["export", "--checkpoint", str(a), "--out", str(b / "step_000006")]) == 2  # a checkpoint: refused too
    # a run with a model beside its checkpoints: refused by every reader, by train and resume too
    assert cli(["export", "--checkpoint", str(a), "--out", str(tmp_path / "x")]) == 0
    for name in ("model.safetensors", "config.json"):
        shutil.copy(tmp_path / "x" / name, b / name)
    with pytest.raises(RecurformerError, match=r"holds both a run's checkpoints \(step_000006, ...\) and a model"):
        recurformer_load(b)
    capsys.readouterr()
    assert cli(["generate", "--checkpoint", str(b), "--prompt", "the", "--max-new-tokens", "2"]) == 2
    assert f"name one ({b / 'step_000006'} is the run's newest)" in last_error(capsys)
    assert train("--resume", str(b)) == 2 and "holds both" in last_error(capsys)
    assert train(*tiny(corpus, b, tmp_path / "data"), "--overwrite") == 2
    assert last_error(capsys) == (
        f"recurformer: error: {b} holds a model (model.safetensors: an exported or pretrained directory), not a run; "
        "train into another directory (--set train.out_dir=DIR)"
    )
    assert steps_in(b) == [3, 6]  # nothing of the run was deleted
    own = load_file(b / "step_000006" / "model.safetensors")
    assert all(torch.equal(own[k], v) for k, v in weights(b / "step_000006").items())


def recurformer_load(path: Path):  # type: ignore[no-untyped-def]
    import recurformer

    return recurformer.load(path)


def test_export_replaces_only_an_earlier_export_of_the_same_run(corpus, tmp_path, capsys) -> None:
    """Exporting again into an earlier export of the same run needs no flag; an export of another
    run, or a directory with other files, needs ``--overwrite`` (``overwrite=True``), which leaves
    the other files in place."""
    import recurformer

    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "out"
    assert train(*tiny(corpus, a, tmp_path / "data")) == 0
    assert train(*tiny(corpus, b, tmp_path / "data", seed=1)) == 0
    assert cli(["export", "--checkpoint", str(a), "--out", str(out)]) == 0
    assert cli(["export", "--checkpoint", str(a / "step_000003"), "--out", str(out)]) == 0  # the same run
    assert cli(["export", "--checkpoint", str(b), "--out", str(out)]) == 2
    assert last_error(capsys) == (
        f"recurformer: error: {out} holds the export of another model or run (its config.json differs); export into "
        "another directory, or pass --overwrite to write the export's files there"
    )
    with pytest.raises(RecurformerError, match=r"pass overwrite=True to write"):
        recurformer.export(b, out)
    assert torch.equal(recurformer.load(out)[0].tok_emb.weight, weights(a / "step_000003")["tok_emb.weight"])
    notes = tmp_path / "mine"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    assert cli(["export", "--checkpoint", str(b), "--out", str(notes)]) == 2
    assert "holds files an export does not write (notes.txt)" in last_error(capsys)
    assert cli(["export", "--checkpoint", str(b), "--out", str(notes), "--overwrite"]) == 0
    assert (notes / "notes.txt").read_text() == "mine"
    assert torch.equal(recurformer.load(notes)[0].tok_emb.weight, weights(b)["tok_emb.weight"])


# -- out of memory: one line, and nothing left in the way of a retry --------------------------------

CUDA_OOM = torch.OutOfMemoryError(
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which 1.2 GiB is "
    "free.\nOf the allocated memory 70 GiB is allocated by PyTorch. See documentation for Memory Management"
)
CPU_OOM = RuntimeError(
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate "
    "2147483648 bytes. Error code 12 (Cannot allocate memory)"
)


def fail_at(calls: int, error: BaseException):  # type: ignore[no-untyped-def]
    """A ``Trainer.train_step`` that raises ``error`` at its ``calls``-th call, else trains."""
    real, seen = Trainer.train_step, []

    def step(self, read=True):  # type: ignore[no-untyped-def]
        seen.append(1)
        if len(seen) == calls:
            raise error
        return real(self, read)

    return step


@pytest.mark.parametrize("error", [CUDA_OOM, CPU_OOM], ids=["cuda", "cpu"])
def test_out_of_memory_in_training_is_one_line_and_a_retry_just_works(
    corpus, tmp_path, capsys, monkeypatch, error
) -> None:
    run, data = tmp_path / "run", tmp_path / "data"
    monkeypatch.setattr(Trainer, "train_step", fail_at(1, error))
    assert train(*tiny(corpus, run, data)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        "recurformer: error: out of memory training memory_attention (dim 32, n_layers 1) at train.batch_size 2 x "
        "train.seq_len 16 tokens per backward pass (an allocation of 2.00 GiB failed); lower train.batch_size "
        "(--set train.batch_size=1; --set train.grad_accum=2 keeps the tokens per step) or train.seq_len, or the "
        "model's size"
    )
    assert not run.exists()  # the failed run took its own files with it: a retry is not refused
    monkeypatch.undo()
    assert train(*tiny(corpus, run, data)) == 0 and steps_in(run) == [3, 6]


def test_a_failed_run_removes_only_its_own_files_and_keeps_checkpoints(corpus, tmp_path, capsys, monkeypatch) -> None:
    import recurformer

    run, data = tmp_path / "run", tmp_path / "data"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    monkeypatch.setattr(Trainer, "train_step", fail_at(2, CPU_OOM))
    with pytest.raises(RecurformerError, match=r"lower train.batch_size \(train=\{\"batch_size\": 1\}; train="):
        recurformer.train(load_yaml_tiny(corpus, run, data), progress=False)
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]  # its logs gone, the user's file kept
    monkeypatch.setattr(Trainer, "train_step", fail_at(5, CPU_OOM))  # after the checkpoint of step 3
    assert train(*tiny(corpus, run, data)) == 2
    assert "out of memory training" in last_error(capsys)
    assert steps_in(run) == [3] and (run / "metrics.jsonl").is_file()  # a run with a checkpoint stays, to resume
    monkeypatch.undo()
    assert train("--resume", str(run)) == 0 and steps_in(run) == [3, 6]


def load_yaml_tiny(corpus: Path, out: Path, data: Path) -> dict:
    """``tiny``'s run as a config dict, for the Python API."""
    from recurformer.config import parse_overrides

    args = tiny(corpus, out, data)
    return parse_overrides([v for k, v in zip(args[2::2], args[3::2])])


def test_logs_of_a_killed_run_without_a_checkpoint_are_named_as_such(corpus, tmp_path, capsys) -> None:
    """A run killed (-9, the kernel's OOM killer) before its first checkpoint leaves logs and no
    checkpoint: a retry is told there is nothing to resume, not to resume."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    assert train(*tiny(corpus, run, tmp_path / "data")) == 2
    err = last_error(capsys)
    assert "holds the logs of a run that wrote no checkpoint (metrics.jsonl), so nothing to resume" in err
    assert "--resume" not in err and "--overwrite" in err


def test_out_of_memory_in_eval_and_generate_is_one_line(trained, tmp_path, capsys, monkeypatch) -> None:
    import recurformer
    import recurformer.generate as gen

    def oom(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise CUDA_OOM

    # recurformer eval and recurformer.evaluate both read through evaluate.lengths.evaluate_options (read_lengths)
    monkeypatch.setattr(importlib.import_module("recurformer.evaluate.lengths"), "read_lengths", oom)
    ev = ["eval", "--checkpoint", str(trained), "--lengths", "32,64", "--last", "16", "--windows", "1"]
    assert cli([*ev, "--chunk", "16", "--json", str(tmp_path / "e.json")]) == 2
    err = capsys.readouterr().err
    n = recurformer.load(trained)[0].num_params()
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        f"recurformer: error: out of memory evaluating run (memory_attention, {n:,} parameters): batch_size 8 windows "
        "side by side, chunk 16 tokens per call, lengths up to 64 (an allocation of 2.00 GiB failed); lower "
        "--batch-size or --chunk (a state that grows with the text: --lengths)"
    )
    model, tok = recurformer.load(trained)
    with pytest.raises(RecurformerError, match=r"failed\); lower batch_size or chunk \(a state .*: lengths\)$"):
        recurformer.evaluate(model, tok, dataset="tinystories-sample", lengths=[32], last=16)
    monkeypatch.setattr(gen, "stream", oom)
    assert cli(["generate", "--checkpoint", str(trained), "--prompt", "the cat", "--max-new-tokens", "5"]) == 2
    assert last_error(capsys).startswith("recurformer: error: out of memory generating with memory_attention (")
    with pytest.raises(RecurformerError, match=r"from a prompt of 8 tokens, at most 5 new ones .*max_new_tokens$"):
        recurformer.api.generate_text(trained, "the cat", max_new_tokens=5, device="cpu")
    monkeypatch.setattr(gen, "stream", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("shape mismatch")))
    with pytest.raises(RuntimeError, match="^shape mismatch$"):  # not every RuntimeError is out of memory
        recurformer.api.generate_text(trained, "the cat", max_new_tokens=5, device="cpu")


def test_a_default_eval_reads_a_sample_says_how_far_it_got_in_a_log_and_keeps_what_it_finished(
    trained, tmp_path, capsys, monkeypatch
) -> None:
    """Without ``--windows`` eval reads ``DEFAULT_WINDOWS`` evenly spaced windows, not the whole
    text (``--all`` does); its progress reaches a log (not a terminal here); an eval stopped after
    its first length leaves that length in the JSON, marked incomplete."""
    from recurformer.evaluate.lengths import DEFAULT_WINDOWS

    text = write_corpus(tmp_path / "text.txt", 1)  # ~24k bytes: a few hundred windows of 64 scored tokens
    out = tmp_path / "e.json"
    ev = ["eval", "--checkpoint", str(trained), "--lengths", "64,128", "--last", "64", "--text", str(text)]
    assert cli([*ev, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["complete"] and [r["windows"] for r in doc["results"]["run"]] == [DEFAULT_WINDOWS] * 2
    log, err = capsys.readouterr()
    assert f"{DEFAULT_WINDOWS} windows (evenly spaced, of " in log and "--all for all" in log
    assert f"run: {2 * DEFAULT_WINDOWS}/{2 * DEFAULT_WINDOWS} windows" in err  # the progress line, not a bar
    assert cli([*ev, "--all", "--json", str(out)]) == 0
    every = json.loads(out.read_text())["results"]["run"][0]["windows"]
    assert (
        every > DEFAULT_WINDOWS and f"{every} windows (every window of the evaluation text)" in capsys.readouterr().out
    )

    module = importlib.import_module("recurformer.evaluate.lengths")  # the module, not the function recurformer exports
    real, calls = module.score_rows, {"n": 0}

    def stopped_at_the_second_length(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "score_rows", stopped_at_the_second_length)
    assert cli([*ev, "--json", str(out)]) == 130
    doc = json.loads(out.read_text())
    assert not doc["complete"] and [r["length"] for r in doc["results"]["run"]] == [64]
    assert f"stopped: {out} keeps the lengths finished so far" in capsys.readouterr().out


def test_the_python_api_names_its_own_keywords_in_eval_and_probe_errors(trained, tmp_path) -> None:
    """The same checks as the command line's, in the caller's words: keyword names from Python, never
    a flag the caller did not type."""

    blocker = tmp_path / "file"
    blocker.write_text("x")
    common = dict(lengths=[32], last=16, windows=1, chunk=16, log=lambda s: None)
    cases = [
        (dict(out=blocker / "e.json"), f"cannot write out file {blocker / 'e.json'}: {blocker} is not a directory"),
        (dict(out=tmp_path / "e.json", window=8), "window applies to dense attention models (llama), not"),
    ]
    for extra, message in cases:
        with pytest.raises(RecurformerError) as e:
            importlib.import_module("recurformer.evaluate.command").evaluate_checkpoints(
                [str(trained)], **common, **extra
            )  # type: ignore[arg-type]
        assert str(e.value).startswith(message) and "--" not in str(e.value), str(e.value)
    with pytest.raises(RecurformerError) as e:
        importlib.import_module("recurformer.probe.command").probe_checkpoints(
            [str(trained)], blocker / "p.json", docs=1, log=lambda s: None
        )
    assert str(e.value).startswith(f"cannot write out file {blocker / 'p.json'}"), str(e.value)
