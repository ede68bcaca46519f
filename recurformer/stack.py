"""The layer contract and what a stack of layers answers from it: the layer protocol (``Layer``:
its state, reset, period and reach) and ``Stack``, the part of a model (``nn.StreamingLM``) that
reads its layers alone: whether a state fits them (``check_state``, ``state_from_flat``), where a
row can be reset (``reset_boundary``), how far back a logit reads (``receptive_start``,
``max_context``) and the lines ``recurformer info`` prints of them."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor, nn

from .compat import upgrade_state
from .config import RecurformerError
from .state import Call, LayerState, State

__all__ = ["Layer", "Stack"]


class Layer(nn.Module):
    """One layer of a stack. ``forward(h, state, call) -> (h, state)`` reads and returns its own
    ``LayerState``; ``init_state`` makes a fresh one (zeros; a learned initial state is put in by
    ``reset``); ``reset(state, fresh)`` restores the initial state in the rows marked fresh; a row
    can be reset only when the position is a multiple of ``period`` (the chunk, segment or block
    length, called ``unit``); ``reach(q)`` is the earliest position the output at position q reads
    directly (None: the whole document, through a cache or a recurrent state).

    A layer class overrides the read-only properties below with class attributes or properties."""

    @property
    def kind(self) -> str:
        """The registered kind ('memory', 'xl', ...; see ``registry.register_layer``)."""
        return "layer"

    @property
    def period(self) -> int:
        """Rows reset only at multiples of this many tokens (the chunk, segment or block length)."""
        return 1

    @property
    def unit(self) -> str:
        """What ``period`` tokens are called ('chunk', 'segment', 'block')."""
        return "token"

    @property
    def bounded(self) -> bool:
        """The state stays the same size at any length."""
        return True

    @property
    def shift_invariant(self) -> bool:
        """The output and the new state stay the same when the position and every document start
        move by a multiple of ``period`` (positions are read only relative to a document start or
        within a chunk; absolute RoPE positions are not): one captured step then serves every
        aligned position (``capture.py``)."""
        return False

    @property
    def state_cls(self) -> type[LayerState]:
        return LayerState

    def init_extra(self, std: float) -> None:
        """The layer's own initialisation, after the model's normal(0, std) of every weight."""

    def init_state(self, batch_size: int, device: torch.device | str | None, dtype: torch.dtype) -> LayerState:
        raise NotImplementedError

    def forward(self, x: Tensor, state: Any, call: Call) -> tuple[Tensor, Any]:
        raise NotImplementedError

    def reset(self, state: Any, fresh: Tensor) -> Any:
        return state  # a KV cache needs nothing: ``call.start`` masks the old document

    def reach(self, q: int) -> int | None:
        return None

    def describe(self) -> str:
        return self.kind

    def check_state(self, state: LayerState, pos: int) -> str | None:
        """None if ``state`` fits this layer after ``pos`` tokens, else what is wrong."""
        if type(state) is not self.state_cls:
            return f"holds a {type(state).__name__}, expected a {self.state_cls.__name__}"
        for name, shape in self.state_shapes().items():
            if name in state.runtime:
                continue
            a = getattr(state, name)
            if (a is None) != (shape is None):
                return f"'{name}' is {'missing' if a is None else 'unexpected'}"
            if a is None or shape is None:
                continue
            want = list(shape)
            want[0] = a.shape[0]
            if name in state.cache and a.dim() == len(want):
                want[state.cache[name]] = a.shape[state.cache[name]]
            if name in state.partial:
                want[state.partial[name]] += pos % self.period
            if list(a.shape) != want:
                return f"'{name}' has shape {tuple(a.shape)}, expected {tuple(want)}"
        return None

    def state_shapes(self) -> dict[str, tuple[int, ...] | None]:
        """The shapes of a fresh state of batch 1 (made once, on the meta device)."""
        if "_state_shapes" not in self.__dict__:
            ref = self.init_state(1, "meta", torch.float32)
            self.__dict__["_state_shapes"] = {
                f.name: None if (v := getattr(ref, f.name)) is None else tuple(v.shape) for f in dataclasses.fields(ref)
            }
        return self.__dict__["_state_shapes"]


class Stack:
    """What a model reads of its stack of ``layers`` alone (a mixin of ``nn.StreamingLM``)."""

    layers: list[Layer]

    def check_state(self, state: State, batch_size: int) -> State:
        """Exact: the state's type, batch size, layer count and every layer state's shapes."""
        where = f"state does not fit this {type(self).__name__}"
        if not isinstance(state, State):
            raise RecurformerError(f"{where}: it is a {type(state).__name__}, not a recurformer State")
        if state.batch_size != batch_size:
            raise RecurformerError(f"state has batch size {state.batch_size}, tokens have {batch_size}")
        if len(state.layers) != len(self.layers):
            raise RecurformerError(f"{where}: it has {len(state.layers)} layers, the model {len(self.layers)}")
        for i, (layer, s) in enumerate(zip(self.layers, state.layers)):
            if (why := layer.check_state(s, state.pos)) is not None:
                raise RecurformerError(f"{where}: layer {i} ({layer.kind}) {why}")
        return state

    def state_from_flat(self, flat: dict[str, Tensor]) -> State:
        """The inverse of ``State.to_flat`` (states saved before the layer contract are converted)."""
        if "layers.n" not in flat:
            flat = upgrade_state(self, flat)
        try:
            n = int(flat["layers.n"])
            layers = [layer.state_cls.from_flat(flat, f"layers.{i}.") for i, layer in enumerate(self.layers[:n])]
            state = State(fresh=flat["fresh"], start=flat["start"], pos=int(flat["pos"]), layers=layers)
        except KeyError as e:
            raise RecurformerError(f"saved state is not a recurformer State: missing '{e.args[0]}'") from None
        return self.check_state(state, state.batch_size)

    @property
    def bounded_state(self) -> bool:
        """Whether the state stays the same size at any length (False for a full KV cache)."""
        return all(layer.bounded for layer in self.layers)

    @property
    def reset_boundary(self) -> int:
        """A row's state can be reset only after a multiple of this many tokens: the least common
        multiple of the layers' periods (1 for token-wise layers)."""
        return math.lcm(*(layer.period for layer in self.layers))

    def receptive_start(self, p: int) -> int:
        """Earliest position of a document whose token can change the logits at position p: each
        layer, from the last, maps a position to the earliest one it reads directly."""
        q = p
        for layer in reversed(self.layers):
            r = layer.reach(q)
            if r is None:
                return 0
            q = r
        return max(q, 0)

    def max_context(self) -> int | None:
        """The receptive field of a logit far from the document start (None: unbounded, through a
        cache or a recurrent state)."""
        big, P = 1 << 40, self.reset_boundary
        reach = [layer.reach(big + i) for layer in self.layers for i in range(P)]
        if None in reach:
            return None
        far = len(self.layers) * P + sum(big + P - r for r in reach if r is not None)
        return max(p - self.receptive_start(p) + 1 for p in range(far, far + P))

    def info_lines(self) -> list[str]:
        """The stack and its receptive field for ``recurformer info`` (models add their facts)."""
        stack = ", ".join(f"{i}:{layer.describe()}" for i, layer in enumerate(self.layers))
        ctx = self.max_context()
        where = [i for i, layer in enumerate(self.layers) if layer.reach(1 << 40) is None]
        field_ = (
            f"up to {ctx:,} tokens" if ctx is not None else f"unbounded (cache or recurrent state in layers {where})"
        )
        return [f"layers: {stack}", f"receptive field of a logit: {field_}"]
