"""Synthetic diagnostics: generator formats and masks, determinism and disjoint splits, the passkey
task's window bound, and tiny end-to-end ``synth`` runs for every registered model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import DEVICES, randomize_params

from recurformer.cli import main
from recurformer.config import RecurformerError
from recurformer.data.synthetic import TASKS, make_split, vocab_size
from recurformer.models import build_model, model_names
from recurformer.nn import IGNORE_INDEX
from recurformer.synth.config import SynthConfig, model_values, synth_config
from recurformer.synth.learner import Learner
from recurformer.synth.run import check_eval_budget, run_synth, score_lengths

SMALL = {  # small settings so the tests stay fast; defaults are the MAD baselines
    "in_context_recall": dict(seq_len=32),
    "noisy_in_context_recall": dict(seq_len=32, frac_noise=0.5),
    "fuzzy_in_context_recall": dict(seq_len=40),
    "selective_copying": dict(seq_len=40, num_tokens=6),
    "compression": dict(seq_len=12),
    "memorization": dict(vocab_size=64, seq_len=16),
    "copy": dict(min_len=3, max_len=9),
    "delayed_copy": dict(delay=20),
    "passkey": dict(length=30),
    "mqar": dict(num_pairs=4, num_queries=4, distance=6),
    "mqar_zoology": dict(vocab_size=64, seq_len=32, num_pairs=4),
    "s_niah_1": dict(length=160),
    "s_niah_2": dict(length=160),
    "s_niah_3": dict(length=256),
    "mk_niah": dict(length=224, num_needles=2),
    "qa1": dict(length=96, num_facts=2),
    "qa2": dict(length=160, num_facts=4),
    "qa3": dict(length=192, num_facts=5),
}


def test_every_task_has_small_settings() -> None:
    assert set(SMALL) == set(TASKS)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_format_and_mask(task: str) -> None:
    d = make_split(task, 64, seed=0, params=SMALL[task])
    x, y = d.inputs, d.targets
    V = vocab_size(task, SMALL[task])
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape and x.dim() == 2
    assert 0 <= int(x.min()) and int(x.max()) < V
    scored = y != IGNORE_INDEX
    assert bool(((y >= 0) & (y < V) | ~scored).all())
    assert bool(scored.any(1).all()), "every row asks something"
    if TASKS[task].head == "lm":
        assert float(scored.float().mean()) < 0.6, "most positions are not scored"
    if task != "memorization":  # every other task is solvable from the row itself: the answer is in context
        eos = V - 2 if task == "copy" else None  # the copy task's end marker is the one answer not copied
        for row_x, row_y in zip(x.tolist(), y.tolist()):
            for t, target in enumerate(row_y):
                if target not in (IGNORE_INDEX, eos):
                    assert target in row_x[: t + 1], (task, t)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_deterministic_and_disjoint(task: str) -> None:
    p = SMALL[task]
    a, b = make_split(task, 40, seed=3, params=p), make_split(task, 40, seed=3, params=p)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.inputs, make_split(task, 40, seed=4, params=p).inputs)
    test = make_split(task, 40, seed=3, params=p, exclude=a.row_keys())  # same seed, yet disjoint
    assert len(test.row_keys()) == 40 and not (test.row_keys() & a.row_keys())


def test_too_small_task_space_raises() -> None:
    with pytest.raises(RecurformerError, match="too few distinct rows"):
        make_split("delayed_copy", 5, seed=0, params=dict(vocab_size=3, copy_len=2, delay=1))  # one content token
    with pytest.raises(RecurformerError, match="did you mean 'delay'"):
        make_split("delayed_copy", 5, seed=0, params=dict(dealy=3))
    with pytest.raises(RecurformerError, match="must be an integer"):
        make_split("copy", 5, seed=0, params=dict(max_len="many"))


def test_layouts() -> None:
    sc = make_split("selective_copying", 8, seed=0, params=SMALL["selective_copying"])
    blank, copy = 14, 15
    for x, y in zip(sc.inputs.tolist(), sc.targets.tolist()):
        head = x.index(copy)
        assert [t for t in x[:head] if t != blank] == y[-6:] and all(t == IGNORE_INDEX for t in y[:-6])
        assert x[head + 1 :] == [blank] * 6 and len(x) == 40

    cp = make_split("copy", 8, seed=0, params=SMALL["copy"])
    bos, sep, eos = 26, 27, 28
    for x, y in zip(cp.inputs.tolist(), cp.targets.tolist()):
        s = x[1 : x.index(sep)]
        assert x[0] == bos and 3 <= len(s) <= 9
        assert [t for t in y if t != IGNORE_INDEX] == s + [eos]

    dc = make_split("delayed_copy", 8, seed=0, params=dict(copy_len=5, delay=7))
    assert dc.inputs.shape[1] == 2 * 5 + 7 and bool((dc.inputs[:, 5 + 7] == 9).all())
    assert torch.equal(dc.targets[:, 12:], dc.inputs[:, :5]) and bool((dc.targets[:, :12] == IGNORE_INDEX).all())

    cz = make_split("compression", 8, seed=0, params=SMALL["compression"])
    assert (
        torch.equal(cz.inputs, cz.targets)
        and bool((cz.inputs[:, -1] == 15).all())
        and bool((cz.inputs[:, :-1] < 15).all())
    )

    # memorization: one fixed key -> value map shared by every split
    m = {}
    for seed in (0, 1):
        d = make_split("memorization", 16, seed=seed, params=SMALL["memorization"])
        for k, v in zip(d.inputs[:, 0::2].flatten().tolist(), d.targets[:, 1::2].flatten().tolist()):
            assert m.setdefault(k, v) == v


@pytest.mark.parametrize("L", [30, 200])
def test_passkey_is_out_of_reach_of_windows_up_to_L_plus_1(L: int) -> None:
    """The key tokens lie outside every window of W <= L + 1 tokens ending at a scored position,
    and the filler never contains a key token; the bound is tight (W = L + 2 reaches the key)."""
    m, key_vocab = 4, 16
    d = make_split("passkey", 32, seed=0, params=dict(length=L, key_len=m, key_vocab=key_vocab))
    x, y = d.inputs, d.targets
    assert x.shape[1] == 2 * m + L
    assert bool((x[:, m : m + L] >= key_vocab).all())
    assert torch.equal(y[:, -m:], x[:, :m]) and bool((y[:, :-m] == IGNORE_INDEX).all())
    key_positions = set(range(m))

    def reachable(W: int) -> bool:
        answer_positions = (y[0] != IGNORE_INDEX).nonzero().flatten().tolist()
        return any(key_positions & set(range(p - W + 1, p + 1)) for p in answer_positions)

    assert not reachable(L + 1) and not reachable(L // 2)
    assert reachable(L + 2)


@pytest.mark.parametrize("span", [0.5, 1.0])
def test_passkey_key_at_random_positions_within_its_span(span: float) -> None:
    """``key_span``: each row's key starts after p ~ U[0, floor(span * L)] filler tokens, every
    position of that range occurs, the filler around it never holds a key token, the answer is the
    key, and no window of W <= L - floor(span * L) + 1 tokens ending at a scored position reaches it
    (tight: one more token reaches the latest key)."""
    L, m, key_vocab = 40, 4, 16
    d = make_split("passkey", 512, seed=0, params=dict(length=L, key_len=m, key_vocab=key_vocab, key_span=span))
    x, y = d.inputs, d.targets
    assert x.shape[1] == 2 * m + L
    is_key = x[:, : m + L] < key_vocab
    assert bool((is_key.sum(1) == m).all())  # the key, and no key token in the filler
    start = is_key.int().argmax(1)
    assert bool((is_key.int().diff(dim=1).clamp(min=0).sum(1) <= 1).all())  # one contiguous run
    rows = torch.arange(len(x))[:, None]
    assert torch.equal(x[rows, start[:, None] + torch.arange(m)], y[:, -m:])
    hi = int(span * L)
    assert set(start.tolist()) == set(range(hi + 1))
    nearest = (x.shape[1] - m) - (start + m - 1)  # distance from the first scored position to the key's end
    W = L - hi + 1
    assert int(nearest.min()) == W  # a window of W tokens ending there misses every key; W + 1 reaches one


def test_passkey_key_span_out_of_range_is_one_line() -> None:
    with pytest.raises(RecurformerError, match="key_span"):
        make_split("passkey", 4, seed=0, params=dict(length=8, key_span=1.5))


def test_model_values_set_context_and_guard_vocab() -> None:
    v = model_values("memory_attention", {"dim": 32}, vocab=16, context=8)
    assert v["chunk_size"] == 8 and v["dim"] == 32 and v["vocab_size"] == 16 and v["n_layers"] == 1
    assert model_values("block_recurrent", {}, 16, 8)["block_size"] == 8
    assert model_values("transformer_xl", {}, 16, 8)["segment_len"] == 8
    assert "block_size" not in model_values("recurrent_transformer", {}, 16, 8)  # its b is a granularity, not a reach
    assert "window" not in model_values("llama", {}, 16, 8)  # None = full attention stays
    with pytest.raises(RecurformerError, match="task fixes vocab_size"):
        model_values("llama", {"vocab_size": 99}, vocab=16, context=8)


def is_fraction(accuracy: float, n: int) -> bool:
    """A headline accuracy is a count over n rows or tokens: k/n for an integer 0 <= k <= n."""
    k = accuracy * n
    return abs(k - round(k)) < 1e-4 and 0 <= round(k) <= n


# Known model bugs found by these runs (strict: the mark fails once the bug is fixed, so it is removed).
@pytest.mark.parametrize(
    "name, extra",
    [(n, {}) for n in model_names()] + [("block_recurrent", {"qk_norm": False})],
)
def test_end_to_end_every_model(name: str, extra: dict) -> None:
    """A few steps on the passkey task, evaluated through the streaming contract at a length
    longer than the context and the evaluation chunk."""
    cfg = SynthConfig(
        steps=4,
        batch_size=8,
        n_train=16,
        n_val=8,
        n_test=8,
        lrs=[1e-3, 3e-3],
        context=8,
        chunk=16,
        eval_lengths=[12, 70],
    )
    r = run_synth("passkey", name, {"dim": 16, "n_heads": 2, "ffn_hidden": 32, **extra}, {"length": 12}, cfg)
    assert r.metric == "sequence" and r.accuracy == r.test.exact_match and is_fraction(r.accuracy, r.test.rows)
    assert [s["lr"] for s in r.sweep] == [1e-3, 3e-3] and all(np.isfinite(s["train_loss"]) for s in r.sweep)
    best = max(s["val_accuracy"] for s in r.sweep)  # the first lr with the best validation accuracy
    assert r.val_accuracy == best and r.lr == next(s["lr"] for s in r.sweep if s["val_accuracy"] == best)
    assert set(r.by_length) == {12, 70} and all(is_fraction(a, cfg.n_length_test) for a in r.by_length.values())
    assert r.test.rows == 8 and r.test.scored_tokens == 8 * 4


def test_learns_memorization_quickly() -> None:
    """The training loop really trains: a tiny key -> value map is learned to high accuracy."""
    cfg = SynthConfig(steps=150, batch_size=16, n_train=64, n_val=16, n_test=32, lrs=[1e-2], warmup=0.0)
    r = run_synth(
        "memorization", "llama", {"dim": 32, "n_heads": 4, "ffn_hidden": 64}, dict(vocab_size=20, seq_len=8), cfg
    )
    assert r.metric == "token" and r.accuracy > 0.9, r.sweep


def test_cli(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    argv = [
        "synth",
        "--task",
        "in_context_recall",
        "--model",
        "llama",
        "--steps",
        "3",
        "--lrs",
        "1e-3",
        "--n-train",
        "16",
        "--n-test",
        "8",
        "--set",
        "dim=16",
        "--set",
        "n_heads=2",
        "--set",
        "task.seq_len=16",
        "--set",
        "synth.n_val=8",
        "--set",
        "synth.batch_size=8",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert r["task"] == "in_context_recall" and r["model_config"]["dim"] == 16
    assert r["accuracy"] == r["test"]["token_accuracy" if r["metric"] == "token" else "exact_match"]
    assert is_fraction(r["test"]["token_accuracy"], r["test"]["scored_tokens"])
    assert "micro token accuracy" in capsys.readouterr().out
    assert main(["synth", "--task", "copy", "--model", "llama", "--set", "task.vocab=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("recurformer: error: unknown parameter 'vocab' of task copy") and "\n" not in err


def test_length_sweeps_set_the_tasks_length() -> None:
    assert TASKS["copy"].at_length({"min_len": 5, "max_len": 20}, 40) == {"min_len": 40, "max_len": 40}
    d = make_split("copy", 4, seed=0, params=TASKS["copy"].at_length(TASKS["copy"].params(), 33))
    assert bool(((d.targets != IGNORE_INDEX).sum(1) == 34).all())  # 33 letters and the end marker
    assert (
        make_split("passkey", 2, 0, TASKS["passkey"].at_length(TASKS["passkey"].params(), 99)).inputs.shape[1] == 99 + 8
    )
    with pytest.raises(RecurformerError, match="no length to sweep"):
        run_synth(
            "in_context_recall",
            "llama",
            {"dim": 16, "n_heads": 2},
            {"seq_len": 16},
            SynthConfig(steps=1, eval_lengths=[32]),
        )


def _learner(name: str, **extra) -> Learner:
    torch.manual_seed(0)
    model = build_model(
        name, model_values(name, {"dim": 16, "n_heads": 2, "ffn_hidden": 32, **extra}, vocab=16, context=4)
    )
    randomize_params(model, std=0.3)
    return Learner(model, TASKS["compression"]).eval()


def test_compression_reads_only_the_last_position() -> None:
    """The AutoEncoder head decodes every token from the features at the last position. A window
    of 1 token sees only the compression marker there, so every row gets the same logits; full
    attention sees the row, so the logits differ."""
    x = make_split("compression", 6, seed=0, params=SMALL["compression"]).inputs

    def logits(learner: Learner) -> torch.Tensor:
        assert learner.decoder is not None
        return learner.decoder(learner.model.features(x)[0][:, -1], x.shape[1])

    blind = logits(_learner("sliding_window", window=1))
    assert torch.allclose(blind, blind[:1].expand_as(blind), atol=1e-6)
    full = logits(_learner("llama"))
    assert (full - full[:1]).abs().amax() > 1e-3


@pytest.mark.parametrize("name", model_names())
@pytest.mark.parametrize("device", DEVICES)
def test_autoencoder_predictions_stream(name: str, device: str) -> None:
    """Reading the row in chunks with the state carried gives the same decoded tokens as one call."""
    learner = _learner(name).to(device)
    x = make_split("compression", 5, seed=1, params=dict(seq_len=23)).inputs.to(device)
    assert torch.equal(learner.predict(x, chunk=23), learner.predict(x, chunk=5))
    assert learner.predict(x, chunk=5).shape == x.shape


@pytest.mark.parametrize("name", model_names())
def test_compression_end_to_end(name: str) -> None:
    cfg = SynthConfig(steps=3, batch_size=8, n_train=16, n_val=8, n_test=8, lrs=[1e-3], context=4, chunk=5)
    r = run_synth("compression", name, {"dim": 16, "n_heads": 2, "ffn_hidden": 32}, SMALL["compression"], cfg)
    assert r.metric == "token" and r.accuracy == r.test.token_accuracy and r.test.scored_tokens == 8 * 12
    assert is_fraction(r.accuracy, r.test.scored_tokens) and is_fraction(r.test.exact_match, r.test.rows)


def test_copy_accuracy_by_length() -> None:
    cfg = SynthConfig(
        steps=3,
        batch_size=8,
        n_train=16,
        n_val=8,
        n_test=8,
        n_length_test=8,
        lrs=[1e-3],
        context=8,
        eval_lengths=[4, 30],
    )
    r = run_synth("copy", "memory_attention", {"dim": 16, "n_heads": 2, "ffn_hidden": 32}, SMALL["copy"], cfg)
    assert set(r.by_length) == {4, 30} and all(is_fraction(a, cfg.n_length_test) for a in r.by_length.values())


def test_synth_config_lists_from_the_command_line() -> None:
    assert synth_config({"eval_lengths": 64}).eval_lengths == [64]
    assert synth_config({"eval_lengths": "64,128", "lrs": 1e-3}).eval_lengths == [64, 128]
    with pytest.raises(RecurformerError, match="eval_lengths"):
        synth_config({"eval_lengths": {"a": 1}})


def test_merged_sweep_halves_equal_the_whole_sweep() -> None:
    """``benchmarks/synthetic.py --merge``: a sweep run as two halves (one lr each) merges into the
    same cell as the sweep run in one go; runs of one cell with another protocol refuse to merge."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "synthetic.py"
    spec = importlib.util.spec_from_file_location("synthetic_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def run(lrs: list[float], steps: int = 6) -> dict:
        cfg = SynthConfig(steps=steps, batch_size=8, n_train=32, n_val=16, n_test=16, lrs=lrs)
        r = run_synth("in_context_recall", "llama", {"dim": 16, "n_heads": 2, "ffn_hidden": 32}, {"seq_len": 16}, cfg)
        return json.loads(json.dumps(bench.result_dict(r) | {"synth": vars(cfg)}))

    whole, low, high = run([1e-3, 3e-2]), run([1e-3]), run([3e-2])
    assert whole["sweep"][0]["val_accuracy"] != whole["sweep"][1]["val_accuracy"]  # the choice matters
    (merged,) = bench.merge_runs([high, low])
    for k in ("lr", "accuracy", "val_accuracy", "test", "sweep"):
        assert merged[k] == whole[k], k
    with pytest.raises(RecurformerError, match="differ in steps"):
        bench.merge_runs([low, run([3e-2], steps=5)])


@pytest.mark.parametrize("name", model_names())
@pytest.mark.parametrize("device", DEVICES)
def test_lm_head_predictions_stream(name: str, device: str) -> None:
    """The LM-head tasks (passkey, copy by length, ...): reading each row in chunks with the
    state carried gives the predictions of one call, which depend on the context."""
    torch.manual_seed(0)
    V = vocab_size("copy", SMALL["copy"])
    model = build_model(
        name, model_values(name, {"dim": 16, "n_heads": 2, "ffn_hidden": 32}, vocab=V, context=4)
    ).double()
    randomize_params(model, std=0.3)
    learner = Learner(model, TASKS["copy"]).to(device).eval()
    x = make_split("copy", 6, seed=1, params=dict(min_len=9, max_len=9)).inputs.to(device)
    whole = learner.predict(x, chunk=x.shape[1])
    with torch.no_grad():
        assert torch.equal(whole, model(x).logits.argmax(-1))
    assert torch.equal(learner.predict(x, chunk=5), whole) and torch.equal(learner.predict(x, chunk=1), whole)
    assert len(whole.unique()) >= 4


# -- multi-query associative recall ----------------------------------------------------------------


def test_mqar_layout() -> None:
    """Distinct keys, then the distance in filler, then distinct queried keys whose targets are
    the values shown with them; with seq_len the row is longer only by filler in front."""
    P, Q, d = 6, 4, 9
    data = make_split("mqar", 64, seed=0, params=dict(num_pairs=P, num_queries=Q, distance=d))
    x, y = data.inputs, data.targets
    assert x.shape[1] == 2 * P + d + 2 * Q - 1
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        pairs = dict(zip(row_x[0 : 2 * P : 2], row_x[1 : 2 * P : 2]))
        assert len(pairs) == P and all(k < 24 and 24 <= v < 48 for k, v in pairs.items())
        assert all(t >= 48 for t in row_x[2 * P : 2 * P + d])
        q = 2 * P + d
        asked = row_x[q::2]
        assert len(set(asked)) == Q and [row_y[i] for i in range(q, len(row_y), 2)] == [pairs[k] for k in asked]
        assert all(t == IGNORE_INDEX for i, t in enumerate(row_y) if i < q or (i - q) % 2)
    longer = make_split("mqar", 4, seed=0, params=dict(num_pairs=P, num_queries=Q, distance=d, seq_len=60))
    assert longer.inputs.shape[1] == 60 and bool((longer.inputs[:, : 60 - x.shape[1]] >= 48).all())


def test_mqar_chance_level_on_the_data() -> None:
    """Without the pairs no rule does better than 1 / value_vocab: the values are independent
    of the keys, of each other and of the row, so the best key -> value rule learnt on one split
    scores chance on another (within 4 standard errors), as does the most common value."""
    p = dict(num_pairs=8, num_queries=8, distance=0)
    train, test = make_split("mqar", 4000, 0, p), make_split("mqar", 4000, 1, p)

    def answers(d):  # (query key, answer) of every scored position
        s = d.targets != IGNORE_INDEX
        keys = torch.zeros_like(d.inputs)[s] + d.inputs[s]  # the scored position holds the query key
        return keys, d.targets[s]

    k_tr, v_tr = answers(train)
    k_te, v_te = answers(test)
    rule = {int(k): int(torch.mode(v_tr[k_tr == k]).values) for k in k_tr.unique()}
    acc = float(torch.tensor([rule[int(k)] == int(v) for k, v in zip(k_te, v_te)]).float().mean())
    chance, n = 1 / 24, len(v_te)
    se = (chance * (1 - chance) / n) ** 0.5
    assert abs(acc - chance) < 4 * se, acc
    assert abs(float((v_te == torch.mode(v_tr).values).float().mean()) - chance) < 4 * se


def bounded_models(context: int) -> list[tuple[str, object]]:
    """Every registered model whose logits read a bounded past (max_context not None), tiny."""
    out = []
    for name in model_names():
        values = model_values(
            name, {"dim": 16, "n_heads": 2, "ffn_hidden": 32, "n_layers": 2}, vocab=64, context=context
        )
        model = build_model(name, values)
        if model.max_context() is not None:
            out.append((name, model))
    return out


def test_mqar_is_out_of_reach_of_every_bounded_model_beyond_its_reach() -> None:
    """For each model with a bounded reach R (sliding window, Transformer-XL, ...): at distance
    R - 1 no query's receptive field holds a pair token, and the logits at every scored position
    are exactly the same when every pair is redrawn (so the model scores chance, exactly); one
    at distance 0, the pairs are in reach and the logits change."""
    models = bounded_models(context=8)
    assert {"sliding_window", "transformer_xl"} <= {n for n, _ in models}
    torch.manual_seed(0)
    for name, model in models:
        R = model.max_context()
        randomize_params(model)
        model.eval()
        for d, reachable in ((R - 1, False), (0, True)):
            P = 4
            a = make_split("mqar", 8, seed=0, params=dict(num_pairs=P, num_queries=P, distance=d))
            scored = (a.targets[0] != IGNORE_INDEX).nonzero().flatten().tolist()
            assert any(model.receptive_start(p) <= 2 * P - 1 for p in scored) == reachable, (name, d)
            b = a.inputs.clone()
            b[:, : 2 * P] = make_split("mqar", 8, seed=1, params=dict(num_pairs=P, num_queries=P, distance=d)).inputs[
                :, : 2 * P
            ]
            with torch.no_grad():
                la, lb = model(a.inputs).logits, model(b).logits
            same = torch.equal(la[:, scored], lb[:, scored])
            assert same != reachable, (name, d, R)


def test_mqar_distance_longer_than_the_sequence_is_one_line() -> None:
    with pytest.raises(RecurformerError, match=r"task parameter 'distance' = 100 does not fit in seq_len 50"):
        make_split("mqar", 2, 0, dict(distance=100, seq_len=50))


def test_scores_by_order_on_a_predictor_whose_answer_is_known() -> None:
    """A predictor right on every row's last MQAR query only (what ruling out the values already
    answered gives): by_order is 0 for every earlier query and 1 for the last; the micro accuracy is
    1 / num_queries."""
    from types import SimpleNamespace

    from recurformer.synth.learner import evaluate

    d = make_split("mqar", 16, 0, dict(num_pairs=4, num_queries=4, distance=3))
    last = torch.zeros_like(d.targets, dtype=torch.bool)
    for r, row in enumerate(d.targets != IGNORE_INDEX):
        last[r, row.nonzero().max()] = True
    preds = torch.where(last, d.targets, torch.full_like(d.targets, -1))
    stub = SimpleNamespace(
        eval=lambda: None,
        model=SimpleNamespace(tok_emb=SimpleNamespace(weight=torch.zeros(1))),
        predict=lambda x, chunk, progress=None: preds[: len(x)] if len(x) == len(preds) else None,
    )
    s = evaluate(stub, d, chunk=8, batch_size=16)  # type: ignore[arg-type]
    assert s.by_order == [0.0, 0.0, 0.0, 1.0] and s.token_accuracy == 0.25


def test_eval_budget_refuses_a_length_whose_state_does_not_fit_before_any_work() -> None:
    """A full-attention model's KV cache grows with the row: testing it at 131,072 tokens exceeds a
    small budget, and the error names the length, the sizes and the keys to change, before training
    starts; a bounded model of the same size fits the same budget (its state does not grow), and so
    does the full-attention model at a short length."""
    cfg = SynthConfig(steps=1, batch_size=4, n_val=4, n_test=4, lrs=[1e-3], n_length_test=64, eval_batch_size=64)
    cfg.eval_memory_gb = 0.5
    small = {"dim": 16, "n_heads": 2, "ffn_hidden": 32}
    t = TASKS["passkey"]
    params = t.params({"length": 12})
    llama = build_model("llama", model_values("llama", dict(small), 32, 8))
    with pytest.raises(
        RecurformerError,
        match=r"length 131072 .*grows with the row.*eval_memory_gb = 0.5: lower synth.eval_lengths, synth.n_length_test",
    ):
        check_eval_budget(t, params, cfg, llama, [64, 131072])
    check_eval_budget(t, params, cfg, llama, [64, 1024])
    rmt = build_model("memory_attention", model_values("memory_attention", dict(small), 32, 8))
    check_eval_budget(t, params, cfg, rmt, [64, 131072])
    cfg.eval_lengths = [131072]
    with pytest.raises(RecurformerError, match="eval_memory_gb"):
        run_synth("passkey", "llama", small, {"length": 12}, cfg)


def test_scoring_a_saved_model_budgets_the_rows_it_reads() -> None:
    """``score_lengths`` (``synth --evaluate --n-test N``) checks the budget for the N rows it
    reads, not for the config's ``n_length_test``: 4 rows of 16,384 tokens fit 20 MB where 256 would
    not, and 256 rows are refused with the command's own options to lower."""
    cfg = SynthConfig(n_length_test=256, eval_batch_size=4, eval_memory_gb=0.02)
    model = build_model(
        "gated_deltanet", model_values("gated_deltanet", {"dim": 16, "n_heads": 2, "ffn_hidden": 32}, 32, 8)
    )
    params = {"length": 12, "key_span": 0.5}
    with pytest.raises(
        RecurformerError, match=r"length 16384 .*for 256 rows.*lower --lengths, --n-test or synth.eval_batch"
    ):
        score_lengths(model, "passkey", params, [16384], 256, cfg)
    scores = score_lengths(model, "passkey", params, [16384], 4, cfg)
    assert scores[16384].rows == 4


def test_held_out_rows_of_a_task_in_book_text_come_from_the_test_books(monkeypatch) -> None:
    """A synth run trains on rows cut from the training books and validates and tests (at its own
    length and at ``eval_lengths``) on rows cut from the held-out books."""
    import recurformer.synth.run as run

    drawn: list[tuple[int, str]] = []

    def recording(task, n, seed, params=None, exclude=None, split="train"):
        drawn.append((n, split))
        return make_split(task, n, seed, params, exclude, split)

    monkeypatch.setattr(run, "make_split", recording)
    cfg = synth_config({"steps": 1, "batch_size": 2, "n_train": 3, "n_val": 4, "n_test": 5, "lrs": [1e-3]})
    cfg.eval_lengths, cfg.n_length_test = [192], 6
    run_synth("s_niah_2", "llama", {"dim": 16, "n_heads": 2, "ffn_hidden": 32}, {"length": 160}, cfg)
    assert drawn == [(3, "train"), (4, "test"), (5, "test"), (6, "test")]
