"""The trainer: exact resume, the carried state and its detach boundary, atomic checkpoints,
and one-line errors for bad input."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from helpers import DEVICES, WORDS, run_config

import recurformer.checkpoint as ckpt
from recurformer import RecurformerError
from recurformer.cli import main as cli_main
from recurformer.training.config import load_run_config
from recurformer.training.steps import Pacing
from recurformer.training.trainer import Trainer

RESUME_CASES = {  # data order, precision and truncation: a resume continues each exactly
    "default": {},
    "shuffled": {"data_order": "shuffled"},
    "bf16": {"precision": "bf16"},
    "truncation2": {"truncation": 2},
    # a self-paced stage starts at step 1 (the loss of one step below 100): the resumed run must read
    # where it started from the checkpoint, not from the schedule's step 50
    "self_paced": {"schedule": "{advance_below: 100.0, advance_window: 1, stages: [{step: 50, truncation: 2}]}"},
}


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c == "bf16" else c for c in sorted(RESUME_CASES)]
)
@pytest.mark.parametrize("device", DEVICES)
def test_resume_is_exact(corpus, tmp_path, device, case) -> None:
    extra = RESUME_CASES[case]
    full = Trainer(
        run_config(corpus, tmp_path / "a", steps=6, save_every=100, grad_accum=2, device=device, **extra),
        show_progress=False,
    )
    losses_full = [full.train_step() for _ in range(6)]

    half = Trainer(
        run_config(corpus, tmp_path / "b", steps=3, grad_accum=2, device=device, **extra), show_progress=False
    )
    losses_half = [half.train_step() for _ in range(3)]
    half.save()
    rng = torch.get_rng_state(), random.getstate()
    torch.manual_seed(123)  # the process's generators move on; a resume restores them
    random.seed(123)
    resumed = Trainer(
        run_config(corpus, tmp_path / "b", steps=6, grad_accum=2, device=device, **extra),
        resume=str(tmp_path / "b" / "run"),
        show_progress=False,
    )
    assert torch.equal(torch.get_rng_state(), rng[0]) and random.getstate() == rng[1]
    assert resumed.step == 3
    losses_half += [resumed.train_step() for _ in range(3)]

    assert losses_half == losses_full  # bitwise
    for (n, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), n
    sa, sb = full.opt.state_dict()["state"], resumed.opt.state_dict()["state"]
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k])
    fa, fb = full.state.to_flat(), resumed.state.to_flat()
    assert all(torch.equal(fa[k], fb[k]) for k in fa)
    assert full.streams.state_dict() == resumed.streams.state_dict()


SCHEDULES = {  # stage changes at step 3 (where the run is resumed) and at step 2 (before it)
    "truncation": "{stages: [{step: 0, truncation: 1}, {step: 3, truncation: 2}]}",
    "seq_len": "{stages: [{step: 2, seq_len: 16}, {step: 3, seq_len: 48}]}",
    "doubling": "{double_every: 2, double: {seq_len: 64, truncation: 2}}",
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("state_init, state", [("zero", "carry"), ("noise", "reset"), ("passing", "reset")])
def test_resume_is_exact_across_stage_changes(corpus, tmp_path, schedule, state_init, state) -> None:
    """Bitwise: 6 steps in one run == 3 steps, a checkpoint, 3 more, with the schedule changing
    the segment length or the truncation at the resumed step and before it, and every state_init."""
    kw = dict(grad_accum=2, schedule=SCHEDULES[schedule], state_init=state_init, state=state)
    full = Trainer(run_config(corpus, tmp_path / "a", steps=6, save_every=100, **kw), show_progress=False)
    losses_full, lens_full = [], []
    for _ in range(6):
        losses_full.append(full.train_step())
        lens_full.append(full.streams.seq_len)
    half = Trainer(run_config(corpus, tmp_path / "b", steps=3, **kw), show_progress=False)
    losses_half = [half.train_step() for _ in range(3)]
    half.save()
    resumed = Trainer(
        run_config(corpus, tmp_path / "b", steps=6, **kw), resume=str(tmp_path / "b" / "run"), show_progress=False
    )
    losses_half += [resumed.train_step() for _ in range(3)]
    assert losses_half == losses_full
    for (n, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), n
    fa, fb = full.state.to_flat(), resumed.state.to_flat()
    assert all(torch.equal(fa[k], fb[k]) for k in fa)
    assert full.streams.state_dict() == resumed.streams.state_dict()
    assert full.tokens_seen == resumed.tokens_seen
    expect = {"truncation": [32] * 6, "seq_len": [32, 32, 16, 48, 48, 48], "doubling": [32, 32, 64, 64, 64, 64]}[
        schedule
    ]
    assert lens_full == expect


def test_schedule_applies_at_its_steps(corpus, tmp_path) -> None:
    """The stage in force is a function of the step: truncation 1 -> 2 -> 4 by doubling every 2
    steps, and a truncation-2 step backpropagates the first segment's loss through the state."""
    cfg = run_config(corpus, tmp_path, grad_accum=4, schedule="{double_every: 2, double: {truncation: 4}}").train
    pacing = Pacing(cfg)
    assert [pacing.at(s)["truncation"] for s in range(7)] == [1, 1, 2, 2, 4, 4, 4]
    assert [pacing.at(s)["seq_len"] for s in range(7)] == [32] * 7
    tr = Trainer(
        run_config(corpus, tmp_path, grad_accum=4, schedule="{stages: [{step: 1, truncation: 4}]}"), show_progress=False
    )
    calls = []
    real = tr._segment
    tr._segment = lambda b, s, i=0: (calls.append(s is not None and s.layers[0].memory.requires_grad), real(b, s, i))[1]  # type: ignore[method-assign]
    tr.train_step()  # truncation 1: every segment starts from a detached state
    assert calls[1:4] == [False] * 3
    calls.clear()
    tr.train_step()  # truncation 4: segments 2..4 read a state that still has its graph
    assert calls == [False, True, True, True]


