"""Training throughput of recurformer's models beside the implementations a researcher would
otherwise use, each pair at the same dim, depth, heads, window / segment / memory sizes and batch,
fp32 or bf16 (``--precision``), training steps (forward + backward + AdamW) timed A B A B
interleaved, warm-up rounds discarded; reported as median tokens/s, the median of the per-round
ratios ours / theirs with its 95% interval and spread (min-max), and the same ratio per FLOP.

The interval is distribution-free: the order statistics r_(k) <= median <= r_(n+1-k) of n
per-round ratios, with the largest k whose binomial tail P(Bin(n, 1/2) < k) is at most 2.5%
(n = 7: min-max, 98%; n = 15: r_(4)-r_(12), 96%); it needs n >= 6. ``--until W`` keeps adding
rounds, up to ``--max-rounds``, until that interval is at most W wide: machine noise of 10-15% per
step leaves a 7-round interval wider than the few percent a comparison may turn on.

``--processes K`` times each pair in K fresh pairs of worker processes, one pair after another,
the side that steps first (and starts first) alternating. Rounds within one process pair share
that pair's bias (where each process's memory landed, which side warmed the caches), which the
interval over rounds does not hold: two runs of the same tree against itself (``--base HEAD``,
a Llama of dim 64 x 2 layers, one thread) gave 0.96 (0.81-0.99) and 1.06 (1.03-1.09). With K > 1
the ratio is the median of the K process pairs' median ratios and its interval is over those
(K >= 6).

Pairs (ours vs theirs):
  transformer_xl   vs x-transformers' ``TransformerWrapper(max_mem_len=...)``, segments of L with
                      the previous segment's hidden states as memory (XL recurrence), memory detached
  block_recurrent  vs lucidrains' block-recurrent-transformer-pytorch, block width = window = states,
                      one key/value head on both sides (the peer's multi-query attention; ours
                      at its default of one per query head: ``--ours-set kv_heads=null``)
  rmt              vs lucidrains' recurrent-memory-transformer-pytorch (rotary positions,
                      one residual stream, no XL memories, no memory replay)
  llama            vs x-transformers' ``Decoder`` (rotary, RMSNorm, SwiGLU of Llama's width)
  memory_attention vs the Memory Attention authors' llama2Rnn code (only with ``--llama2rnn PATH``,
                      a checkout of siyuanseever/llama2Rnn; memseqlen = chunk)

The peers are installed with pip into a scratch venv (``--venv``, default ``out/peers-venv``,
created when missing; ``--no-install`` uses it as it is), never vendored and never imported by the
package. Every model, ours and theirs, runs in its own subprocess (this script with ``--worker``):
ours under this interpreter, theirs under the venv's, so the two torch installations never mix;
the parent tells each to take one step in turn and reads back its time. A peer that fails to
install, import or build is named in one line and its pair skipped.

FLOP/token: ours from ``recurformer.flops.train_flops_per_token``; theirs counted the same way in
their process (one forward of batch 1 over the sequence under
``torch.utils.flop_counter.FlopCounterMode``, SDPA calls by the (query, key) pairs their mask
shows, x 3 for a training step). Where the counts differ the peer does different work (a wider
FFN, extra tokens, recomputed memory), and the per-FLOP ratio compares achieved FLOP/s.

``--precision bf16`` runs each side's forward and loss under ``torch.autocast("cpu", torch.bfloat16)``
in its own process (backward and AdamW outside it, as the trainer does), the same autocast for both;
what each implementation then does inside it is its own (ours runs attention in fp32 on CPU). The
FLOP count is the same in both precisions.

    python benchmarks/peers.py [--threads 1] [--dim 128 --depth 4 --heads 4 --batch 4 --seq 256]
    python benchmarks/peers.py --llama2rnn /path/to/llama2Rnn --pairs memory_attention --precision bf16
    python benchmarks/peers.py --pairs block_recurrent --ours-set position=rope   # ours with the peer's positions

Both sides run under one OpenMP wait policy (``--wait-policy``): PASSIVE by default, as the
``recurformer`` command line sets it (a waiting thread sleeps at once), or OpenMP's default (spin a
while, then sleep) or ACTIVE (spin), as a user of the peer's code may run it.

``--ours-set KEY=VALUE`` configures our side of every pair (checked before anything runs) to put
an option of ours closer to what the peer does; the JSON's config records it.

``--base REV`` (a git revision of this checkout, or a directory holding another source tree) puts
our model as that tree builds it in the peer's place: the same pair configuration, the two trees'
steps interleaved A B with the same interval, for a change's before and after in one run:

    python benchmarks/peers.py --base HEAD~1 --pairs memory_attention --precision bf16 --until 0.05
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {  # pip name: the peer pairs that need it
    "x-transformers": ("transformer_xl", "llama"),
    "block-recurrent-transformer-pytorch": ("block_recurrent",),
    "recurrent-memory-transformer-pytorch": ("rmt",),
}
PEER_NAMES = {
    "transformer_xl": "x-transformers XL",
    "block_recurrent": "lucidrains BRT",
    "rmt": "lucidrains RMT",
    "llama": "x-transformers decoder",
    "memory_attention": "llama2Rnn (authors)",
}
DIFFERS = {  # what the peer computes differently, beyond the FLOP count measured in the run
    "transformer_xl": "rotary positions (ours: XL's relative R with u, v biases)",
    "block_recurrent": "rotary + xpos, LayerNorm, GEGLU; ours T5 bias, qk-norm, RMSNorm, SwiGLU",
    "rmt": "null key/value, value residuals, GEGLU, separate write tokens",
    "llama": "same layout (tied embedding, rotary, RMSNorm, SwiGLU)",
    "memory_attention": "the paper's configuration on both sides (memseqlen = chunk)",
}
Step = Callable[[], None]
Built = tuple[torch.nn.Module, Step, Callable[[torch.Tensor], Any]]  # model, one step, a forward on [1, T]


# ---- the worker: builds one model and times one step per line on stdin ----


class _CountAttention(TorchFunctionMode):
    """SDPA (and our written-out ``biased_attend``) counted by the (query, key) pairs its mask
    shows, as ``recurformer.flops`` does, and not run (zeros of the output's shape), so the FLOP
    counter never sees a dense kernel. A copy, because the peer's process cannot import our
    package; tests/benchmarks/test_peers.py holds the two equal."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "biased_attend":  # recurformer.modules': q, k, v, additive bias
            (q, k, v, mask), causal = args, False
        elif func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        else:
            q, k, v = args[:3]
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
        lead, (Lq, d), Lk = q.shape[:-2], q.shape[-2:], k.shape[-2]  # lead: batch, heads
        if mask is not None:  # boolean, or additive (-inf = hidden)
            visible = mask if mask.dtype == torch.bool else mask != float("-inf")
            pairs = int(torch.broadcast_to(visible, (*lead, Lq, Lk)).sum())
        elif causal:  # aligned top-left: query i sees keys 0..i
            pairs = lead.numel() * sum(min(Lk, i + 1) for i in range(Lq))
        else:
            pairs = lead.numel() * Lq * Lk
        self.flops += 2 * pairs * (d + v.shape[-1])
        return q.new_zeros(*q.shape[:-1], v.shape[-1])


def peer_train_flops(model: torch.nn.Module, forward: Callable[[torch.Tensor], Any], T: int) -> float:
    """FLOPs of one forward over T tokens (batch 1, fresh state) per token, x 3 for a training step.
    Grad stays enabled (the graph is dropped unused): llama2Rnn's forward trips the counter's module
    tracker under no_grad; the count is the same."""
    x = torch.zeros(1, T + 1, dtype=torch.long)
    counter, attention = FlopCounterMode(display=False), _CountAttention()
    model.eval()
    try:
        with counter, attention:
            forward(x)
    finally:
        model.train()
    return 3 * (counter.get_total_flops() + attention.flops) / T


def train_step(model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor], precision: str) -> Step:
    """Forward and loss under CPU bf16 autocast when ``precision`` is bf16, backward and AdamW outside it."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def ours_values(pair: str, c: dict) -> dict[str, Any]:
    """Our model's config values for a pair: the shared sizes, the pair's own, then ``--ours-set``."""
    base = dict(vocab_size=c["vocab"], dim=c["dim"], n_layers=c["depth"], n_heads=c["heads"])
    extra = {
        "transformer_xl": dict(segment_len=c["segment"], mem_len=c["segment"]),
        "block_recurrent": dict(block_size=c["segment"], num_states=c["segment"], kv_heads=1),
        "rmt": dict(segment_len=c["segment"], memory_size=c["memory"]),
        "llama": {},
        "memory_attention": dict(chunk_size=c["chunk"], memory_qkv="shared"),
    }[pair]
    return {**base, **extra, **c["ours_set"]}


def build_ours(pair: str, c: dict, root: Path = ROOT) -> tuple[torch.nn.Module, Step, float]:
    """Our model of ``pair`` as the source tree at ``root`` builds it (this one, or ``--base``)."""
    sys.path.insert(0, str(root))  # run from a checkout without installing
    from recurformer import build_model
    from recurformer.flops import train_flops_per_token

    model = build_model(pair, ours_values(pair, c))
    x = torch.randint(0, c["vocab"], (c["batch"], c["seq"] + 1))

    def loss() -> torch.Tensor:
        out = model(x[:, :-1], targets=x[:, 1:])
        assert out.loss is not None
        return out.loss

    return model, train_step(model, loss, c["precision"]), train_flops_per_token(model, c["seq"])


def x_decoder(c: dict, **kw: Any) -> torch.nn.Module:
    from x_transformers import Decoder, TransformerWrapper

    layers = Decoder(
        dim=c["dim"], depth=c["depth"], heads=c["heads"], attn_dim_head=c["dim"] // c["heads"], rotary_pos_emb=True,
        attn_flash=True, use_rmsnorm=True,
        ff_glu=True, ff_swish=True, ff_no_bias=True, ff_mult=c["ffn_hidden"] / c["dim"],
    )  # fmt: skip
    return TransformerWrapper(
        num_tokens=c["vocab"], attn_layers=layers, use_abs_pos_emb=False, tie_embedding=True, **kw
    )


def build_theirs(pair: str, c: dict) -> Built:
    """The peer, configured as close to ours as it allows; the forward on [1, T+1] is what is counted."""
    L = c["segment"]
    if pair == "llama":
        model = x_decoder(c, max_seq_len=c["seq"])

        def fwd(x: torch.Tensor) -> torch.Tensor:
            logits = model(x[:, :-1])
            return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())

    elif pair == "transformer_xl":
        model = x_decoder(c, max_seq_len=L, max_mem_len=L)

        def fwd(x: torch.Tensor) -> torch.Tensor:  # XL recurrence: each segment reads the last one's memory
            mems, losses = None, []
            for s in range(0, x.shape[1] - 1, L):
                logits, mems = model(x[:, s : s + L], mems=mems, return_mems=True)
                losses.append(F.cross_entropy(logits.flatten(0, 1), x[:, s + 1 : s + L + 1].flatten()))
            return torch.stack(losses).mean()

    elif pair == "block_recurrent":
        from block_recurrent_transformer_pytorch import BlockRecurrentTransformer

        model = BlockRecurrentTransformer(
            num_tokens=c["vocab"], dim=c["dim"], depth=c["depth"], heads=c["heads"], dim_head=c["dim"] // c["heads"],
            max_seq_len=c["seq"], block_width=L, num_state_vectors=L, recurrent_layers=(c["depth"] - 2,),
            use_flash_attn=True,
        )  # fmt: skip  # recurrent layer 1-based depth-2 = ours -3 (0-based depth-3)

        def fwd(x: torch.Tensor) -> torch.Tensor:
            return model(x, return_loss=True)[0]

    elif pair == "rmt":
        from recurrent_memory_transformer_pytorch import RecurrentMemoryTransformer, RecurrentMemoryTransformerWrapper

        inner = RecurrentMemoryTransformer(
            c["dim"], num_tokens=c["vocab"], depth=c["depth"], heads=c["heads"], dim_head=c["dim"] // c["heads"],
            seq_len=L, num_memory_tokens=c["memory"], use_flash_attn=True, abs_pos_emb=False, rotary_pos_emb=True,
            use_xl_memories=False, num_residual_streams=1,
        )  # fmt: skip
        model = RecurrentMemoryTransformerWrapper(inner)

        def fwd(x: torch.Tensor) -> torch.Tensor:
            return model(x, return_loss=True)[0]  # the wrapper shifts x into inputs and labels

    elif pair == "memory_attention":
        sys.path.insert(0, c["llama2rnn"])
        from model import Transformer  # type: ignore[import-not-found]
        from modelargs import ModelArgs  # type: ignore[import-not-found]

        margs = ModelArgs(
            dim=c["dim"], n_layers=c["depth"], n_heads=c["heads"], vocab_size=c["vocab"], multiple_of=32,
            max_seq_len=c["seq"], extend_seq_len=c["seq"], extend_method="extrapolation", dropout=0.0,
            attention_type="memory_attention", memseqlen=c["chunk"], do_memory_ffn=True, memory_norm=True,
            reuse_kv=True, train_orimem=True,
        )  # fmt: skip
        model = Transformer(margs)

        def fwd(x: torch.Tensor) -> torch.Tensor:
            model(x[:, :-1], x[:, 1:])
            return model.last_loss

    else:
        raise ValueError(pair)
    x = torch.randint(0, c["vocab"], (c["batch"], c["seq"] + 1))
    return model, train_step(model, lambda: fwd(x), c["precision"]), fwd


def worker(spec: str) -> None:
    """One JSON line when built ({params, flops, torch, version, source: the tree our model came from}
    or {error}), then per line on stdin one step and its seconds; output goes to the saved stdout,
    the models' prints to stderr."""
    out: IO[str] = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    s = json.loads(spec)
    c, pair, side = s["config"], s["pair"], s["side"]
    torch.set_num_threads(c["threads"])
    torch.manual_seed(0)
    try:
        if side == "ours":
            model, step, flops = build_ours(pair, c, Path(s.get("root") or ROOT))
            import recurformer

            version, source = "recurformer", str(Path(recurformer.__file__).resolve().parents[1])  # its tree
        else:
            from importlib import metadata

            model, step, fwd = build_theirs(pair, c)
            flops = peer_train_flops(model, fwd, c["seq"])
            dist = s.get("dist")
            version, source = (f"{dist} {metadata.version(dist)}" if dist else "checkout"), ""
    except Exception as e:  # noqa: BLE001 - any failure of a peer is one line for the parent
        out.write(json.dumps(dict(error=f"{type(e).__name__}: {e}".splitlines()[0][:200])) + "\n")
        return
    params = sum(p.numel() for p in model.parameters())
    out.write(
        json.dumps(dict(params=params, flops=flops, torch=torch.__version__, version=version, source=source)) + "\n"
    )
    for _ in sys.stdin:
        t0 = time.perf_counter()
        step()
        out.write(f"{time.perf_counter() - t0}\n")


