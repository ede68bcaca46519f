"""Shared building blocks: the streaming contract (State, Output, StreamingLM), RMSNorm, SwiGLU,
RoPE with arbitrary positions, and attention helpers over PyTorch SDPA."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import RecurformerError

# ----------------------------------------------------------------------------------------------
# the streaming contract


@dataclass
class State:
    """Base of every model state: a dataclass whose fields are tensors (batch first), lists of
    per-layer tensors, or ints. ``fresh[b]`` marks rows that start a new document at the next
    call: the model replaces their state by its initial state before reading it, so a learned
    initial state still receives gradients after ``reset``.

    States are values: ``detach()``, ``to()`` and ``reset()`` return new states."""

    fresh: Tensor  # [B] bool

    @property
    def batch_size(self) -> int:
        return self.fresh.shape[0]

    def _map(self, fn: Callable[[Tensor], Tensor]) -> "State":
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                changes[f.name] = fn(v)
            elif isinstance(v, list):
                changes[f.name] = [fn(t) for t in v]
        return dataclasses.replace(self, **changes)

    def detach(self) -> "State":
        """Cut the autograd graph (the TBPTT boundary)."""
        return self._map(lambda t: t.detach())

    def to(self, *args: Any, **kwargs: Any) -> "State":
        """Move / cast like ``Tensor.to``; integer and boolean tensors keep their dtype."""

        def move(t: Tensor) -> Tensor:
            if t.is_floating_point():
                return t.to(*args, **kwargs)
            dev = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
            return t.to(device=dev) if dev is not None else t

        return self._map(move)

    def reset(self, mask: Tensor) -> "State":
        """Start a new document in the rows where ``mask`` ([B] bool) is true."""
        mask = torch.as_tensor(mask, dtype=torch.bool, device=self.fresh.device)
        if mask.shape != self.fresh.shape:
            raise RecurformerError(f"reset mask has shape {tuple(mask.shape)}, expected ({self.batch_size},)")
        return dataclasses.replace(self, fresh=self.fresh | mask)

    def to_flat(self) -> dict[str, Tensor]:
        """Flatten to ``{name: tensor}`` (for safetensors); ints become 0-d int64 tensors."""
        out: dict[str, Tensor] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                out[f.name] = v
            elif isinstance(v, list):
                out[f"{f.name}.n"] = torch.tensor(len(v))
                for i, t in enumerate(v):
                    out[f"{f.name}.{i}"] = t
            elif isinstance(v, int):
                out[f.name] = torch.tensor(v)
        return {k: t.detach().contiguous() for k, t in out.items()}

    @classmethod
    def from_flat(cls, flat: dict[str, Tensor]) -> "State":
        hints = typing.get_type_hints(cls)
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            try:
                if typing.get_origin(tp) is list:
                    kwargs[f.name] = [flat[f"{f.name}.{i}"] for i in range(int(flat[f"{f.name}.n"]))]
                elif tp is int:
                    kwargs[f.name] = int(flat[f.name])
                else:
                    kwargs[f.name] = flat[f.name]
            except KeyError as e:
                raise RecurformerError(f"saved state is not a {cls.__name__}: missing '{e.args[0]}'") from None
        return cls(**kwargs)


@dataclass
class Output:
    logits: Tensor  # [B, T, V]
    loss: Tensor | None  # mean cross-entropy over targets != ignore_index
    state: State  # state after the last token (not detached)


IGNORE_INDEX = -100


@dataclass
class ModelConfig:
    """Fields shared by every model. Subclasses add their own."""

    vocab_size: int = 4096
    dim: int = 288
    n_layers: int = 6
    n_heads: int = 6
    ffn_hidden: int | None = None  # None: Llama's rule, 2/3 * 4 * dim rounded up to multiple_of
    multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    # The field that bounds how far back a token attends directly (window, chunk, segment or block
    # length), None if the model has none; the synthetic diagnostics give every model this context.
    context_field: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        for k in ("vocab_size", "dim", "n_layers", "n_heads"):
            if getattr(self, k) <= 0:
                raise RecurformerError(f"config key '{k}' must be positive, got {getattr(self, k)}")
        if self.dim % self.n_heads:
            raise RecurformerError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if (self.dim // self.n_heads) % 2:
            raise RecurformerError(f"head dim dim/n_heads = {self.dim // self.n_heads} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        h = int(2 * 4 * self.dim / 3)
        return self.multiple_of * ((h + self.multiple_of - 1) // self.multiple_of)


class StreamingLM(nn.Module):
    """Token embedding -> ``self.body`` (the architecture) -> final RMSNorm -> tied LM head.

    Subclasses implement ``init_state(batch)`` and ``body(h, state) -> (h, state)``. ``forward``
    validates its inputs and computes logits and the loss."""

    state_cls: type[State] = State
    layers: nn.ModuleList  # the architecture's layers, run in order by ``body``

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.dim)
        self.norm = RMSNorm(config.dim, config.norm_eps)

    def init_weights(self) -> None:
        """normal(0, std) everywhere; residual output projections get std / sqrt(2 * n_layers)."""
        std = self.config.init_std
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                scale = 1 / math.sqrt(2 * self.config.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 1.0
                nn.init.normal_(p, 0.0, std * scale)

    # -- contract ------------------------------------------------------------------------------
    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> State:
        raise NotImplementedError

    def body(self, h: Tensor, state: State) -> tuple[Tensor, State]:
        raise NotImplementedError

    def features(self, tokens: Tensor, state: State | None = None) -> tuple[Tensor, State]:
        """Validated ``tokens`` [B, T] -> final-norm hidden states [B, T, D] (what the LM head
        reads) and the state after the last token."""
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise RecurformerError(f"tokens must be an integer tensor [batch, time], got {tuple(tokens.shape)} {tokens.dtype}")
        B, T = tokens.shape
        if T > 0:
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
            if targets.shape != tokens.shape:
                raise RecurformerError(f"targets shape {tuple(targets.shape)} != tokens shape {tuple(tokens.shape)}")
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
        return Output(logits=logits, loss=loss, state=state)

    def check_state(self, state: State, batch_size: int) -> State:
        if type(state) is not self.state_cls:
            raise RecurformerError(
                f"state is a {type(state).__name__}, but {type(self).__name__} expects a {self.state_cls.__name__}"
            )
        if state.batch_size != batch_size:
            raise RecurformerError(f"state has batch size {state.batch_size}, tokens have {batch_size}")
        if not hasattr(self, "_state_sig"):
            self._state_sig = _signature(self.init_state(1, "cpu"))
        if _signature(state) != self._state_sig:
            raise RecurformerError(f"state does not fit this {type(self).__name__} (made by a model of another size)")
        return state

    def generate(self, prompt: Any, max_new_tokens: int, temperature: float, **kwargs: Any) -> list[list[int]]:
        """Sample ``max_new_tokens`` after ``prompt`` (see ``recurformer.generate.generate``).
        ``temperature=0`` is greedy; there is no default on purpose."""
        from .generate import generate

        return generate(self, prompt, max_new_tokens, temperature, **kwargs)

    def stream(self, prompt: Any, max_new_tokens: int, temperature: float, **kwargs: Any):
        """Iterator form of ``generate``: yields the new tokens [B] one step at a time."""
        from .generate import stream

        return stream(self, prompt, max_new_tokens, temperature, **kwargs)

    def save_pretrained(self, directory: str | Path, **kwargs: Any) -> Path:
        """Weights, config, model card (+ ``tokenizer=``) in Hub layout; see ``recurformer.hub``."""
        from .hub import save_pretrained

        return save_pretrained(self, directory, **kwargs)

    @classmethod
    def from_pretrained(cls, dir_or_repo_id: str | Path, **kwargs: Any) -> "StreamingLM":
        """The model saved in a local directory (pretrained, checkpoint or run) or a Hub repo."""
        from .hub import from_pretrained

        model = from_pretrained(dir_or_repo_id, **kwargs)[0]
        if not isinstance(model, cls):
            raise RecurformerError(f"{dir_or_repo_id} holds a {type(model).__name__}, not a {cls.__name__}")
        return model

    def push_to_hub(self, repo_id: str, **kwargs: Any) -> str:
        """Upload to the Hub repo ``repo_id``; see ``recurformer.hub.push_to_hub``."""
        from .hub import push_to_hub

        return push_to_hub(self, repo_id, **kwargs)

    @property
    def bounded_state(self) -> bool:
        """Whether the state stays the same size at any length (False for a full KV cache)."""
        return True

    @property
    def reset_boundary(self) -> int:
        """A row's state can be reset only after a multiple of this many tokens (the chunk,
        segment or block length of models that process tokens in groups; 1 otherwise)."""
        return 1

    def compile_layers(self) -> None:
        """``torch.compile`` each layer in place (regional compilation): identical layers share one
        compiled graph, so compiling costs about one layer however deep the model is. The
        embedding, the loss and the Python-side input checks stay eager."""
        for layer in self.layers:
            layer.compile()

    def info_lines(self) -> list[str]:
        """Extra architecture facts for ``recurformer info`` (e.g. state size formulas)."""
        return []

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def param_groups(self) -> dict[str, int]:
        """Parameter counts by top-level module (for ``recurformer info``)."""
        out: dict[str, int] = {}
        for name, p in self.named_parameters():
            key = name.split(".")[0] if not name.startswith("layers.") else "layers." + ".".join(name.split(".")[2:-1])
            out[key] = out.get(key, 0) + p.numel()
        return out


def _signature(state: State) -> list:
    """Layer counts and head/feature sizes of a state (not batch or sequence lengths)."""

    def sig(t: Tensor) -> tuple:
        return (t.dim(), t.shape[1] if t.dim() == 4 else None, t.shape[-1] if t.dim() > 1 else None)

    out = []
    for f in dataclasses.fields(state):
        v = getattr(state, f.name)
        if isinstance(v, Tensor):
            out.append((f.name, sig(v)))
        elif isinstance(v, list):
            out.append((f.name, [sig(t) for t in v]))
    return out


# ----------------------------------------------------------------------------------------------
# layers


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * g  (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class SwiGLU(nn.Module):
    """FFN(x) = W2 (silu(W1 x) * W3 x), no biases (Shazeer 2020; Llama)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin tables [..., head_dim/2] for integer ``positions``. Angles are computed in float64,
    so a position of 10^6 is as precise as position 10 (RoPE, Su et al. 2021)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    ang = positions.to(torch.float64).unsqueeze(-1) * inv_freq
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[i], x[i + d/2]) of ``x`` [B, H, T, d] by angles given as cos/sin [T, d/2]
    (or [B, 1, T, d/2])."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def split_heads(x: Tensor, n_heads: int) -> Tensor:
    """[B, T, H*d] -> [B, H, T, d]"""
    B, T, _ = x.shape
    return x.view(B, T, n_heads, -1).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """[B, H, T, d] -> [B, T, H*d]"""
    B, H, T, d = x.shape
    return x.transpose(1, 2).reshape(B, T, H * d)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
    """softmax(q k^T / sqrt(d) + mask) v via PyTorch SDPA. ``mask`` is boolean (True = visible),
    broadcastable to [B, H, Tq, Tk].

    Under CPU autocast the attention runs in float32: PyTorch's CPU flash-attention backward is
    2.5-4x slower in bf16 than in fp32 (benchmarks/throughput.py, docs/results.md §5), while the
    projections around it keep bf16."""
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            o = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, is_causal=causal and mask is None)
        return o.to(torch.get_autocast_dtype("cpu"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)


def alibi_slopes(n_heads: int, max_bias: float = 8.0) -> Tensor:
    """ALiBi head slopes m_h = 2^(-max_bias * h / H), h = 1..H (Press et al. 2022; for H a power
    of two these are the paper's slopes, otherwise the same geometric rule without MPT's fix)."""
    h = torch.arange(1, n_heads + 1, dtype=torch.float64)
    return torch.exp2(-max_bias * h / n_heads)