def test_state_init_per_row(corpus, tmp_path) -> None:
    """noise: every fresh row starts from a different, seeded noisy memory; passing: row b starts
    from another row's final state of the previous segment, detached; zero: the fresh state."""
    from recurformer.curriculum import initial_state

    tr = Trainer(run_config(corpus, tmp_path, state="reset"), show_progress=False)
    m, B = tr.model, 3
    prev = m(torch.randint(0, 50, (B, 32)), state=None).state
    rows = torch.tensor([True, False, True])
    g = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    noisy = initial_state(m, "noise", rows, prev, B, "cpu", g(), sigma=0.5)
    again = initial_state(m, "noise", rows, prev, B, "cpu", g(), sigma=0.5)
    a, p = noisy.layers[0].memory, prev.layers[0].memory
    assert torch.equal(a, again.layers[0].memory) and torch.equal(a[1], p[1])  # seeded; row 1 continues
    assert 0.4 < float(a[0].detach().std()) < 0.6 and not torch.equal(a[0], a[2])
    assert noisy.fresh.tolist() == [False, False, False]
    passed = initial_state(m, "passing", rows, prev, B, "cpu", g())
    got = passed.layers[0].memory
    assert torch.equal(got[1], p[1])
    for b in (0, 2):
        assert any(torch.equal(got[b], p[c]) for c in range(B) if c != b)
    (got[0].sum() + got[2].sum()).backward()  # the passed rows carry no gradient to the other stream
    assert all(q.grad is None or not q.grad.any() for q in m.parameters())
    for s in (noisy, passed):  # the host's bound below every start survives (Transformer-XL skips by it)
        assert s.start_floor == prev.start_floor == 0 and s.start_floor <= int(s.start.min())
    zero = initial_state(m, "zero", rows, prev, B, "cpu", g())
    assert zero.fresh.tolist() == [True, False, True]
    with pytest.raises(RecurformerError, match="must be one of"):
        initial_state(m, "warm", rows, prev, B, "cpu", g())


