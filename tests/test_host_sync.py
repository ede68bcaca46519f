"""No device->host synchronisation in the training step: the loss (and with it tokens/s and MFU)
is read once per log interval, and before a checkpoint.

A CPU run cannot see a CUDA sync, so ``HostReads`` emulates ``torch.cuda.set_sync_debug_mode``:
under a ``TorchFunctionMode`` it records every call that makes the host wait for a device value
(``item``, ``tolist``, ``bool``/``float``/``int``/``index`` of a tensor, ``cpu``, ``numpy``,
formatting, and the data-dependent shapes of ``nonzero``/``masked_select``/``unique``/
``repeat_interleave``) when the tensor lives on the device. Which tensors would live on the
device is tracked by provenance: the model's parameters and everything computed from them are
device tensors; host tensors are the data pipeline's batches, tensors made by a factory without a
``device`` (PyTorch's default device is the CPU: e.g. AdamW's step counters) and what is computed
from host tensors alone; ``.to(device)`` makes a device tensor.
"""

from __future__ import annotations

import dataclasses
import traceback
import weakref
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from helpers import TEST_CONFIGS, run_config
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from recurformer import build_model
from recurformer.models import REGISTRY
from recurformer.training.config import RunConfig

# every registered model as the trainer's fixture runs it: its chunk, segment, block or window 8,
from recurformer.training.trainer import Trainer

# so the fixture's train.seq_len (32) is a whole number of them
MODELS: dict[str, dict[str, Any]] = {
    "memory_attention": {"chunk_size": 8},
    "transformer_xl": {"segment_len": 8},
    "block_recurrent": {"block_size": 8, "recurrent_layers": [1]},
    "recurrent_transformer": {"block_size": 8},
    "rmt": {"segment_len": 8, "memory_size": 2},
    "gated_deltanet": {"chunk_size": 8},
    "llama": {},
    "sliding_window": {"window": 8},
}


def test_every_model_is_watched() -> None:
    assert set(MODELS) == set(REGISTRY)


def with_model(cfg: RunConfig, name: str) -> RunConfig:
    """The fixture's run with model ``name`` (dim 32, 2 layers, 2 heads) in place of its own."""
    return dataclasses.replace(cfg, model={"name": name, "dim": 32, "n_layers": 2, "n_heads": 2, **MODELS[name]})


READS = {
    "item",
    "tolist",
    "cpu",
    "numpy",
    "__array__",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "__format__",
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
    "unique_consecutive",
    "repeat_interleave",
}


class HostReads(TorchFunctionMode):
    """Records ``(operation, where)`` for each host read of a device tensor (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.host: dict[int, weakref.ref] = {}
        self.reads: list[tuple[str, str]] = []
        self.also_host: Callable[[torch.Tensor], bool] = lambda t: False

    def mark_host(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self.host[id(t)] = weakref.ref(t)

    def is_host(self, t: torch.Tensor) -> bool:
        r = self.host.get(id(t))
        return (r is not None and r() is t) or self.also_host(t)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if name in READS and tensors and not self.is_host(tensors[0]):
            self.reads.append((name, where()))
        out = func(*args, **kwargs)
        moved = "device" in kwargs or (name == "to" and any(isinstance(a, (torch.device, str)) for a in args[1:]))
        results = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if moved:  # onto the device (on the CPU .to() may return its input: that one is now a device tensor too)
            for t in results:
                self.host.pop(id(t), None)
        elif all(self.is_host(t) for t in tensors):
            self.mark_host(*results)
        return out


def where() -> str:
    """The calls in recurformer that led to the read, outermost first (else the innermost caller)."""
    frames = [f for f in traceback.extract_stack()[:-2] if "torch" not in Path(f.filename).parts]
    ours = [f for f in frames if "recurformer" in Path(f.filename).parts] or frames[-1:]
    return " > ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in ours)


def watched(tr: Trainer) -> HostReads:
    """A HostReads whose host tensors include every batch the trainer's streams hand out and the
    optimizer's step counters (PyTorch keeps them on the CPU for a non-fused AdamW; the fused AdamW
    the trainer uses on CUDA keeps them on the device and never reads them)."""
    mode, real = HostReads(), tr.streams.next_batch
    mode.also_host = lambda t: any(t is st.get("step") for st in tr.opt.state.values())

    def next_batch() -> Any:
        b = real()
        mode.mark_host(b.x, b.y, b.wrapped)
        return b

    tr.streams.next_batch = next_batch  # type: ignore[method-assign]
    return mode


def test_the_emulation_sees_a_read() -> None:
    w = torch.nn.Parameter(torch.ones(3))
    with HostReads() as mode:
        loss = (w * 2).sum()
        _ = torch.tensor([1.0, 2.0]).sum().item()  # a host tensor: no sync
        _ = torch.ones(2, device="cpu").sum().item()  # made on the device
        _ = loss.item(), bool(loss > 0), f"{loss:.1f}"
    assert [r[0] for r in mode.reads] == ["item", "item", "__bool__", "__format__"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_training_steps_do_not_wait_for_the_device(corpus, tmp_path, name) -> None:  # noqa: F811
    """A state carried across steps (reset every step for a KV cache that grows without bound)."""
    carry = build_model(name, {"dim": 32, "n_layers": 2, "n_heads": 2, **MODELS[name]}).bounded_state
    cfg = run_config(corpus, tmp_path, truncation=2, grad_accum=2, grad_clip=1.0, state="carry" if carry else "reset")
    tr = Trainer(with_model(cfg, name), show_progress=False)
    mode = watched(tr)
    with mode:
        losses = [tr.train_step(read=False) for _ in range(4)]
    assert mode.reads == []
    with mode:
        loss = tr.read_loss(losses[-1])
    assert len(mode.reads) == 1 and "read_loss" in mode.reads[0][1]
    assert loss == losses[-1].item()


def test_the_loop_reads_once_per_log_interval(corpus, tmp_path) -> None:  # noqa: F811
    """8 steps, logged every 4, evaluated and saved at the end: two reads of the loss, and the
    other reads are in the evaluation and the checkpoint (where the run asks for values)."""
    cfg = run_config(corpus, tmp_path, steps=8, log_every=4, eval_every=8, save_every=8)
    tr = Trainer(cfg, show_progress=False)
    mode = watched(tr)
    with mode:
        tr.run()
    asked = [
        next((f for f in ("read_loss", "evaluate", "save") if f" {f} >" in site + " >"), None) for _, site in mode.reads
    ]
    assert asked.count("read_loss") == 2
    assert None not in asked, [r for r, a in zip(mode.reads, asked) if a is None]
    assert {"evaluate", "save"} <= set(asked)  # the emulation sees these reads


@pytest.mark.parametrize("name", sorted(TEST_CONFIGS))
def test_decoding_steps_do_not_wait_for_the_device(name) -> None:
    """A prompt that ends mid-chunk (mid-segment, mid-block), then one token per call, as
    decoding reads: after the first call the state knows on the host that no row is fresh, so no
    call asks the device (the tokens are host data here; their range check reads only them)."""
    torch.manual_seed(0)
    cfg = TEST_CONFIGS[name][0]
    model = build_model(name, cfg).eval()
    tokens = torch.randint(0, cfg["vocab_size"], (2, 13))
    with torch.no_grad(), HostReads() as mode:
        mode.mark_host(tokens)
        state = model(tokens[:, :5]).state
        for t in range(5, tokens.shape[1]):
            x = tokens[:, t : t + 1]
            mode.mark_host(x)
            state = model(x, state=state).state
    assert mode.reads == []
