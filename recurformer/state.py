"""The state types of the streaming contract: one layer's state (``LayerState``), the model's
state (``State``: fresh rows, position, document starts and the list of layer states), a call's
output (``Output``) and what the layers of one call share (``Call``). They import nothing of the
model, so generation, checkpoints and the Hub code can be read and typed against them alone."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, TypeVar

import torch
from torch import Tensor, nn

from .config import RecurformerError

IGNORE_INDEX = -100  # targets with this value count in no loss
S = TypeVar("S", bound="LayerState")


@dataclass
class LayerState:
    """One layer's state: a dataclass of tensors, batch first (a field may be None where a layer
    has no such part). ``cache`` names the fields whose dimension ``dim`` holds past positions of
    any length (a KV cache); ``partial`` the fields whose dimension holds the tokens read so far
    of the current chunk, ``pos % period`` more than in a fresh state. The state check is exact
    on every other dimension. ``runtime`` names the fields that hold no part of the state's value
    but a ``Room`` (buffers that make decoding cheaper): they are never saved, checked or compared,
    and ``map`` keeps one only while it still fits the mapped tensors (``detach`` keeps it)."""

    cache: ClassVar[dict[str, int]] = {}
    partial: ClassVar[dict[str, int]] = {}
    runtime: ClassVar[tuple[str, ...]] = ()

    def map(self: S, fn: Callable[[Tensor], Tensor]) -> S:
        out = dataclasses.replace(self, **{k: fn(v) for k, v in self.tensors().items()})
        rooms: dict[str, Room | None] = {k: getattr(out, k) for k in self.runtime}
        stale = {k: None for k, room in rooms.items() if room is not None and not room.fits(out)}
        return dataclasses.replace(out, **stale) if stale else out

    def tensors(self) -> dict[str, Tensor]:
        return {f.name: v for f in dataclasses.fields(self) if isinstance(v := getattr(self, f.name), Tensor)}

    @classmethod
    def from_flat(cls: type[S], flat: dict[str, Tensor], prefix: str) -> S:
        return cls(**{f.name: flat.get(prefix + f.name) for f in dataclasses.fields(cls) if f.name not in cls.runtime})


class Room(typing.Protocol):
    """Decoding buffers kept next to a layer state (a ``runtime`` field) and updated in place by
    the layer without autograd. Several states can share one room (the state a call returns and
    the one it read), so a layer writes into it only after ``fits`` confirms that the state it
    reads is the one the room was last brought up to date with; otherwise it makes a new room."""

    def fits(self, state: Any) -> bool: ...


def writable(t: Tensor) -> bool:
    """Whether a room's buffer ``t`` may be written in place now: one made under
    ``torch.inference_mode`` only inside it (PyTorch refuses the write elsewhere)."""
    return not t.is_inference() or torch.is_inference_mode_enabled()


@dataclass
class State:
    """The model's state after ``pos`` tokens: one ``LayerState`` per layer, ``start[b]`` where
    row b's current document began and ``fresh[b]`` for rows that start a new document at the next
    call (the model replaces their layer states by the initial ones before reading them, so a
    learned initial state still receives gradients after ``reset``).

    States are values: ``detach()``, ``to()`` and ``reset()`` return new states."""

    fresh: Tensor  # [B] bool
    start: Tensor  # [B] int64
    pos: int
    layers: list[LayerState]
    any_fresh: bool | None = None  # whether fresh.any(), when known on the host (None: ask the device)
    start_floor: int | None = None  # a bound <= every start[b], known on the host (None: unknown)
    start_ceiling: int | None = None  # a bound >= every start[b], known on the host (None: unknown)

    @property
    def batch_size(self) -> int:
        return self.fresh.shape[0]

    def map(self, fn: Callable[[Tensor], Tensor]) -> "State":
        return dataclasses.replace(
            self, fresh=fn(self.fresh), start=fn(self.start), layers=[s.map(fn) for s in self.layers]
        )

    def detach(self) -> "State":
        """Cut the autograd graph (the TBPTT boundary)."""
        return self.map(lambda t: t.detach())

    def to(self, *args: Any, **kwargs: Any) -> "State":
        """Move / cast like ``Tensor.to``; integer and boolean tensors keep their dtype."""

        def move(t: Tensor) -> Tensor:
            if t.is_floating_point():
                return t.to(*args, **kwargs)
            dev = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
            return t.to(device=dev) if dev is not None else t

        return self.map(move)

    def reset(self, mask: Tensor) -> "State":
        """Start a new document in the rows where ``mask`` ([B] bool) is true."""
        known: bool | None = None
        if self.any_fresh:
            known = True
        elif (
            not isinstance(mask, Tensor) or mask.device.type == "cpu"
        ):  # a host mask: any() needs no wait for the device
            known = True if bool(torch.as_tensor(mask).any()) else self.any_fresh
        mask = torch.as_tensor(mask, dtype=torch.bool, device=self.fresh.device)
        if mask.shape != self.fresh.shape:
            raise RecurformerError(f"reset mask has shape {tuple(mask.shape)}, expected ({self.batch_size},)")
        return dataclasses.replace(self, fresh=self.fresh | mask, any_fresh=known)

    def to_flat(self) -> dict[str, Tensor]:
        """``{name: tensor}`` for safetensors: fresh, start, pos, layers.n, layers.<i>.<field>."""
        out = {
            "fresh": self.fresh,
            "start": self.start,
            "pos": torch.tensor(self.pos),
            "layers.n": torch.tensor(len(self.layers)),
        }
        for i, s in enumerate(self.layers):
            out.update({f"layers.{i}.{k}": t for k, t in s.tensors().items()})
        return {k: t.detach().contiguous() for k, t in out.items()}


@dataclass
class Output:
    logits: Tensor  # [B, T, V]
    loss: Tensor | None  # mean cross-entropy over targets != ignore_index
    state: State  # state after the last token (not detached)


@dataclass
class Call:
    """What every layer of one call shares: the position of its first token, the document start
    of every row (and a bound below every start that the host knows, ``State.start_floor``: a
    layer can skip cached positions before it, which no row can see, without asking the device;
    and one above every start, ``State.start_ceiling``: a cache from it on is hidden from no row),
    and a memo for tables (masks, RoPE angles) that several layers would build alike."""

    pos: int
    start: Tensor  # [B] int64
    start_floor: int | None = None
    start_ceiling: int | None = None
    memo: dict[Any, Any] = field(default_factory=dict)

    def shared(self, key: Any, make: Callable[[], Any]) -> Any:
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]


def reset_rows(fresh: Tensor, old: Tensor, init: Tensor) -> Tensor:
    """``old`` with the rows b where ``fresh[b]`` replaced by ``init`` (broadcast to a row)."""
    f = fresh.view(-1, *([1] * (old.dim() - 1)))
    return torch.where(f, init.to(old.dtype).expand_as(old), old)


class StreamingModel(typing.Protocol):
    """What generation needs of a model: the contract's calls (``nn.StreamingLM`` is one)."""

    training: bool
    tok_emb: nn.Embedding

    def __call__(self, tokens: Tensor, state: State | None = None, targets: Tensor | None = None) -> Output: ...

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> State: ...

    def check_state(self, state: State, batch_size: int) -> State: ...

    def state_from_flat(self, flat: dict[str, Tensor]) -> State: ...

    def eval(self) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...
