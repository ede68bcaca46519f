"""benchmarks/peers.py counts a peer's FLOPs in the peer's own process with its own copy of
``recurformer.flops``' rule (FlopCounterMode, SDPA by the pairs its mask shows): on our models the
copy must give our count, or the per-FLOP ratios compare different rules."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import peers  # noqa: E402

from recurformer import build_model  # noqa: E402
from recurformer.flops import train_flops_per_token  # noqa: E402

TINY = dict(vocab_size=64, dim=16, n_layers=2, n_heads=2)


@pytest.mark.parametrize(
    "name, extra",
    [
        ("llama", {}),
        ("sliding_window", dict(window=8)),  # an SDPA mask, not is_causal
        ("rmt", dict(segment_len=8, memory_size=4)),
        ("block_recurrent", dict(block_size=8, recurrent_layers=(0,))),
        ("memory_attention", dict(chunk_size=8)),
    ],
)
def test_peer_flop_count_matches_ours(name: str, extra: dict) -> None:
    torch.manual_seed(0)
    model = build_model(name, {**TINY, **extra})
    T = 24
    theirs = peers.peer_train_flops(model, lambda x: model(x[:, :-1]), T)
    assert theirs == train_flops_per_token(model, T)


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_train_step_runs_under_the_precision(precision: str, dtype: torch.dtype) -> None:
    """--precision bf16 puts each side's forward under CPU bf16 autocast; the weights stay fp32 and
    are updated."""
    model = build_model("llama", TINY)
    seen: set[torch.dtype] = set()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda _m, _i, o: seen.add(o.dtype))
    x = torch.randint(0, TINY["vocab_size"], (2, 9))
    before = [p.detach().clone() for p in model.parameters()]
    peers.train_step(model, lambda: model(x[:, :-1], targets=x[:, 1:]).loss, precision)()
    assert seen == {dtype}
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_ours_set_reaches_our_model_and_a_wrong_key_is_one_line(monkeypatch, capsys) -> None:
    """--ours-set configures our side of every pair; a key our model lacks stops the run before any
    worker starts, in one line naming it."""
    c = dict(vocab=64, dim=16, depth=3, heads=2, segment=8, memory=4, chunk=8, batch=1, seq=16, precision="fp32")
    model, _, _ = peers.build_ours("block_recurrent", {**c, "ours_set": {"position": "rope"}})
    assert model.config.position == "rope"
    assert model.config.kv_heads == 1  # the pair's default: the peer's one key/value head
    model, _, _ = peers.build_ours("block_recurrent", {**c, "ours_set": {"kv_heads": None}})
    assert model.config.key_value_heads == c["heads"]
    monkeypatch.setattr(
        sys, "argv", ["peers.py", "--pairs", "block_recurrent", "--venv", "/nonexistent", "--ours-set", "positon=rope"]
    )
    with pytest.raises(SystemExit) as e:
        peers.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "--ours-set" in err[-1] and "positon" in err[-1]


@pytest.mark.parametrize("n, k, coverage", [(6, 1, 0.969), (7, 1, 0.984), (15, 4, 0.965), (21, 6, 0.973)])
def test_median_interval_is_the_order_statistics_and_covers_as_it_says(n: int, k: int, coverage: float) -> None:
    """[x_(k), x_(n+1-k)] with its exact binomial coverage; over many samples of a skewed
    distribution the interval holds the true median as often as the coverage says."""
    xs = [float(v) for v in torch.randperm(n)]
    lo, hi, cov = peers.median_interval(xs)
    assert (lo, hi) == (k - 1, n - k) and round(cov, 3) == coverage
    g = torch.Generator().manual_seed(0)
    samples = torch.empty(4000, n).exponential_(generator=g)  # true median ln 2
    hits = 0
    for row in samples.tolist():
        lo, hi, cov = peers.median_interval(row)
        hits += lo <= math.log(2) <= hi
    assert abs(hits / 4000 - cov) < 4 * math.sqrt(cov * (1 - cov) / 4000)


def test_median_interval_needs_six() -> None:
    assert peers.median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None


class _FakeWorker:
    """Step times from a script: ours 1 s, theirs 1.1 s times a factor that alternates, so the
    per-round ratios spread around 1.1 and the interval narrows only as rounds add up."""

    def __init__(
        self, python: Path, pair: str, side: str, config: dict, dist: str | None, root: Path = peers.ROOT
    ) -> None:
        self.side, self.n = side, 0
        self.info = dict(params=1, flops=1.0, torch="x", version="x", source=str(root.resolve()))

    def step(self) -> float:
        self.n += 1
        return 1.0 if self.side == "ours" else 1.1 * (1 + 0.2 * (-1) ** self.n / (self.n**0.5))

    def close(self) -> None:
        pass


@pytest.mark.parametrize("until, max_rounds, want", [(0.0, 40, 7), (10.0, 40, 7), (1e-9, 12, 12), (0.2, 40, None)])
def test_until_adds_rounds_until_the_interval_is_narrow(monkeypatch, until, max_rounds, want) -> None:
    """--until stops at the first round count >= --rounds whose interval is at most W wide, and
    never past --max-rounds; without it, exactly --rounds."""
    monkeypatch.setattr(peers, "Worker", _FakeWorker)
    c = dict(batch=1, seq=1)
    row = peers.run_pair("llama", c, Path("x"), None, rounds=7, warmup=2, until=until, max_rounds=max_rounds)
    assert row is not None
    n = row["rounds"]
    if want is not None:
        assert n == want
    else:  # the first n >= 7 at which the interval is <= 0.2 wide, and none before it
        lo, hi = row["ratio_ci"]
        assert hi - lo <= 0.2 + 1e-3 and n > 7
        times = {k: v[:-1] for k, v in row["seconds"].items()}
        assert peers.width(times) > 0.2
    assert len(row["seconds"]["ours"]) == n


class _BiasedWorker(_FakeWorker):
    """Each new process pair gets a bias of its own: theirs takes 1.1 x (1 + 0.05 k) s in the k-th
    pair (k = 0, 1, ...), ours 1 s; the order in which the sides step is logged."""

    started: list[str] = []
    steps: list[str] = []

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        _BiasedWorker.started.append(self.side)
        self.k = sum(s == self.side for s in _BiasedWorker.started) - 1

    def step(self) -> float:
        _BiasedWorker.steps.append(self.side)
        return 1.0 if self.side == "ours" else 1.1 * (1 + 0.05 * self.k)


@pytest.mark.parametrize("processes", [1, 3, 7])
def test_processes_are_the_units_of_the_ratio(monkeypatch, processes) -> None:
    """--processes K: K fresh process pairs, the side that starts and steps first alternating, and
    the ratio and its interval over the pairs' medians (a bias of each process pair that its own
    rounds cannot show); with one pair, over the rounds as before."""
    monkeypatch.setattr(peers, "Worker", _BiasedWorker)
    _BiasedWorker.started, _BiasedWorker.steps = [], []
    row = peers.run_pair("llama", dict(batch=1, seq=1), Path("x"), None, 6, 1, 0.0, 40, processes=processes)
    assert row is not None and row["processes"] == processes and row["rounds"] == 6 * processes
    want = [1.1 * (1 + 0.05 * k) for k in range(processes)]
    assert row["process_ratios"] == pytest.approx(want, abs=1e-3)
    assert _BiasedWorker.started == [
        s for k in range(processes) for s in (("ours", "theirs"), ("theirs", "ours"))[k % 2]
    ]
    firsts = _BiasedWorker.steps[::2]  # who stepped first in each round, warm-up included: 7 per pair
    assert firsts == [("ours", "theirs")[k % 2] for k in range(processes) for _ in range(7)]
    assert row["ratio"] == pytest.approx(want[processes // 2], abs=1e-3)
    if processes == 1:  # six equal rounds: an interval of zero width
        assert row["ratio_ci"] == pytest.approx([1.1, 1.1], abs=1e-3)
    elif processes == 7:  # seven process medians: min-max
        assert row["ratio_ci"] == pytest.approx([want[0], want[-1]], abs=1e-3)
    else:  # three medians: too few for an interval, though each pair ran six rounds
        assert row["ratio_ci"] is None


TINY_RUN = ["--pairs", "llama", "--dim", "16", "--depth", "1", "--heads", "2", "--vocab", "64", "--batch", "1"]
TINY_RUN += ["--seq", "64", "--segment", "32", "--rounds", "6", "--warmup", "0"]


def test_base_tree_takes_the_peers_place(monkeypatch, tmp_path, capsys) -> None:
    """--base DIR: our model as a copy of the package in DIR builds it is timed against ours, A B
    with the interval; no peer is installed. A tree whose recurformer is not its own (a link to this
    one) is refused, so a run never compares a tree with itself unawares."""
    tree, linked, out = tmp_path / "base", tmp_path / "linked", tmp_path / "ab.json"
    shutil.copytree(peers.ROOT / "recurformer", tree / "recurformer", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(sys, "argv", ["peers.py", *TINY_RUN, "--base", str(tree), "--out", str(out)])
    peers.main()
    d = json.loads(out.read_text())
    (row,) = d["results"]
    assert row["peer"] == "ours at base" and row["rounds"] == 6 and row["ratio_ci"] is not None
    assert row["flops_per_token"]["ours"] == row["flops_per_token"]["theirs"] and d["meta"]["base"] == "base"
    linked.mkdir()
    (linked / "recurformer").symlink_to(peers.ROOT / "recurformer")
    monkeypatch.setattr(sys, "argv", ["peers.py", *TINY_RUN, "--base", str(linked), "--out", str(out)])
    peers.main()
    assert "skipped: imported recurformer from" in capsys.readouterr().out
    assert json.loads(out.read_text())["results"] == []


@pytest.mark.skipif(not (peers.ROOT / ".git").exists(), reason="needs a git checkout")
def test_base_revision_is_exported_and_a_wrong_one_is_one_line(monkeypatch, capsys) -> None:
    with peers.source_tree("HEAD") as (tree, label):
        assert (tree / "recurformer" / "__init__.py").is_file() and label and tree != peers.ROOT
    assert not tree.exists()  # the export is removed on leaving
    monkeypatch.setattr(sys, "argv", ["peers.py", *TINY_RUN, "--base", "no-such-rev"])
    with pytest.raises(SystemExit) as e:
        peers.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "--base" in err[-1] and "no-such-rev" in err[-1]
