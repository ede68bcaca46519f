"""Every command that can run for minutes says how far it got on stderr (``progress.Progress``):
where stderr is not a terminal (a log, here pytest's capture), plain lines with done/total and the
time left, never a bar; stdout keeps the results. The synthetic evaluation's memory check counts a
row's tokens instead of building the row; a warmup longer than the run is a warning."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import pytest
from helpers import TEST_CONFIGS, randomize_params, tiny_config, write_corpus

import recurformer.data.synthetic as synthetic
import recurformer.progress
import recurformer.synth.run as synth
from recurformer import build_model
from recurformer.cli import main as cli
from recurformer.data import Tokenizer
from recurformer.data.synthetic import ROW_TOKENS, TASKS, make_split, row_tokens
from recurformer.progress import Progress
from recurformer.synth.config import SynthConfig
from recurformer.synth.run import run_synth

TINY = {"dim": 16, "n_heads": 2, "ffn_hidden": 32}


def test_lines_say_done_of_total_and_the_time_left(monkeypatch, capsys) -> None:
    """At most one line per ``every`` seconds, and one at the end; the time left at the rate so
    far, the units of a resumed run not counted in it; a count alone without a total, and no line
    at its end; nothing with ``show`` False; nothing on stdout."""
    clock = iter([0.0, 30.0, 40.0, 60.0, 0.0, 30.0, 31.0, 0.0, 0.0])
    monkeypatch.setattr(recurformer.progress, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    p = Progress(10, "test", "row", initial=2, every=20)  # starts at 0 s
    p.update(2)  # 30 s: 2 rows in 30 s, 6 left
    p.update(1)  # 40 s: under 20 s since the last line
    p.update(5)  # 60 s: the end
    counting = Progress(None, "measure", "doc", every=20)  # 0 s
    counting.update(7)  # 30 s
    counting.update(1)  # 31 s
    Progress(3, "quiet", "row", every=0, show=False).update(3)
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        "  test: 4/10 rows, 0.5 min, about 1.5 min left",
        "  test: 10/10 rows, 1.0 min",
        "  measure: 7 docs, 0.5 min",
    ]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny random model with the byte tokenizer (for eval, probe, niah) and a corpus to read."""
    d = tmp_path_factory.mktemp("progress")
    tok = Tokenizer.byte()
    model = build_model("block_recurrent", dict(TEST_CONFIGS["block_recurrent"][0], vocab_size=tok.vocab_size))
    randomize_params(model, std=0.1)
    model.save_pretrained(d / "m", tokenizer=tok)
    return d / "m", write_corpus(d / "corpus.txt", 40)


def progress_lines(err: str, desc: str, unit: str) -> list[str]:
    return re.findall(rf"^  {re.escape(desc)}: [\d,]+/[\d,]+ {unit}s, .*min.*$", err, flags=re.M)


def test_eval_probe_and_niah_show_progress_lines_on_stderr(saved, tmp_path, capsys) -> None:
    m, corpus = saved
    ev = ["eval", "--checkpoint", str(m), "--lengths", "32,64", "--last", "16", "--windows", "3", "--text", str(corpus)]
    assert cli([*ev, "--json", str(tmp_path / "e.json")]) == 0
    out, err = capsys.readouterr()
    assert progress_lines(err, "m", "window")[-1].startswith("  m: 6/6 windows") and "6/6 windows" not in out
    assert f"wrote {tmp_path / 'e.json'}" in out  # the results stay on stdout

    probe = ["probe", "--checkpoint", str(m), "--text", str(corpus), "--docs", "3", "--passage", "20"]
    assert cli([*probe, "--warm-min", "5", "--warm-max", "30", "--json", str(tmp_path / "p.json")]) == 0
    out, err = capsys.readouterr()
    done = progress_lines(err, "m", "token")[-1]
    total = re.search(r"/([\d,]+) tokens", done).group(1)  # type: ignore[union-attr]
    assert done.startswith(f"  m: {total}/{total} tokens") and "tokens," not in out

    niah = ["niah", "--checkpoint", str(m), "--lengths", "160,256", "--depths", "0,100", "--trials", "2"]
    assert cli([*niah, "--chunk", "64", "--text", str(corpus), "--json", str(tmp_path / "n.json")]) == 0
    out, err = capsys.readouterr()
    assert progress_lines(err, "niah", "token")[-1].startswith(
        f"  niah: {2 * 2 * (160 + 256):,}/{2 * 2 * (160 + 256):,}"
    )
    assert "| 100% |" in out and "niah:" not in out


def test_prepare_shows_lines_and_no_stray_bar(tmp_path, capsys) -> None:
    """No ``measure: 0doc`` bar in a log: the pass that measures the files has no total, so it
    shows a line only when it runs long; the passes with a total end with their line."""
    corpus = write_corpus(tmp_path / "c.txt", 30)
    assert cli(["prepare", "--text", str(corpus), "--tokenizer", "byte", "--out", str(tmp_path / "p")]) == 0
    out, err = capsys.readouterr()
    assert "measure" not in err and "0doc" not in err and "\r" not in err
    assert progress_lines(err, "split", "doc")[-1].startswith("  split: 30/30 docs")  # the documents read
    assert re.match(r"  encode: (\d+)/\1 docs", progress_lines(err, "encode", "doc")[-1])  # train + val parts
    assert out.startswith("[prepare] reading")


