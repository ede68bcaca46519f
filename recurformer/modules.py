"""Building blocks in plain PyTorch, importing nothing of the package: RMSNorm, the MLP (SwiGLU or
ReLU), the short causal convolution (a function, and a module with its piece of state), the
closed-at-initialisation memory write gate, RoPE with arbitrary positions, ALiBi slopes, attention helpers over PyTorch SDPA, and ``pieces``, which splits a call into chunks /
segments / blocks at the current offset."""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, Literal, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import handle_torch_function, has_torch_function

Fn = TypeVar("Fn", bound=Callable[..., Tensor])


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulators for half types, otherwise the input dtype (float64 stays float64)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _rms_normalize(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """r = 1 / sqrt(mean(x^2) + eps) in at least float32, and n = x r in x's dtype."""
    xf = x.to(acc_dtype(x.dtype))
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return r, (xf * r).to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    """y = n * g with n = (x r) in x's dtype, r = 1 / sqrt(mean(x^2) + eps) in at least float32,
    and its gradient written out: dg = sum(dy * n), dx = r (dn - x r^2 mean(dn * x)) with
    dn = dy * g. Fewer passes over x than autograd's graph of the same ops (pow, mean, rsqrt, two
    products and their backwards); equal to it to rounding (tests/test_modules.py). Returns
    (y, r, n), r and n not differentiable; a separate ``setup_context`` lets ``torch.func``
    transforms (``vjp``) run it."""

    @staticmethod
    def forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
        r, n = _rms_normalize(x, eps)
        return n * weight, r, n

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor, float], output: tuple[Tensor, Tensor, Tensor]) -> None:
        _, r, n = output
        ctx.mark_non_differentiable(r, n)
        ctx.set_materialize_grads(False)  # no zero gradients filled in for r and n
        ctx.save_for_backward(inputs[0], inputs[1], r, n)

    @staticmethod
    def backward(ctx: Any, dy: Tensor, *_: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, weight, r, n = ctx.saved_tensors
        dw = (dy * n).flatten(0, -2).sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        if not ctx.needs_input_grad[0]:
            return None, dw, None
        xf = x.to(acc_dtype(x.dtype))
        dn = (dy * weight).to(xf.dtype)
        dx = (dn - xf * (r * r * (dn * xf).mean(-1, keepdim=True))) * r
        return dx.to(x.dtype), dw, None


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * g  (Zhang & Sennrich 2019), the normalisation in at least
    float32, rounded to x's dtype before the gain (as Llama)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return cast(Tensor, _RMSNorm.apply(x, self.weight, self.eps)[0])
        return _rms_normalize(x, self.eps)[1] * self.weight  # no graph: the ops alone, fewer calls (decoding)


class MLP(nn.Module):
    """d_in -> hidden -> d_out, no biases. swiglu: W2 (silu(W1 x) * W3 x) (Shazeer 2020; Llama);
    relu: W2 relu(W1 x). ``hidden(x)`` is the activation fed to W2 (what LSTM-style gates read)."""

    def __init__(
        self, dim: int, hidden: int, out: int | None = None, kind: Literal["swiglu", "relu"] = "swiglu"
    ) -> None:
        super().__init__()
        self.kind = kind
        self.w1 = nn.Linear(dim, hidden, bias=False)
        if kind == "swiglu":
            self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim if out is None else out, bias=False)

    def hidden(self, x: Tensor) -> Tensor:
        return F.silu(self.w1(x)) * self.w3(x) if self.kind == "swiglu" else F.relu(self.w1(x))

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.hidden(x))


