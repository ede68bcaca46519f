"""Data layer: stream continuity and resume, tokenizers, prepare/load_prepared and their errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from recurformer.config import RecurformerError
from recurformer.data import ContiguousStreams, ShuffledWindows, Tokenizer, eval_windows, load_prepared, prepare
from recurformer.data.prepare import REPEAT_PROMPT, bundled_corpus
from recurformer.data.tokenizer import pieces

# ---------------------------------------------------------------- streams


def _rows_over(streams: ContiguousStreams, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batches = [streams.next_batch() for _ in range(k)]
    x = torch.cat([b.x for b in batches], dim=1)
    y = torch.cat([b.y for b in batches], dim=1)
    return x, y, torch.stack([b.wrapped for b in batches])


def test_contiguous_rows_continue_exactly_and_wrap() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    B, T = 3, 7
    s = ContiguousStreams(tokens, B, T)
    region = 1000 // B  # 333 tokens -> (333 - 1) // 7 = 47 windows per pass
    per_pass = (region - 1) // T
    x, y, wrapped = _rows_over(s, per_pass + 5)
    for b in range(B):
        start = b * region
        first_pass = torch.from_numpy(tokens[start : start + per_pass * T].astype(np.int64))
        assert torch.equal(x[b, : per_pass * T], first_pass)
        assert torch.equal(x[b, per_pass * T :], first_pass[: 5 * T])  # restarted at the region start
        assert torch.equal(y[b, : per_pass * T - 1], x[b, 1 : per_pass * T])
    expected = torch.zeros(per_pass + 5, B, dtype=torch.bool)
    expected[per_pass] = True
    assert torch.equal(wrapped, expected)


def test_contiguous_wrap_per_row_with_bos_alignment() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, 50, size=2000).astype(np.uint16)
    tokens[rng.choice(2000, size=40, replace=False)] = 0  # BOS
    s = ContiguousStreams(tokens, 4, 5, bos_id=0)
    assert all(tokens[st] == 0 for st in s.region_start[1:])
    assert s.region_len.sum() == len(tokens)
    k = int(s.windows_per_pass.max()) + 3
    x, _, wrapped = _rows_over(s, k)
    for b in range(4):
        n = int(s.windows_per_pass[b])
        start = int(s.region_start[b])
        assert torch.equal(x[b, : n * 5], torch.from_numpy(tokens[start : start + n * 5].astype(np.int64)))
        assert torch.equal(torch.nonzero(wrapped[:, b]).flatten(), torch.tensor([n]))  # exactly this row, this batch
        assert torch.equal(x[b, n * 5 : (n + 1) * 5], torch.from_numpy(tokens[start : start + 5].astype(np.int64)))


def test_rank_split_equals_single_rank_rows() -> None:
    tokens = np.arange(5000, dtype=np.uint32)
    whole = ContiguousStreams(tokens, 4, 9)
    ranks = [ContiguousStreams(tokens, 2, 9, rank=r, world_size=2) for r in range(2)]
    for _ in range(30):
        full = whole.next_batch()
        parts = [r.next_batch() for r in ranks]
        assert torch.equal(full.x, torch.cat([p.x for p in parts]))
        assert torch.equal(full.y, torch.cat([p.y for p in parts]))
        assert torch.equal(full.wrapped, torch.cat([p.wrapped for p in parts]))


@pytest.mark.parametrize("kind", ["contiguous", "shuffled"])
def test_state_dict_resume_is_exact(kind: str) -> None:
    tokens = np.arange(3000, dtype=np.uint16)
    make = (
        (lambda: ContiguousStreams(tokens, 3, 8))
        if kind == "contiguous"
        else (lambda: ShuffledWindows(tokens, 3, 8, seed=5))
    )
    a = make()
    for _ in range(130):  # past a wrap for the contiguous streams
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))
    b = make()
    b.load_state_dict(state)
    for _ in range(10):
        ba, bb = a.next_batch(), b.next_batch()
        assert torch.equal(ba.x, bb.x) and torch.equal(ba.y, bb.y) and torch.equal(ba.wrapped, bb.wrapped)


def test_state_dict_mismatch_and_too_small() -> None:
    tokens = np.arange(3000, dtype=np.uint16)
    state = ContiguousStreams(tokens, 3, 8).state_dict()
    with pytest.raises(RecurformerError, match="batch_size"):
        ContiguousStreams(tokens, 4, 8).load_state_dict(state)
    with pytest.raises(RecurformerError, match="num_tokens"):
        ContiguousStreams(tokens[:2000], 3, 8).load_state_dict(state)
    with pytest.raises(RecurformerError, match="seq_len"):
        ContiguousStreams(tokens, 3, 9).load_state_dict(state)
    with pytest.raises(RecurformerError, match="too few"):
        ContiguousStreams(tokens[:100], 10, 10)


def test_shuffled_and_eval_windows() -> None:
    tokens = np.arange(10_000, dtype=np.uint16)
    r0, r1 = ShuffledWindows(tokens, 4, 16, rank=0, world_size=2), ShuffledWindows(tokens, 4, 16, rank=1, world_size=2)
    b0, b1 = r0.next_batch(), r1.next_batch()
    assert not torch.equal(b0.x, b1.x) and not bool(b0.wrapped.any())
    assert torch.equal(b0.y, b0.x + 1)  # windows are contiguous slices of arange
    w = eval_windows(tokens, 64, 5, seed=3)
    assert w.shape == (5, 65) and w.dtype == torch.long
    assert torch.equal(w, eval_windows(tokens, 64, 5, seed=3))
    assert torch.equal(w[:, 1:] - w[:, :-1], torch.ones(5, 64, dtype=torch.long))
    with pytest.raises(RecurformerError):
        eval_windows(tokens[:10], 64, 5)


# ---------------------------------------------------------------- tokenizers

TEXTS = ["hello world, this is a test.", "Über naïve café — «quotes» 日本語 🙂", "once upon a time\nthere was a cat."]


def test_byte_tokenizer_round_trip(tmp_path: Path) -> None:
    tok = Tokenizer.byte()
    for t in TEXTS:
        assert tok.decode(tok.encode(t)) == t
    assert tok.decode([tok.bos_id, *tok.encode("ab"), tok.eos_id]) == "ab"
    tok.save(tmp_path)
    assert Tokenizer.load(tmp_path).encode_batch(TEXTS) == tok.encode_batch(TEXTS)


def test_bpe_round_trip_save_load_and_determinism(tmp_path: Path) -> None:
    corpus = bundled_corpus("tinystories_val")[:300]
    a, b = Tokenizer.train_bpe(corpus, 600), Tokenizer.train_bpe(corpus, 600)
    assert a.vocab_size == 600 and (a.bos_id, a.eos_id) == (0, 1)
    for t in TEXTS:
        assert a.decode(a.encode(t)) == t
    assert a.encode_batch(corpus[:50]) == b.encode_batch(corpus[:50])
    a.save(tmp_path / "a")
    b.save(tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert Tokenizer.load(tmp_path / "a").encode_batch(TEXTS) == a.encode_batch(TEXTS)


def test_long_text_pieces_encode_like_whole_text() -> None:
    text = bundled_corpus("warpeace")[0][:300_000]
    tok = Tokenizer.train_bpe([text[:50_000]], 500)
    parts = pieces(text, 10_000)
    assert len(parts) > 20 and "".join(parts) == text
    assert tok.encode(text) == tok._hf.encode(text, add_special_tokens=False).ids


def test_tokenizer_missing_or_corrupt(tmp_path: Path) -> None:
    with pytest.raises(RecurformerError, match="cannot read tokenizer"):
        Tokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": 3')
    with pytest.raises(RecurformerError, match="tokenizer") as e:
        Tokenizer.load(tmp_path)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- prepare


def _small_corpus(tmp_path: Path) -> list[str]:
    one = tmp_path / "one.txt"
    one.write_text("\n".join(f"line {i} of a long single document." for i in range(400)))
    many = tmp_path / "many.txt"
    many.write_text("<|endoftext|>".join(f"story {i}: the cat sat on the mat {i % 7} times." for i in range(200)))
    return [str(one), str(many)]


def test_prepare_text_files_byte_and_bpe(tmp_path: Path) -> None:
    files = _small_corpus(tmp_path)
    meta = prepare(tmp_path / "byte", text_files=files, tokenizer="byte", val_fraction=0.1)
    m, train, val, tok = load_prepared(tmp_path / "byte")
    assert m == meta and meta["dtype"] == "uint16" and tok.kind == "byte"
    assert (len(train), len(val)) == (meta["train_tokens"], meta["val_tokens"])
    assert int((train == tok.bos_id).sum()) == meta["train_documents"]
    assert train[0] == tok.bos_id and val[0] == tok.bos_id
    assert tok.decode(train[: meta["train_tokens"]]).startswith("line 0 of a long")
    assert tok.decode(val).rstrip().endswith("story 199: the cat sat on the mat 3 times.")
    assert meta["train_documents"] + meta["val_documents"] == 1 + 200 + 1  # the document at the cut is split in two

    meta = prepare(tmp_path / "bpe", text_files=files, tokenizer="bpe", vocab_size=300, val_fraction=0.1)
    _, train, val, tok = load_prepared(tmp_path / "bpe")
    assert tok.vocab_size == 300 and meta["tokenizer"] == "bpe"
    assert int((train == tok.bos_id).sum()) == meta["train_documents"]


@pytest.mark.slow
def test_prepare_uint32_for_big_vocab(tmp_path: Path) -> None:
    files = _small_corpus(tmp_path)
    corpus = [f"w{i} " * 3 for i in range(70_000)]  # enough distinct words for a > 65535 vocab
    (tmp_path / "big.txt").write_text(" ".join(corpus))
    meta = prepare(tmp_path / "p", text_files=[*files, str(tmp_path / "big.txt")], vocab_size=66_000)
    _, train, _, tok = load_prepared(tmp_path / "p")
    assert tok.vocab_size > 65535 and meta["dtype"] == "uint32" and train.dtype == np.uint32


@pytest.mark.slow
def test_prepare_tinystories_sample_and_repeat(tmp_path: Path) -> None:
    meta = prepare(tmp_path / "ts", dataset="tinystories-sample", vocab_size=1024)
    _, train, val, tok = load_prepared(tmp_path / "ts")
    assert meta["train_documents"] > 4000 and meta["val_documents"] == 1000
    assert int((np.asarray(val) == tok.bos_id).sum()) == 1000
    assert (tmp_path / "ts" / "train.bin").stat().st_size == 2 * meta["train_tokens"]

    meta = prepare(tmp_path / "rep", dataset="tinystories-repeat", tokenizer="byte")
    _, _, val, tok = load_prepared(tmp_path / "rep")
    bos = np.flatnonzero(np.asarray(val) == tok.bos_id)
    assert len(bos) == meta["val_documents"] == 1000 and meta["append_eos"]
    doc = np.asarray(val[bos[0] : bos[1]])
    assert doc[-1] == tok.eos_id
    story, copy = tok.decode(doc).split(f"\n{REPEAT_PROMPT}\n")
    assert story == copy and len(story) > 100


def test_prepare_bad_inputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RecurformerError, match="did you mean 'tinystories-sample'") as e:
        prepare(tmp_path / "x", dataset="tinystories-smaple")
    assert "\n" not in str(e.value)
    with pytest.raises(RecurformerError, match="does not exist"):
        prepare(tmp_path / "x", text_files=[str(tmp_path / "nope.txt")])
    with pytest.raises(RecurformerError, match="exactly one"):
        prepare(tmp_path / "x")
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(RecurformerError, match="needs the `datasets` package"):
        prepare(tmp_path / "x", dataset="tinystories")
    assert not (tmp_path / "x").exists()


def test_load_prepared_errors(tmp_path: Path) -> None:
    with pytest.raises(RecurformerError, match="does not exist"):
        load_prepared(tmp_path / "missing")
    prepare(tmp_path / "p", text_files=_small_corpus(tmp_path), tokenizer="byte")
    with (tmp_path / "p" / "train.bin").open("ab") as f:
        f.write(b"\0\0")
    with pytest.raises(RecurformerError, match="train.bin has .* bytes but meta.json says") as e:
        load_prepared(tmp_path / "p")
    assert "\n" not in str(e.value)
    (tmp_path / "p" / "meta.json").write_text("{not json")
    with pytest.raises(RecurformerError, match="corrupt"):
        load_prepared(tmp_path / "p")
    (tmp_path / "p" / "val.bin").unlink()
    with pytest.raises(RecurformerError, match="missing val.bin"):
        load_prepared(tmp_path / "p")


def test_prepare_replaces_previous_dataset_but_not_other_dirs(tmp_path: Path) -> None:
    files = _small_corpus(tmp_path)
    prepare(tmp_path / "p", text_files=files, tokenizer="byte")
    prepare(tmp_path / "p", text_files=files[:1], tokenizer="byte")
    assert load_prepared(tmp_path / "p")[0]["train_documents"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many.txt", "one.txt", "p"]  # no temp dirs left
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(RecurformerError, match="refusing to overwrite"):
        prepare(tmp_path / "other", text_files=files, tokenizer="byte")
