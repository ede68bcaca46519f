"""``prepare`` on corpora as users have them: the same documents as plain text, JSONL, Parquet and
a ``datasets`` directory prepare into identical token files; a JSONL file larger than a memory
cap is streamed under it; a missing field or column is one line and nothing is written."""

from __future__ import annotations

import importlib
import json
import random
import tracemalloc
from pathlib import Path

import pytest

from recurformer import RecurformerError
from recurformer.cli import main as cli_main
from recurformer.data import prepare, sources

prep_module = importlib.import_module("recurformer.data.prepare")  # the module, not the function

WORDS = ["the", "cat", "dog", "sat", "ran", "on", "a", "mat", "big", "red", "house", "tree", "saw", "blue", "\n"]


def corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 80))).strip() + "." for _ in range(n)]


def write_all(tmp: Path, docs: list[str]) -> dict[str, Path]:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    paths = {"text": tmp / "c.txt", "jsonl": tmp / "c.jsonl", "parquet": tmp / "c.parquet", "datasets": tmp / "c_ds"}
    paths["text"].write_text("\n<|endoftext|>\n".join(docs))
    paths["jsonl"].write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)))
    pq.write_table(pa.table({"id": list(range(len(docs))), "body": docs}), paths["parquet"], row_group_size=17)
    half = len(docs) // 2  # a DatasetDict: its splits are read in order
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"body": docs[:half]}),
            "more": datasets.Dataset.from_dict({"body": docs[half:]}),
        }
    ).save_to_disk(str(paths["datasets"]))
    return paths


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_every_format_prepares_like_plain_text(tokenizer, offline, monkeypatch) -> None:
    monkeypatch.setattr(prep_module, "BATCH_CHARS", 1 << 10)  # many encode batches
    monkeypatch.setattr(sources, "BLOCK", 1 << 9)  # text read in many blocks
    paths = write_all(offline, corpus(300))
    files = {}
    for kind, path in paths.items():
        out = offline / f"out-{kind}"
        meta = prepare(out, text_files=[str(path)], tokenizer=tokenizer, vocab_size=300, text_field="body")
        files[kind] = [(out / f).read_bytes() for f in ("train.bin", "val.bin", "tokenizer.json")]
        assert meta["train_documents"] + meta["val_documents"] >= 300
    for kind in ("jsonl", "parquet", "datasets"):
        assert files[kind] == files["text"], kind


def test_large_jsonl_streams_under_a_memory_cap(offline, monkeypatch) -> None:
    """A 2 MB JSONL file, prepared while Python's traced allocations stay under 512 KiB."""
    monkeypatch.setattr(prep_module, "BATCH_CHARS", 1 << 14)
    path = offline / "big.jsonl"
    with path.open("w") as f:
        for i, d in enumerate(corpus(12_000, seed=1)):
            f.write(json.dumps({"text": d}) + "\n")
    cap = 1 << 19
    assert path.stat().st_size > 4 * cap
    tracemalloc.start()
    try:
        meta = prepare(offline / "out", text_files=[str(path)], tokenizer="byte")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < cap, f"peak {peak:,} bytes"
    assert (
        meta["train_tokens"] + meta["val_tokens"]
        == (offline / "out" / "train.bin").stat().st_size // 2 + (offline / "out" / "val.bin").stat().st_size // 2
    )


def test_missing_field_or_column_is_one_line(offline, capsys) -> None:
    paths = write_all(offline, corpus(40))
    for kind, want in (
        ("jsonl", f"{paths['jsonl']} line 1 has no field 'text' (it has: id, body); set --text-field"),
        ("parquet", f"Parquet file {paths['parquet']} has no column 'text' (columns: id, body); set --text-field"),
        ("datasets", f"dataset {paths['datasets']} has no column 'text' (columns: body); set --text-field"),
    ):
        out = offline / f"out-{kind}"
        assert cli_main(["prepare", "--text", str(paths[kind]), "--tokenizer", "byte", "--out", str(out)]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"recurformer: error: {want}"
        assert not out.exists() and not list(offline.glob(f".out-{kind}*"))  # nothing written, not even a temporary
    bad = offline / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": 3}\nnot json\n')
    with pytest.raises(RecurformerError, match=r"bad.jsonl line 2: field 'text' is a int, not text"):
        list(sources.documents(bad))