def test_state_init_share_splits_the_starting_rows() -> None:
    """share f: each starting row takes the passed / noisy state with probability f (seeded) and
    the initial state otherwise; f = 1 draws nothing (the plain recipe, bitwise), f = 0 is zero."""
    from recurformer import build_model
    from recurformer.curriculum import initial_state

    torch.manual_seed(0)
    m = build_model("memory_attention", dict(vocab_size=50, dim=16, n_layers=1, n_heads=2, chunk_size=8))
    B = 64
    prev = m(torch.randint(0, 50, (B, 8)), state=None).state
    p = prev.layers[0].memory
    rows = torch.ones(B, dtype=torch.bool)
    rows[:4] = False  # these rows go on reading their own stream
    g = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    for kind in ("passing", "noise"):
        half = initial_state(m, kind, rows, prev, B, "cpu", g(), share=0.5)
        again = initial_state(m, kind, rows, prev, B, "cpu", g(), share=0.5)
        assert torch.equal(half.fresh, again.fresh) and torch.equal(half.layers[0].memory, again.layers[0].memory)
        fresh = half.fresh
        assert not fresh[:4].any() and torch.equal(half.layers[0].memory[:4], p[:4])
        assert 15 < int(fresh.sum()) < 45, int(fresh.sum())  # about half of the 60 starting rows
        given = rows & ~fresh
        assert given.any() and not any(
            torch.equal(half.layers[0].memory[b], p[b]) for b in range(B) if given[b]
        )  # another row's state, or noise
    full = initial_state(m, "passing", rows, prev, B, "cpu", g(), share=1.0)
    plain = initial_state(m, "passing", rows, prev, B, "cpu", g())
    assert not full.fresh.any() and torch.equal(full.layers[0].memory, plain.layers[0].memory)
    none = initial_state(m, "passing", rows, prev, B, "cpu", g(), share=0.0)
    assert torch.equal(none.fresh, rows)