# ---- the parent: installs, starts the workers, interleaves their steps ----


def venv_python(venv: Path, install: bool) -> tuple[Path, set[str]]:
    """The venv's python and the pip names that failed to install (one line each)."""
    py = venv / "bin" / "python"
    failed: set[str] = set()
    if not install:
        return py, failed
    if not py.exists():
        print(f"creating {venv} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for pkg in (f"torch=={torch.__version__.split('+')[0]}", *PACKAGES):
        r = subprocess.run([str(py), "-m", "pip", "install", "-q", pkg], capture_output=True, text=True)
        if r.returncode:
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"peer {pkg}: pip install failed ({last[:160]})", flush=True)
            failed.add(pkg)
    return py, failed


class Worker:
    def __init__(self, python: Path, pair: str, side: str, config: dict, dist: str | None, root: Path = ROOT) -> None:
        self.log = tempfile.TemporaryFile(mode="w+")
        spec = json.dumps(dict(pair=pair, side=side, config=config, dist=dist, root=str(root)))
        env = {**os.environ, "OMP_NUM_THREADS": str(config["threads"]), "PYTHONNOUSERSITE": "1"}
        env.pop("PYTHONPATH", None)  # the peer's process sees its own venv only
        # both sides under --wait-policy (this process's import of recurformer has set one)
        env.pop("OMP_WAIT_POLICY", None)
        if config["wait_policy"] != "default":
            env["OMP_WAIT_POLICY"] = config["wait_policy"].upper()
        self.proc = subprocess.Popen(
            [str(python), __file__, "--worker", spec], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True, bufsize=1, env=env, cwd=root,
        )  # fmt: skip
        self.info = self._read()

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            last = ([ln for ln in self.log.read().splitlines() if ln.strip()] or ["exited without a word"])[-1]
            return dict(error=last.strip()[:200])
        return json.loads(line) if line.startswith("{") else dict(seconds=float(line))

    def step(self) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        r = self._read()
        if "error" in r:
            raise RuntimeError(r["error"])
        return r["seconds"]

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait()
        self.log.close()


