"""Recipes for a state that must remember (truncation, schedules, mixed lengths, initial states in
``synth``) and the read-out of the memory path, on constructed models whose answer is known."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from helpers import randomize_params

import recurformer
from recurformer.cli import main
from recurformer.config import RecurformerError
from recurformer.curriculum import schedule_from
from recurformer.data.synthetic import TASKS, make_split
from recurformer.models import build_model, model_names
from recurformer.nn import IGNORE_INDEX
from recurformer.readout import memory_share, readout, state_gradient
from recurformer.synth.config import SynthConfig, model_values, synth_config
from recurformer.synth.job import FreshRows
from recurformer.synth.learner import Learner
from recurformer.synth.run import run_synth

TINY = {"dim": 16, "n_heads": 2, "ffn_hidden": 32}


def learner(name: str = "memory_attention", context: int = 4, **extra) -> Learner:
    torch.manual_seed(0)
    model = build_model(name, model_values(name, {**TINY, **extra}, vocab=64, context=context))
    randomize_params(model)
    return Learner(model, TASKS["mqar"])


def grads(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    return out


def test_learner_backward_matches_the_whole_row_and_a_hand_truncation() -> None:
    """piece 0 == the plain loss's gradient; piece C == two backward passes with the state
    detached between them (the slow reference, written out)."""
    lr = learner()
    d = make_split("mqar", 4, 0, dict(num_pairs=3, num_queries=3, distance=5))  # 16 tokens: 4 chunks of 4
    x, y = d.inputs, d.targets
    lr.loss(x, y).backward()
    ref = grads(lr)
    loss, kept = lr.backward(x, y, None, 0, 4)
    got = grads(lr)
    assert ref.keys() == got.keys() and all(torch.allclose(ref[k], got[k], atol=1e-6) for k in ref)
    assert kept.pos == 16 and not kept.layers[0].memory.requires_grad

    n = (y != IGNORE_INDEX).sum()
    F = torch.nn.functional
    out = lr.model(x[:, :8])
    (
        F.cross_entropy(out.logits.flatten(0, 1), y[:, :8].flatten(), ignore_index=IGNORE_INDEX, reduction="sum") / n
    ).backward()
    out = lr.model(x[:, 8:], state=out.state.detach())
    (
        F.cross_entropy(out.logits.flatten(0, 1), y[:, 8:].flatten(), ignore_index=IGNORE_INDEX, reduction="sum") / n
    ).backward()
    ref = grads(lr)
    lr.backward(x, y, None, 8, 4)
    got = grads(lr)
    assert all(torch.allclose(ref[k], got[k], atol=1e-6) for k in ref)
    lr.backward(x, y, None, 0, 4)
    full_again = grads(lr)
    assert any(not torch.allclose(full_again[k], got[k], atol=1e-6) for k in got), "truncation changes the gradient"


def test_a_row_shorter_than_a_chunk_passes_on_the_state_it_was_read_from() -> None:
    """Mixed lengths can draw a row shorter than one chunk: it completes no chunk, so the state
    it gives ``state_init=passing`` is the one it started from (detached), or the fresh state."""
    lr = learner()
    d = make_split("mqar", 4, 0, dict(num_pairs=1, num_queries=1, distance=0))  # 3 tokens < chunk 4
    _, kept = lr.backward(d.inputs, d.targets, None, 0, 4)
    assert kept.pos == 0 and torch.equal(kept.layers[0].memory, lr.model.init_state(4).layers[0].memory)
    long = make_split("mqar", 4, 1, dict(num_pairs=3, num_queries=3, distance=5))
    _, after = lr.backward(long.inputs, long.targets, None, 0, 4)
    _, kept = lr.backward(d.inputs, d.targets, after, 0, 4)
    assert kept.pos == after.pos and torch.equal(kept.layers[0].memory, after.layers[0].memory)
    assert not kept.layers[0].memory.requires_grad


def test_the_truncation_check_reads_the_shortest_row_mixed_lengths_draw() -> None:
    """Without a length schedule mixed lengths never train at the task's own length, so a task
    length below lo does not make the shortest row; with one, every stage's range counts."""
    from recurformer.synth.config import check_recipe

    t = TASKS["mqar"]
    p = t.params(dict(num_pairs=2, num_queries=2, distance=3))  # rows of 10 tokens; 15 at distance 8
    check_recipe(t, p, synth_config({"train_lengths": [8, 12], "truncation": 3, "context": 4}))
    with pytest.raises(recurformer.RecurformerError, match=r"shortest training row \(10 tokens\)"):
        staged = {"train_lengths": [8, 12], "schedule": {"stages": [{"step": 5, "length": 12}]}}
        check_recipe(t, p, synth_config({**staged, "truncation": 3, "context": 4}))