def short_conv(x: Tensor, cache: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """The short causal depthwise convolution with SiLU of H3, Mamba and Gated DeltaNet (Yang,
    Kautz & Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule", §3, the block
    diagram), per channel c with kernel K:

        y_t[c] = SiLU(sum_{j=0}^{K-1} weight[c, j] x_{t-K+1+j}[c])

    over x [B, T, C], continued from ``cache`` [B, K-1, C], the K-1 inputs before x (zeros at a
    document start). Returns y [B, T, C] and the new cache (the last K-1 inputs, in its dtype)."""
    xc = torch.cat((cache.to(x.dtype), x), dim=1)
    y = F.silu(F.conv1d(xc.transpose(1, 2), weight.unsqueeze(1), groups=x.shape[2])).transpose(1, 2)
    return y, xc[:, x.shape[1] :].to(cache.dtype)


def init_short_conv(weight: Tensor) -> None:
    """``short_conv``'s weight [C, K] as PyTorch's Conv1d default: uniform, bound 1/sqrt(K)."""
    bound = 1 / math.sqrt(weight.shape[1])
    nn.init.uniform_(weight, -bound, bound)


class ShortConvolution(nn.Module):
    """``short_conv`` as a module with its own piece of state (as flash-linear-attention's
    ``ShortConvolution``): the weight [C, K] (``weight``), initialised by ``init_extra`` as
    PyTorch's Conv1d (``init_short_conv``), and the state piece, the last K-1 inputs [B, K-1, C]
    (``init_state``: zeros, as at a document start; ``reset``: zeros in the fresh rows;
    ``check_state``: its shape).
    ``forward(x, cache)`` continues the convolution from ``cache`` (None: from zeros in x's dtype)
    and returns the output and the new cache. An owner registers it before its other modules: its
    weight then comes right after the owner's own parameters, and its ``init_extra`` runs right
    after the owner's (the order of the random draws from a seed)."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel))

    def init_extra(self, std: float) -> None:
        init_short_conv(self.weight)

    def init_state(self, batch_size: int, device: torch.device | str | None, dtype: torch.dtype) -> Tensor:
        C, K = self.weight.shape
        return torch.zeros(batch_size, K - 1, C, device=device, dtype=dtype)

    def reset(self, cache: Tensor, fresh: Tensor) -> Tensor:
        """``cache`` with the rows where ``fresh`` back to zero."""
        return torch.where(fresh.view(-1, 1, 1), cache.new_zeros(()), cache)

    def check_state(self, cache: Tensor | None) -> str | None:
        """None if ``cache`` fits (the state's field ``conv``), else what is wrong."""
        if cache is None:
            return "'conv' is missing"
        want = (cache.shape[0], self.weight.shape[1] - 1, self.weight.shape[0])
        return None if cache.shape == want else f"'conv' has shape {tuple(cache.shape)}, expected {want}"

    def forward(self, x: Tensor, cache: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if cache is None:
            cache = x.new_zeros(x.shape[0], self.weight.shape[1] - 1, x.shape[2])
        return short_conv(x, cache, self.weight)


class WriteGate(nn.Module):
    """A memory write that holds unless the new content opens it, closed at initialisation:

        g = sigmoid(W_g W + b_g),    M_new = M + g * (W - M)

    per slot and channel, W [.., D] the candidate (what the segment would write), M the memory
    carried so far. The keep path is the identity (no norm, no gain): g = 0 leaves M exactly
    unchanged. This is the selective state space update with one state and A = -1, whose step
    reduces to h_t = (1 - g_t) h_{t-1} + g_t x_t with g_t = sigmoid(Linear(x_t)) (Gu & Dao,
    "Mamba: Linear-Time Sequence Modeling with Selective State Spaces", §3.5.1, Theorem 1); b_g
    starts at -5 (g ~ 0.007: closed, as Mamba's step size starts small), W_g as every weight."""

    closed = -5.0

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def init_extra(self, std: float) -> None:
        nn.init.constant_(self.proj.bias, self.closed)

    def forward(self, memory: Tensor, new: Tensor) -> Tensor:
        return memory + torch.sigmoid(self.proj(new)) * (new - memory)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin tables [..., head_dim/2] for integer ``positions``. Angles are computed in float64,
    so a position of 10^6 is as precise as position 10 (RoPE, Su et al. 2021)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    ang = positions.to(torch.float64).unsqueeze(-1) * inv_freq
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, sign: float) -> Tensor:
    """[x1 c - sign x2 s, x2 c + sign x1 s] for the halves x1, x2 of x's last dimension, written
    into one new tensor: two passes per half and no cat. sign = -1 rotates back (the transpose)."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    half = torch.broadcast_shapes(x1.shape, cos.shape)
    # in x's memory layout (heads split off a [B, T, D] projection are a transposed view): the
    # gradient then reaches that projection without a copy
    y = torch.empty_like(x) if half == x1.shape else x.new_empty(*half[:-1], 2 * h)
    y1, y2 = y[..., :h], y[..., h:]
    torch.mul(x1, cos, out=y1).addcmul_(x2, sin, value=-sign)
    torch.mul(x2, cos, out=y2).addcmul_(x1, sin, value=sign)
    return y


class _RoPE(torch.autograd.Function):
    """y = R(θ) x on each pair, and its gradient dx = R(θ)^T dy = R(-θ) dy written out: one
    rotation each way, where autograd's graph of the same products takes four products, a negation,
    two sums and a cat in the backward. cos/sin are tables (no gradient). Equal to the plain ops to
    rounding (tests/test_modules.py). A separate ``setup_context`` lets ``torch.func`` run it."""

    @staticmethod
    def forward(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return _rotate(x, cos, sin, 1.0)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
        ctx.save_for_backward(inputs[1], inputs[2])

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(dy, cos, sin, -1.0), None, None


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[i], x[i + d/2]) of ``x`` [B, H, T, d] by angles given as cos/sin [T, d/2]
    (or [B, 1, T, d/2]): x[i] cos - x[i + d/2] sin, x[i + d/2] cos + x[i] sin."""
    x = x.to(torch.promote_types(x.dtype, cos.dtype))  # the result's dtype: one cast, not one per mixed-dtype product
    if torch.is_grad_enabled() and x.requires_grad and not torch.compiler.is_compiling():
        return cast(Tensor, _RoPE.apply(x, cos, sin))
    # no graph: the plain ops, fewer calls (one token: 15 us, against 31 us written out); compiled:
    # the compiler fuses them (and does not take the out= writes)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def qkvo(dim: int) -> tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear]:
    """W_q, W_k, W_v, W_o of an attention layer: bias-free [dim, dim] linears, made (so drawn at
    initialisation) in that order; assign them in that order to keep the state_dict's."""
    wq, wk, wv, wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
    return wq, wk, wv, wo


def split_heads(x: Tensor, n_heads: int) -> Tensor:
    """[B, T, H*d] -> [B, H, T, d]"""
    B, T, D = x.shape
    return x.view(B, T, n_heads, D // n_heads).transpose(1, 2)


def project_heads(x: Tensor, weights: tuple[Tensor, ...], heads: tuple[int, ...]) -> list[Tensor]:
    """x [B, T, D_in] through ``weights`` [D_i, D_in] side by side in one matmul, the output cut
    into parts of ``heads`` heads each (of the same head size) and split: [B, h_j, T, d] per part.
    One matmul, and one per input in the backward, instead of one per weight."""
    y = F.linear(x, torch.cat(weights))
    d = y.shape[-1] // sum(heads)
    return [split_heads(p, h) for p, h in zip(y.split([h * d for h in heads], dim=-1), heads)]


def merge_heads(x: Tensor) -> Tensor:
    """[B, H, T, d] -> [B, T, H*d]"""
    B, H, T, d = x.shape
    return x.transpose(1, 2).reshape(B, T, H * d)


def group_heads(q: Tensor, kv_heads: int) -> Tensor:
    """Grouped-query attention (Ainslie et al. 2023, "GQA: Training Generalized Multi-Query
    Transformer Models from Multi-Head Checkpoints", §2.2) as one attention per key/value head:
    queries [B, H, T, d] -> [B, Hkv, (H/Hkv) T, d], the queries of the H/Hkv heads that share a
    key/value head stacked along time (heads j H/Hkv ... (j + 1) H/Hkv - 1 read key/value head j).
    A bias [H, T, Tk] goes the same way (``group_bias``); ``ungroup_heads`` undoes it. Unchanged
    when Hkv = H."""
    B, H, T, d = q.shape
    return q if H == kv_heads else q.reshape(B, kv_heads, (H // kv_heads) * T, d)


def group_bias(b: Tensor, n_heads: int, kv_heads: int) -> Tensor:
    """An additive bias [H or 1, T, Tk] -> [Hkv, (H/Hkv) T, Tk], as ``group_heads`` groups the queries."""
    if n_heads == kv_heads:
        return b
    _, T, Tk = b.shape
    return b.expand(n_heads, T, Tk).reshape(kv_heads, (n_heads // kv_heads) * T, Tk)


def ungroup_heads(o: Tensor, n_heads: int) -> Tensor:
    """The inverse of ``group_heads``: [B, Hkv, (H/Hkv) T, d] -> [B, H, T, d]."""
    B, G, GT, d = o.shape
    return o if G == n_heads else o.reshape(B, n_heads, GT * G // n_heads, d)


AnyFn = TypeVar("AnyFn", bound=Callable[..., Any])


def compiled_region(fn: AnyFn) -> AnyFn:
    """``fn``, the body of a loop over chunks (segments, blocks), as a compiled region
    (``torch.compiler.nested_compile_region``): compiled, it is traced once and the same graph runs
    at every call of the same shapes (one ``invoke_subgraph``), where the loop would be unrolled;
    eagerly ``fn`` itself. Its arguments are tensors, lists of them and the module.

    A region serves forward-only calls (evaluation, generation, a compiled model under
    ``torch.no_grad``). Where gradients are recorded it is inlined: torch 2.13's inductor gives
    wrong gradients through ``invoke_subgraph`` (Gated DeltaNet's write-gate bias: relative error
    4.7 against float64, 6e-6 inlined; tests/test_compiled_regions.py), and dynamo's tracing of a
    backward inside the graph (``trace_autograd_ops``, tests/test_capture.py) does not run it."""
    region = torch.compiler.nested_compile_region(fn)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        inline = torch.is_grad_enabled() or torch._dynamo.config.trace_autograd_ops
        return (fn if inline else region)(*args, **kwargs)

    return cast(AnyFn, run)


def float32_under_cpu_autocast(fn: Fn) -> Fn:
    """``fn`` run in float32 under CPU autocast: its floating tensor arguments cast once, autocast
    off inside, the output cast to the autocast dtype; as it is otherwise. For attention, whose
    CPU flash-attention backward is 2.5-4x slower in bf16 than in fp32 (benchmarks/throughput.py),
    while the projections around it keep bf16."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Tensor:
        t = next(a for a in args if isinstance(a, Tensor))
        if t.device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
            return fn(*args, **kwargs)
        f32 = [a.float() if isinstance(a, Tensor) and a.is_floating_point() else a for a in args]
        with torch.autocast("cpu", enabled=False):
            o = fn(*f32, **kwargs)
        return o.to(torch.get_autocast_dtype("cpu"))

    return cast(Fn, run)


# SDPA's CUDA kernels other than cuDNN's. On an H200 with torch 2.11, bf16 training at 125M
# parameters failed in cuDNN's attention backward ("mha_graph.execute(...).is_good()", then an
# illegal memory access) and ran with cuDNN's kernel disabled (docs/results/gpu.md); PyTorch issue
# #196678 reports NaN query gradients from it with an explicit mask on H100/H200 since 2.11.
CUDA_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@float32_under_cpu_autocast
def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
    """softmax(q k^T / sqrt(d) + mask) v via PyTorch SDPA. ``mask`` is boolean (True = visible) or
    additive, broadcastable to [B, H, Tq, Tk]. In float32 under CPU autocast; on CUDA through the
    flash, memory-efficient or math kernel, never cuDNN's (``CUDA_SDPA``)."""
    with sdpa_kernel(CUDA_SDPA) if q.is_cuda else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)


def grouped_attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``attend`` without a mask of queries [B, H, T, d] over keys/values [B, Hkv, Tk, d] whose
    Hkv heads are each shared by H / Hkv query heads (``group_heads``); [B, H, T, d]."""
    return ungroup_heads(attend(group_heads(q, k.shape[1]), k, v), q.shape[1])


@float32_under_cpu_autocast
def biased_attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
    """softmax(q k^T + bias) v, written out: ``q`` comes scaled (no 1/sqrt(d) here), ``bias`` is
    additive (-inf = hidden, every row with a visible key), broadcastable to [..., Tq, Tk]; any
    number of batch dimensions. For a bias that needs a gradient (a learned relative bias), which
    sends PyTorch's SDPA down its math path anyway, with a check for fully masked rows on top.
    In float32 under CPU autocast. ``recurformer.flops`` counts it as SDPA: by the (query, key)
    pairs the bias shows."""
    if has_torch_function((q, k, v, bias)):  # lets recurformer.flops count the call
        return handle_torch_function(biased_attend, (q, k, v, bias), q, k, v, bias)
    return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-1, -2)) + bias, dim=-1), v)


class _CrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``logits`` [N, V] against ``targets`` [N], with the gradient computed in
    the forward, block by block of rows: softmax - one-hot, scaled by 1 / (scored rows) and stored
    in the logits' dtype. One pass over the logits per block, the float32 block staying in cache,
    and one scaling pass in the backward, where autograd's log-softmax and NLL take about five
    passes over [N, V] float32 and keep the log-probabilities alive. Exact to rounding against
    ``F.cross_entropy`` (tests/test_modules.py)."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, ignore_index: int) -> Tensor:
        N, V = logits.shape
        acc = acc_dtype(logits.dtype)
        keep = targets != ignore_index
        t = targets.masked_fill(~keep, 0)
        n = keep.sum()
        w = keep.to(acc) / n.clamp(min=1)  # a row's share of the mean; 0 where ignored
        grad = torch.empty_like(logits)
        total = torch.zeros((), dtype=acc, device=logits.device)
        rows = max(1, (1 << 18) // V) if logits.device.type == "cpu" else N  # a 1 MiB float32 block on the CPU
        with torch.autocast(logits.device.type, enabled=False):
            for s in range(0, N, rows):
                e = min(s + rows, N)
                logp = torch.log_softmax(logits[s:e], -1, dtype=acc)
                total -= (logp.gather(1, t[s:e, None]).squeeze(1) * keep[s:e]).sum()
                p = torch.exp(logp, out=logp)
                p[torch.arange(e - s, device=p.device), t[s:e]] -= 1
                torch.mul(p, w[s:e, None], out=grad[s:e])
        ctx.save_for_backward(grad)
        return total / n  # nan when every target is ignored, as F.cross_entropy

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None]:
        (grad,) = ctx.saved_tensors
        if grad_out.device.type == "cpu" and bool(grad_out == 1):  # the usual loss.backward(): skip a pass
            return grad, None, None
        return grad * grad_out.to(grad.dtype), None, None


def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """``F.cross_entropy`` (the mean over the targets that are not ``ignore_index``) of logits
    [N, V], computed in float32 for float16/bfloat16 logits and in their own dtype otherwise.
    Training on float16/bfloat16 logits goes through ``_CrossEntropy``, which saves the gradient
    in their dtype instead of float32 log-probabilities, in about a third of the time on the CPU
    (benchmarks/cross_entropy.py; on float32 logits PyTorch's own is as fast). Targets must lie in
    [0, V) or equal ``ignore_index``."""
    acc = acc_dtype(logits.dtype)
    if acc != logits.dtype and torch.is_grad_enabled() and logits.requires_grad:
        return cast(Tensor, _CrossEntropy.apply(logits, targets, ignore_index))
    return F.cross_entropy(logits.to(acc), targets, ignore_index=ignore_index)


def alibi_slopes(n_heads: int, max_bias: float = 8.0) -> Tensor:
    """ALiBi head slopes m_h = 2^(-max_bias * h / H), h = 1..H (Press et al. 2022; for H a power
    of two these are the paper's slopes, otherwise the same geometric rule without MPT's fix)."""
    h = torch.arange(1, n_heads + 1, dtype=torch.float64)
    return torch.exp2(-max_bias * h / n_heads)


def pieces(offset: int, T: int, size: int) -> list[int]:
    """Lengths of the pieces of a call of T tokens that starts ``offset`` tokens into a chunk of
    ``size``: the rest of the current chunk, whole chunks, then a partial one. Sums to T."""
    first = min(size - offset, T)
    whole, rest = divmod(T - first, size)
    return [first] + [size] * whole + ([rest] if rest else [])
