"""One training call of a model as a function of static buffers, captured once per shape and
replayed: the protocol of a CUDA graph over the step (PyTorch docs, "CUDA Graphs": whole-network
capture with ``torch.cuda.graph``; ``torch.cuda.make_graphed_callables`` for a part), written so
that the CPU runs it too.

The step: tokens and targets [B, T] and the carried state in; the loss, the state after the last
token (detached: truncated BPTT at every call) and the parameter gradients of loss / grad_accum
out. Calls must be aligned (T and the position multiples of the model's ``reset_boundary``: no
partial chunk), so that the chunk loop has the same shapes at every call.

The known traps of replaying a captured step, each handled here:

* A replay overwrites its outputs (pytorch#148439): the loss and the new state are copied out,
  and the gradients added to ``p.grad``, before the next replay.
* Warm up before capture (cuBLAS/cuDNN workspaces, Triton autotuning; triton#10596): ``warmup``
  eager calls on a side stream first.
* One graph per shape: a step is captured per key (batch, T, training mode, the state's shapes
  and dtypes, the position within the reset boundary), and per position for a model with a layer
  that reads absolute positions (``Layer.shift_invariant`` false: RoPE over a KV cache). A
  shift-invariant step captured at position p0 serves every aligned position p: it runs at p0
  with every document start moved by p0 - p.
* Autocast's cache of cast weights (the bf16 copy of a parameter, kept while an autocast context
  lasts) would leave the cast out of the record, which would then read the copy made when it was
  recorded: freed memory once the context ends, stale weights once the optimizer steps (PyTorch
  docs, ``make_graphed_callables``: autocast with ``cache_enabled=False``). A step is recorded
  with the cache off, so the casts are part of it.
* No host read and no Python branch on a device value inside: resets are masks (the state's
  ``fresh``, set by ``State.reset``; the model takes the masked reset when it does not know on the
  host whether a row is fresh), and the token range is checked before the copy in (the model's
  own check is off inside the step).

Backends: "eager" runs the step function at every call; "trace" records it once per key with
``make_fx`` (forward and backward as one graph of ATen operators, its Python run once) and
replays the record: the CPU's stand-in for a CUDA graph, in which a value the step read on the
host or a position it took as a constant is frozen as well; "cuda" captures it with
``torch.cuda.graph``."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor
from torch.fx.experimental.proxy_tensor import make_fx

from .config import RecurformerError
from .state import IGNORE_INDEX, State

StreamingLM = (
    Any  # an ``nn.StreamingLM`` (a floor above: ``generate`` and ``evaluate`` capture their forward steps here)
)

Backend = Literal["eager", "trace", "cuda"]
Pick = Callable[[Tensor], Tensor]  # next-token logits [B, V] -> the tokens [B] chosen (a sampler)


class CaptureFailed(RecurformerError):
    """Capturing a step failed (out of memory, an operator a capture cannot hold): one line; the
    caller may go on without the capture."""


def failed(doing: str, e: BaseException) -> CaptureFailed:
    """``doing`` failed, in one line: the first line of ``e`` (its type when it has no message)."""
    what = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return CaptureFailed(f"{doing} failed: {what}")


def flatten(state: State) -> list[Tensor]:
    """fresh, start and every layer state's tensors, in a fixed order (``unflatten`` inverts it)."""
    return [state.fresh, state.start, *(t for s in state.layers for t in s.tensors().values())]


def unflatten(like: State, tensors: Sequence[Tensor], pos: int) -> State:
    """A state of ``like``'s layer types made of ``tensors`` (``flatten``'s order), at ``pos``;
    nothing known on the host (whether a row is fresh, bounds on the starts), no decoding rooms."""
    it = iter(tensors)
    fresh, start = next(it), next(it)
    layers = [
        dataclasses.replace(s, **{k: next(it) for k in s.tensors()}, **{k: None for k in s.runtime})
        for s in like.layers
    ]
    return State(fresh=fresh, start=start, pos=pos, layers=layers)


@contextlib.contextmanager
def unchecked(model: StreamingLM) -> Iterator[None]:
    """The model's per-call token check (a host read) off while a step is captured or replayed."""
    before = model.check_tokens
    model.check_tokens = False
    try:
        yield
    finally:
        model.check_tokens = before