def test_fresh_rows_follow_the_schedule_and_mixed_lengths() -> None:
    p = TASKS["mqar"].params(dict(num_pairs=2, num_queries=2, distance=4))
    cfg = synth_config({"batch_size": 4, "schedule": {"stages": [{"step": 3, "length": 8}, {"step": 5, "length": 16}]}})
    rows = FreshRows("mqar", p, cfg, set())
    assert [rows.length(s) for s in range(7)] == [4, 4, 4, 8, 8, 16, 16]
    assert rows.batch(4).inputs.shape == (4, 2 * 2 + 8 + 2 * 2 - 1)
    doubling = FreshRows("mqar", p, synth_config({"schedule": {"double_every": 2, "double": {"length": 16}}}), set())
    assert [doubling.length(s) for s in range(8)] == [4, 4, 8, 8, 16, 16, 16, 16]
    mixed = FreshRows("mqar", p, synth_config({"train_lengths": [3, 9], "batch_size": 4}), set())
    lengths = [mixed.length(s) for s in range(200)]
    assert set(lengths) == set(range(3, 10)) and lengths == [
        mixed.length(s) for s in range(200)
    ]  # every length, seeded
    staged = FreshRows(
        "mqar", p, synth_config({"train_lengths": [2, 6], "schedule": {"stages": [{"step": 100, "length": 8}]}}), set()
    )  # mixed lengths up to the stage's length: 2..4 (the task's 4) before step 100, then 2..6
    assert {staged.length(s) for s in range(100)} == {2, 3, 4} and {staged.length(s) for s in range(100, 300)} == {
        2,
        3,
        4,
        5,
        6,
    }
    short = FreshRows(
        "mqar", p, synth_config({"train_lengths": [6, 9], "schedule": {"stages": [{"step": 5, "length": 8}]}}), set()
    )  # a stage below lo trains at its own length
    assert [short.length(s) for s in range(5)] == [4] * 5 and {short.length(s) for s in range(5, 200)} == {6, 7, 8}
    held = make_split(
        "mqar", 4, 10**9 + 0 * 10**6 + 1, TASKS["mqar"].at_length(p, mixed.length(1))
    )  # what batch 1 would draw first
    again = FreshRows("mqar", p, synth_config({"train_lengths": [3, 9], "batch_size": 4}), held.row_keys()).batch(1)
    assert not (again.row_keys() & held.row_keys()) and len(again.row_keys()) == 4


@pytest.mark.parametrize(
    "name, synth",
    [
        (
            "memory_attention",
            {"schedule": {"double_every": 2, "double": {"length": 16}}, "truncation": 2, "state_init": "passing"},
        ),
        ("block_recurrent", {"train_lengths": [4, 12], "state_init": "noise"}),
        (
            "memory_attention",
            {"train_lengths": [0, 1], "state_init": "passing", "context": 8},
        ),  # rows of 7 or 8 tokens, chunks of 8
        ("transformer_xl", {"fresh_data": True, "truncation": 1}),
        ("rmt", {"train_lengths": [4, 12], "state_init": "passing", "state_init_share": 0.5}),
    ],
)
def test_recipes_end_to_end(name: str, synth: dict) -> None:
    cfg = synth_config(
        {
            "steps": 6,
            "batch_size": 4,
            "n_val": 8,
            "n_test": 8,
            "lrs": [1e-3],
            "context": 4,
            "chunk": 8,
            "eval_lengths": [4, 64],
            "n_length_test": 8,
            **synth,
        }
    )
    r = run_synth("mqar", name, TINY, {"num_pairs": 2, "num_queries": 2, "distance": 4}, cfg)
    assert math.isfinite(r.sweep[0]["train_loss"]) and set(r.by_length) == {4, 64} and r.test.rows == 8


def test_eval_every_records_a_learning_curve_that_ends_at_the_final_score(capsys) -> None:
    """synth.eval_every: the validation accuracy every N steps, per lr, each point also printed on
    stderr; its last point is the trained model's, so it equals the sweep's final validation
    accuracy; evaluating on the way changes no training step."""
    cfg = synth_config(
        {"steps": 6, "batch_size": 4, "n_val": 8, "n_test": 4, "lrs": [3e-3], "context": 4, "chunk": 8, "eval_every": 2}
    )
    r = run_synth("mqar", "block_recurrent", TINY, {"num_pairs": 2, "num_queries": 2, "distance": 4}, cfg)
    curve = r.sweep[0]["curve"]
    assert [c["step"] for c in curve] == [2, 4, 6] and all(math.isfinite(c["train_loss"]) for c in curve)
    assert curve[-1]["val_accuracy"] == r.sweep[0]["val_accuracy"]
    printed = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lr 0.003 step ")]
    assert printed == [
        f"lr 0.003 step {c['step']}/6: train loss {c['train_loss']:.4f}, val accuracy {c['val_accuracy']:.3f}"
        for c in curve
    ]
    plain = run_synth(
        "mqar",
        "block_recurrent",
        TINY,
        {"num_pairs": 2, "num_queries": 2, "distance": 4},
        synth_config({**cfg.__dict__, "eval_every": 0}),
    )
    assert "curve" not in plain.sweep[0] and plain.sweep[0]["val_accuracy"] == r.sweep[0]["val_accuracy"]


def test_a_length_curriculum_is_scored_at_the_length_it_ends_at() -> None:
    """Held-out rows are at the last stage's length (the headline of a curriculum cell), while
    training starts at the config's; without a schedule they stay at the config's length."""
    p = {"num_pairs": 2, "num_queries": 2, "distance": 4}
    base = {"steps": 4, "batch_size": 4, "n_val": 4, "n_test": 4, "lrs": [1e-3], "context": 4, "chunk": 8}
    lines: list[str] = []
    run_synth(
        "mqar",
        "llama",
        TINY,
        p,
        synth_config({**base, "schedule": {"double_every": 2, "double": {"length": 8}}}),
        lines.append,
    )
    assert f"rows of {2 * 2 + 8 + 2 * 2 - 1} tokens" in lines[0]
    lines.clear()
    run_synth("mqar", "llama", TINY, p, synth_config({**base, "fresh_data": True}), lines.append)
    assert f"rows of {2 * 2 + 4 + 2 * 2 - 1} tokens" in lines[0]


