"""The state probe: exact zeros beyond a bounded model's receptive field (and not inside it),
a recurrent state that the probe sees, streamed losses equal to one forward, the bootstrap over
documents, and the CLI with its one-line errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import randomize_params

from recurformer import build_model
from recurformer.cli import main as cli_main
from recurformer.intervals import bootstrap_mean
from recurformer.probe.measure import aggregate, distance_bins, receptive_field, row_losses
from recurformer.probe.samples import repeat_samples_from_stream, split_copy_document, swap_samples

BOUNDED = {
    "sliding_window": dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, window=5),
    "transformer_xl": dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, segment_len=6, mem_len=4),
}
RECURRENT = {
    "memory_attention": dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, chunk_size=4),
    "block_recurrent": dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, block_size=4, recurrent_layers=(0,)),
}


def _model(name: str, cfg: dict, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    model = build_model(name, cfg).to(dtype).eval()
    randomize_params(model, 0.3)
    return model


def _values(samples, losses, metric):
    """Per-token (distance, value) pairs of ``metric`` over all samples."""
    d, v = [], []
    for s, ls in zip(samples, losses):
        for c in s.comparisons:
            if c.metric == metric:
                d.append(c.distance)
                v.append(ls[c.row_a][c.pos_a] - ls[c.row_b][c.pos_b])
    return np.concatenate(d), np.concatenate(v)


def _per_sample(samples, model, chunk=7):
    flat = [r for s in samples for r in s.rows]
    losses = row_losses(model, flat, chunk=chunk, batch_size=3)
    out, i = [], 0
    for s in samples:
        out.append(losses[i : i + len(s.rows)])
        i += len(s.rows)
    return out


def test_receptive_fields() -> None:
    assert receptive_field(build_model("sliding_window", BOUNDED["sliding_window"])) == 2 * (5 - 1)
    # XL, segment 6, memory 4, 2 layers: a query at 6s + 5 sees layer-1 outputs from 6s - 4 (offset 2
    # of the previous segment), which see inputs from 6(s - 1) - 4: 15 tokens back
    assert receptive_field(build_model("transformer_xl", BOUNDED["transformer_xl"])) == 15
    for name, cfg in RECURRENT.items():
        assert receptive_field(build_model(name, cfg)) is None
    assert receptive_field(build_model("llama", dict(vocab_size=61, dim=32, n_layers=2, n_heads=4))) is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", sorted(BOUNDED))
def test_bounded_models_are_exactly_zero_beyond_R_and_not_inside(name, dtype) -> None:
    """Beyond R: 0 to 1e-10 in float64; in float32 within 1e-6 of the loss itself (copy_gain
    compares the same window at other absolute positions, where RoPE rounds differently)."""
    model = _model(name, BOUNDED[name], dtype)
    R = receptive_field(model)
    rng = np.random.default_rng(0)
    stream = rng.integers(2, 61, 4000)
    marker = np.array([0, 1, 0])
    samples = repeat_samples_from_stream(stream, marker, n_docs=6, passage=3 * R, warm=(0, 20), rng=rng)
    losses = _per_sample(samples, model)
    scale = np.nanmax(np.abs(np.concatenate([ls for s in losses for ls in s])))
    tol = 1e-10 if dtype == torch.float64 else 1e-6 * scale
    for metric in ("copy_gain", "swap_delta"):
        d, v = _values(samples, losses, metric)
        assert np.abs(v[d > R]).max() <= tol, metric
        assert np.abs(v[d <= R]).max() > 1e-3, metric
        for b in aggregate(samples, losses, metric):
            if b.lo > R:
                assert max(abs(b.mean), abs(b.ci_lo), abs(b.ci_hi)) <= tol
    # swap: the nearest replaced token exactly R back changes a logit, R + 1 back changes none.
    # (XL reaches R back only from one segment phase: distances R-3..R put distance R at 4 phases a sample.)
    samples = swap_samples(
        stream, n_docs=8, distances=[R - 3, R - 2, R - 1, R, R + 1, 3 * R], span=5, warm=(0, 12), rng=rng
    )
    d, v = _values(samples, _per_sample(samples, model), "swap_delta")
    assert np.abs(v[d > R]).max() <= tol
    assert np.abs(v[d == R]).max() > 1e-4


@pytest.mark.parametrize("name", sorted(RECURRENT))
def test_recurrent_state_is_seen_far_beyond_any_chunk(name) -> None:
    model = _model(name, RECURRENT[name])
    rng = np.random.default_rng(1)
    stream = rng.integers(2, 61, 4000)
    far = 10 * 4  # ten chunks/blocks back
    samples = swap_samples(stream, n_docs=4, distances=[far, 3 * far], span=4, warm=(0, 9), rng=rng)
    d, v = _values(samples, _per_sample(samples, model), "swap_delta")
    assert np.abs(v[d >= far]).max() > 1e-4
    assert np.abs(v[d >= 3 * far]).max() > 0


def test_split_copy_document() -> None:
    marker = np.array([7, 8])
    s1, gap = np.array([3, 4, 5]), np.array([9, 7, 9, 4])
    doc = np.concatenate([[0], s1, gap, marker, s1, [1]])
    head, a, g, m, b, tail = split_copy_document(doc, marker, tail=1)
    assert (
        head.tolist() == [0]
        and a.tolist() == b.tolist() == s1.tolist()
        and g.tolist() == gap.tolist()
        and tail.tolist() == [1]
    )
    assert split_copy_document(np.concatenate([[0], s1, marker, [3, 4, 6]]), marker, tail=0) is None  # copy differs
    assert split_copy_document(np.concatenate([[0], s1, gap]), marker, tail=0) is None  # no marker


def test_row_losses_stream_exactly_like_one_forward() -> None:
    """Rows of different lengths, batched with end padding and read 7 tokens per call, give the
    per-token losses of one whole forward over each row alone (float64)."""
    model = build_model("memory_attention", RECURRENT["memory_attention"]).double().eval()
    randomize_params(model, 0.1)
    rng = np.random.default_rng(2)
    rows = [rng.integers(0, 61, n) for n in (30, 11, 23, 2)]
    got = row_losses(model, rows, chunk=7, batch_size=3)
    for r, g in zip(rows, got):
        x = torch.from_numpy(r)[None]
        with torch.no_grad():
            logits = model(x[:, :-1]).logits[0]
        ref = F.cross_entropy(logits, x[0, 1:], reduction="none").numpy()
        assert np.isnan(g[0]) and len(g) == len(r)
        np.testing.assert_allclose(g[1:], ref, rtol=0, atol=1e-10)


def test_bootstrap_interval_on_constructed_samples() -> None:
    assert bootstrap_mean(np.full(50, 0.25)) == (0.25, 0.25, 0.25)
    rng = np.random.default_rng(3)
    hits, widths = 0, []
    for trial in range(40):
        x = rng.normal(1.0, 2.0, 400)
        m, lo, hi = bootstrap_mean(x, seed=trial)
        hits += lo <= 1.0 <= hi
        widths.append(hi - lo)
    assert hits >= 34  # a 95% interval covers the true mean ~38 of 40 times
    assert abs(np.mean(widths) / (2 * 1.96 * 2.0 / np.sqrt(400)) - 1) < 0.1
    assert [b for b in distance_bins(9)] == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 16)]


def test_aggregate_weighs_documents_not_tokens() -> None:
    from recurformer.probe.samples import Comparison, Sample

    def doc(n: int, value: float) -> tuple[Sample, list[np.ndarray]]:
        """n tokens at distance 5 whose metric (loss of row 1 - loss of row 0) is ``value``."""
        pos = np.arange(1, n + 1)
        s = Sample([np.zeros(n + 1), np.zeros(n + 1)], [Comparison("m", 1, pos, 0, pos, np.full(n, 5))])
        return s, [np.zeros(n + 1), np.full(n + 1, value)]

    (a, la), (b, lb) = doc(100, 1.0), doc(1, 0.0)
    (stat,) = [s for s in aggregate([a, b], [la, lb], "m") if s.lo <= 5 < s.hi]
    assert stat.mean == pytest.approx(0.5) and stat.docs == 2 and stat.tokens == 101  # by tokens it would be 0.99


# ----------------------------------------------------------------------------------------------
# CLI

WORDS = "the a cat dog ran sat on mat big small red blue happy sad tree house went saw".split()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    from recurformer.training.config import load_run_config
    from recurformer.training.trainer import Trainer

    d = tmp_path_factory.mktemp("probe")
    rng = random.Random(0)
    corpus = d / "corpus.txt"
    corpus.write_text(
        "<|endoftext|>".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80))) + "." for _ in range(200))
    )
    cfg = load_run_config(
        None,
        [
            "model.name=sliding_window",
            "model.window=8",
            "model.dim=32",
            "model.n_layers=2",
            "model.n_heads=2",
            "data.dataset=null",
            f"data.text_files=[{corpus}]",
            "data.tokenizer=byte",
            f"data.dir={d / 'prepared'}",
            f"train.out_dir={d / 'run'}",
            "train.batch_size=2",
            "train.seq_len=32",
            "train.steps=2",
            "train.warmup=1",
            "train.precision=fp32",
            "train.eval_every=2",
            "train.eval_batches=1",
            "train.save_every=2",
            "train.log_every=1",
        ],
    )
    tr = Trainer(cfg, show_progress=False)
    tr.run()
    return d / "run", corpus


def test_cli_repeat_and_swap(trained, tmp_path, capsys) -> None:
    import shutil

    run, corpus = trained
    other = tmp_path / "run2"
    shutil.copytree(run, other)
    out = tmp_path / "p" / "probe.json"
    assert (
        cli_main(
            [
                "probe",
                "--checkpoint",
                str(run),
                str(other),
                "--text",
                str(corpus),
                "--docs",
                "12",
                "--passage",
                "20",
                "--warm-min",
                "5",
                "--warm-max",
                "30",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "**copy_gain**" in printed and "**swap_delta**" in printed and "| run2 | 14 |" in printed
    res = json.loads(out.read_text())
    assert out.with_suffix(".png").is_file() and [r["label"] for r in res["results"]] == ["run", "run2"]
    first = res["results"][0]
    assert first["receptive_field"] == 14 and first["step"] == 2 and first["val_loss"] is not None
    far = [b for b in first["metrics"]["swap_delta"] if b["lo"] > 14]
    assert far and all(abs(b["mean"]) <= 1e-6 for b in far)  # a sliding window of 8 over 2 layers
    assert all(b["docs"] == 12 for b in first["metrics"]["copy_gain"] if b["hi"] <= 20)
    assert (
        cli_main(
            [
                "probe",
                "--checkpoint",
                str(run),
                "--task",
                "swap",
                "--text",
                str(corpus),
                "--docs",
                "5",
                "--distances",
                "2,20",
                "--span",
                "4",
                "--warm-min",
                "0",
                "--warm-max",
                "10",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert set(json.loads(out.read_text())["results"][0]["metrics"]) == {"swap_delta"}


def test_cli_repeat_on_copy_documents_with_a_gap(trained, tmp_path, capsys) -> None:
    """Documents ``s1 gap marker s1`` (scripts/make_copy_task.py's form): the probe splits them at
    the marker and files swap_Δ at k + |gap| + |marker|; a window of 14 tokens never sees s1."""
    from recurformer.data.prepare import EOT, REPEAT_PROMPT

    run, _ = trained
    rng = random.Random(1)
    docs = []
    for _ in range(30):
        s1 = " ".join(rng.choice(WORDS) for _ in range(3)) + "."
        gap = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 12)))
        docs.append(f"{s1}\n{gap}\n{REPEAT_PROMPT}\n{s1}")
    text = tmp_path / "copy.txt"
    text.write_text(f"\n{EOT}\n".join(docs))
    out = tmp_path / "c.json"
    assert (
        cli_main(
            [
                "probe",
                "--checkpoint",
                str(run),
                "--text",
                str(text),
                "--docs",
                "20",
                "--warm-min",
                "3",
                "--warm-max",
                "20",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    m = json.loads(out.read_text())["results"][0]["metrics"]
    assert min(b["lo"] for b in m["swap_delta"]) >= 16 and max(b["lo"] for b in m["copy_gain"]) < 32
    assert all(abs(b["mean"]) <= 1e-6 for b in m["swap_delta"])  # s1 lies > |marker| = 15 > R = 14 bytes back
    assert any(abs(b["mean"]) > 1e-3 for b in m["copy_gain"])  # inside R the contexts of s1[k], s2[k] differ


@pytest.mark.parametrize(
    "args, message",
    [
        (["--task", "nope"], "unknown probe task 'nope'"),
        (["--docs", "0"], "--docs must be >= 1"),
        (["--passage", "50000"], "too short for 50000-token passages"),
        (["--task", "swap", "--distances", "4,x"], "--distances must be comma-separated integers"),
        (["--warm-min", "9", "--warm-max", "3"], "--warm-min <= --warm-max"),
        (["--json", "/proc/nope/p.json"], "cannot write /proc/nope/p.json"),
    ],
)
def test_cli_bad_input_is_one_line(trained, tmp_path, capsys, args, message) -> None:
    run, corpus = trained
    json_args = [] if "--json" in args else ["--json", str(tmp_path / "p.json")]
    assert cli_main(["probe", "--checkpoint", str(run), "--text", str(corpus), "--docs", "3", *args, *json_args]) == 2
    *progress, error = capsys.readouterr().err.splitlines()  # progress lines of any work done first
    assert message in error and error.startswith("recurformer: error: ")
    assert all(line.startswith("  run: ") for line in progress), progress  # no traceback
    assert not (tmp_path / "p.json").exists()


def test_cli_checkpoint_without_tokenizer_and_non_utf8_text(trained, tmp_path, capsys) -> None:
    import shutil

    from recurformer.checkpoint import resolve

    run, corpus = trained
    copy = tmp_path / "run"
    shutil.copytree(resolve(run), copy)
    (copy / "tokenizer.json").unlink()
    assert (
        cli_main(["probe", "--checkpoint", str(copy), "--text", str(corpus), "--json", str(tmp_path / "p.json")]) == 2
    )
    assert "has no tokenizer.json" in capsys.readouterr().err
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xe9 " * 100)
    assert cli_main(["probe", "--checkpoint", str(run), "--text", str(bad), "--json", str(tmp_path / "p.json")]) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


@pytest.mark.slow
def test_cli_merge_equals_one_run_and_refuses_other_settings(trained, tmp_path, capsys) -> None:
    """Probing checkpoints one at a time and merging the files gives the table of one run over
    them all (the documents depend only on the text and the seed); files run with other settings
    are refused in one line, nothing written."""
    import shutil

    run, corpus = trained
    other = tmp_path / "run2"
    shutil.copytree(run, other)
    common = ["--text", str(corpus), "--docs", "8", "--passage", "20", "--warm-min", "5", "--warm-max", "30"]
    assert (
        cli_main(["probe", "--checkpoint", str(run), str(other), *common, "--json", str(tmp_path / "both.json")]) == 0
    )
    assert cli_main(["probe", "--checkpoint", str(run), *common, "--json", str(tmp_path / "a.json")]) == 0
    assert cli_main(["probe", "--checkpoint", str(other), *common, "--json", str(tmp_path / "b.json")]) == 0
    capsys.readouterr()
    merged = tmp_path / "m" / "merged.json"
    assert (
        cli_main(["probe", "--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json", str(merged)]) == 0
    )
    assert "**swap_delta**" in capsys.readouterr().out and merged.with_suffix(".png").is_file()
    both = json.loads((tmp_path / "both.json").read_text())["results"]
    got = json.loads(merged.read_text())["results"]
    assert [r["metrics"] for r in got] == [r["metrics"] for r in both]
    assert [r["checkpoint"] for r in got] == [r["checkpoint"] for r in both]

    assert (
        cli_main(
            [
                "probe",
                "--checkpoint",
                str(run),
                *common[:-4],
                "--warm-min",
                "0",
                "--warm-max",
                "9",
                "--json",
                str(tmp_path / "c.json"),
            ]
        )
        == 0
    )
    capsys.readouterr()
    bad = tmp_path / "bad.json"
    assert cli_main(["probe", "--merge", str(tmp_path / "a.json"), str(tmp_path / "c.json"), "--json", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "different warm_min" in err and err.count("\n") == 1 and not bad.exists()
    assert cli_main(["probe", "--merge", str(tmp_path / "nope.json"), "--json", str(bad)]) == 2
    assert "probe result not found" in capsys.readouterr().err

    # same file name and settings, other documents: refused by the content hash
    meta_b = json.loads((tmp_path / "b.json").read_text())
    assert meta_b["meta"]["text_sha256"] == json.loads(merged.read_text())["meta"]["text_sha256"]
    meta_b["meta"]["text_sha256"] = "0" * 64
    (tmp_path / "d.json").write_text(json.dumps(meta_b))
    assert cli_main(["probe", "--merge", str(tmp_path / "a.json"), str(tmp_path / "d.json"), "--json", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "same names but other contents" in err and err.count("\n") == 1 and not bad.exists()


def test_plot_marks_receptive_fields_and_labels_distance_zero() -> None:
    """The dotted R line is promised only when one is drawn; an unbounded model says so in the
    legend; the bin at distance 0 (drawn at 1/2 on the log axis) has its tick labelled 0."""
    import matplotlib.pyplot as plt

    from recurformer.probe.results import BinStat, ProbeResult, figure

    bins = [
        BinStat(0, 1, 0.5, 0.4, 0.6, 10, 10),
        BinStat(1, 2, 0.3, 0.2, 0.4, 10, 10),
        BinStat(16, 64, 0.1, 0.0, 0.2, 10, 10),
    ]
    facts = {"step": None, "tokens_seen": None, "val_loss": None, "train_tok_per_s": None}
    unbounded = ProbeResult("ma", "", "memory_attention", None, metrics={"copy_gain": bins}, **facts)
    bounded = ProbeResult("sw", "", "sliding_window", 31, metrics={"copy_gain": bins}, **facts)
    ax = figure([unbounded], "t").axes[0]
    assert "dotted" not in ax.get_xlabel() and "ma (R unbounded)" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert ax.get_xticks()[0] == 0.5 and ax.get_xticklabels()[0].get_text() == "0"
    plt.close("all")
    ax = figure([unbounded, bounded], "t").axes[0]
    assert "dotted: receptive field R" in ax.get_xlabel() and "sw (R = 31)" in [
        t.get_text() for t in ax.get_legend().get_texts()
    ]
    assert any(list(line.get_xdata()) == [31, 31] and line.get_linestyle() == ":" for line in ax.lines)
    plt.close("all")


def test_split_copy_document_finds_the_last_marker_as_a_scan_does() -> None:
    """The vectorized marker search against a plain scan from the end, on random documents with
    0-3 planted markers (overlapping ones included) and copies that match or not."""

    def by_scan(doc: np.ndarray, marker: np.ndarray, tail: int):  # type: ignore[no-untyped-def]
        m, body = len(marker), doc[1 : len(doc) - tail]
        hits = [i for i in range(len(body) - m, -1, -1) if np.array_equal(body[i : i + m], marker)]
        if not hits or (n := len(body) - hits[0] - m) == 0 or hits[0] < n or not np.array_equal(body[:n], body[-n:]):
            return None
        return doc[:1], body[:n], body[n : hits[0]], marker, body[-n:], doc[len(doc) - tail :]

    rng = np.random.default_rng(0)
    found = 0
    for _ in range(400):
        marker = rng.integers(5, 8, size=int(rng.integers(1, 4)))
        s1 = rng.integers(5, 9, size=int(rng.integers(0, 6)))
        pieces = [[0], s1]
        for _ in range(int(rng.integers(0, 4))):
            pieces += [rng.integers(5, 9, size=int(rng.integers(0, 3))), marker]
        pieces += [s1 if rng.random() < 0.7 else rng.integers(5, 9, size=len(s1)), [1] * int(rng.integers(0, 2))]
        doc = np.concatenate(pieces).astype(np.int64)
        tail = int(doc[-1] == 1)
        want, got = by_scan(doc, marker, tail), split_copy_document(doc, marker, tail)
        assert (want is None) == (got is None)
        if want is not None:
            found += 1
            assert all(np.array_equal(w, g) for w, g in zip(want, got))
    assert found > 50


def test_a_probe_result_prints_as_tables_that_say_how_to_read_them() -> None:
    """``print(probe(...))`` shows one table per metric (not the dataclass fields), each under a
    line saying what a good value looks like."""
    from recurformer.probe.results import READING, BinStat, ProbeResult, markdown_tables

    bins = [BinStat(1, 2, 0.3, 0.2, 0.4, 10, 10), BinStat(16, 64, 0.1, 0.0, 0.2, 10, 10)]
    facts = {"step": None, "tokens_seen": None, "val_loss": None, "train_tok_per_s": None}
    result = ProbeResult("ma", "", "memory_attention", None, metrics={"copy_gain": bins, "swap_delta": bins}, **facts)
    text = str(result)
    assert text == markdown_tables([result]) == result._repr_markdown_()
    assert "BinStat" not in text and "| ma | ∞ | – | – | +0.300 [+0.200, +0.400] | +0.100 [+0.000, +0.200] |" in text
    assert f"({READING['copy_gain']})" in text and f"({READING['swap_delta']})" in text


def test_probe_options_are_checked_where_they_are_built() -> None:
    from recurformer.config import RecurformerError
    from recurformer.probe.command import ProbeCommandOptions
    from recurformer.probe.options import ProbeOptions

    with pytest.raises(RecurformerError, match=r"^unknown probe task 'nope'; valid tasks: repeat, swap$"):
        ProbeOptions(task="nope")
    with pytest.raises(RecurformerError, match=r"^warm must be \(min, max\) with min <= max, got \(5, 2\)$"):
        ProbeCommandOptions(warm=(5, 2))
