"""Gated DeltaNet: Yang, Kautz & Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta
Rule" (ICLR 2025). A linear-attention layer whose state S (one [d_v, d_k] matrix per head) is
updated per token by the gated delta rule (§3, its formulation):

    S_t = a_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T,    o_t = S_t q_t

with q_t, k_t L2-normalised, a data-dependent decay a_t = exp(-softplus(W_a x_t + dt_bias) exp(A_log))
in (0, 1) (Mamba2's gate) and a data-dependent write strength b_t = sigmoid(W_b x_t + c_b) in (0, 1).
With a_t = 1 and b_t = 0 the state is left exactly unchanged: the layer can hold a fact over
any length of irrelevant input (§2-3). As the paper's block (§3, its block diagram): q, k, v pass a short
causal depthwise convolution (kernel ``conv_size``) and SiLU before the normalisation, and the
output is normalised per head (RMSNorm), gated by SiLU(W_g x) and projected by W_o:

    y_t = W_o (RMSNorm(o_t) * SiLU(W_g x_t))

The layer sits in the library's pre-norm block with a SwiGLU MLP, as the paper's models do.

Two exact forms of the recurrence (``ops/delta_rule``): ``delta_rule_naive`` (token by token, the
reference; it also decodes single tokens) and ``delta_rule_chunked`` (the paper's chunkwise WY/UT form,
§3, over chunks of ``chunk_size`` tokens, for training), equal to rounding in outputs, final state and
gradients (tests/ops/test_delta_rule.py). The chunk is a unit of compute only: a row can be reset at any
token, and any split of a text into calls gives the same result. On CUDA the chunked form is
flash-linear-attention's Triton kernel where ``fla-core[cuda]`` imports (``impl: auto``, the default;
``impl: fla`` insists, ``chunked`` / ``naive`` pick ours): the same arguments, parameters and state
(``ops/delta_rule/fla.py``).

Initialisation: W_a starts at zero, A_log at 0 and dt_bias at softplus^{-1}(-log ``decay_init``),
so a_t = ``decay_init`` (0.999 by default) on every input at first: a fact then halves in about
700 tokens before anything is learned, where Mamba2's initialisation (dt in [0.001, 0.1], A in
[1, 16], so a_t as low as exp(-1.6)) keeps almost nothing past a few tokens in its fastest heads. The bias c_b starts at logit(``write_init``).

``write_floor`` eps (not in the paper; 0, the default, is the paper's layer) passes the write
strength through a floor, b_t = max(0, sigmoid(W_b x_t + c_b) - eps) / (1 - eps): a sigmoid never
reaches 0, and a trained passkey model's filler writes of b_t ~ 0.005 erase its key over 10^5
tokens (docs/results/memory.md), while below the floor a token writes and erases exactly nothing,
as Mamba's step size can reach 0 on filler ("Mamba", Gu & Dao, §3.5). Above eps the gradient is
the sigmoid's, rescaled; ``synth.init_from`` may add a floor to a model trained without one.

``decay_floor`` delta (not in the paper; 0, the default, is the paper's layer) does the same for
the decay, in log space: g_t = min(0, log a_t + delta), so a token that decays the state by less
than delta (per token) decays it exactly not at all, and a stronger decay is delta weaker. A
trained passkey model's filler decays of log a_t ~ -1e-5..-2e-4 per token shrink its key over
10^4-10^5 tokens against the recent filler that its heads keep writing (docs/results/memory.md);
below the floor a head holds what it has exactly. delta must stay below -log ``decay_init``, the
decay at initialisation, else every g_t starts at 0 and the decay gets no gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import RecurformerError, opt, option
from ..modules import RMSNorm, acc_dtype, init_short_conv, short_conv
from ..nn import Block, ModelConfig, StreamingLM
from ..ops.delta_rule import delta_rule_chunked, delta_rule_naive
from ..ops.delta_rule.fla import FLA_CHUNKS, delta_rule_fla, use_fla
from ..registry import register, register_layer
from ..stack import Layer
from ..state import Call, LayerState, reset_rows


@dataclass
class GatedDeltaNetConfig(ModelConfig):
    context_field = "window"  # of the hybrid stacks' window layers (a delta layer reaches back without bound)
    retrain_keys = ("write_floor", "decay_floor", "chunk_size", "impl")
    # tokens per chunk of the chunked (WY) form; compute only, the result is the same
    chunk_size: int = option(64, range=">= 1")
    # kernel of the causal depthwise convolution on q, k, v (1: a per-channel scale)
    conv_size: int = option(4, range=">= 1")
    decay_init: float = option(0.999, range="(0, 1)")  # a_t at initialisation, on every input (W_a starts at zero)
    # sigmoid(c_b) at initialisation where W_b x = 0 (bias logit(write_init))
    write_init: float = option(0.5, range="(0, 1)")
    write_floor: float = 0.0  # eps: b_t = max(0, sigmoid(.) - eps) / (1 - eps), exactly 0 below eps (0: the paper's)
    decay_floor: float = 0.0  # delta: log a_t = min(0, log a_t + delta), exactly no decay above -delta (0: the paper's)
    # the recurrence over a call of several tokens: "chunked" (ours), "naive" (per token), "fla"
    # (flash-linear-attention's kernel, CUDA only), "auto" (fla on CUDA where it imports, else chunked)
    impl: Literal["auto", "chunked", "naive", "fla"] = option("auto")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.write_floor < self.write_init:
            raise RecurformerError(
                f"config key 'write_floor' must be >= 0 and below write_init = {self.write_init} "
                f"(else every write is 0 at initialisation and b_t gets no gradient), got {self.write_floor}"
            )
        if not 0.0 <= self.decay_floor < -math.log(self.decay_init):
            raise RecurformerError(
                f"config key 'decay_floor' must be >= 0 and below -log(decay_init) = {-math.log(self.decay_init):.4g} "
                f"(else no token decays at initialisation and a_t gets no gradient), got {self.decay_floor}"
            )
        if self.impl == "fla" and self.chunk_size not in FLA_CHUNKS:
            raise RecurformerError(
                f"config key 'model.chunk_size' must be 16, 32 or 64 for flash-linear-attention's kernel "
                f"({opt('model.impl', 'fla')}), got {self.chunk_size}: use {opt('model.chunk_size', 64)}"
            )


@dataclass
class DeltaState(LayerState):
    """``S`` [B, H, d, d]: each head's state (values x keys); ``conv`` [B, K-1, 3D]: the last K-1
    projected q/k/v inputs of the causal convolution (zeros before a document's first token)."""

    S: Tensor
    conv: Tensor


class GatedDeltaNetLayer(Layer):
    """The Gated DeltaNet token mixer (see the module docstring); its state is ``DeltaState``."""

    kind = "delta"
    state_cls = DeltaState

    def __init__(self, cfg: GatedDeltaNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        D, H = cfg.dim, cfg.n_heads
        self.wq = nn.Linear(D, D, bias=False)
        self.wk = nn.Linear(D, D, bias=False)
        self.wv = nn.Linear(D, D, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(3 * D, cfg.conv_size))  # depthwise, over [q; k; v]
        self.wa = nn.Linear(D, H, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.A_log = nn.Parameter(torch.empty(H))
        self.wb = nn.Linear(D, H)
        self.wg = nn.Linear(D, D, bias=False)
        self.out_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.wo = nn.Linear(D, D, bias=False)
        self.init_extra(cfg.init_std)

    def init_extra(self, std: float) -> None:
        """a_t = decay_init and b_t ~ write_init on every input; the convolution as PyTorch's
        Conv1d default (uniform, bound 1/sqrt(K))."""
        with torch.no_grad():
            nn.init.zeros_(self.wa.weight)
            nn.init.zeros_(self.A_log)
            rate = -math.log(self.cfg.decay_init)  # softplus(dt_bias) * exp(0)
            self.dt_bias.fill_(rate + math.log(-math.expm1(-rate)))  # softplus^{-1}(rate)
            self.wb.bias.fill_(math.log(self.cfg.write_init / (1 - self.cfg.write_init)))
            init_short_conv(self.conv_weight)

    def describe(self) -> str:
        return f"delta(K={self.cfg.conv_size})"

    def init_state(self, batch_size: int, device: torch.device | str | None, dtype: torch.dtype) -> DeltaState:
        H, d, D = self.cfg.n_heads, self.cfg.head_dim, self.cfg.dim
        return DeltaState(
            S=torch.zeros(batch_size, H, d, d, device=device, dtype=dtype),
            conv=torch.zeros(batch_size, self.cfg.conv_size - 1, 3 * D, device=device, dtype=dtype),
        )

    def reset(self, state: DeltaState, fresh: Tensor) -> DeltaState:
        return DeltaState(
            S=reset_rows(fresh, state.S, state.S.new_zeros(())),
            conv=reset_rows(fresh, state.conv, state.conv.new_zeros(())),
        )

    def gates(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Write strengths b = sigmoid(W_b x + c_b) (with ``write_floor`` eps: max(0, b - eps) /
        (1 - eps)) and log-decays g = log a = -softplus(W_a x + dt_bias) exp(A_log) (with
        ``decay_floor`` delta: min(0, g + delta)), each [B, H, T]."""
        xt = x.transpose(1, 2)  # [B, D, T]: the gates come out [B, H, T] contiguous (a compiled
        # backward fails on the transposed gradient of a [B, T, H] projection)
        b = torch.sigmoid(self.wb.weight @ xt + self.wb.bias[:, None])
        if eps := self.cfg.write_floor:
            b = (b - eps).clamp_min(0.0) / (1.0 - eps)
        g = -F.softplus(self.wa.weight @ xt + self.dt_bias[:, None]) * self.A_log.exp()[:, None]
        if delta := self.cfg.decay_floor:
            g = (g + delta).clamp_max(0.0)
        return b, g

    def forward(self, x: Tensor, state: DeltaState, call: Call) -> tuple[Tensor, DeltaState]:
        """x [B, T, D] (normed) -> (y [B, T, D], the new state)."""
        T, D = x.shape[1], x.shape[2]
        H, d = self.cfg.n_heads, self.cfg.head_dim
        # q, k, v and the output gate's input in one matmul (the weights side by side)
        qkv, gate = F.linear(x, torch.cat((self.wq.weight, self.wk.weight, self.wv.weight, self.wg.weight))).split(
            (3 * D, D), dim=-1
        )
        c, conv = short_conv(qkv, state.conv, self.conv_weight)
        q, k, v = (t.unflatten(-1, (H, d)).transpose(1, 2) for t in c.split(D, dim=-1))  # [B, H, T, d]
        b, g = self.gates(x)
        f = acc_dtype(q.dtype)  # the recurrence in float32 at least, autocast off
        with torch.autocast(x.device.type, enabled=False):
            args = (F.normalize(q.to(f), dim=-1), F.normalize(k.to(f), dim=-1), v.to(f), b.to(f), g.to(f))
            if self.cfg.impl == "naive" or T == 1:
                o, S = delta_rule_naive(*args, state.S.to(f))
            elif self.cfg.impl != "chunked" and use_fla(self.cfg.impl, x.device, self.cfg.chunk_size):
                # q, k, v in the projections' dtype (bf16 under autocast, as fla's own layers call it;
                # the kernel accumulates in float32), the gates and the state in float32 at least
                qk = (args[0].to(q.dtype), args[1].to(q.dtype))
                o, S = delta_rule_fla(*qk, v, *args[3:], state.S.to(f), self.cfg.chunk_size)
            else:
                o, S = delta_rule_chunked(*args, state.S.to(f), self.cfg.chunk_size)
        o = self.out_norm(o.transpose(1, 2).to(x.dtype)) * F.silu(gate).unflatten(-1, (H, d))
        y = self.wo(o.flatten(2))
        return y, DeltaState(S=S.to(state.S.dtype), conv=conv)


@register_layer("delta", GatedDeltaNetConfig)
def delta_layer(cfg: GatedDeltaNetConfig, index: int) -> Layer:
    return Block(cfg, GatedDeltaNetLayer(cfg))


class GatedDeltaNet(StreamingLM):
    kind = "delta"


register(
    "gated_deltanet",
    GatedDeltaNetConfig,
    GatedDeltaNet,
    "Gated DeltaNet: linear attention whose per-head matrix state follows the gated delta rule",
)