def test_a_self_paced_stage_starts_once_the_stage_before_is_learned() -> None:
    """schedule.advance_below: a stage starts at the step after the mean training loss of the
    stage before, over that stage's last advance_window steps, first falls below the threshold;
    no earlier than a whole window into the stage, no later than its own step; a run that never
    learns keeps the steps as written. The same for synth's schedule and train's."""
    sched = schedule_from(
        {"advance_below": 0.5, "advance_window": 3, "stages": [{"step": 10, "length": 8}, {"step": 20, "length": 16}]},
        "synth.schedule",
    )
    base = {"length": 4, "truncation": 0}
    pace = sched.pace(base)
    started = {}
    for step, loss in enumerate([2.0, 1.0, 0.4, 0.3, 0.2, 0.1, 0.1, 0.1, 0.1]):
        if (stage := sched.observe(pace, step, loss)) is not None:
            started[stage] = step + 1
    # steps 2-4 average 0.3 (steps 1-3: 0.567); stage 1's first three steps (5-7) average 0.1
    assert started == {1: 5, 2: 8} and pace.starts == [0, 5, 8]
    assert [sched.at(k, base, pace)["length"] for k in (4, 5, 7, 8)] == [4, 8, 8, 16]
    slow = sched.pace(base)
    for step in range(30):
        assert sched.observe(slow, step, 1.0) is None
    assert slow.starts == [0, 10, 20] and sched.at(10, base, slow) == sched.at(10, base)
    assert sched.at(10, base) == {"length": 8, "truncation": 0}
    from recurformer.training.config import TrainConfig
    from recurformer.training.steps import Pacing

    # train's schedule paces itself the same way (its stages set seq_len and truncation)
    paced = {"advance_below": 0.5, "advance_window": 2, "stages": [{"step": 10, "truncation": 2}]}
    pacing = Pacing(TrainConfig(grad_accum=2, schedule=paced))
    assert pacing.observe(0, 0.4) is None and pacing.at(1)["truncation"] == 1  # the window is not full yet
    assert pacing.observe(1, 0.4) == (
        "step 2: stage 1 (seq_len 256, truncation 2) starts, the training loss of the last 2 steps below 0.5"
    )
    assert pacing.at(2) == {"seq_len": 256, "truncation": 2} and pacing.state_dict()["pace"]["starts"] == [0, 2]
    assert Pacing(TrainConfig(schedule={"stages": [{"step": 5, "seq_len": 128}]})).state_dict() == {}


def test_a_self_paced_synth_run_records_where_its_stages_started(capsys) -> None:
    """A synth run with a self-paced schedule announces a stage that starts early, records every
    stage's start in its sweep, and is scored at the last stage's length whether or not it got
    there early."""
    p = {"num_pairs": 2, "num_queries": 2, "distance": 4}
    base = {"steps": 6, "batch_size": 4, "n_val": 4, "n_test": 4, "lrs": [1e-3], "context": 4, "chunk": 8}
    for below, starts in ((100.0, [0, 2]), (1e-9, [0, 50])):
        schedule = {"advance_below": below, "advance_window": 2, "stages": [{"step": 50, "length": 8}]}
        lines: list[str] = []
        r = run_synth("mqar", "llama", TINY, p, synth_config({**base, "schedule": schedule}), lines.append)
        assert r.sweep[0]["stage_starts"] == starts
        assert f"rows of {2 * 2 + 8 + 2 * 2 - 1} tokens" in lines[0]  # held-out rows at distance 8
        err = capsys.readouterr().err
        assert ("step 2/6: stage 1 (truncation 0, length 8) starts" in err) == (below == 100.0), err


@pytest.mark.parametrize(
    "sets, message",
    [
        (
            ["synth.schedule={advance_below: -1, stages: [{step: 5, length: 8}]}"],
            "config key 'synth.schedule.advance_below' must be a training loss >= 0 (0: off), got -1",
        ),
        (
            ["synth.schedule={stages: [{step: 5, length: 8}, {step: 2, length: 4}]}"],
            "'synth.schedule.stages' must start at increasing steps, got step 2 after step 5",
        ),
        (
            ["synth.truncation=3"],
            "synth key 'truncation' = 3: more segments of 4 tokens (synth.context) than the shortest training row (10 tokens) has",
        ),
        (
            ["synth.state_init=warm"],
            "config key 'synth.state_init' must be one of ['zero', 'noise', 'passing'], got 'warm'",
        ),
        (
            ["synth.train_lengths=[5, 8]", "synth.schedule={stages: [{step: 1, length: 8}]}", "synth.truncation=3"],
            "synth key 'truncation' = 3: more segments of 4 tokens (synth.context) than the shortest training row (10 tokens) has",
        ),
        (["task.distance=100", "task.seq_len=50"], "task parameter 'distance' = 100 does not fit in seq_len 50"),
        (
            ["synth.schedule={double_every: 2, double: {length: 9}}"],
            "'synth.schedule.double.length' must be 3 (the base value) times a power of two, got 9",
        ),
        (["synth.eval_every=-1"], "synth key 'eval_every' must be >= 0 (0: only at the end), got -1"),
        (
            ["synth.state_init_share=0.5"],
            "config key 'synth.state_init_share' = 0.5 needs synth.state_init noise or passing, got zero",
        ),
    ],
)
def test_bad_recipes_are_one_line_errors(capsys, sets, message) -> None:
    args = [
        "synth",
        "--task",
        "mqar",
        "--model",
        "memory_attention",
        "--steps",
        "2",
        "--set",
        "dim=16",
        "--set",
        "n_heads=2",
        "--set",
        "synth.context=4",
        "--set",
        "task.num_pairs=2",
        "--set",
        "task.num_queries=2",
        "--set",
        "task.distance=3",
    ]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("recurformer: error: ") and "\n" not in err and message in err, err


