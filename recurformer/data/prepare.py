"""Turn a corpus into a prepared dataset directory: ``train.bin``, ``val.bin``, ``tokenizer.json``, ``meta.json``.

The ``.bin`` files are raw little-endian token arrays (uint16, or uint32 for vocabularies over
65535) that ``load_prepared`` memory-maps. Each document is preceded by BOS (as in the authors'
pretokenisation), so documents are concatenated into one stream per split; the ``-repeat``
variant also ends each document with EOS, as the authors' ``tinystories_repeat`` did.
The BPE tokenizer is trained on the train split only. The directory is written to a temporary
sibling and renamed into place, so an interrupted ``prepare`` never leaves a half-written dataset;
the temporary directory is removed on failure, and one left by a killed ``prepare`` is removed by
the next. ``meta.json`` records a ``source_key`` (a hash of the dataset name or the text files'
contents, the tokenizer and the split) so that prepared data is never confused with other data.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import lzma
import os
import random
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import BinaryIO

import numpy as np

from recurformer.config import RecurformerError
from recurformer.data.sources import EOT, documents, kind_of
from recurformer.data.tokenizer import FILENAME as TOKENIZER_FILE
from recurformer.data.tokenizer import Tokenizer
from recurformer.files import atomic_dir, check_writable
from recurformer.progress import Progress

DATASETS = ("tinystories-sample", "tinystories-repeat", "tinystories-cased", "warpeace", "books", "tinystories")
TOKENIZERS = ("bpe", "byte")
REPEAT_PROMPT = "Repeat above."
BPE_TRAIN_MAX_DOCS = 100_000  # larger train splits train the BPE on a seeded random sample of documents
FILES = ("train.bin", "val.bin", TOKENIZER_FILE, "meta.json")


def _log(msg: str) -> None:
    print(f"[prepare] {msg}", flush=True)


def _split_docs(text: str) -> list[str]:
    return [d.strip() for d in text.split(EOT) if d.strip()]


def bundled_corpus(name: str) -> list[str]:
    """Documents of a bundled ``recurformer/data/corpora/<name>.txt.xz`` file."""
    blob = resources.files("recurformer.data").joinpath("corpora").joinpath(f"{name}.txt.xz")
    try:
        return _split_docs(lzma.decompress(blob.read_bytes()).decode("utf-8"))
    except (OSError, lzma.LZMAError) as e:
        raise RecurformerError(f"bundled corpus {name}.txt.xz is missing or corrupt: {e}") from None


def split_contiguous(docs: Sequence[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """The last ``val_fraction`` of the characters is val; the document at the cut is split at a line break."""
    total = sum(len(d) for d in docs)
    cut = total * (1.0 - val_fraction)
    train: list[str] = []
    val: list[str] = []
    seen = 0
    for doc in docs:
        if seen + len(doc) <= cut:
            train.append(doc)
        elif seen >= cut:
            val.append(doc)
        else:
            local = int(cut - seen)
            at = doc.rfind("\n", 0, local)
            at = at if at > 0 else local
            train.append(doc[:at].strip())
            val.append(doc[at:].strip())
        seen += len(doc)
    return [d for d in train if d], [d for d in val if d]


def read_text_file(path: str | Path) -> str:
    """A UTF-8 text file (BOM dropped, CRLF -> LF), or a one-line error naming it."""
    p = Path(path)
    if not p.is_file():
        raise RecurformerError(f"text file {p} does not exist")
    try:
        return p.read_text(encoding="utf-8-sig").replace("\r\n", "\n")
    except UnicodeDecodeError as e:
        raise RecurformerError(f"text file {p} is not UTF-8 (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise RecurformerError(f"cannot read text file {p}: {e.strerror or e}") from None


def source_key(
    dataset: str | None,
    text_files: Sequence[str | Path] | None,
    tokenizer: str,
    vocab_size: int,
    val_fraction: float = 0.05,
    seed: int = 0,
    text_field: str = "text",
) -> str:
    """A hex digest of everything a prepared directory is made of: the dataset name or the input
    files' contents (in order; every file of a datasets directory), the tokenizer kind and
    vocabulary size, the split settings and the text field."""
    h = hashlib.sha256()
    settings = {
        "dataset": dataset,
        "tokenizer": tokenizer,
        "vocab_size": vocab_size if tokenizer == "bpe" else None,
        "val_fraction": val_fraction,
        "seed": seed,
    }
    if text_field != "text":  # (the default is left out: keys of earlier preparations stay valid)
        settings["text_field"] = text_field
    h.update(json.dumps(settings, sort_keys=True).encode())
    for f in text_files or []:
        p = Path(f)
        if not p.exists():
            raise RecurformerError(f"text file {p} does not exist")
        for part in sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]:  # a datasets directory
            if p.is_dir():
                h.update(str(part.relative_to(p)).encode())
            digest = hashlib.sha256()
            with part.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 16), b""):  # hashlib.file_digest needs Python 3.11
                    digest.update(block)
            h.update(digest.digest())
    return h.hexdigest()


def _read_text_files(paths: Sequence[str | Path]) -> list[str]:
    docs: list[str] = []
    for p in paths:
        docs.extend(_split_docs(read_text_file(p)))
    if not docs:
        raise RecurformerError(f"text files {', '.join(map(str, paths))} contain no text")
    return docs


def _hub_tinystories() -> tuple[list[str], list[str]]:
    try:
        import datasets
    except ImportError:
        raise RecurformerError(
            "dataset 'tinystories' needs the `datasets` package (pip install 'recurformer[hub]'); "
            "use 'tinystories-sample' for the bundled offline sample"
        ) from None
    try:
        ds = datasets.load_dataset("roneneldan/TinyStories")
    except Exception as e:  # network/hub errors come in many types
        msg = f"{type(e).__name__}: {e}".splitlines()[0]
        raise RecurformerError(
            f"could not load roneneldan/TinyStories from the Hugging Face hub (no network?): {msg}"
        ) from None
    return [t.strip() for t in ds["train"]["text"] if t.strip()], [
        t.strip() for t in ds["validation"]["text"] if t.strip()
    ]


def _unknown_dataset(name: str) -> RecurformerError:
    close = difflib.get_close_matches(name, DATASETS, n=1, cutoff=0.5)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return RecurformerError(
        f"unknown dataset {name!r}{hint}; valid datasets: {', '.join(DATASETS)} (or pass text_files)"
    )


def load_documents(
    dataset: str | None, text_files: Sequence[str | Path] | None, val_fraction: float
) -> tuple[list[str], list[str], str]:
    """(train documents, val documents, description of the source)."""
    if dataset in ("tinystories-sample", "tinystories-repeat"):
        train, val = bundled_corpus("tinystories_train"), bundled_corpus("tinystories_val")
        if dataset == "tinystories-repeat":
            train, val = ([f"{s}\n{REPEAT_PROMPT}\n{s}" for s in docs] for docs in (train, val))
        return train, val, "bundled TinyStories sample, lower-cased (recurformer/data/corpora, CDLA-Sharing-1.0)"
    if dataset == "tinystories-cased":
        train, val = bundled_corpus("tinystories_cased_train"), bundled_corpus("tinystories_cased_val")
        return train, val, "bundled TinyStories sample in original case (recurformer/data/corpora, CDLA-Sharing-1.0)"
    if dataset == "warpeace":
        train, val = split_contiguous(bundled_corpus("warpeace"), val_fraction)
        return train, val, f"bundled War and Peace (public domain), last {val_fraction:.0%} is val"
    if dataset == "books":
        return (
            bundled_corpus("books_train"),
            bundled_corpus("books_val"),
            "bundled Project Gutenberg books (public domain), split by book",
        )
    if dataset == "tinystories":
        train, val = _hub_tinystories()
        return train, val, "Hugging Face roneneldan/TinyStories (train / validation splits)"
    if dataset is not None:
        raise _unknown_dataset(dataset)
    assert text_files is not None
    train, val = split_contiguous(_read_text_files(text_files), val_fraction)
    return (
        train,
        val,
        f"text files {', '.join(str(Path(p).resolve()) for p in text_files)}, last {val_fraction:.0%} is val",
    )


BATCH_CHARS = 1 << 20  # characters encoded at a time (bounds the encoder's memory)


def _labelled(docs: Iterable[str], total: int, val_fraction: float) -> Iterator[tuple[str, str]]:
    """``split_contiguous`` as a stream: ("train" | "val", document) given the total length."""
    cut = total * (1.0 - val_fraction)
    seen = 0
    for doc in docs:
        if seen + len(doc) <= cut:
            yield "train", doc
        elif seen >= cut:
            yield "val", doc
        else:
            local = int(cut - seen)
            at = doc.rfind("\n", 0, local)
            at = at if at > 0 else local
            for split, part in (("train", doc[:at].strip()), ("val", doc[at:].strip())):
                if part:
                    yield split, part
        seen += len(doc)


def _write_tokens(
    out: dict[str, BinaryIO],
    docs: Iterable[tuple[str, str]],
    tok: Tokenizer,
    dtype: np.dtype,
    append_eos: bool,
    total: int | None,
) -> dict[str, int]:
    """Encode each (split, document) as BOS + document [+ EOS] onto its split's file, about
    ``BATCH_CHARS`` characters at a time; returns the token count of each split."""
    counts = dict.fromkeys(out, 0)
    tail = [tok.eos_id] if append_eos else []

    def flush(group: list[tuple[str, str]]) -> None:
        for (split, _), ids in zip(group, tok.encode_batch([d for _, d in group])):
            arr = np.array([tok.bos_id, *ids, *tail], dtype=dtype)
            out[split].write(arr.tobytes())
            counts[split] += arr.size

    group: list[tuple[str, str]] = []
    size = 0
    bar = Progress(total, "encode", "doc")
    try:
        for item in docs:
            group.append(item)
            size += len(item[1])
            if size >= BATCH_CHARS:
                flush(group)
                bar.update(len(group))
                group, size = [], 0
        flush(group)
        bar.update(len(group))
    finally:
        bar.close()
    return counts


def _stream_sources(
    text_files: Sequence[str | Path], text_field: str, val_fraction: float, seed: int, bpe: bool
) -> tuple[Callable[[], Iterator[tuple[str, str]]], list[str], dict[str, int]]:
    """Input files of any kind, never held in memory: (a function that streams the labelled
    documents again, the BPE training sample, the document count of each split). The files are
    read once to measure them, once to count the splits and draw the sample, once to encode."""

    def docs() -> Iterator[str]:
        for f in text_files:
            yield from documents(f, text_field)

    total = n = 0
    for doc in Progress(None, "measure", "doc").track(docs()):  # no total: a line only every so often
        total, n = total + len(doc), n + 1
    if not n:
        raise RecurformerError(f"text files {', '.join(map(str, text_files))} contain no text")
    counts = {"train": 0, "val": 0}
    for split, _ in _labelled(Progress(n, "split", "doc").track(docs()), total, val_fraction):
        counts[split] += 1
    sample: list[str] = []
    if bpe:
        n_train = counts["train"]
        if n_train <= BPE_TRAIN_MAX_DOCS:
            sample = [d for split, d in _labelled(docs(), total, val_fraction) if split == "train"]
        else:  # the documents random.sample would pick from the list of all train documents, in its order
            pick = random.Random(seed).sample(range(n_train), BPE_TRAIN_MAX_DOCS)
            where = {i: k for k, i in enumerate(pick)}
            chosen: dict[int, str] = {}
            train = (d for split, d in _labelled(docs(), total, val_fraction) if split == "train")
            for i, d in enumerate(train):
                if i in where:
                    chosen[where[i]] = d
            sample = [chosen[k] for k in range(len(pick))]
    return lambda: _labelled(docs(), total, val_fraction), sample, counts


def _remove_stale_temporaries(out: Path) -> None:
    """Delete the temporary siblings of ``out`` left by a ``prepare`` that was killed (its
    process is gone); those of a ``prepare`` still running are left alone."""
    for d in out.parent.glob(f".{out.name}.*-*"):
        kind, _, pid = d.name[len(out.name) + 2 :].rpartition("-")
        if kind not in ("tmp", "old") or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


def prepare(
    out_dir: str | Path,
    dataset: str | None = None,
    text_files: list[str] | None = None,
    tokenizer: str = "bpe",
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    seed: int = 0,
    text_field: str = "text",
) -> dict:
    """Prepare ``dataset`` (one of ``DATASETS``) or ``text_files`` (plain text, JSONL, Parquet or
    ``datasets`` directories, streamed: see ``sources``; ``text_field`` names their text) into
    ``out_dir``; returns the meta dict."""
    out = Path(out_dir)
    if (dataset is None) == (not text_files):
        raise RecurformerError("prepare needs exactly one of dataset=... or text_files=[...]")
    if dataset is not None and dataset not in DATASETS:
        raise _unknown_dataset(dataset)
    if tokenizer not in TOKENIZERS:
        raise RecurformerError(f"unknown tokenizer {tokenizer!r}; valid tokenizers: {', '.join(TOKENIZERS)}")
    if not 0.0 < val_fraction < 1.0:
        raise RecurformerError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / "meta.json").is_file())):
        raise RecurformerError(f"{out} exists and is not a prepared dataset directory; refusing to overwrite it")
    check_writable(out, "prepared data", is_dir=True)

    _log(f"reading {dataset or f'{len(text_files or [])} input file(s)'}")
    if dataset is not None:
        train, val, source = load_documents(dataset, None, val_fraction)
        if not train or not val:
            raise RecurformerError(f"dataset {dataset} has an empty {'train' if not train else 'val'} split")
        stream: Callable[[], Iterable[tuple[str, str]]] = lambda: [
            *(("train", d) for d in train),
            *(("val", d) for d in val),
        ]  # noqa: E731
        sample, n_docs = train, {"train": len(train), "val": len(val)}
        if len(sample) > BPE_TRAIN_MAX_DOCS:
            sample = random.Random(seed).sample(train, BPE_TRAIN_MAX_DOCS)
    else:
        assert text_files is not None
        stream, sample, n_docs = _stream_sources(text_files, text_field, val_fraction, seed, tokenizer == "bpe")
        if not n_docs["train"] or not n_docs["val"]:
            raise RecurformerError(f"text_files give an empty {'train' if not n_docs['train'] else 'val'} split")
        kinds = sorted({kind_of(f) for f in text_files})
        source = (
            f"{'/'.join(kinds)} files {', '.join(str(Path(p).resolve()) for p in text_files)}"
            f"{'' if kinds == ['text'] else f' (field {text_field!r})'}, last {val_fraction:.0%} is val"
        )

    if tokenizer == "byte":
        tok = Tokenizer.byte()
    else:
        _log(f"training byte-level BPE (vocab {vocab_size}) on {len(sample):,} train documents")
        tok = Tokenizer.train_bpe(sample, vocab_size)
    del sample
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 65535 else np.uint32)
    append_eos = dataset == "tinystories-repeat"

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(out)
        with atomic_dir(out, tmp, old):
            with (tmp / "train.bin").open("wb") as f_train, (tmp / "val.bin").open("wb") as f_val:
                counts = _write_tokens(
                    {"train": f_train, "val": f_val}, stream(), tok, dtype, append_eos, sum(n_docs.values())
                )
            for split in ("train", "val"):
                _log(f"{split}: {n_docs[split]:,} documents, {counts[split]:,} tokens")
            tok.save(tmp)
            meta = {
                "format_version": 1,
                "dataset": dataset or "text_files",
                "source": source,
                "source_key": source_key(dataset, text_files, tokenizer, vocab_size, val_fraction, seed, text_field),
                "tokenizer": tok.kind,
                "vocab_size": tok.vocab_size,
                "bos_id": tok.bos_id,
                "eos_id": tok.eos_id,
                "dtype": dtype.name,
                "append_eos": append_eos,
                "train_documents": n_docs["train"],
                "train_tokens": counts["train"],
                "val_documents": n_docs["val"],
                "val_tokens": counts["val"],
                "val_fraction": val_fraction,
                "seed": seed,
            }
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    except OSError as e:
        raise RecurformerError(f"cannot write prepared data {out}: {e.strerror or e}") from None
    _log(f"wrote {out}")
    return meta


def load_prepared(directory: str | Path) -> tuple[dict, np.memmap, np.memmap, Tokenizer]:
    """(meta, train tokens, val tokens, tokenizer) of a ``prepare``d directory, checking sizes against meta."""
    d = Path(directory)
    if not d.is_dir():
        raise RecurformerError(f"prepared dataset directory {d} does not exist (run prepare first)")
    for name in FILES:
        if not (d / name).is_file():
            raise RecurformerError(f"prepared dataset {d} is missing {name} (re-run prepare)")
    try:
        meta = json.loads((d / "meta.json").read_text())
        dtype = np.dtype(meta["dtype"])
        sizes = {split: int(meta[f"{split}_tokens"]) for split in ("train", "val")}
        vocab_size = int(meta["vocab_size"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise RecurformerError(f"corrupt {d / 'meta.json'}: {type(e).__name__}: {e}".splitlines()[0]) from None
    if dtype not in (np.uint16, np.uint32):
        raise RecurformerError(f"{d / 'meta.json'}: dtype must be uint16 or uint32, got {dtype.name}")
    arrays = []
    for split, n in sizes.items():
        path = d / f"{split}.bin"
        size = path.stat().st_size
        if n < 1 or size != n * dtype.itemsize:
            raise RecurformerError(
                f"{path} has {size} bytes but meta.json says {n} {dtype.name} tokens ({n * dtype.itemsize} bytes); re-run prepare"
            )
        arrays.append(np.memmap(path, dtype=dtype, mode="r"))
    tok = Tokenizer.load(d)
    if tok.vocab_size != vocab_size:
        raise RecurformerError(f"{d / TOKENIZER_FILE} has vocab size {tok.vocab_size} but meta.json says {vocab_size}")
    return meta, arrays[0], arrays[1], tok