@pytest.mark.parametrize(
    "key, value, message",
    [
        (
            "schedule",
            "{stages: [{step: 4, truncation: 2}, {step: 2, truncation: 1}]}",
            "must start at increasing steps, got step 2 after step 4",
        ),
        (
            "schedule",
            "{stages: [{step: 4, truncation: 4}]}",
            "sets truncation 4: more segments than the 2 a step reads",
        ),
        ("schedule", "{stages: [{step: 4, seq_len: 20}]}", "sets seq_len 20, not a multiple of the model's chunk"),
        ("schedule", "{stages: [{step: 4, lr: 2}]}", "'train.schedule.stages[0].lr' is not schedulable"),
        (
            "schedule",
            "{double_every: 2, double: {seq_len: 96}}",
            "'train.schedule.double.seq_len' must be 32 (the base value) times a power of two",
        ),
        ("schedule", "{double_every: 2, stages: [{step: 1}]}", "give either 'stages' or 'double_every'"),
        ("state_init", "warm", "config key 'train.state_init' must be one of ['zero', 'noise', 'passing'], got 'warm'"),
        ("state_init", "passing, batch_size: 1", "'train.state_init' = passing needs train.batch_size >= 2"),
        ("state_init_share", "1.5", "config key 'train.state_init_share' is a fraction of rows in [0, 1], got 1.5"),
        (
            "state_init_share",
            "0.5",
            "config key 'train.state_init_share' = 0.5 needs train.state_init noise or passing",
        ),
    ],
)
def test_bad_schedules_and_state_inits_are_one_line_errors(corpus, tmp_path, capsys, key, value, message) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"model: {{name: memory_attention, dim: 32, n_layers: 1, n_heads: 2, chunk_size: 8}}\n"
        f"data: {{dataset: null, text_files: [{corpus}], tokenizer: byte, dir: {tmp_path / 'p'}}}\n"
        f"train: {{out_dir: {tmp_path / 'run'}, seq_len: 32, grad_accum: 2, steps: 2, {key}: {value}}}\n"
    )
    assert cli_main(["train", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("recurformer: error: ") and "\n" not in err and message in err, err
    assert not (tmp_path / "run").exists()


def test_metrics_give_tokens_per_s_and_fraction_of_peak(corpus, tmp_path) -> None:
    """mfu = tokens/s x counted FLOP per token / the matmul peak measured at start (flops.py)."""
    import json

    tr = Trainer(run_config(corpus, tmp_path, steps=4, log_every=2, loggers="[]"), show_progress=False)
    assert (
        tr.flops_per_token > 6 * sum(p.numel() for p in tr.model.parameters() if p.dim() >= 2) / 2
    )  # 3 forwards of >= 2N
    tr.run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "mfu" in r]
    assert [r["step"] for r in logged] == [2, 4]
    for r in logged:
        assert r["mfu"] == pytest.approx(r["mean_tok_per_s"] * tr.flops_per_token / tr.peak_flops)
        assert 0 < r["mfu"] < 1.5
    a, b = logged  # the run's mean: tokens over training time, the intervals weighted by their time
    want = b["tokens"] / (a["tokens"] / a["tok_per_s"] + (b["tokens"] - a["tokens"]) / b["tok_per_s"])
    assert a["mean_tok_per_s"] == pytest.approx(a["tok_per_s"]) and b["mean_tok_per_s"] == pytest.approx(want, rel=1e-6)


def test_mfu_reference_is_cached_per_machine(corpus, tmp_path, monkeypatch) -> None:
    """The peak the mfu divides by is measured by the first run and read from the cache by the
    next one, so two runs on one machine compare; the header says where it comes from."""
    from recurformer import flops

    monkeypatch.setenv("RECURFORMER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(flops, "PEAK_SECONDS", 0.05)
    first = Trainer(run_config(corpus, tmp_path, steps=1, loggers="[]"), show_progress=False)
    assert "measured now and cached" in first.peak_source and flops.peak_cache_file().is_file()
    second = Trainer(run_config(corpus, tmp_path / "b", steps=1, loggers="[]"), show_progress=False)
    assert second.peak_flops == first.peak_flops and second.peak_source.startswith("cached in")
    assert any(second.peak_source in line for line in second.header)


def test_mfu_above_one_measures_the_stale_peak_again(tmp_path, monkeypatch) -> None:
    """A cached peak measured while the machine was busy (here 1 kFLOP/s) puts the mfu above 1:
    the peak is measured again, once, the higher one cached, the fraction taken of it, and a note
    says so; a re-measurement never lowers a cached peak."""
    from recurformer import build_model, flops
    from recurformer.training.meter import Throughput

    monkeypatch.setenv("RECURFORMER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(flops, "PEAK_SECONDS", 0.05)
    model = build_model("memory_attention", dict(vocab_size=61, dim=32, n_layers=1, n_heads=2, chunk_size=8))
    notes: list[str] = []
    Throughput(model, 16, torch.device("cpu"), "fp32", 1, notes.append)  # measures and caches the peak
    path = flops.peak_cache_file()
    (key,) = json.loads(path.read_text())
    path.write_text(json.dumps({key: 1e3}))
    meter = Throughput(model, 16, torch.device("cpu"), "fp32", 1, notes.append)
    assert meter.peak_flops == 1e3 and not notes
    rate = 2e3 / meter.flops_per_token  # twice the stale peak
    mfu = meter.fraction(rate)
    assert meter.peak_flops > 1e6 and json.loads(path.read_text())[key] == meter.peak_flops
    assert mfu == pytest.approx(rate * meter.flops_per_token / meter.peak_flops) and 0 < mfu < 1
    assert len(notes) == 1 and "re-measured: mfu 2.00 against the earlier 0.0 GFLOP/s" in notes[0], notes
    assert "re-measured" in meter.peak_source
    peak = meter.peak_flops
    assert meter.fraction(10 * peak / meter.flops_per_token) == pytest.approx(10) and meter.peak_flops == peak
    assert len(notes) == 1  # once per run
    path.write_text(json.dumps({key: 1e30}))
    assert flops.reference_peak(torch.float32, "cpu", remeasure=True)[0] == 1e30


@pytest.mark.parametrize("order", ["contiguous", "shuffled"])
@pytest.mark.parametrize("mode", ["carry", "reset"])
def test_loss_depends_on_previous_batch_only_when_carrying(corpus, tmp_path, mode, order) -> None:
    """All four ablation modes of Table 2 of Liang, "Block-wise Recurrent Transformer": the state
    crosses batches exactly when carried, with contiguous or shuffled data alike."""
    tr = Trainer(run_config(corpus, tmp_path, state=mode, data_order=order), show_progress=False)
    b1, b2 = tr.streams.next_batch(), tr.streams.next_batch()
    _, s1 = tr._segment(b1, None)
    b1p = type(b1)(b1.x.clone(), b1.y, b1.wrapped)
    b1p.x[:, 5:] = (b1p.x[:, 5:] + 1) % 200
    _, s1p = tr._segment(b1p, None)
    with torch.no_grad():
        loss, _ = tr._segment(b2, s1.detach())
        loss_p, _ = tr._segment(b2, s1p.detach())
    assert (loss != loss_p) if mode == "carry" else (loss == loss_p)


def test_no_gradient_crosses_the_detach_boundary(corpus, tmp_path) -> None:
    tr = Trainer(run_config(corpus, tmp_path, truncation=2, grad_accum=2), show_progress=False)
    tr.train_step()
    assert all(t.grad_fn is None and not t.requires_grad for s in tr.state.layers for t in (s.memory, s.mem_k))
    # inside a truncation window the gradient does reach the earlier segment
    emb = []
    h = tr.model.tok_emb.register_forward_hook(lambda m, i, o: emb.append(o))
    l1, s = tr._segment(tr.streams.next_batch(), tr.state)
    l2, s2 = tr._segment(tr.streams.next_batch(), s)
    h.remove()
    g_within = torch.autograd.grad(l2, emb[0], retain_graph=True)[0]
    assert g_within.abs().sum() > 0
    l3, _ = tr._segment(tr.streams.next_batch(), s2.detach())
    assert l3.grad_fn is not None
    with pytest.raises(RuntimeError):  # the first segment is not in l3's graph at all
        torch.autograd.grad(l3, emb[0])


def test_crash_mid_write_keeps_previous_checkpoint(corpus, tmp_path, monkeypatch) -> None:
    tr = Trainer(run_config(corpus, tmp_path), show_progress=False)
    tr.train_step()
    good = tr.save()
    tr.train_step()
    calls = {"n": 0}
    real = ckpt.save_file

    def dying(tensors, path, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:  # weights written, then the process "dies" mid-way
            Path(path).write_bytes(b"\x00" * 10)
            raise KeyboardInterrupt
        return real(tensors, path, *a, **k)

    monkeypatch.setattr(ckpt, "save_file", dying)
    with pytest.raises(KeyboardInterrupt):
        tr.save()
    assert ckpt.resolve(tmp_path / "run") == good
    loaded = ckpt.load_checkpoint(tmp_path / "run", with_train_state=True)
    assert loaded["train_json"]["step"] == 1
    monkeypatch.setattr(ckpt, "save_file", real)
    Trainer(run_config(corpus, tmp_path), resume=str(tmp_path / "run"), show_progress=False)


def test_nan_loss_stops_with_message_and_keeps_checkpoint(corpus, tmp_path) -> None:
    tr = Trainer(run_config(corpus, tmp_path), show_progress=False)
    tr.train_step()
    good = tr.save()
    with torch.no_grad():
        tr.model.tok_emb.weight[0, 0] = float("nan")
    with pytest.raises(RecurformerError, match="loss became nan at step 2.*last good checkpoint"):
        tr.train_step()
    assert ckpt.resolve(tmp_path / "run") == good


def test_bad_inputs_are_one_line_errors(corpus, tmp_path, capsys) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  name: memory_attention\ntrain:\n  stpes: 3\n")
    assert cli_main(["train", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "recurformer: error: unknown config key 'train.stpes' (did you mean 'steps'?)"
    cfg.write_text("model:\n  name: memory_attention\ntrain:\n  steps: many\n")
    assert cli_main(["train", "--config", str(cfg)]) == 2
    assert "train.steps' must be an integer" in capsys.readouterr().err
    assert cli_main(["train", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err
    with pytest.raises(RecurformerError, match="not found|does not exist|missing"):
        Trainer(
            load_run_config(
                None,
                [
                    "model.name=llama",
                    "data.dataset=null",
                    f"data.text_files=[{tmp_path / 'missing.txt'}]",
                    f"data.dir={tmp_path / 'p2'}",
                    "data.tokenizer=byte",
                ],
            ),
            show_progress=False,
        )
    # a checkpoint of another architecture
    tr = Trainer(run_config(corpus, tmp_path), show_progress=False)
    tr.train_step()
    tr.save()
    other = run_config(corpus, tmp_path)
    other.model = {"name": "llama", "dim": 32, "n_layers": 2, "n_heads": 2}
    with pytest.raises(RecurformerError, match="holds a 'memory_attention' model, the config asks for 'llama'"):
        Trainer(other, resume=str(tmp_path / "run"), show_progress=False)
    # a corrupted safetensors file
    weights = ckpt.resolve(tmp_path / "run") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(RecurformerError, match="corrupted or truncated"):
        Trainer(run_config(corpus, tmp_path), resume=str(tmp_path / "run"), show_progress=False)


def test_cli_train_end_to_end(corpus, tmp_path, capsys) -> None:
    args = [
        "train",
        "--set",
        "model.name=llama",
        "--set",
        "model.dim=32",
        "--set",
        "model.n_layers=1",
        "--set",
        "model.n_heads=2",
        "--set",
        "data.dataset=null",
        "--set",
        f"data.text_files=[{corpus}]",
        "--set",
        "data.tokenizer=byte",
        "--set",
        f"data.dir={tmp_path / 'prep'}",
        "--set",
        f"train.out_dir={tmp_path / 'r'}",
        "--set",
        "train.steps=4",
        "--set",
        "train.batch_size=2",
        "--set",
        "train.seq_len=16",
        "--set",
        "train.eval_every=2",
        "--set",
        "train.precision=fp32",
        "--set",
        "train.log_every=1",
    ]
    assert cli_main(args) == 2  # no --config: told to give one
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  name: llama\ntrain:\n  state: reset\n")
    assert cli_main(["train", "--config", str(cfg)] + args[1:]) == 0
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert any("val_loss" in ln for ln in lines) and len(lines) >= 4
    assert (ckpt.resolve(tmp_path / "r") / "tokenizer.json").is_file()
    (done,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("done: ")]
    last = [json.loads(ln) for ln in lines if "mean_tok_per_s" in ln][-1]
    assert (
        done.startswith("done: step=4, ") and f"mean_tok_per_s={last['mean_tok_per_s']:.4g}" in done
    )  # the run's mean
    assert f"last_interval_tok_per_s={last['tok_per_s']:.4g}" in done and " tok_per_s=" not in done


def test_cli_eval_and_generate_on_a_trained_checkpoint(corpus, tmp_path, capsys) -> None:
    tr = Trainer(run_config(corpus, tmp_path), show_progress=False)
    tr.train_step()
    tr.save()
    run = str(tmp_path / "run")
    out = tmp_path / "ev" / "e.json"
    assert (
        cli_main(
            [
                "eval",
                "--checkpoint",
                run,
                "--lengths",
                "64,128",
                "--last",
                "32",
                "--windows",
                "2",
                "--chunk",
                "24",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "| run | " in printed and out.is_file() and out.with_suffix(".png").is_file()
    assert cli_main(["eval", "--checkpoint", run, "--window", "16", "--json", str(out)]) == 2
    assert "--window applies to dense attention models" in capsys.readouterr().err
    st = tmp_path / "s.safetensors"
    assert (
        cli_main(
            [
                "generate",
                "--checkpoint",
                run,
                "--prompt",
                "the cat",
                "--max-new-tokens",
                "5",
                "--temperature",
                "0",
                "--save-state",
                str(st),
                "--stats",
            ]
        )
        == 0
    )
    first = capsys.readouterr()
    assert first.out.startswith("the cat") and "tok/s" in first.err and st.is_file()
    assert (
        cli_main(
            [
                "generate",
                "--checkpoint",
                run,
                "--prompt",
                " sat",
                "--load-state",
                str(st),
                "--max-new-tokens",
                "3",
                "--temperature",
                "0",
            ]
        )
        == 0
    )


def step_gradients(tr: Trainer) -> dict[str, torch.Tensor]:
    """Run one training step; return the gradients it applied (before the optimizer)."""
    seen: dict[str, torch.Tensor] = {}
    real = tr.opt.step

    def record(*a, **k):
        seen.update({n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None})
        return real(*a, **k)

    tr.opt.step = record
    try:
        tr.train_step()
    finally:
        del tr.opt.step
    return seen


def hand_gradients(tr: Trainer, truncation: int, reset: bool = True) -> dict[str, torch.Tensor]:
    """The gradient of the next step by hand, on copies of the model, streams and carried state:
    mean loss over grad_accum segments, the state detached every ``truncation`` segments and (with
    ``reset``) a row's state reset where its stream wraps."""
    import copy

    t = tr.cfg.train
    model, streams = copy.deepcopy(tr.model), copy.deepcopy(tr.streams)
    state = tr.state if tr.state is not None else model.init_state(t.batch_size, tr.device)
    total = 0.0
    for k in range(t.grad_accum):
        if k % truncation == 0:
            state = state.detach()
        b = streams.next_batch()
        x, y = b.x.to(tr.device), b.y.to(tr.device)
        out = model(x, state=state.reset(b.wrapped) if reset else state, targets=y)
        total = total + out.loss
        state = out.state
    (total / t.grad_accum).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("device", DEVICES)
def test_truncation_backpropagates_through_that_many_segments(corpus, tmp_path, device) -> None:
    """A step of 4 segments with truncation 2 has the gradient of two backward passes over two
    segments each (the state carried from the step before detached), not that of truncation 1."""
    tr = Trainer(
        run_config(corpus, tmp_path, grad_accum=4, truncation=2, grad_clip=0, device=device), show_progress=False
    )
    for _ in range(2):  # the second step starts from the carried state
        want, cut = hand_gradients(tr, 2), hand_gradients(tr, 1)
        got = step_gradients(tr)
        assert got.keys() == want.keys()
        for n in got:
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-8, msg=n)
        diff = max(float((want[n] - cut[n]).norm() / want[n].norm()) for n in want)
        assert diff > 1e-3  # the segments' state carries gradient: truncation 1 differs


@pytest.fixture(scope="module")
def wrapping_data(tmp_path_factory) -> Path:
    """Prepared data so small that two streams of 32 tokens wrap after 3 and 2 training segments
    (regions of 103 and 89 tokens) and after 1 and 2 validation segments (64 and 65 tokens)."""
    from recurformer.data import prepare

    d = tmp_path_factory.mktemp("wrap")
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 8))) + "." for _ in range(10)]
    (d / "c.txt").write_text("<|endoftext|>".join(docs))
    prepare(d / "prepared", text_files=[d / "c.txt"], tokenizer="byte", val_fraction=0.4)
    return d / "prepared"


def wrapping_trainer(data: Path, tmp: Path, device: str) -> Trainer:
    over = [
        "model.name=memory_attention",
        "model.dim=32",
        "model.n_layers=2",
        "model.n_heads=2",
        "model.chunk_size=8",
        "data.dataset=null",
        f"data.dir={data}",
        f"train.out_dir={tmp / 'run'}",
        "train.batch_size=2",
        "train.seq_len=32",
        "train.steps=6",
        "train.warmup=2",
        "train.precision=fp32",
        "train.grad_clip=0",
        "train.eval_batches=4",
        "train.loggers=[]",
        f"train.device={device}",
    ]
    tr = Trainer(load_run_config(None, over), show_progress=False)
    assert list(tr.streams.windows_per_pass) == [3, 2]
    return tr


@pytest.mark.parametrize("device", DEVICES)
def test_a_row_state_is_reset_where_its_stream_wraps(wrapping_data, tmp_path, device) -> None:
    """Five steps over streams that wrap at steps 2 (row 1), 3 (row 0) and 4 (row 1): each step's
    gradient is that of the carried state with the wrapped rows reset, which differs from carrying on."""
    tr = wrapping_trainer(wrapping_data, tmp_path, device)
    wrapped = []
    for step in range(5):
        want, carried = hand_gradients(tr, 1), hand_gradients(tr, 1, reset=False)
        wrapped.append(tr.streams.step % tr.streams.windows_per_pass == 0 if step else [False, False])
        got = step_gradients(tr)
        for n in got:
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-8, msg=n)
        differs = max(float((want[n] - carried[n]).norm() / want[n].norm()) for n in want) > 1e-3
        assert differs == bool(any(wrapped[-1]))
    assert [list(map(bool, w)) for w in wrapped] == [
        [False, False],
        [False, False],
        [False, True],
        [True, False],
        [False, True],
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_validation_resets_a_row_where_its_stream_wraps(wrapping_data, tmp_path, device) -> None:
    from recurformer.data import ContiguousStreams

    tr = wrapping_trainer(wrapping_data, tmp_path, device)

    def by_hand(reset: bool) -> float:
        streams = ContiguousStreams(tr.val_tokens, 2, 32)
        state, losses = tr.model.init_state(2, device), []
        with torch.no_grad():
            for _ in range(4):
                b = streams.next_batch()
                x, y = b.x.to(device), b.y.to(device)
                out = tr.model(x, state=state.reset(b.wrapped) if reset else state, targets=y)
                state = out.state
                losses.append(float(out.loss))
        return sum(losses) / len(losses)

    assert list(ContiguousStreams(tr.val_tokens, 2, 32).windows_per_pass) == [1, 2]
    assert tr.evaluate() == pytest.approx(by_hand(True), rel=1e-6)
    assert abs(by_hand(True) - by_hand(False)) > 1e-4