def test_synth_train_lengths_need_a_task_with_a_length() -> None:
    from recurformer.config import RecurformerError

    with pytest.raises(RecurformerError, match="'train_lengths' needs a task with a length"):
        run_synth("in_context_recall", "llama", TINY, {"seq_len": 16}, SynthConfig(steps=1, train_lengths=[4, 8]))


# -- the read-out ---------------------------------------------------------------------------------


def memory_model(C: int = 4, **extra):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    m = build_model("memory_attention", {**TINY, "vocab_size": 64, "n_layers": 2, "chunk_size": C, **extra})
    randomize_params(m)
    return m


def test_memory_share_of_uniform_attention_is_known() -> None:
    """With W_q = 0 every score is 0, so a token at chunk offset j spreads its attention evenly
    over the C memory slots and the j + 1 chunk tokens it sees: share C / (C + j + 1)."""
    C = 4
    m = memory_model(C)
    for block in m.layers:
        torch.nn.init.zeros_(block.attn.wq.weight)
    x = torch.randint(0, 64, (3, 5 * C))
    share = memory_share(m, x, C)
    want = sum(C / (C + j + 1) for j in range(C)) / C
    assert set(share) == {0, 1} and all(abs(v - want) < 1e-6 for s in share.values() for v in s) and len(share[0]) == 5
    m2 = memory_model(C)  # random weights: a different share, and it depends on the layer
    s2 = memory_share(m2, x, C)
    assert all(0 < v < 1 for s in s2.values() for v in s) and abs(s2[0][2] - want) > 1e-3