@dataclass
class Graph:
    """A step captured for one key: it reads ``inputs`` (tokens, targets, the flattened state) and
    writes ``outputs`` (the loss, the flattened new state, the gradients of the parameters that
    got one) at every ``replay``; it ran at position ``pos``."""

    pos: int
    inputs: list[Tensor]
    outputs: list[Tensor]
    replay: Callable[[], None]


def check_backend(backend: str) -> None:
    if backend not in ("eager", "trace", "cuda"):
        raise RecurformerError(f"unknown capture backend '{backend}' (eager, trace or cuda)")
    if backend == "cuda" and not torch.cuda.is_available():
        raise RecurformerError("the 'cuda' capture backend needs a CUDA GPU; this machine has none")


@contextlib.contextmanager
def uncached_casts() -> Iterator[None]:
    """Autocast's weight-cast cache off inside (see the module docstring), as it was after."""
    before = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(before)


@uncached_casts()
def record(
    fn: Callable[..., list[Tensor]],
    inputs: list[Tensor],
    backend: Backend,
    warmup: int,
    generators: Sequence[torch.Generator] = (),
) -> tuple[list[Tensor], Callable[[], None]]:
    """``fn(*inputs)``'s outputs as static buffers and a replay that rewrites them from the
    current contents of ``inputs``: a CUDA graph (``warmup`` eager calls on a side stream first),
    a ``make_fx`` record replayed, or ``fn`` itself run again ("eager"). Recorded with autocast's
    weight-cast cache off (``uncached_casts``). ``generators``: the ones ``fn`` draws random
    numbers from, registered with a CUDA graph so that every replay draws new ones
    (``CUDAGraph.register_generator_state``; ``make_fx`` keeps the generator itself in its record).
    Recording runs ``fn``: what it writes in place and draws is the caller's to restore."""
    if backend != "cuda":  # a CUDA graph's own protocol: static outputs, overwritten by every replay
        run = fn if backend == "eager" else torch.no_grad()(make_fx(fn)(*inputs))
        outputs = fn(*inputs)

        def replay() -> None:
            new = run(*inputs)
            if outputs:  # a step may write its results into its inputs instead
                torch._foreach_copy_(outputs, new)

        return outputs, replay
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    cuda_graph = torch.cuda.CUDAGraph()
    for g in generators:
        cuda_graph.register_generator_state(g)
    with torch.cuda.graph(cuda_graph):
        outputs = fn(*inputs)
    return outputs, cuda_graph.replay


def aligned(model: StreamingLM, tokens: Tensor, state: State) -> bool:
    """Whether a call of ``tokens`` from ``state`` can be captured: its length and position
    multiples of the model's reset boundary (no partial chunk)."""
    P = model.reset_boundary
    return tokens.shape[-1] % P == 0 and state.pos % P == 0


