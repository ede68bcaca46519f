"""The streaming contract, written once for every model: the model config (``ModelConfig``; with
the short convolution of attention inputs, ``ConvConfig``), the pre-norm ``Block`` around a mixer
(``ConvLayer``: a mixer whose input it convolves), and the model around a stack of layers
(``StreamingLM``: embedding, input checks, the lazy per-row reset, the layer loop, the final norm
and the tied LM head). The layer protocol (``Layer``) and what the model reads of its stack alone
(state checks, reset boundary, receptive field: ``Stack``) live in ``stack.py``, the state types in
``state.py`` (re-exported here), the building blocks in ``modules.py``, the architectures in
``models/``; generation and the Hub methods come from the mixins of ``generate.py`` and ``hub.py``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import Checked, RecurformerError, check_range, option
from .device import autocast_context
from .generate import GenerationMixin
from .hub import HubMixin
from .modules import MLP, RMSNorm, ShortConvolution, cross_entropy
from .registry import build_layer
from .stack import Layer, Stack
from .state import IGNORE_INDEX, Call, LayerState, Output, Room, State, reset_rows, writable

__all__ = [
    "IGNORE_INDEX",
    "Block",
    "Call",
    "ConvConfig",
    "ConvLayer",
    "LayerState",
    "ModelConfig",
    "NonFiniteLogits",
    "Output",
    "Room",
    "State",
    "StreamingLM",
    "reset_rows",
    "writable",
]


# ----------------------------------------------------------------------------------------------
# configs


@dataclass
class ModelConfig(Checked):
    """Fields shared by every model. Subclasses add their own."""

    key_format = "config key '{}'"
    vocab_size: int = option(4096, range="> 0")
    dim: int = option(288, range="> 0")
    n_layers: int = option(6, range="> 0")
    n_heads: int = option(6, range="> 0")
    ffn_hidden: int | None = None  # None: Llama's rule, 2/3 * 4 * dim rounded up to multiple_of
    multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    # attention window W of 'window' layers (a query sees W tokens, itself included)
    window: int | None = option(None, range=">= 1")
    layers: list[str] | None = None  # a kind per layer for hybrid stacks, e.g. [window, window, memory, window]
    # The field that bounds how far back a token attends directly (window, chunk, segment or block
    # length), None if the model has none; the synthetic diagnostics give every model this context.
    context_field: ClassVar[str | None] = None
    # Keys that change no parameter: a run may start from weights saved with another value
    # (``synth.init_from``), e.g. to train on with a setting the saved model did not have.
    retrain_keys: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dim % self.n_heads:
            raise RecurformerError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if (self.dim // self.n_heads) % 2:
            raise RecurformerError(f"head dim dim/n_heads = {self.dim // self.n_heads} must be even for RoPE")
        if self.layers is not None and len(self.layers) != self.n_layers:
            raise RecurformerError(f"config key 'layers' names {len(self.layers)} layers, n_layers is {self.n_layers}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        h = int(2 * 4 * self.dim / 3)
        return self.multiple_of * ((h + self.multiple_of - 1) // self.multiple_of)

    def layer_kinds(self, default: str) -> list[str]:
        """The kind of every layer: ``layers`` if given, else the model's own kind everywhere."""
        return list(self.layers) if self.layers is not None else [default] * self.n_layers


@dataclass
class ConvConfig(ModelConfig):
    """The config of a model whose attention layers may take a short convolution of their input
    (``ConvLayer``, run by ``Block``). ``qkv_conv: K`` (K >= 1; 0, the default, is none) passes
    each such layer's (normed) input through a short causal depthwise convolution with SiLU before
    q/k/v (``modules.short_conv``, the one Gated DeltaNet uses: Yang, Kautz & Hatamizadeh, "Gated
    Delta Networks", §3, after H3 and Mamba), so a key can carry the token before it, the cheapest
    published lever for learning recall (Zoology; Based). Its last K-1 inputs are kept in the
    layer's state (``conv``, zeros at a document start), so any split into calls gives the same
    result."""

    # K: a short causal convolution on each attention layer's input before q/k/v (0: none)
    qkv_conv: int = option(0, range=">= 0", key="model.qkv_conv")

    @property
    def conv_floats(self) -> int:
        """What the convolution adds to a row's state: the last K-1 inputs of every layer."""
        return max(self.qkv_conv - 1, 0) * self.dim * self.n_layers


# ----------------------------------------------------------------------------------------------
# the block around a mixer


