"""Zoology's MQAR (``mqar_zoology``): the row layout its definition fixes, a trivial reader that
recovers every answer, the power law of the query slots, the protocol's shapes and the one-line
errors; and the synth keys its protocol needs (``train_settings``, ``eval_settings``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from recurformer.cli import main
from recurformer.config import RecurformerError
from recurformer.data.synthetic import TASKS, make_split, row_tokens
from recurformer.data.zoology import mqar_zoology
from recurformer.nn import IGNORE_INDEX
from recurformer.synth.config import synth_config
from recurformer.synth.job import FreshRows
from recurformer.synth.run import run_synth, summary

TRAIN = [(64, 4), (128, 8), (256, 16), (256, 32), (256, 64)]  # Zoology's (seq_len, num_pairs) mixture
TEST = [(64, 4), (64, 8), (64, 16), (128, 32), (256, 64), (512, 128), (1024, 256)]
TINY = {"dim": 16, "n_heads": 2, "ffn_hidden": 32}


def read(inputs: np.ndarray, P: int) -> np.ndarray:
    """The trivial reader: at every position, the value its token is paired with in the row's first
    2P tokens (IGNORE_INDEX where the token is no key there)."""
    out = np.full_like(inputs, IGNORE_INDEX)
    for i, row in enumerate(inputs):
        pairs = dict(zip(row[0 : 2 * P : 2].tolist(), row[1 : 2 * P : 2].tolist()))
        out[i] = [pairs.get(int(tok), IGNORE_INDEX) for tok in row]
    return out


@pytest.mark.parametrize("V, T, P", [(8192, 256, 64), (64, 32, 4), (16, 16, 4)])
def test_rows_hold_distinct_pairs_then_queries_whose_answers_a_reader_recovers(V: int, T: int, P: int) -> None:
    x, y = mqar_zoology(np.random.default_rng(0), 200, vocab_size=V, seq_len=T, num_pairs=P)
    assert x.shape == y.shape == (200, T) and x.min() >= 0 and x.max() < V
    keys, values = x[:, 0 : 2 * P : 2], x[:, 1 : 2 * P : 2]
    assert (keys >= 1).all() and (keys < V // 2).all() and (values >= V // 2).all() and (values < V).all()
    assert all(len(set(r)) == P for r in keys) and all(len(set(r)) == P for r in values)
    scored = y != IGNORE_INDEX
    where = np.nonzero(scored)
    assert (scored.sum(1) == P).all() and (where[1] >= 2 * P).all() and ((where[1] - 2 * P) % 2 == 0).all()
    for i in range(len(x)):  # each key asked exactly once, its pair's value the target
        assert sorted(x[i, scored[i]]) == sorted(keys[i])
        assert dict(zip(x[i, scored[i]], y[i, scored[i]])) == dict(zip(keys[i], values[i]))
    answer = read(x, P)
    assert (answer[scored] == y[scored]).all()  # a perfect score for the reader
    assert (x[:, 1:][scored[:, :-1]] != y[:, :-1][scored[:, :-1]]).mean() > 0.9  # the value does not follow


def test_query_slots_follow_the_power_law() -> None:
    """Slot i (from 1) is drawn with weight i^(power_a - 1): one query lands in the first slot with
    probability 1 / sum_i i^(power_a - 1); many land well before a uniform draw's mean slot."""
    T, P = 256, 16
    space = (T - 2 * P) // 2
    _, y = mqar_zoology(np.random.default_rng(1), 4000, vocab_size=8192, seq_len=T, num_pairs=P)
    slots = (np.nonzero(y != IGNORE_INDEX)[1] - 2 * P) // 2
    uniform = (space - 1) / 2
    assert slots.mean() < 0.6 * uniform, (slots.mean(), uniform)
    _, y1 = mqar_zoology(np.random.default_rng(2), 20000, vocab_size=8192, seq_len=T, num_pairs=1)
    first = float(((np.nonzero(y1 != IGNORE_INDEX)[1] - 2) // 2 == 0).mean())
    expected = 1 / float((np.arange(1, (T - 2) // 2 + 1) ** (0.01 - 1)).sum())
    assert abs(first - expected) < 0.01, (first, expected)
    _, flat = mqar_zoology(np.random.default_rng(1), 4000, vocab_size=8192, seq_len=T, num_pairs=P, power_a=1.0)
    assert abs((np.nonzero(flat != IGNORE_INDEX)[1] - 2 * P).mean() / 2 - uniform) < 1.0  # power_a 1: uniform


def test_every_protocol_setting_builds_rows_of_its_length() -> None:
    for T, P in sorted(set(TRAIN + TEST)):
        d = make_split("mqar_zoology", 8, 0, {"seq_len": T, "num_pairs": P})
        assert d.inputs.shape == (8, T) == (8, row_tokens("mqar_zoology", {"seq_len": T, "num_pairs": P}))
        assert ((d.targets != IGNORE_INDEX).sum(1) == P).all()


@pytest.mark.parametrize(
    "params, message",
    [
        (
            {"seq_len": 63},
            'needs an even task={"seq_len": 63} >= 4 (pairs, then query slots of 2 tokens): set task={"seq_len": 64}',
        ),
        (
            {"seq_len": 64, "num_pairs": 17},
            'pairs and their queries need 4 x num_pairs tokens, more than task={"seq_len": 64} holds: set task={"num_pairs": 16} or task={"seq_len": 68}',
        ),
        (
            {"vocab_size": 64, "seq_len": 256, "num_pairs": 32},
            'draws task={"num_pairs": 32} distinct keys from the 31 tokens [1, vocab_size/2) of task={"vocab_size": 64}: set task={"vocab_size": 66} or more',
        ),
        ({"power_a": 0.0}, 'needs task={"power_a": 0.0} > 0: set task={"power_a": 0.01}'),
    ],
)
def test_bad_parameters_are_one_line_errors(params: dict, message: str) -> None:
    with pytest.raises(RecurformerError) as e:
        make_split("mqar_zoology", 4, 0, params)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_parameters_are_spelled_for_the_command_line(capsys) -> None:
    argv = ["synth", "--task", "mqar_zoology", "--model", "llama", "--steps", "1", "--set", "task.seq_len=63"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "recurformer: error: task mqar_zoology needs an even --set task.seq_len=63 >= 4 (pairs, then query "
        "slots of 2 tokens): set --set task.seq_len=64"
    )


def test_train_settings_draw_every_setting_and_a_batch_shares_one_shape() -> None:
    settings = [{"seq_len": 16, "num_pairs": 2}, {"seq_len": 32, "num_pairs": 4}, {"seq_len": 64, "num_pairs": 8}]
    p = TASKS["mqar_zoology"].params({"vocab_size": 64, "seq_len": 32, "num_pairs": 4})
    rows = FreshRows("mqar_zoology", p, synth_config({"batch_size": 4, "train_settings": settings}), set())
    drawn = [rows.setting(s) for s in range(300)]
    assert all(d in settings for d in drawn) and {d["seq_len"] for d in drawn} == {16, 32, 64}
    assert drawn == [rows.setting(s) for s in range(300)]  # seeded by the step alone
    for step in range(6):
        b = rows.batch(step)
        T, P = drawn[step]["seq_len"], drawn[step]["num_pairs"]
        assert b.inputs.shape == (4, T) and ((b.targets != IGNORE_INDEX).sum(1) == P).all()


def test_eval_settings_land_in_by_setting_and_the_summary(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    argv = ["synth", "--task", "mqar_zoology", "--model", "gated_deltanet", "--steps", "3", "--lrs", "1e-3"]
    for s in [
        "dim=16",
        "n_heads=2",
        "ffn_hidden=32",
        "task.vocab_size=64",
        "task.seq_len=32",
        "task.num_pairs=4",
        "synth.batch_size=4",
        "synth.n_val=8",
        "synth.n_test=8",
        "synth.n_length_test=8",
        "synth.context=8",
        "synth.train_settings=[{seq_len: 16, num_pairs: 2}, {seq_len: 32, num_pairs: 4}]",
        "synth.eval_settings=[{seq_len: 64, num_pairs: 16}, {num_pairs: 1, seq_len: 16}]",
    ]:
        argv += ["--set", s]
    assert main(argv + ["--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert list(r["by_setting"]) == ["seq_len=64,num_pairs=16", "num_pairs=1,seq_len=16"]
    assert all(0 <= a <= 1 for a in r["by_setting"].values()) and r["task_params"]["seq_len"] == 32
    printed = capsys.readouterr().out
    assert "  at seq_len=64,num_pairs=16: test micro token accuracy" in printed
    assert "  at num_pairs=1,seq_len=16: test micro token accuracy" in printed


def test_eval_setting_rows_are_held_out_from_training(monkeypatch) -> None:
    """A setting tested after training that is also trained: its test rows are none of the rows
    a batch draws (a row space of 36 rows, 20 of them held out, so a batch that ignored them would
    meet them)."""
    import recurformer.synth.run as run

    tested: list[set[bytes]] = []
    trained: list[set[bytes]] = []
    split, batch = run.setting_split, FreshRows.batch
    monkeypatch.setattr(run, "setting_split", lambda *a: tested.append((d := split(*a)).row_keys()) or d)
    monkeypatch.setattr(FreshRows, "batch", lambda *a: trained.append((d := batch(*a)).row_keys()) or d)
    setting = {"seq_len": 4, "num_pairs": 1}  # a key of 2, a value of 3, the query, a random token of 6
    values = {"steps": 3, "batch_size": 4, "n_val": 2, "n_test": 2, "n_length_test": 16, "lrs": [1e-3], "context": 2}
    cfg = synth_config({**values, "train_settings": [setting], "eval_settings": [setting]})
    r = run_synth("mqar_zoology", "llama", TINY, {"vocab_size": 6, **setting}, cfg)
    assert set(r.by_setting) == {"seq_len=4,num_pairs=1"} and "at seq_len=4,num_pairs=1" in summary(r)
    assert len(tested) == 1 and len(trained) == 3 and not any(tested[0] & rows for rows in trained)


@pytest.mark.parametrize(
    "synth, message",
    [
        (
            {"train_settings": [{"seq_len": 16}], "train_lengths": [16, 32]},
            "synth keys 'train_settings' and 'train_lengths' both choose each batch's task parameters: give one",
        ),
        (
            {"train_settings": [{"seq_lne": 16}]},
            "synth key 'train_settings', setting seq_lne=16: unknown parameter 'seq_lne' of task mqar_zoology (did you mean 'seq_len'?)",
        ),
        ({"eval_settings": [{"pairs": 4}]}, "synth key 'eval_settings', setting pairs=4: unknown parameter 'pairs'"),
        ({"train_settings": [{"seq_len": 16, "num_pairs": 8}]}, "pairs and their queries need 4 x num_pairs tokens"),
        ({"train_settings": [16]}, "synth key 'train_settings' holds task-parameter settings, got 16: give mappings"),
        (
            {"train_settings": [{"seq_len": 16}], "schedule": {"stages": [{"step": 1, "length": 64}]}},
            "synth key 'train_settings' sets each batch's task parameters, synth.schedule its length: give one",
        ),
        (
            {"eval_settings": [{"seq_len": 1 << 20, "num_pairs": 4}], "eval_memory_gb": 0.1},
            "testing mqar_zoology at seq_len=1048576,num_pairs=4 (1,048,576 tokens a row)",
        ),
    ],
)
def test_bad_settings_are_one_line_errors_before_work(monkeypatch, synth: dict, message: str) -> None:
    import recurformer.synth.run as run

    def no_work(*args, **kw):  # type: ignore[no-untyped-def]
        raise AssertionError("rows were built before the error")

    monkeypatch.setattr(run, "make_split", no_work)
    cfg_values = {"steps": 1, "batch_size": 4, "n_val": 4, "n_test": 4, "lrs": [1e-3], "context": 4, **synth}
    with pytest.raises(RecurformerError) as e:
        run_synth(
            "mqar_zoology", "llama", TINY, {"vocab_size": 64, "seq_len": 32, "num_pairs": 4}, synth_config(cfg_values)
        )
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