def test_synth_training_and_length_tests_show_lines_on_stderr(tmp_path, capsys) -> None:
    """``synth``: each learning rate's steps and the tests at eval_lengths; ``synth --evaluate``:
    the tokens it reads; stdout keeps the table."""
    cfg = SynthConfig(steps=3, batch_size=8, n_val=8, n_test=8, lrs=[1e-3], context=4, eval_lengths=[4, 12])
    cfg.n_length_test = 8
    task = {"num_pairs": 3, "num_queries": 3, "distance": 4}
    run_synth("mqar", "memory_attention", TINY, task, cfg, progress=True, save=str(tmp_path / "s"))
    err = capsys.readouterr().err
    assert progress_lines(err, "lr 0.001", "step")[-1].startswith("  lr 0.001: 3/3 steps")
    total = 8 * sum(row_tokens("mqar", {**task, "distance": L}) for L in (4, 12))
    assert progress_lines(err, "test at eval_lengths", "token")[-1].startswith(
        f"  test at eval_lengths: {total}/{total} tokens"
    )

    assert cli(["synth", "--evaluate", str(tmp_path / "s"), "--lengths", "4,40", "--n-test", "8"]) == 0
    out, err = capsys.readouterr()
    total = 8 * sum(row_tokens("mqar", {**task, "distance": L}) for L in (4, 40))
    assert progress_lines(err, "evaluate", "token")[-1].startswith(f"  evaluate: {total}/{total} tokens")
    assert "| 40 |" in out and "evaluate:" not in out


def test_row_tokens_count_the_rows_the_tasks_build() -> None:
    """``row_tokens`` equals the built row's length for every task with a length, at several
    lengths and parameters (the layouts it mirrors), and for the others."""
    assert set(ROW_TOKENS) == {name for name, t in TASKS.items() if t.length_key}
    cases = [
        ("copy", {}),
        ("delayed_copy", {"copy_len": 3}),
        ("passkey", {"key_len": 2}),
        ("mqar", {}),
        ("mqar", {"num_pairs": 2, "num_queries": 1, "seq_len": 60}),
    ]
    for name, params in cases:
        for L in (1, 7, 30):
            p = TASKS[name].at_length(TASKS[name].params(params), L)
            assert row_tokens(name, p) == make_split(name, 2, 0, p).inputs.shape[1], (name, params, L)
    assert row_tokens("in_context_recall", {"seq_len": 40}) == 39


def test_synth_evaluate_refuses_a_length_too_long_for_memory_in_one_line_without_building_a_row(
    tmp_path, capsys, monkeypatch
) -> None:
    """``synth --evaluate --lengths 1000000000``: one line naming --lengths and --n-test, within
    seconds, from sizes alone (building one row of that length took the old check 44 s and GBs)."""
    cfg = SynthConfig(steps=1, batch_size=4, n_val=4, n_test=4, lrs=[1e-3], context=4)
    run_synth("passkey", "memory_attention", TINY, {"length": 12}, cfg, save=str(tmp_path / "s"))
    real = make_split

    def short_rows_only(task, n, seed, params=None, exclude=None):  # type: ignore[no-untyped-def]
        assert max(v for v in (params or {}).values() if isinstance(v, int)) < 10_000, "a long row was built"
        return real(task, n, seed, params, exclude)

    monkeypatch.setattr(synth, "make_split", short_rows_only)
    monkeypatch.setattr(synthetic, "make_split", short_rows_only)
    capsys.readouterr()
    start = time.monotonic()
    assert cli(["synth", "--evaluate", str(tmp_path / "s"), "--lengths", "64,1000000000"]) == 2
    assert time.monotonic() - start < 30
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith("recurformer: error: testing passkey at length 1000000000 (1,000,000,008 tokens a row)")
    assert "lower --lengths, --n-test or synth.eval_batch_size, or raise synth.eval_memory_gb" in err


def test_a_warmup_longer_than_the_run_is_a_warning(tmp_path, capsys) -> None:
    """train.warmup > train.steps: the learning rate never reaches train.lr; one line on stderr
    naming the option, once; none when the warmup fits."""
    import recurformer

    corpus = write_corpus(tmp_path / "c.txt", 30)
    cfg = tiny_config(corpus, tmp_path)
    cfg["train"] |= {"steps": 2, "warmup": 100, "eval_every": 2, "save_every": 2}
    recurformer.train(cfg, progress=False)
    lines = [line for line in capsys.readouterr().err.splitlines() if "train.warmup" in line]
    assert lines == [
        "warning: train.warmup = 100 is more than train.steps = 2: the learning rate never reaches train.lr = "
        "0.001 (it ends at 2e-05); set train.warmup to at most 2, e.g. 0"
    ]
    cfg["train"] |= {"warmup": 2, "out_dir": str(tmp_path / "fits")}
    recurformer.train(cfg, progress=False)
    assert "train.warmup" not in capsys.readouterr().err


def test_a_terminal_gets_a_bar_with_the_time_left(monkeypatch, capsys) -> None:
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    p = Progress(3, "lr 0.001", "step")
    p.update(3)
    p.close()
    err = capsys.readouterr().err
    assert "lr 0.001:   0%|" in err and "| 0/3 [00:00<" in err  # tqdm's bar: elapsed<left
    assert "steps, " not in err  # not a line


def test_train_shows_lines_with_its_loss_in_a_log(tmp_path, capsys) -> None:
    """``train`` where stderr is a log: lines with the steps done, the time left and the latest
    loss, never a bar's carriage returns; stdout keeps the run's own lines."""
    import recurformer

    corpus = write_corpus(tmp_path / "c.txt", 30)
    cfg = tiny_config(corpus, tmp_path)
    cfg["train"] |= {"steps": 4, "warmup": 1, "log_every": 2, "eval_every": 4, "save_every": 4}
    recurformer.train(cfg)
    out, err = capsys.readouterr()
    assert "\r" not in err and "step 4: val loss" in out
    assert re.search(r"^  train: 4/4 steps, \d+\.\d min; loss \d+\.\d{3}, tok_s [\d,]+", err, re.M), err