class ConvLayer(Layer):
    """A mixer that may own a short convolution of its input (``conv``, a ``ShortConvolution``:
    the option ``ConvConfig.qkv_conv``; None without it), which ``Block`` runs. It is made before
    the mixer's other modules (see ``ShortConvolution``: the order of the random draws)."""

    def __init__(self, cfg: ConvConfig) -> None:
        super().__init__()
        self.conv = ShortConvolution(cfg.dim, cfg.qkv_conv) if cfg.qkv_conv else None


class Block(Layer):
    """The pre-norm block around a mixer (the layer's sequence-mixing part), n = RMSNorm:

        h = x + mixer(n(x), state),   y = h + MLP(n(h))

    A mixer may answer for the last rows of x only (a shorter output, as RMT's last layer): the
    block is then those rows' (h = x[:, -m:] + mixer(...), m its output's length). The block is
    the layer: its state, reset, period and reach are the mixer's.

    A mixer may own a short convolution of its input (a ``ConvLayer``'s ``conv``), which the block
    runs between the norm and the mixer,
    h = x + mixer(SiLU(conv(n(x))), state); the block keeps the convolution's piece of the state
    (the state's ``conv``): makes it, resets it, checks it and carries it across calls."""

    def __init__(self, cfg: ModelConfig, mixer: Layer, mlp: Literal["swiglu", "relu"] = "swiglu") -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = mixer
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = MLP(cfg.dim, cfg.hidden, kind=mlp)

    @property
    def kind(self) -> str:
        return self.attn.kind

    @property
    def period(self) -> int:
        return self.attn.period

    @property
    def unit(self) -> str:
        return self.attn.unit

    @property
    def bounded(self) -> bool:
        return self.attn.bounded

    @property
    def shift_invariant(self) -> bool:
        return self.attn.shift_invariant

    @property
    def state_cls(self) -> type[LayerState]:
        return self.attn.state_cls

    @property
    def conv(self) -> ShortConvolution | None:
        """The mixer's short convolution of its input, if it has one."""
        return self.attn.conv if isinstance(self.attn, ConvLayer) else None

    def init_state(self, batch_size: int, device: torch.device | str | None, dtype: torch.dtype) -> LayerState:
        state = self.attn.init_state(batch_size, device, dtype)
        if (conv := self.conv) is None:
            return state
        return with_conv(state, conv.init_state(batch_size, device, dtype))

    def reset(self, state: LayerState, fresh: Tensor) -> LayerState:
        new = self.attn.reset(state, fresh)
        if (conv := self.conv) is None:
            return new
        return with_conv(new, conv.reset(getattr(state, "conv"), fresh))

    def check_state(self, state: LayerState, pos: int) -> str | None:
        if (conv := self.conv) is None or type(state) is not self.state_cls:
            return self.attn.check_state(state, pos)
        if (why := self.attn.check_state(with_conv(state, None), pos)) is not None:
            return why
        return conv.check_state(getattr(state, "conv"))

    def reach(self, q: int) -> int | None:
        return self.attn.reach(q)

    def describe(self) -> str:
        return self.attn.describe()

    def forward(self, x: Tensor, state: LayerState, call: Call) -> tuple[Tensor, LayerState]:
        n = self.attn_norm(x)
        if (conv := self.conv) is not None:
            n, cache = conv(n, getattr(state, "conv"))
        a, state = self.attn(n, state, call)
        if conv is not None:
            state = with_conv(state, cache)
        h = (x if a.shape[1] == x.shape[1] else x[:, x.shape[1] - a.shape[1] :]) + a
        return h + self.ffn(self.ffn_norm(h)), state


def with_conv(state: LayerState, cache: Tensor | None) -> LayerState:
    """``state`` (of a mixer with a short convolution) with the convolution's piece replaced."""
    return dataclasses.replace(cast(Any, state), conv=cache)


# ----------------------------------------------------------------------------------------------
# the model


class NonFiniteLogits(RecurformerError):
    """A call of ``StreamingLM.read`` gave a logit that is NaN or infinite."""


def check_token_shape(tokens: Tensor) -> None:
    """One line unless ``tokens`` is an integer tensor [B, T]."""
    if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
        raise RecurformerError(
            f"tokens must be an integer tensor [batch, time], got {tuple(tokens.shape)} {tokens.dtype}"
        )


def check_targets(tokens: Tensor, targets: Tensor) -> None:
    """One line unless ``targets`` has the shape of ``tokens``."""
    if targets.shape != tokens.shape:
        raise RecurformerError(f"targets shape {tuple(targets.shape)} != tokens shape {tuple(tokens.shape)}")


def check_compile() -> None:
    """Compiling needs torch >= 2.5: torch 2.4's inductor fails on the RoPE tables (``TypeError:
    Invalid NaN comparison``, in code generation); the eager model runs on 2.4."""
    if torch.__version__ < "2.5":
        raise RecurformerError(
            f"compiling needs torch >= 2.5 (torch 2.4's inductor fails on the RoPE tables); this is {torch.__version__}"
        )