def per_round(times: dict[str, list[float]]) -> list[float]:
    """ours / theirs in tokens/s, one per A B round."""
    return [b / a for a, b in zip(times["ours"], times["theirs"])]


def width(times: dict[str, list[float]]) -> float:
    """The width of the 95% interval of the median ratio (inf while there are too few rounds)."""
    ci = median_interval(per_round(times))
    return ci[1] - ci[0] if ci else math.inf


def median_interval(xs: list[float], level: float = 0.95) -> tuple[float, float, float] | None:
    """(low, high, coverage): the distribution-free interval [x_(k), x_(n+1-k)] of the median of
    ``xs`` (1-based order statistics), k the largest with P(Bin(n, 1/2) <= k - 1) <= (1 - level) / 2,
    and its exact coverage 1 - 2 P(Bin(n, 1/2) <= k - 1); None when even min-max falls short."""
    n, tail = len(xs), (1 - level) / 2
    cdf = [sum(math.comb(n, i) for i in range(j + 1)) / 2**n for j in range(n)]  # P(Bin <= j)
    k = max((k for k in range(1, (n + 1) // 2 + 1) if cdf[k - 1] <= tail), default=0)
    if k == 0:
        return None
    s = sorted(xs)
    return s[k - 1], s[n - k], 1 - 2 * cdf[k - 1]


def run_pair(
    pair: str,
    config: dict,
    peer_python: Path,
    dist: str | None,
    rounds: int,
    warmup: int,
    until: float,
    max_rounds: int,
    base: tuple[Path, str] | None = None,
    processes: int = 1,
) -> dict | None:
    """One pair timed in ``processes`` fresh pairs of worker processes, one after another, the side
    that steps first alternating; with ``base`` (a source tree and its label) our model as that
    tree builds it takes the peer's place. With one process pair the ratio and its interval are
    over the rounds; with several, over the process pairs' medians (a process carries a bias of
    its own, which its rounds do not average out)."""
    if base:
        peer, differs = f"ours at {base[1]}", "the same configuration, built by the base tree"
    else:
        peer, differs = PEER_NAMES[pair], DIFFERS[pair]

    def start(side: str) -> Worker:
        if side == "ours":
            return Worker(Path(sys.executable), pair, "ours", config, None)
        if base:
            return Worker(Path(sys.executable), pair, "ours", config, None, root=base[0])
        return Worker(peer_python, pair, "theirs", config, dist)

    def one(order: tuple[str, str]) -> tuple[dict[str, list[float]], dict[str, Worker]] | None:
        """One pair of worker processes, started and stepped in ``order`` (A B A B): the step
        times of each side and the workers; None, with one line said, when a side cannot run."""
        workers: dict[str, Worker] = {}
        try:
            for side in order:
                workers[side] = start(side)
            for name, side, root in (("ours", "ours", ROOT), (peer, "theirs", base[0] if base else None)):
                info = workers[side].info
                if "error" in info:
                    print(f"{pair}: {name} skipped: {info['error']}", flush=True)
                    return None
                if root and info["source"] != str(root.resolve()):  # not another installed copy
                    print(f"{pair}: {name} skipped: imported recurformer from {info['source']}, not {root}", flush=True)
                    return None
            times: dict[str, list[float]] = {"ours": [], "theirs": []}
            for _ in range(warmup):
                for side in order:
                    workers[side].step()
            while True:  # A B A B: machine noise hits both alike
                for side in order:
                    times[side].append(workers[side].step())
                n = len(times["ours"])
                if n >= rounds and (not until or n >= max_rounds or width(times) <= until):
                    return times, workers
        except RuntimeError as e:
            print(f"{pair}: skipped, a step failed: {e}", flush=True)
            return None
        finally:
            for w in workers.values():
                w.close()

    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    process_ratios = []
    for i in range(processes):
        got = one(("ours", "theirs") if i % 2 == 0 else ("theirs", "ours"))
        if got is None:
            return None
        t, workers = got
        process_ratios.append(statistics.median(per_round(t)))
        for side in times:
            times[side] += t[side]
    ours_info, theirs_info = workers["ours"].info, workers["theirs"].info
    tokens = config["batch"] * config["seq"]
    ratios = per_round(times)
    units = process_ratios if processes > 1 else ratios
    ci = median_interval(units)
    f_o, f_t = ours_info["flops"], theirs_info["flops"]
    return dict(
        pair=pair,
        peer=peer,
        peer_version=f"recurformer {base[1]}" if base else theirs_info["version"],
        peer_torch=theirs_info["torch"],
        params=dict(ours=ours_info["params"], theirs=theirs_info["params"]),
        flops_per_token=dict(ours=round(f_o), theirs=round(f_t)),
        tokens_per_s=dict(
            ours=round(tokens / statistics.median(times["ours"])),
            theirs=round(tokens / statistics.median(times["theirs"])),
        ),  # fmt: skip
        ratio=round(statistics.median(units), 3),
        ratio_ci=[round(ci[0], 3), round(ci[1], 3)] if ci else None,
        ratio_ci_coverage=round(ci[2], 3) if ci else None,
        rounds=len(ratios),
        processes=processes,
        process_ratios=[round(r, 3) for r in process_ratios],
        ratio_min=round(min(units), 3),
        ratio_max=round(max(units), 3),
        ratio_per_flop=round(statistics.median(units) * f_o / f_t, 3),
        differs=differs,
        seconds={k: [round(t, 4) for t in v] for k, v in times.items()},
    )


@contextlib.contextmanager
def source_tree(base: str) -> Iterator[tuple[Path, str]]:
    """``--base``: (a source tree, its label). A directory holding ``recurformer/`` is used as it is
    (label: its name); otherwise ``base`` is a git revision of this checkout, exported into a
    temporary directory (label: the short commit) that is removed on leaving, however the run ends.
    ValueError, one line, when it is neither."""
    if Path(base, "recurformer").is_dir():
        yield Path(base).resolve(), Path(base).resolve().name
        return
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", f"{base}^{{commit}}"], capture_output=True, text=True)  # fmt: skip
    if rev.returncode:
        raise ValueError(f"{base!r} is neither a directory with recurformer/ nor a git revision of {ROOT}")
    out = Path(tempfile.mkdtemp(prefix="peers-base-"))
    try:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev.stdout.strip()], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
        yield out, rev.stdout.strip()
    finally:
        shutil.rmtree(out)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        return worker(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", default="transformer_xl,block_recurrent,rmt,llama,memory_attention")
    ap.add_argument("--venv", default="out/peers-venv", help="scratch venv the peers are pip-installed into")
    ap.add_argument("--no-install", action="store_true", help="use --venv as it is, no pip")
    ap.add_argument("--llama2rnn", metavar="PATH", help="a checkout of siyuanseever/llama2Rnn (the memory_attention pair)")  # fmt: skip
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--segment", type=int, default=64, help="XL segment = memory, BRT block = window = states, RMT segment")  # fmt: skip
    ap.add_argument("--memory", type=int, default=16, help="RMT memory slots")
    ap.add_argument("--chunk", type=int, default=32, help="Memory Attention chunk (llama2Rnn's memseqlen)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7, help="timed A B rounds per pair (>= 3; an interval needs 6)")
    ap.add_argument("--warmup", type=int, default=2, help="A B rounds run first and discarded")
    ap.add_argument(
        "--until", type=float, default=0.0, metavar="W",
        help="after --rounds, add rounds until the ratio's 95%% interval is at most W wide (e.g. 0.1), or --max-rounds",
    )  # fmt: skip
    ap.add_argument("--max-rounds", type=int, default=40, help="the most timed rounds per pair with --until")
    ap.add_argument(
        "--processes", type=int, default=1, metavar="K",
        help="time each pair in K fresh pairs of processes (the side stepping first alternating); "
        "ratio and interval over their medians (K >= 6 for an interval)",
    )  # fmt: skip
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="bf16: both sides under CPU autocast")
    ap.add_argument(
        "--wait-policy", choices=("passive", "default", "active"), default="passive",
        help="OMP_WAIT_POLICY of both sides: passive (what the recurformer command line sets), OpenMP's default, active",
    )  # fmt: skip
    ap.add_argument(
        "--ours-set", action="append", metavar="KEY=VALUE", default=[],
        help="a config value of ours in every pair, e.g. position=rope (a peer's positions); repeatable",
    )  # fmt: skip
    ap.add_argument(
        "--base", metavar="REV",
        help="a git revision of this checkout (or a directory with another source tree): its build of our model is the peer",
    )  # fmt: skip
    ap.add_argument("--out", default="out/peers.json")
    args = ap.parse_args()
    pairs = [p for p in args.pairs.split(",") if p]
    for p in pairs:
        if p not in PEER_NAMES:
            ap.error(f"--pairs: unknown pair {p!r} (choose from {', '.join(PEER_NAMES)})")
    if args.rounds < 3:
        ap.error(f"--rounds must be >= 3, got {args.rounds}")
    if args.until < 0 or (args.until and args.max_rounds < args.rounds):
        ap.error(f"--until must be >= 0 and --max-rounds >= --rounds, got {args.until} and {args.max_rounds}")
    if args.processes < 1:
        ap.error(f"--processes must be >= 1, got {args.processes}")
    if args.seq % args.segment:
        ap.error(f"--seq ({args.seq}) must be a multiple of --segment ({args.segment})")
    if args.llama2rnn and not (Path(args.llama2rnn) / "model.py").is_file():
        ap.error(f"--llama2rnn {args.llama2rnn} has no model.py (a checkout of siyuanseever/llama2Rnn)")

    sys.path.insert(0, str(ROOT))
    from recurformer.config import RecurformerError, parse_overrides
    from recurformer.flops import machine_name
    from recurformer.models import build_model
    from recurformer.nn import ModelConfig

    keys = (
        "dim",
        "depth",
        "heads",
        "vocab",
        "segment",
        "memory",
        "chunk",
        "batch",
        "seq",
        "threads",
        "precision",
        "wait_policy",
    )
    config = dict(
        {k: getattr(args, k) for k in keys},
        ffn_hidden=ModelConfig(dim=args.dim, n_heads=args.heads).hidden,
        llama2rnn=str(Path(args.llama2rnn).resolve()) if args.llama2rnn else None,
    )
    try:  # a wrong key or value of ours: one line here, not in a worker
        config["ours_set"] = ours_set = parse_overrides(args.ours_set)
        for p in pairs:
            build_model(p, ours_values(p, config))
    except RecurformerError as e:
        ap.error(f"--ours-set: {e}")
    with contextlib.ExitStack() as cleanup:  # an exported --base revision is removed however the run ends
        base = None
        if args.base:
            try:
                base = cleanup.enter_context(source_tree(args.base))
            except ValueError as e:
                ap.error(f"--base: {e}")
            py, failed = Path(sys.executable), set[str]()  # no peers to install
        else:
            py, failed = venv_python(Path(args.venv).resolve(), not args.no_install)
        print(
            f"{args.precision}, {args.threads} thread(s), OMP_WAIT_POLICY {args.wait_policy}, batch {args.batch} x {args.seq}, dim {args.dim} x {args.depth} layers, "
            f"{args.heads} heads, segment/block {args.segment}, RMT memory {args.memory}; "
            + (f"ours with {ours_set}; " if ours_set else "")
            + (f"the peer: ours at {base[1]}; " if base else "")
            + f"{args.warmup} warm-up + {args.rounds} timed A B rounds"
            + (f" in each of {args.processes} process pairs" if args.processes > 1 else "")
            + (
                f", more until the ratio's 95% interval is <= {args.until} wide (at most {args.max_rounds})"
                if args.until
                else ""
            ),
            flush=True,
        )
        results = []
        for pair in pairs:
            dist = None if base else next((d for d, ps in PACKAGES.items() if pair in ps), None)
            if pair == "memory_attention" and not (base or args.llama2rnn):
                print("memory_attention: skipped, no --llama2rnn PATH (a checkout of siyuanseever/llama2Rnn)", flush=True)  # fmt: skip
                continue
            if dist in failed:
                print(f"{pair}: skipped, {dist} did not install", flush=True)
                continue
            if not py.exists():
                print(f"{pair}: skipped, no python in --venv {args.venv}", flush=True)
                continue
            row = run_pair(
                pair, config, py, dist, args.rounds, args.warmup, args.until, args.max_rounds, base, args.processes
            )
            if row:
                results.append(row)
                print(
                    f"{pair}: done, ours / theirs {row['ratio']:.2f} ({row['rounds']} rounds"
                    + (f" in {args.processes} process pairs: {row['process_ratios']})" if args.processes > 1 else ")"),
                    flush=True,
                )

    head = f"{'ours':<17}{'theirs':<23}{'ours tok/s':>11}{'theirs tok/s':>13}{'ratio':>7}{'95% interval':>14}{'spread':>12}"
    head += f"{'MFLOP/tok o|t':>16}{'per FLOP':>9}  differs"
    print(head)
    for r in results:
        t, f = r["tokens_per_s"], r["flops_per_token"]
        print(
            f"{r['pair']:<17}{r['peer']:<23}{t['ours']:>11,}{t['theirs']:>13,}{r['ratio']:>7.2f}"
            + (f"{ci[0]:>8.2f}-{ci[1]:<5.2f}" if (ci := r["ratio_ci"]) else f"{'n < 6':>14}")
            + f"{r['ratio_min']:>6.2f}-{r['ratio_max']:<5.2f}{f['ours'] / 1e6:>8.1f}|{f['theirs'] / 1e6:<7.1f}"
            f"{r['ratio_per_flop']:>9.2f}  {r['differs']}"
        )
    argv = ["PATH" if a == args.llama2rnn else "VENV" if a == args.venv else a for a in sys.argv]  # no local paths
    meta = dict(
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d"), cpu=machine_name(), cores=os.cpu_count(),
        threads=args.threads, precision=args.precision, torch=torch.__version__, config={k: v for k, v in config.items() if k != "llama2rnn"},
        rounds=args.rounds, until=args.until or None, max_rounds=args.max_rounds if args.until else None,
        warmup=args.warmup, processes=args.processes, base=base[1] if base else None, command="python " + " ".join(argv),
    )  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(meta=meta, results=results), indent=2) + "\n")
    tmp.replace(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the workers stop when their stdin closes; no JSON was written
        print("peers.py: interrupted, nothing written", file=sys.stderr)
        sys.exit(130)