def test_rmt_share_of_uniform_attention_is_known_and_streams() -> None:
    """RMT with W_q = 0: a token at segment offset j sees the M read slots and j + 1 tokens
    (never the write slots), share M / (M + j + 1); reading the segments in pieces of 3 tokens
    records the same shares for the same tokens."""
    M, S = 3, 5
    torch.manual_seed(0)
    m = build_model("rmt", {**TINY, "vocab_size": 64, "n_layers": 2, "segment_len": S, "memory_size": M})
    randomize_params(m)
    for block in m.layers:
        torch.nn.init.zeros_(block.attn.wq.weight)
    x = torch.randint(0, 64, (2, 3 * S))
    want = sum(M / (M + j + 1) for j in range(S)) / S
    share = memory_share(m, x, S)
    assert set(share) == {0, 1} and all(abs(v - want) < 1e-6 for s in share.values() for v in s) and len(share[0]) == 3
    randomize_params(m)
    whole = memory_share(m, x, S)
    from recurformer import tap

    with torch.no_grad(), tap.recording() as rec:
        state = None
        for a in range(0, 3 * S, 3):
            state = m(x[:, a : a + 3], state=state).state
    pieces = torch.cat(rec[m.layers[1].attn], dim=1)
    assert pieces.shape == (2, 3 * S)
    assert all(abs(float(pieces[:, a : a + S].mean()) - whole[1][a // S]) < 1e-5 for a in range(0, 3 * S, S))


def test_block_recurrent_share_is_zero_or_one_when_a_path_is_cut() -> None:
    torch.manual_seed(0)
    m = build_model(
        "block_recurrent", {**TINY, "vocab_size": 64, "n_layers": 1, "block_size": 4, "recurrent_layers": [-1]}
    )
    randomize_params(m)
    x = torch.randint(0, 64, (2, 12))
    attn = m.layers[0].attn
    D = TINY["dim"]
    with torch.no_grad():
        attn.wo.weight[:, D:] = 0  # the state's half of Wo: nothing comes from the state
    assert all(v == 0 for v in memory_share(m, x, 4)[0])
    randomize_params(m)
    with torch.no_grad():
        attn.wo.weight[:, :D] = 0  # the tokens' half: everything comes from the state
    assert all(abs(v - 1) < 1e-6 for v in memory_share(m, x, 4)[0])


def test_state_gradient_is_zero_where_the_state_cannot_matter() -> None:
    """Memory attention whose memory keys and values are constant (W_km = W_vm = 0) cannot use
    its memory: the gradient reaching it is exactly 0, while the same model with random W_km,
    W_vm gets one from every later segment. A two-layer sliding window of W = 4 (reach 2W - 1)
    gets a gradient from the two next segments, and exactly none from the third, out of reach."""
    C = 4
    m = memory_model(C, memory_qkv="separate")
    x = torch.randint(0, 64, (2, 4 * C + 1))
    norms = state_gradient(m, x[:, :-1], x[:, 1:], C, 3)
    assert all(g > 0 for g in norms)
    for block in m.layers:
        torch.nn.init.zeros_(block.attn.wkm.weight)
        torch.nn.init.zeros_(block.attn.wvm.weight)
    assert state_gradient(m, x[:, :-1], x[:, 1:], C, 3) == [0.0, 0.0, 0.0]

    torch.manual_seed(0)
    sw = build_model("sliding_window", {**TINY, "vocab_size": 64, "n_layers": 2, "window": 4})
    randomize_params(sw)
    norms = state_gradient(sw, x[:, :-1], x[:, 1:], 4, 3)  # segment 0 (positions 0..3) reaches up to 3 + 2 (W - 1) = 9
    assert norms[0] > 0 and norms[1] > 0 and norms[2] == 0.0
    y = torch.full_like(x[:, 1:], IGNORE_INDEX)
    assert all(math.isnan(g) for g in state_gradient(sw, x[:, :-1], y, 4, 2))  # nothing scored: no number


def test_readout_cli_on_a_saved_synth_model(tmp_path, capsys) -> None:
    cfg = SynthConfig(steps=2, batch_size=4, n_train=8, n_val=4, n_test=4, lrs=[1e-3], context=4)
    run_synth(
        "mqar",
        "memory_attention",
        TINY,
        {"num_pairs": 2, "num_queries": 2, "distance": 12},
        cfg,
        save=str(tmp_path / "m"),
    )
    capsys.readouterr()
    out = tmp_path / "r.json"
    args = [
        "readout",
        "--checkpoint",
        str(tmp_path / "m"),
        "--task",
        "mqar",
        "--set",
        "task.num_pairs=2",
        "--set",
        "task.num_queries=2",
        "--set",
        "task.distance=12",
        "--segments",
        "3",
        "--rows",
        "4",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "| 0 | memory |" in text and "| 3 |" in text
    r = json.loads(out.read_text())
    assert r["segment"] == 4 and len(r["share"]["0"]) == 5 and len(r["grad_norm"]) == 3
    # the queries lie in segments 4..5: the segments before them score nothing, said in words, not 'nan'
    assert math.isnan(r["grad_norm"][0]) and "| 1 | - (no token scored in segment 1) |" in text and "nan" not in text
    assert main(args[:-4] + ["--segments", "9"]) == 2
    assert "the read-out needs 40 (10 segments of 4); lengthen the task" in capsys.readouterr().err
    m = build_model("memory_attention", {**TINY, "vocab_size": 64, "chunk_size": 4})
    assert readout(m, torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long), k=1).segment == 4


def test_synth_config_files(tmp_path, capsys) -> None:
    """--config: model / task / synth sections, later files and --set winning; every study
    config of experiments/memory/configs/ is a valid synth config of its task."""
    from recurformer.config import load_yaml, study_configs

    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(
        "model: {dim: 16, n_heads: 2, ffn_hidden: 32}\ntask: {num_pairs: 2, num_queries: 2, distance: 3}\n"
        "synth: {steps: 2, batch_size: 4, n_train: 8, n_val: 4, n_test: 4, lrs: [1e-3], context: 4}\n"
    )
    b.write_text("task: {distance: 5}\n")
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "synth",
                "--task",
                "mqar",
                "--model",
                "llama",
                "--config",
                str(a),
                "--config",
                str(b),
                "--set",
                "task.num_queries=1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert r["task_params"]["distance"] == 5 and r["task_params"]["num_queries"] == 1 and r["model_config"]["dim"] == 16
    b.write_text("train: {steps: 3}\n")
    assert main(["synth", "--task", "mqar", "--model", "llama", "--config", str(b)]) == 2
    assert "has section 'train'; valid sections: model, task, synth" in capsys.readouterr().err
    memory = [n for n in study_configs() if n.startswith("memory/")]
    # 6 recipes x 2 tasks, MQAR's twostage, twostage-mixed, recall-first, selfpaced and
    # selfpaced-mixed, 6 whole experiments (best results), the Block-Recurrent LSTM gate on passkey
    # and MQAR, the stage of the passkey's curriculum over segment counts, Gated DeltaNet's closed writes,
    # the Zoology MQAR protocol (mqar_zoology-fixed), MK-NIAH and S-NIAH-2 in book text (Gated DeltaNet's closed writes),
    # and the model-neutral recipes of S-NIAH-2, MK-NIAH and QA1 (experiments/memory/longcontext.sh)
    assert len(memory) == 33
    for name in memory:
        raw = load_yaml(name)
        task = name.split("/")[1].split("-")[0]
        assert raw["task"].pop("name", task) == task and raw["model"].pop("name", None) in (None, *model_names())
        cfg = synth_config(raw["synth"])
        from recurformer.synth.config import check_recipe

        check_recipe(TASKS[task], TASKS[task].params(raw["task"]), cfg)


def test_a_synth_config_that_names_its_task_and_model_is_one_command(tmp_path, capsys) -> None:
    """task.name and model.name in a config stand for --task and --model (the command line wins);
    without either, one line naming what is missing."""
    cfg = tmp_path / "exp.yaml"
    cfg.write_text(
        "model: {name: llama, dim: 16, n_heads: 2, ffn_hidden: 32}\n"
        "task: {name: mqar, num_pairs: 2, num_queries: 2, distance: 3}\n"
        "synth: {steps: 2, batch_size: 4, n_train: 8, n_val: 4, n_test: 4, lrs: [1e-3], context: 4}\n"
    )
    named, flags = tmp_path / "named.json", tmp_path / "flags.json"
    assert main(["synth", "--config", str(cfg), "--json", str(named)]) == 0
    plain = tmp_path / "plain.yaml"
    plain.write_text(cfg.read_text().replace("name: llama, ", "").replace("name: mqar, ", ""))
    assert main(["synth", "--task", "mqar", "--model", "llama", "--config", str(plain), "--json", str(flags)]) == 0
    a, b = json.loads(named.read_text()), json.loads(flags.read_text())
    assert a["task"] == b["task"] == "mqar" and a["model"] == b["model"] == "llama"
    assert a["test"] == b["test"] and a["sweep"] == b["sweep"]
    over = tmp_path / "over.json"
    assert main(["synth", "--config", str(cfg), "--model", "sliding_window", "--json", str(over)]) == 0
    assert json.loads(over.read_text())["model"] == "sliding_window"
    capsys.readouterr()
    assert main(["synth", "--config", str(plain)]) == 2
    assert capsys.readouterr().err.strip() == "recurformer: error: synth needs --task (or task.name in a --config)"
    assert main(["synth", "--task", "mqar", "--config", str(plain)]) == 2
    assert capsys.readouterr().err.strip() == "recurformer: error: synth needs --model (or model.name in a --config)"
    plain.write_text(cfg.read_text().replace("name: mqar", "name: recall"))
    assert main(["synth", "--config", str(plain)]) == 2
    assert "unknown synth task 'recall' (task.name); one of: compression" in capsys.readouterr().err


def test_synth_evaluate_scores_a_saved_model_at_more_lengths(tmp_path, capsys) -> None:
    """synth --evaluate DIR --lengths: the saved model on the rows its run would draw at each
    length, so at a length of the run's eval_lengths it gives the run's own scores; bad use is
    one line."""
    cfg = SynthConfig(steps=20, batch_size=8, n_val=4, n_test=4, lrs=[3e-3], context=4, eval_lengths=[4, 12])
    cfg.n_length_test = 64
    task = {"num_pairs": 3, "num_queries": 3, "distance": 4}
    r = run_synth("mqar", "memory_attention", TINY, task, cfg, save=str(tmp_path / "m"))
    capsys.readouterr()
    out = tmp_path / "e.json"
    args = ["synth", "--evaluate", str(tmp_path / "m"), "--lengths", "4,12,40", "--n-test", "64", "--json", str(out)]
    assert main(args) == 0
    e = json.loads(out.read_text())
    assert e["task"] == "mqar" and e["model"] == "memory_attention" and set(e["by_length"]) == {"4", "12", "40"}
    for L in (4, 12):  # MQAR's headline is the token accuracy: 192 scored tokens per length
        assert e["by_length"][str(L)]["token_accuracy"] == r.by_length[L] and e["by_length"][str(L)]["rows"] == 64
    assert "| 40 |" in capsys.readouterr().out
    for extra, message in [
        ([], "synth --evaluate needs --lengths"),
        (["--lengths", "8", "--set", "dim=8"], "reads the saved model as it is; --set dim=... does not apply"),
    ]:
        assert main(["synth", "--evaluate", str(tmp_path / "m"), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("recurformer: error: ") and "\n" not in err and message in err, err


def test_synth_init_from_starts_from_a_saved_model(tmp_path, capsys) -> None:
    """synth.init_from: training starts from a model saved by synth --save (post-training, e.g.
    with state passing after a curriculum); another model or config is one line before any work."""
    from recurformer.checkpoint import load_checkpoint

    task = {"num_pairs": 2, "num_queries": 2, "distance": 4}
    cfg = SynthConfig(steps=4, batch_size=4, n_val=4, n_test=4, lrs=[3e-3], context=4, fresh_data=True)
    run_synth("mqar", "memory_attention", TINY, task, cfg, save=str(tmp_path / "a"))
    a = load_checkpoint(tmp_path / "a")["model"]
    tiny_lr = dataclasses.replace(cfg, lrs=[1e-9], steps=2, seed=1)
    run_synth(
        "mqar",
        "memory_attention",
        TINY,
        task,
        dataclasses.replace(tiny_lr, init_from=str(tmp_path / "a")),
        save=str(tmp_path / "b"),
    )
    b = load_checkpoint(tmp_path / "b")["model"]
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    run_synth("mqar", "memory_attention", TINY, task, tiny_lr, save=str(tmp_path / "c"))  # the control: a fresh start
    c = load_checkpoint(tmp_path / "c")["model"]
    assert any(not torch.allclose(a[k], c[k], atol=1e-3) for k in a)
    capsys.readouterr()
    base = [
        "synth",
        "--task",
        "mqar",
        "--steps",
        "1",
        "--set",
        "dim=16",
        "--set",
        "n_heads=2",
        "--set",
        "ffn_hidden=32",
    ]
    base += ["--set", "synth.context=4", "--set", f"synth.init_from={tmp_path / 'a'}"]
    for extra, message in [
        (
            ["--model", "llama"],
            f"synth.init_from {tmp_path / 'a'} holds a 'memory_attention' model, this run trains 'llama'",
        ),
        (["--model", "memory_attention", "--set", "ffn_hidden=64"], "has model ffn_hidden = 32, this run builds 64"),
    ]:
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("recurformer: error: ") and "\n" not in err and message in err, err


def test_synth_init_from_may_add_a_write_floor(tmp_path) -> None:
    """A Gated DeltaNet trained without a write floor (saved before the key existed: no key in its
    config) trains on with one (a key of the config's ``retrain_keys``, changing no parameter; a
    line says so), and the floor is in the new model; a key outside them (decay_init) is still one
    line before any work."""
    from recurformer.checkpoint import load_checkpoint

    task = {"num_pairs": 2, "num_queries": 2, "distance": 4}
    cfg = SynthConfig(steps=2, batch_size=4, n_val=4, n_test=4, lrs=[3e-3], context=4, fresh_data=True)
    run_synth("mqar", "gated_deltanet", TINY, task, cfg, save=str(tmp_path / "a"))
    saved = json.loads((tmp_path / "a" / "config.json").read_text())
    del saved["model"]["write_floor"]  # as a model saved before the key existed: its default, 0
    (tmp_path / "a" / "config.json").write_text(json.dumps(saved))
    lines: list[str] = []
    on = dataclasses.replace(cfg, init_from=str(tmp_path / "a"))
    run_synth(
        "mqar", "gated_deltanet", {**TINY, "write_floor": 0.05}, task, on, log=lines.append, save=str(tmp_path / "b")
    )
    assert (
        f"synth.init_from {tmp_path / 'a'} was saved with model write_floor = 0.0; this run trains on with 0.05"
        in lines
    )
    assert load_checkpoint(tmp_path / "b")["config"]["model"]["write_floor"] == 0.05
    with pytest.raises(recurformer.RecurformerError, match="has model decay_init = 0.999, this run builds 0.99"):
        run_synth("mqar", "gated_deltanet", {**TINY, "decay_init": 0.99}, task, on)


def test_key_signal_sees_a_carried_key_and_the_exact_zero_of_a_window() -> None:
    """experiments/memory/key_signal.py: the distance between the states of rows that differ only
    in the passkey. A sliding window of 8 tokens has forgotten the key once 8 filler tokens follow
    it (exactly 0); full attention keeps the key's keys and values in its cache (> 0 at every
    segment); Memory Attention's memory carries a trace of it (> 0)."""
    import sys as _sys
    from pathlib import Path as P

    _sys.path.insert(0, str(P(__file__).resolve().parents[2] / "experiments" / "memory"))
    import key_signal  # noqa: PLC0415

    def model(name: str, **extra):  # noqa: ANN202
        torch.manual_seed(0)
        m = build_model(name, {**TINY, "vocab_size": 32, **extra})
        randomize_params(m)
        return m.eval()

    # 2 layers of a window of 8: the state after position p (the last 7 keys/values of each layer)
    # depends on tokens p - 14 .. p, so on the key (tokens 0..3) after segments 1 and 2 only
    window = key_signal.key_signal(model("sliding_window", n_layers=2, window=8), 6, 8, 8, 0, 32, 4, 16)
    assert min(window[:2]) > 0.01 and window[2:] == [0.0] * 4
    full = key_signal.key_signal(model("llama", n_layers=2), 6, 8, 8, 0, 32, 4, 16)
    assert min(full) > 0.01
    memory = key_signal.key_signal(model("memory_attention", n_layers=2, chunk_size=8), 6, 8, 8, 0, 32, 4, 16)
    assert min(memory) > 0.01


def test_segment_curriculum_chains_stages_from_the_last_model_and_resumes(tmp_path) -> None:
    """experiments/memory/passkey_segments.sh: stage n trains on rows of n segments of 32 tokens
    (L = 32 n - 8) from stage n/2's saved model, a stage whose JSON exists is skipped, and the last
    model is tested with synth --evaluate. Stage 1 is trained at lr 1e-2 alone; stage 2 at lr 1e-30
    then holds stage 1's weights exactly if, and only if, it started from them (a fresh model of the
    same seed is stage 1's untrained start)."""
    import os
    import subprocess
    import sys as _sys
    from pathlib import Path as P

    from recurformer.checkpoint import load_checkpoint

    root = P(__file__).resolve().parents[2]
    tiny = ["model.dim=16", "model.n_heads=2", "model.ffn_hidden=32", "model.n_layers=1", "synth.steps=2"]
    tiny += ["synth.batch_size=4", "synth.n_val=4", "synth.n_test=4", "synth.eval_every=0"]

    def chain(stages: str, lr: str) -> None:
        sets = [a for kv in [*tiny, f"synth.lrs=[{lr}]"] for a in ("--set", kv)]
        env = {**os.environ, "PYTHON": _sys.executable, "STAGES": stages, "LENGTHS": "24"}
        script = root / "experiments" / "memory" / "passkey_segments.sh"
        subprocess.run(["bash", str(script), "0", str(tmp_path), *sets], env=env, check=True, capture_output=True)

    chain("1", "1e-2")
    first = (tmp_path / "stage1.log").stat().st_mtime_ns
    chain("1 2", "1e-30")
    assert (tmp_path / "stage1.log").stat().st_mtime_ns == first  # done, so skipped
    for n in (1, 2):
        r = json.loads((tmp_path / f"stage{n}.json").read_text())
        assert r["task_params"]["length"] == 32 * n - 8
        assert make_split("passkey", 1, 0, r["task_params"]).inputs.shape[1] == 32 * n
    a, b = (load_checkpoint(tmp_path / f"stage{n}.model")["model"] for n in (1, 2))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    e = json.loads((tmp_path / "eval.stage2.json").read_text())
    assert e["checkpoint"] == str(tmp_path / "stage2.model") and set(e["by_length"]) == {"24"}


class Killed(Exception):
    """Stands for the process being killed in the middle of a step."""


@pytest.mark.parametrize(
    "name, task, params, synth",
    [  # fresh rows and the state passed between batches; a fixed training set read in a seeded order
        (
            "rmt",
            "mqar",
            {"num_pairs": 2, "num_queries": 2, "distance": 4},
            {"train_lengths": [4, 12], "state_init": "passing"},
        ),
        ("gated_deltanet", "in_context_recall", {"seq_len": 16}, {"n_train": 10}),
        (  # Zoology's protocol: a batch at one of the task-parameter settings, tested at others after
            "gated_deltanet",
            "mqar_zoology",
            {"vocab_size": 64, "seq_len": 16, "num_pairs": 2},
            {
                "train_settings": [{"seq_len": 8, "num_pairs": 1}, {"seq_len": 16, "num_pairs": 4}],
                "eval_settings": [{"seq_len": 32, "num_pairs": 8}],
                "n_length_test": 8,
            },
        ),
        (  # self-paced: stage 1 starts at step 2, before the save at step 3 (its start is saved)
            "llama",
            "mqar",
            {"num_pairs": 2, "num_queries": 2, "distance": 4},
            {"schedule": {"advance_below": 100.0, "advance_window": 2, "stages": [{"step": 7, "length": 8}]}},
        ),
    ],
)
def test_resumed_synth_run_equals_the_uninterrupted_one(
    tmp_path, monkeypatch, capsys, name, task, params, synth
) -> None:
    """synth.save_every: a run killed in step 6 after its progress was saved at step 3, continued
    by ``synth --resume``, ends with the same weights (bitwise), curve and scores as the same run
    uninterrupted; its progress is removed once the model is saved."""
    from safetensors.torch import load_file

    from recurformer.tbptt import Update

    values = {"steps": 8, "batch_size": 4, "n_val": 8, "n_test": 8, "lrs": [3e-3], "context": 4, "chunk": 8}
    cfg = synth_config({**values, "eval_every": 2, "save_every": 3, **synth})
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    a = run_synth(task, name, TINY, params, cfg, save=str(whole))
    finish, calls = Update.finish, []

    def killed_in_step_6(self: Update) -> None:
        calls.append(1)
        if len(calls) == 6:
            raise Killed
        finish(self)

    monkeypatch.setattr(Update, "finish", killed_in_step_6)
    with pytest.raises(Killed):
        run_synth(task, name, TINY, params, cfg, save=str(cut))
    monkeypatch.setattr(Update, "finish", finish)
    assert [p.name for p in (cut / "progress").iterdir() if p.name.startswith("step_")] == ["step_000003"]
    with pytest.raises(RecurformerError, match="holds a synth run in progress"):  # a fresh run there would mix two runs
        run_synth(task, name, TINY, params, cfg, save=str(cut))
    out = tmp_path / "r.json"
    assert main(["synth", "--resume", str(cut), "--json", str(out)]) == 0
    assert "from step 3 of 8" in capsys.readouterr().out
    b = json.loads(out.read_text())
    wa, wb = load_file(whole / "model.safetensors"), load_file(cut / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert b["sweep"] == a.sweep and b["test"] == dataclasses.asdict(a.test) and len(a.sweep[0]["curve"]) == 4
    assert b["by_setting"] == a.by_setting and len(a.by_setting) == len(cfg.eval_settings)
    assert not (cut / "progress").exists() and not (whole / "progress").exists()


def test_resume_refuses_what_it_cannot_continue(tmp_path, capsys) -> None:
    from recurformer.checkpoint import save_checkpoint

    other = tmp_path / "other"  # a training checkpoint where a synth run's progress should be
    save_checkpoint(other / "progress", 1, {"w": torch.zeros(1)}, {"model": {"name": "llama"}}, None, {}, {})
    for argv, says in [
        (["synth", "--resume", str(other)], "is not a synth run's progress"),
        (["synth", "--resume", str(tmp_path)], "holds no synth run in progress"),
        (
            ["synth", "--resume", str(tmp_path / "missing")],
            f"{tmp_path / 'missing'} does not exist: give --resume the directory a synth run was saved to",
        ),
        (
            ["synth", "--resume", str(other / "progress")],
            f"{other / 'progress'} is a train run, not a synth run: resume it with "
            f"`recurformer train --resume {other / 'progress'}`",
        ),
        (["synth", "--resume", str(tmp_path), "--set", "synth.steps=9"], "--set does not apply"),
        (
            ["synth", "--task", "mqar", "--model", "llama", "--set", "synth.save_every=2", "--lrs", "1e-3"],
            "give --save DIR",
        ),
        (
            ["synth", "--task", "mqar", "--model", "llama", "--set", "synth.save_every=2", "--lrs", "1e-3,2e-3"],
            "one learning rate",
        ),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and "\n" not in err, err


def test_longcontext_script_runs_each_cell_once(tmp_path) -> None:
    """experiments/memory/longcontext.sh runs one synth per (cell, seed[, width]) with that cell's
    model and seed, and skips a cell whose JSON exists (a fake interpreter records each call)."""
    import shutil
    import subprocess
    from pathlib import Path

    if shutil.which("bash") is None or shutil.which("xargs") is None:
        pytest.skip("needs bash and xargs")
    calls = tmp_path / "calls"
    fake = tmp_path / "py"
    fake.write_text(f'#!/usr/bin/env bash\n[ "$1" = -m ] && echo "$*" >> {calls}\nexit 0\n')
    fake.chmod(0o755)
    root = Path(__file__).resolve().parents[2]
    (tmp_path / "out" / "mk_niah").mkdir(parents=True)
    (tmp_path / "out" / "mk_niah" / "gated_deltanet.fixed.seed1.json").write_text("{}")

    def run(**env: str) -> list[list[str]]:
        calls.unlink(missing_ok=True)
        base = {"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "OUT": str(tmp_path / "out")}
        script = root / "experiments" / "memory" / "longcontext.sh"
        subprocess.run(["bash", str(script), "mk_niah"], env={**base, **env}, check=True, capture_output=True)
        return [line.split() for line in calls.read_text().splitlines()]

    def cell(args: list[str]) -> tuple[str, str, str]:
        sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
        width = next((s.split("=")[1] for s in sets if s.startswith("model.dim=")), "")
        seed = next(s.split("=")[1] for s in sets if s.startswith("synth.seed="))
        return args[args.index("--model") + 1], seed, width

    got = sorted(cell(a) for a in run(MODELS="llama gdn armt", SEEDS="0 1"))
    want = [(m, s, "") for m in ("gated_deltanet", "llama", "rmt") for s in "01" if (m, s) != ("gated_deltanet", "1")]
    assert got == sorted(want)
    got = sorted(cell(a) for a in run(MODELS="llama sliding_window", WIDTHS="64 128"))
    assert got == sorted((m, "0", w) for m in ("llama", "sliding_window") for w in ("64", "128"))