class StreamingLM(nn.Module, Stack, GenerationMixin, HubMixin):
    """Token embedding -> the stack of layers -> final RMSNorm -> tied LM head.

    A model class names the ``kind`` of its layers (registered by ``registry.register_layer``) and
    registers itself (``registry.register``); ``config.layers`` may mix kinds (see
    ``registry.build_layer``)."""

    kind: ClassVar[str]
    check_tokens = True  # features() checks every token id, a wait for the device (the trainer checks its data once)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.dim)
        kinds = config.layer_kinds(self.default_kind())
        # an nn.ModuleList, typed by what it holds
        self.layers: list[Layer] = nn.ModuleList(build_layer(k, config, i) for i, k in enumerate(kinds))  # type: ignore[assignment]
        self.norm = RMSNorm(config.dim, config.norm_eps)
        if config.window is not None and not any(layer.kind == "window" for layer in self.layers):
            raise RecurformerError(
                "config key 'window' is set, but no layer is a 'window' layer (see config key 'layers')"
            )
        self.init_weights()

    def default_kind(self) -> str:
        return self.kind

    def init_weights(self) -> None:
        """normal(0, std) everywhere; residual output projections get std / sqrt(2 * n_layers);
        then each layer's own initialisation (``Layer.init_extra``)."""
        std = self.config.init_std
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                scale = 1 / math.sqrt(2 * self.config.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 1.0
                nn.init.normal_(p, 0.0, std * scale)
        for m in self.modules():
            if m is not self and callable(init := getattr(m, "init_extra", None)):
                init(std)

    # -- contract ------------------------------------------------------------------------------
    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> State:
        dtype = self.tok_emb.weight.dtype
        return State(
            fresh=torch.ones(batch_size, dtype=torch.bool, device=device),
            start=torch.zeros(batch_size, dtype=torch.long, device=device),
            pos=0,
            layers=[layer.init_state(batch_size, device, dtype) for layer in self.layers],
            any_fresh=True,
            start_floor=0,
            start_ceiling=0,
        )

    def body(self, h: Tensor, state: State) -> tuple[Tensor, State]:
        """The layers over h [B, T, D] (``layer_pass``), after the checks and the lazy reset of
        the fresh rows; the new state's document starts and what the host knows of them."""
        layers, pos, P = state.layers, state.pos, self.reset_boundary
        # whether a row may be fresh: at a boundary an unknown answer needs no wait for the device (the
        # reset is a mask, exact for rows that are not fresh), so a captured step has no host read
        any_fresh = state.any_fresh if state.any_fresh is not None or pos % P == 0 else bool(state.fresh.any())
        if any_fresh is not False and pos % P:
            unit = max(self.layers, key=lambda layer: layer.period).unit
            raise RecurformerError(
                f"{type(self).__name__} can reset a row only at a {unit} boundary (current {unit} has {pos % P} of {P} tokens)"
            )
        if any_fresh is not False or (self.training and torch.is_grad_enabled()):
            # in training, a learned initial state enters every step's graph (a zero gradient when no
            # row is fresh), so that DDP finds every parameter used
            layers = [layer.reset(s, state.fresh) for layer, s in zip(self.layers, layers)]
        start = torch.where(state.fresh, torch.full_like(state.start, pos), state.start)
        ceiling = state.start_ceiling if any_fresh is False else pos  # a fresh row starts at pos
        h, new = self.layer_pass(h, layers, state.fresh, Call(pos, start, state.start_floor, ceiling))
        return h, State(  # a start only moves forward (to pos <= any later one), so the floor holds
            fresh=torch.zeros_like(state.fresh), start=start, pos=pos + h.shape[1], layers=new, any_fresh=False,
            start_floor=state.start_floor, start_ceiling=ceiling,
        )  # fmt: skip

    def layer_pass(
        self, h: Tensor, layers: list[LayerState], fresh: Tensor, call: Call
    ) -> tuple[Tensor, list[LayerState]]:
        """h [B, T, D] through the stack, each layer reading and returning its own state (the fresh
        rows' states already reset; ``fresh`` [B] for a model that resets more of its own). A model
        whose state crosses layers overrides this pass only (RMT); ``body`` keeps the contract."""
        new = []
        for layer, s in zip(self.layers, layers):
            h, s = layer(h, s, call)
            new.append(s)
        return h, new

    def features(self, tokens: Tensor, state: State | None = None) -> tuple[Tensor, State]:
        """Validated ``tokens`` [B, T] -> final-norm hidden states [B, T, D] (what the LM head
        reads) and the state after the last token."""
        check_token_shape(tokens)
        B, T = tokens.shape
        if T > 0 and self.check_tokens:
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi >= self.config.vocab_size:
                bad = lo if lo < 0 else hi
                raise RecurformerError(f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")
        state = self.init_state(B, tokens.device) if state is None else self.check_state(state, B)
        h = self.tok_emb(tokens)
        if T > 0:
            h, state = self.body(h, state)
        return self.norm(h), state

    def forward(self, tokens: Tensor, state: State | None = None, targets: Tensor | None = None) -> Output:
        h, state = self.features(tokens, state)
        logits = F.linear(h, self.tok_emb.weight)
        loss = None
        if targets is not None:
            check_targets(tokens, targets)
            V = self.config.vocab_size
            wrong = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= V)) if self.check_tokens else None
            if wrong is not None and bool(wrong.any()):
                bad = int(targets[wrong][0])
                raise RecurformerError(f"target id {bad} is outside the vocabulary [0, {V}) and is not {IGNORE_INDEX}")
            loss = cross_entropy(logits.flatten(0, 1), targets.flatten(), IGNORE_INDEX)
        return Output(logits=logits, loss=loss, state=state)

    def read(
        self, tokens: Tensor, chunk: int, state: State | None = None, targets: Tensor | None = None,
        precision: str = "fp32", step: Callable[[Tensor, State], tuple[Tensor, State]] | None = None,
    ) -> Iterator[Output]:  # fmt: skip
        """``tokens`` [B, T] read ``chunk`` tokens per call with the state carried (the last call
        reads the T mod chunk left), one ``Output`` per call: the logits promoted to at least
        float32 and checked finite (else ``NonFiniteLogits``, naming the tokens; the check waits
        for the device once per call), the mean loss of the call's ``targets`` [B, T] when given,
        and the state after the call. Every call runs under ``precision``'s autocast
        (``device.autocast_context``: bf16 autocast for bf16; for fp32 none of its own, so an outer
        autocast stays in force). Whole == chunked: the logits equal ``forward``'s over all of
        ``tokens`` (the streaming contract). Gradients flow unless the caller turns them off.
        ``step(tokens, state) -> (logits, state)`` (e.g. a captured step, ``capture.DecodeGraphs``)
        makes each call instead of the model's own, from ``init_state`` when no state is given;
        it gives no loss, so it takes no ``targets``."""
        check_token_shape(tokens)
        check_range("chunk", chunk, (1, True, None, False), "chunk")
        if targets is not None:
            check_targets(tokens, targets)
            if step is not None:
                raise RecurformerError("read through a step gives logits only: it takes no targets")
        return self._read(tokens, chunk, state, targets, precision, step)

    def _read(
        self,
        tokens: Tensor,
        chunk: int,
        state: State | None,
        targets: Tensor | None,
        precision: str,
        step: Callable[[Tensor, State], tuple[Tensor, State]] | None,
    ) -> Iterator[Output]:
        T, device = tokens.shape[1], self.tok_emb.weight.device
        if step is not None and state is None:
            state = self.init_state(tokens.shape[0], device)
        for a in range(0, T, chunk):
            b = min(a + chunk, T)
            with autocast_context(precision, device):
                if step is None:
                    out = self(tokens[:, a:b], state, None if targets is None else targets[:, a:b])
                else:
                    assert state is not None
                    logits, after = step(tokens[:, a:b], state)
                    out = Output(logits, None, after)
            logits = out.logits.to(torch.promote_types(out.logits.dtype, torch.float32))
            if not bool(torch.isfinite(logits).all()):
                raise NonFiniteLogits(
                    f"the model produced non-finite logits (NaN/inf) at tokens {a}..{b - 1} of {T} ({precision}): "
                    "its weights are broken or overflow"
                )
            state = out.state
            yield Output(logits, out.loss, state)

    def compile_layers(self) -> None:
        """``torch.compile`` each layer in place (regional compilation): identical layers share one
        compiled graph, so compiling costs about one layer however deep the model is. The
        embedding, the loss and the Python-side input checks stay eager (``check_compile``)."""
        check_compile()
        for layer in self.layers:
            layer.compile()

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def param_groups(self) -> dict[str, int]:
        """Parameter counts by top-level module (for ``recurformer info``)."""
        out: dict[str, int] = {}
        for name, p in self.named_parameters():
            key = name.split(".")[0] if not name.startswith("layers.") else "layers." + ".".join(name.split(".")[2:-1])
            out[key] = out.get(key, 0) + p.numel()
        return out