class StepGraphs:
    """Training calls of ``model`` through captured steps (see the module docstring):
    ``loss, state = steps(tokens, targets, state)`` equals ``out = model(tokens, state, targets)``,
    ``(out.loss / grad_accum).backward()``, ``out.state.detach()``."""

    def __init__(self, model: StreamingLM, grad_accum: int = 1, backend: Backend = "eager", warmup: int = 3) -> None:
        check_backend(backend)
        self.model, self.grad_accum, self.backend, self.warmup = model, grad_accum, backend, warmup
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.shift = all(layer.shift_invariant for layer in model.layers)
        self.graphs: dict[tuple[Any, ...], Graph] = {}
        self.used: list[bool] | None = None  # which parameters get a gradient (found by the first step)

    def key(self, tokens: Tensor, state: State) -> tuple[Any, ...]:
        shapes = tuple((tuple(t.shape), t.dtype) for t in flatten(state))
        return (tuple(tokens.shape), self.model.training, state.pos % self.model.reset_boundary, shapes) + (
            () if self.shift else (state.pos,)
        )

    def function(self, like: State, pos: int) -> Callable[..., list[Tensor]]:
        """The step at position ``pos`` as a function of tensors only: what is captured."""
        model, params = self.model, self.params

        def step(tokens: Tensor, targets: Tensor, *flat: Tensor) -> list[Tensor]:
            out = model(tokens, unflatten(like, flat, pos), targets)
            assert out.loss is not None
            grads = torch.autograd.grad(out.loss / self.grad_accum, params, allow_unused=True)
            if self.used is None:
                self.used = [g is not None for g in grads]
            return [out.loss.detach(), *flatten(out.state.detach()), *(g for g in grads if g is not None)]

        return step

    def capture(self, tokens: Tensor, targets: Tensor, state: State) -> Graph:
        inputs = [t.clone() for t in (tokens, targets, *flatten(state))]
        outputs, replay = record(self.function(state, state.pos), inputs, self.backend, self.warmup)
        return Graph(state.pos, inputs, outputs, replay)

    def aligned(self, tokens: Tensor, state: State) -> bool:
        return aligned(self.model, tokens, state)

    def check(self, tokens: Tensor, targets: Tensor, state: State) -> None:
        """Aligned shapes, and token ids in the vocabulary (a host read unless the model's check is off)."""
        P, V = self.model.reset_boundary, self.model.config.vocab_size
        if tokens.dim() != 2 or targets.shape != tokens.shape or state.batch_size != tokens.shape[0]:
            raise RecurformerError(
                f"a captured step needs tokens and targets [batch, time] of one shape and a state of that batch, "
                f"got {tuple(tokens.shape)}, {tuple(targets.shape)} and batch {state.batch_size}"
            )
        if not self.aligned(tokens, state):
            raise RecurformerError(
                f"a captured step needs aligned calls: {tokens.shape[1]} tokens at position {state.pos}, "
                f"both multiples of {P} are needed"
            )
        if self.model.check_tokens:
            bad = (tokens < 0) | (tokens >= V) | ((targets != IGNORE_INDEX) & ((targets < 0) | (targets >= V)))
            if bool(bad.any()):
                raise RecurformerError(f"a token or target id is outside the vocabulary [0, {V})")

    def __call__(self, tokens: Tensor, targets: Tensor, state: State) -> tuple[Tensor, State]:
        self.check(tokens, targets, state)
        self.model.check_state(state, tokens.shape[0])
        key = self.key(tokens, state)
        with unchecked(self.model):
            if key not in self.graphs:
                try:
                    self.graphs[key] = self.capture(tokens, targets, state)
                except RuntimeError as e:  # torch.OutOfMemoryError too; the model's own RecurformerError passes
                    raise failed(f"capturing the {self.backend} step of {tuple(tokens.shape)} tokens", e) from None
            graph = self.graphs[key]
            shift = graph.pos - state.pos  # a multiple of the reset boundary (0 unless shift-invariant)
            for buf, t in zip(graph.inputs, (tokens, targets, *flatten(state))):
                buf.copy_(t)
            graph.inputs[3].add_(shift)  # the document starts, moved with the position
            graph.replay()
        n = 2 + sum(len(s.tensors()) for s in state.layers)
        out = graph.outputs
        flat = [t.clone() for t in out[1 : 1 + n]]  # copied out: the next replay overwrites them
        flat[1] -= shift
        grads = iter(out[1 + n :])
        assert self.used is not None
        for p, used in zip(self.params, self.used):
            if used:
                g = next(grads)
                p.grad = g.clone() if p.grad is None else p.grad.add_(g)
        new = unflatten(state, flat, state.pos + tokens.shape[1])
        return out[0].clone(), dataclasses.replace(new, any_fresh=False, start_floor=state.start_floor)


