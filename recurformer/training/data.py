"""The parts a trainer is built from before its first step: its prepared data (``run_data``), the
streams over it (``train_streams``, ``val_streams``) and the checks of its model against the run
(``check_model``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..config import RecurformerError
from ..data import ContiguousStreams, DataConfig, ShuffledWindows, load_prepared
from ..nn import StreamingLM
from .config import RunConfig


@dataclass
class RunData:
    """The prepared data of a run: ``meta.json``, the memory-mapped train and validation tokens,
    the tokenizer (and its JSON, saved with every checkpoint)."""

    dir: Path
    meta: dict[str, Any]
    train_tokens: Any
    val_tokens: Any
    tokenizer: Any
    tokenizer_json: str

    @property
    def key(self) -> str | None:
        """What the data was made from (``DataConfig.source_key``), as ``prepare`` recorded it."""
        return self.meta.get("source_key")


def run_data(data: DataConfig, resumed: dict[str, Any] | None, rank: int, world: int) -> RunData:
    """The run's data, prepared on first use (rank 0; the other ranks wait), then memory-mapped.
    It must be what the run expects: for a resumed run, the data it started with (text files
    deleted after they were prepared into an explicit data.dir cannot be checked), else the
    configured source; a ``data.dir`` alone must hold prepared data."""
    data_dir = data.resolved_dir()
    if resumed is not None:
        expected_key = resumed["train_json"].get("data_key")
    else:
        expected_key = data.source_key() if all(Path(f).is_file() for f in data.text_files) else None
    if (data_dir / "meta.json").is_file():
        found_key = json.loads((data_dir / "meta.json").read_text()).get("source_key")
        if expected_key and found_key and found_key != expected_key:
            what = (
                "the data this run started with" if resumed is not None else "the configured data source and tokenizer"
            )
            fix = (
                "point data.dir at the data this run started with"
                if resumed is not None
                else "to train on what it holds, leave out data.dataset and data.text_files (data.dir alone); "
                "to prepare the configured source, point data.dir at another directory"
            )
            raise RecurformerError(
                f"prepared data {data_dir} was made from other data than {what} (source key {found_key[:12]}, "
                f"expected {expected_key[:12]}); {fix}"
            )
    else:
        if not data.dataset and not data.text_files:
            raise RecurformerError(
                f"data.dir {data_dir} holds no prepared data (no meta.json): prepare it first "
                f"(recurformer prepare --text FILE --out {data_dir}), or name the source to prepare there "
                "(data.text_files or data.dataset)"
            )
        if rank == 0:
            data.prepare(data_dir)
        if world > 1:
            dist.barrier()
    meta, train_tokens, val_tokens, tokenizer = load_prepared(data_dir)
    return RunData(data_dir, meta, train_tokens, val_tokens, tokenizer, (data_dir / "tokenizer.json").read_text())


def check_model(model: StreamingLM, cfg: RunConfig, vocab_size: int) -> None:
    """One line, before any step, where the model does not fit the run: a vocabulary smaller than
    the data's, a segment length that is not a multiple of its chunk, or a carried state that
    grows without bound."""
    t = cfg.train
    if model.config.vocab_size < vocab_size:
        raise RecurformerError(f"model.vocab_size {model.config.vocab_size} < the data's vocabulary {vocab_size}")
    if t.seq_len % model.reset_boundary:
        boundary, key = model.reset_boundary, model.config.context_field
        fix = (
            f"set model.{key} to a divisor of {t.seq_len} or "
            if getattr(model.config, key or "", None) == boundary
            else ""
        )
        raise RecurformerError(
            f"train.seq_len ({t.seq_len}) must be a multiple of the model's chunk/segment/block length ({boundary}): "
            f"{fix}train.seq_len to a multiple of {boundary}"
        )
    if t.state == "carry" and not model.bounded_state:
        raise RecurformerError(
            f"{cfg.model['name']} carries a KV cache that grows without bound; train it with train.state=reset"
        )


def train_streams(
    data: RunData, order: str, batch_size: int, seq_len: int, seed: int, rank: int, world: int, boundary: int
) -> Any:
    """B streams of ``seq_len``-token segments over the training split: ``contiguous`` (row b of a
    segment continues row b of the one before; a stream that wraps starts at a document) or
    ``shuffled`` windows (``seed``); segments a multiple of the model's ``boundary``."""
    if order == "contiguous":
        return ContiguousStreams(
            data.train_tokens,
            batch_size,
            seq_len,
            rank=rank,
            world_size=world,
            bos_id=data.meta["bos_id"],
            seq_multiple=boundary,
            split="training",
        )
    return ShuffledWindows(data.train_tokens, batch_size, seq_len, rank=rank, world_size=world, seed=seed)


def val_streams(data: RunData, batch_size: int, seq_len: int, rank: int, world: int, boundary: int) -> Any:
    """B fresh streams over the validation split."""
    return ContiguousStreams(
        data.val_tokens,
        batch_size,
        seq_len,
        rank=rank,
        world_size=world,
        seq_multiple=boundary,
        split="validation",
    )