class DecodeGraphs:
    """Decoding calls (no autograd) through captured steps, as gpt-fast and mamba decode: the
    tokens [B, T] and the state copied into static buffers, the step replayed, the logits and the
    new state copied out; ``logits, state = steps(tokens, state)`` equals
    ``out = model(tokens, state)`` (logits [B, T, V]). One graph per key as in ``StepGraphs``
    (the position within the reset boundary included, so one token per call costs at most
    ``reset_boundary`` graphs), which needs a state of fixed shapes and layers that do not read
    absolute positions; ``why_not`` says, in one line, why a model cannot decode this way
    (None: it can)."""

    def __init__(self, model: StreamingLM, backend: Backend = "eager", warmup: int = 3) -> None:
        check_backend(backend)
        self.model, self.backend, self.warmup = model, backend, warmup
        self.graphs: dict[tuple[Any, ...], Graph] = {}
        self.samplers: dict[tuple[Any, ...], SampleGraphs] = {}
        self.why_not: str | None = None
        if not model.bounded_state:
            self.why_not = "its cache grows with every token (a graph per length)"
        elif not all(layer.shift_invariant for layer in model.layers):
            self.why_not = "a layer reads absolute positions (a graph per position)"

    def function(self, like: State, pos: int) -> Callable[..., list[Tensor]]:
        """The step at ``pos``; inside a chunk no row is fresh (a reset waits for a boundary, and
        ``__call__`` replays only a state that knows so), so the model reads nothing on the host."""
        model, inside = self.model, pos % self.model.reset_boundary != 0

        def step(tokens: Tensor, *flat: Tensor) -> list[Tensor]:
            state = unflatten(like, flat, pos)
            out = model(tokens, dataclasses.replace(state, any_fresh=False) if inside else state)
            return [out.logits, *flatten(out.state)]

        return step

    @torch.no_grad()
    def __call__(self, tokens: Tensor, state: State) -> tuple[Tensor, State]:
        if self.why_not is not None:
            raise RecurformerError(f"this model cannot decode through captured steps: {self.why_not}")
        V = self.model.config.vocab_size
        if bool(((tokens < 0) | (tokens >= V)).any()):  # the model's own check is off inside the step
            raise RecurformerError(f"a token id is outside the vocabulary [0, {V})")
        self.model.check_state(state, tokens.shape[0])
        if state.pos % self.model.reset_boundary and state.any_fresh is not False:  # not known: the model checks
            out = self.model(tokens, state)
            return out.logits, out.state
        shapes = tuple((tuple(t.shape), t.dtype) for t in flatten(state))
        key = (tuple(tokens.shape), state.pos % self.model.reset_boundary, shapes)
        with unchecked(self.model):
            if key not in self.graphs:
                inputs = [t.clone() for t in (tokens, *flatten(state))]
                try:
                    outputs, replay = record(self.function(state, state.pos), inputs, self.backend, self.warmup)
                except RuntimeError as e:
                    raise failed(
                        f"capturing the {self.backend} forward step of {tuple(tokens.shape)} tokens", e
                    ) from None
                self.graphs[key] = Graph(state.pos, inputs, outputs, replay)
            graph = self.graphs[key]
            shift = graph.pos - state.pos  # a multiple of the reset boundary
            for buf, t in zip(graph.inputs, (tokens, *flatten(state))):
                buf.copy_(t)
            graph.inputs[2].add_(shift)  # the document starts, moved with the position
            graph.replay()
        logits, *flat = (t.clone() for t in graph.outputs)  # copied out: the next replay overwrites them
        flat[1] -= shift
        new = unflatten(state, flat, state.pos + tokens.shape[1])
        return logits, dataclasses.replace(new, any_fresh=False, start_floor=state.start_floor)

    def sampler(
        self,
        sampling: Hashable,
        pick: Pick,
        generator: torch.Generator | None,
        state: State,
        logits: Tensor,
        stops: Sequence[int],
        block: int,
    ) -> SampleGraphs:
        """The steps that sample with ``pick`` (which draws from ``generator``; ``sampling`` names
        how, e.g. temperature, top-k and top-p) and read their token, in blocks of ``block`` (see
        ``SampleGraphs``), loaded with ``state`` and the next-token ``logits`` [B, V]: made once
        per kind of call, so a later generation of the same kind replays the graphs recorded."""
        if self.why_not is not None:
            raise RecurformerError(f"this model cannot decode through captured steps: {self.why_not}")
        shapes = tuple((tuple(t.shape), t.dtype) for t in flatten(state))
        key = (sampling, generator, shapes, tuple(logits.shape), tuple(stops), block)
        if key not in self.samplers:
            self.samplers[key] = SampleGraphs(self, pick, generator, state, logits, stops, block)
        steps = self.samplers[key]
        steps.load(state, logits)
        return steps

    def or_eager(
        self, note: Callable[[str], object], only_aligned: bool = False, doing: str = "decoding"
    ) -> Callable[[Tensor, State], tuple[Tensor, State]]:
        """This as a step that says in one line (to ``note``) why it runs eagerly instead, for a
        model it cannot hold or a capture that fails (then for the rest); ``only_aligned``: a call
        whose length or position is not a multiple of the reset boundary (``aligned``) runs
        eagerly, the first one said in one line (a chunked reader's shorter last call)."""
        plain, told = False, False
        if self.why_not is not None:
            note(f"[{self.backend} graphs: {self.why_not}; {doing} eagerly]")
            plain = True

        def step(tokens: Tensor, state: State) -> tuple[Tensor, State]:
            nonlocal plain, told
            if only_aligned and not plain and not aligned(self.model, tokens, state):
                if not told:
                    P = self.model.reset_boundary
                    note(
                        f"[{self.backend} graphs: a call of {tokens.shape[-1]} tokens at position {state.pos} is not "
                        f"aligned to the reset boundary {P}; such calls run eagerly]"
                    )
                    told = True
            elif not plain:
                try:
                    return self(tokens, state)
                except CaptureFailed as e:
                    note(f"[{e}; {doing} eagerly]")
                    plain = True
            out = self.model(tokens, state=state)
            return out.logits, out.state

        return step


class SampleGraphs:
    """Decoding with the sampling inside the captured step and the host reading the tokens in
    blocks (made by ``DecodeGraphs.sampler``). One step: a token per row chosen from the current
    logits (``pick``, greedy or drawing from ``generator``), read by the model
    (``DecodeGraphs.function``), the new logits kept; the token (-1 in a row that produced a stop
    token earlier) and two flags, whether the new logits are all finite and whether every row has
    now produced a stop token, written into column ``col`` of ``out`` [B + 2, block]. The steps
    read and write static buffers, so ``run(n)`` is n replays with no host work between them and
    ``read(n)`` is the one host read of a block.

    One graph per position within the reset boundary (the state's shapes may change with it: a
    partial chunk's cache), each reading the state buffers of its residue r and writing those of
    the next (its outputs become them, or it writes them in place where they exist: round the
    chunk, back to the first). The graph of residue r runs at position ``base + r`` with the
    document starts moved there (as ``DecodeGraphs`` moves them), the last residue's step moving
    them back by one boundary as a chunk ends; ``pos`` is the true position, known on the host."""

    def __init__(
        self,
        graphs: DecodeGraphs,
        pick: Pick,
        generator: torch.Generator | None,
        state: State,
        logits: Tensor,
        stops: Sequence[int],
        block: int,
    ) -> None:
        self.graphs, self.pick, self.block = graphs, pick, block
        self.generators = [] if generator is None else [generator]
        self.P = graphs.model.reset_boundary
        self.base = state.pos - state.pos % self.P
        self.like, self.pos = state, state.pos
        dev = logits.device
        self.logits = logits.float().clone()
        self.done = torch.zeros(logits.shape[0], dtype=torch.bool, device=dev)
        self.stops = torch.tensor(list(stops), dtype=torch.long, device=dev)
        self.out = torch.zeros(logits.shape[0] + 2, block, dtype=torch.long, device=dev)
        self.col = torch.zeros(1, dtype=torch.long, device=dev)
        self.flats: dict[int, list[Tensor]] = {}  # the state buffers of each residue
        self.replays: dict[int, Callable[[], None]] = {}

    @property
    def shared(self) -> list[Tensor]:
        """The buffers every step reads and writes, in the order of its first arguments."""
        return [self.logits, self.done, self.stops, self.out, self.col]

    @property
    def moved(self) -> int:
        """How far the buffers' document starts are moved from the true ones (``pos`` to ``base + r``)."""
        return self.base - (self.pos - self.pos % self.P)

    def load(self, state: State, logits: Tensor, done: Tensor | None = None) -> None:
        """Start from ``state``, its next-token ``logits`` and the rows ``done`` (default: none)."""
        self.graphs.model.check_state(state, self.done.shape[0])
        self.like, self.pos = state, state.pos
        self.logits.copy_(logits)
        if done is None:
            self.done.zero_()
        else:
            self.done.copy_(done)
        r = self.pos % self.P
        if r in self.flats:
            torch._foreach_copy_(self.flats[r], flatten(state))
        else:
            self.flats[r] = [t.clone() for t in flatten(state)]
        self.flats[r][1].add_(self.moved)

    def state(self) -> State:
        """The state after the steps run so far (a copy: later steps do not change it)."""
        flat = [t.clone() for t in self.flats[self.pos % self.P]]
        flat[1] -= self.moved
        new = unflatten(self.like, flat, self.pos)
        return dataclasses.replace(new, any_fresh=False, start_floor=self.like.start_floor)

    def function(self, r: int) -> tuple[Callable[..., list[Tensor]], list[Tensor]]:
        """The step of residue ``r`` as a function of tensors only (what is captured), and those
        tensors: the shared buffers, the state of residue r and, where the next residue's state
        buffers exist, those, written in place (else the step returns the next state)."""
        after = (r + 1) % self.P
        forward, wrap = self.graphs.function(self.like, self.base + r), self.P if after == 0 else 0
        n, returns = len(self.flats[r]), after not in self.flats  # decided now: the outputs become them
        into = [] if returns or after == r else self.flats[after]

        def step(logits: Tensor, done: Tensor, stops: Tensor, out: Tensor, col: Tensor, *flats: Tensor) -> list[Tensor]:
            tok = self.pick(logits)
            new_logits, *new_flat = forward(tok[:, None], *flats[:n])
            new_logits = new_logits[:, -1].float()
            new_flat[1] = new_flat[1] - wrap
            now = done | torch.isin(tok, stops)
            flags = torch.stack([torch.isfinite(new_logits).all(), now.all()]).long()
            out.index_copy_(1, col, torch.cat([torch.where(done, -1, tok), flags])[:, None])
            col.add_(1)
            logits.copy_(new_logits)
            done.copy_(now)
            if returns:
                return new_flat
            torch._foreach_copy_(list(flats[n:] or flats), new_flat)  # the residue's own buffers at P = 1
            return []

        return step, [*self.shared, *self.flats[r], *into]

    def prepare(self, n: int) -> None:
        """Record the graphs that the next ``n`` steps replay, in the order they run, leaving the
        buffers and the generator as they were (recording runs the step)."""
        for i in range(min(n, self.P)):
            r = (self.pos + i) % self.P
            if r in self.replays:
                continue
            kept = [t.clone() for t in (*self.shared, *(t for f in self.flats.values() for t in f))]
            drawn = [g.get_state() for g in self.generators]
            fn, inputs = self.function(r)
            try:
                with unchecked(self.graphs.model):
                    outputs, self.replays[r] = record(
                        fn, inputs, self.graphs.backend, self.graphs.warmup, self.generators
                    )
            except RuntimeError as e:
                raise failed(f"capturing the {self.graphs.backend} sampling step", e) from None
            finally:
                torch._foreach_copy_([*self.shared, *(t for f in self.flats.values() for t in f)], kept)
                for g, was in zip(self.generators, drawn):
                    g.set_state(was)
            if outputs:
                self.flats[(r + 1) % self.P] = outputs

    @torch.no_grad()
    def run(self, n: int) -> None:
        """``n`` <= ``block`` steps, their tokens and flags in ``out[:, :n]`` (no host read)."""
        self.col.zero_()
        self.prepare(n)
        with unchecked(self.graphs.model):
            for _ in range(n):
                self.replays[self.pos % self.P]()
                self.pos += 1

    def read(self, n: int) -> tuple[Tensor, list[bool], list[bool]]:
        """The one host read of a block of ``n`` steps: their tokens [B, n] (a host tensor), and
        per step whether the logits were finite and whether every row had stopped."""
        *tokens, finite, stopped = self.out[:, :n].tolist()
        return torch.tensor(tokens), [bool(f) for f in finite], [bool(f) for f in stopped]
