"""Shared fixtures. ``TEST_CONFIGS`` lists, for every registered model, small configs that the
streaming-equivalence test runs (hybrid stacks included: every layer kind next to 'full' and
'window' layers); a model missing here fails ``test_every_model_has_test_configs``."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import pytest
import torch

if TYPE_CHECKING:
    from recurformer.training.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]  # the repository: build its paths (README.md, configs/) from here

# tests that run on every device: CUDA rows are skipped (not failed) on a machine without a GPU
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")

TEST_CONFIGS: dict[str, list[dict]] = {
    "llama": [
        dict(vocab_size=61, dim=32, n_layers=2, n_heads=4),
        dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, window=4, layers=["full", "window"]),
    ],
    "sliding_window": [
        dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, window=5),
        dict(vocab_size=61, dim=32, n_layers=2, n_heads=2, window=2),
    ],
    "memory_attention": [
        dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, chunk_size=8),
        dict(
            vocab_size=61,
            dim=24,
            n_layers=3,
            n_heads=2,
            chunk_size=5,
            memory_qkv="separate",
            memory_source="post_wo",
            init_memory="learned",
        ),
        dict(vocab_size=61, dim=32, n_layers=1, n_heads=4, chunk_size=3, memory_ffn=False),
        dict(
            vocab_size=61,
            dim=32,
            n_layers=4,
            n_heads=4,
            chunk_size=4,
            window=3,
            layers=["window", "window", "memory", "window"],
        ),
        dict(vocab_size=61, dim=24, n_layers=3, n_heads=2, chunk_size=5, memory_layers=[1], init_memory="learned"),
        # (2 layers with chunks of 3 recur 25 times over the fixture's 77 tokens: at std 0.3 that
        # chaos turns float64 rounding into 1e-8, in a plain 2-layer Memory Attention as well)
        dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, chunk_size=6, layers=["memory", "full"]),
        dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, chunk_size=7, memory_update="write_gate"),
        dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, chunk_size=5, qkv_conv=4),
        # (the gated update recurs more chaotically still: with chunks of 5 at std 0.3, float64
        # rounding grows to 1e-9 by token 77 with the gate and 3e-12 without; both stay at 4e-14 at std 0.2)
        dict(vocab_size=61, dim=24, n_layers=2, n_heads=2, chunk_size=8, memory_update="gated"),
        dict(
            vocab_size=61,
            dim=32,
            n_layers=2,
            n_heads=4,
            chunk_size=9,
            memory_update="gated",
            memory_source="post_wo",
            init_memory="learned",
        ),
    ],
    "transformer_xl": [
        dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, segment_len=8),
        dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, segment_len=6, mem_len=5, qkv_conv=3),
        dict(vocab_size=61, dim=24, n_layers=3, n_heads=2, segment_len=5, mem_len=7, clamp_len=6),
        dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, segment_len=6, mem_len=4, same_length=True),
        dict(vocab_size=61, dim=32, n_layers=1, n_heads=4, segment_len=3, mem_len=0),
        dict(
            vocab_size=61,
            dim=32,
            n_layers=3,
            n_heads=4,
            segment_len=4,
            mem_len=5,
            window=3,
            layers=["window", "xl", "full"],
        ),
    ],
    "block_recurrent": [  # all six gate x cell combinations; query tiles smaller than a block in four; shared key/value heads in two
        dict(vocab_size=61, dim=32, n_layers=3, n_heads=4, block_size=4, gate="fixed", cell="skip", query_tile=3),
        # (the LSTM cell over blocks of 5 recurs 15 times over 77 tokens: float64 rounding grows to
        # 5e-11 with the convolution, 3e-12 without; blocks of 9 stay near 1e-14)
        dict(
            vocab_size=61,
            dim=32,
            n_layers=2,
            n_heads=4,
            block_size=9,
            gate="lstm",
            cell="single",
            recurrent_layers=(1,),
            qkv_conv=4,
        ),
        dict(
            vocab_size=61,
            dim=32,
            n_layers=2,
            n_heads=2,
            block_size=5,
            gate="fixed",
            cell="single",
            num_states=3,
            position="rope",
            recurrent_layers=(0,),
            query_tile=2,
        ),
        dict(
            vocab_size=61,
            dim=24,
            n_layers=3,
            n_heads=2,
            block_size=3,
            gate="fixed",
            cell="dual",
            recurrent_layers=(0, 2),
            mlp="relu",
        ),
        dict(
            vocab_size=61,
            dim=32,
            n_layers=3,
            n_heads=4,
            block_size=4,
            gate="lstm",
            cell="skip",
            num_states=6,
            position="rope",
            query_tile=1,
            kv_heads=2,
        ),
        dict(
            vocab_size=61,
            dim=32,
            n_layers=2,
            n_heads=4,
            block_size=6,
            gate="lstm",
            cell="single",
            recurrent_layers=(-1,),
            mlp="relu",
            query_tile=4,
            kv_heads=1,
        ),
        dict(
            vocab_size=61,
            dim=24,
            n_layers=1,
            n_heads=2,
            block_size=4,
            gate="lstm",
            cell="dual",
            recurrent_layers=(0,),
            t5_buckets=4,
            t5_max_distance=3,
        ),
        dict(
            vocab_size=61,
            dim=32,
            n_layers=3,
            n_heads=4,
            block_size=4,
            gate="fixed",
            cell="skip",
            recurrent_layers=(1,),
            window=3,
            layers=["window", "block_recurrent", "full"],
        ),
    ],
    "recurrent_transformer": [
        dict(vocab_size=61, dim=32, n_layers=2, n_heads=4),
        dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, impl="naive"),
        dict(vocab_size=61, dim=32, n_layers=2, n_heads=2, position="rope", block_size=3, residual_scale=True),
        dict(vocab_size=61, dim=24, n_layers=2, n_heads=2, position="rope", block_size=3, impl="naive", qk_norm=False),
        dict(vocab_size=61, dim=32, n_layers=1, n_heads=4, block_size=5),
        dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, block_size=4, impl="naive"),
        dict(
            vocab_size=61, dim=32, n_layers=3, n_heads=4, block_size=3, window=2, layers=["recurrent", "window", "full"]
        ),
    ],
    "rmt": [  # segment lengths that divide none of the fixtures' lengths (77, 40, 23, 24)
        # (the memory runs through every layer once per segment: at std 0.3 that recurrence is
        # chaotic, and float64 rounding grows ~3x per segment with 3 layers, to 3e-7 by token 77
        # with segments of 5; 6 to 8 segments stay near 1e-11, and 1 layer stays at 4e-15 over 77)
        dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, segment_len=10, memory_size=3),
        dict(vocab_size=61, dim=24, n_layers=3, n_heads=2, segment_len=12, memory_size=5),
        dict(vocab_size=61, dim=32, n_layers=1, n_heads=4, segment_len=1, memory_size=1),
        dict(vocab_size=61, dim=32, n_layers=2, n_heads=2, segment_len=13, memory_size=2, layers=["rmt", "rmt"]),
        # the write gate (open ~73% at std 0.3): segments of 9 recur 8.5 times over 77 tokens, to 1.3e-10
        dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, segment_len=14, memory_size=3, memory_update="write_gate"),
        dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, segment_len=14, memory_size=2, qkv_conv=4),
        # ARMT's associative memory (a fast-weight matrix per layer, the slots constant); its delta
        # rule recurs more chaotically still: with segments of 11, float32 at std 0.1 drifts ~2x per
        # segment, to 6e-5 by token 77 (float64 at std 0.3: 3e-12); segments of 16 stay at 5e-6 (1e-13)
        dict(
            vocab_size=61, dim=32, n_layers=2, n_heads=4, segment_len=16, memory_size=4, associative=True, assoc_dim=4
        ),
        # without read slots (ARMT as its authors' code: [tokens; write slots]), with the convolution
        dict(
            vocab_size=61,
            dim=32,
            n_layers=2,
            n_heads=4,
            segment_len=15,
            memory_size=3,
            associative=True,
            assoc_dim=4,
            read_slots=False,
            qkv_conv=3,
        ),
    ],
    "gated_deltanet": [  # chunks that divide none of the fixtures' lengths (77, 40, 23, 24)
        dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, chunk_size=8),
        dict(vocab_size=61, dim=24, n_layers=1, n_heads=2, chunk_size=5, conv_size=1, decay_init=0.5),
        dict(
            vocab_size=61,
            dim=32,
            n_layers=4,
            n_heads=4,
            chunk_size=7,
            window=3,
            layers=["window", "delta", "window", "delta"],
        ),
    ],
}


def all_cases() -> list[tuple[str, dict]]:
    return [(name, cfg) for name, cfgs in TEST_CONFIGS.items() for cfg in cfgs]


def case_id(case: tuple[str, dict]) -> str:
    name, cfg = case
    return (
        name
        + "-"
        + "-".join(f"{k}={v}" for k, v in cfg.items() if k not in ("vocab_size", "dim", "n_layers", "n_heads"))
    )


def conv_literal(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The short causal convolution (``qkv_conv``) of x [B, T, C] read literally, one position at a
    time: y_t = SiLU(sum_j weight[:, j] x_{t-K+1+j}), the inputs before the start zero."""
    K = weight.shape[1]
    taps = lambda t: [weight[:, j] * x[:, t - K + 1 + j] for j in range(K) if t - K + 1 + j >= 0]  # noqa: E731
    return torch.stack([torch.nn.functional.silu(sum(taps(t))) for t in range(x.shape[1])], 1)


def randomize_params(model: torch.nn.Module, std: float = 0.3) -> None:
    """Replace every parameter (norm gains and zero-initialised tensors included) by random
    values, so tests don't pass only because of a special initialisation."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * std + (1.0 if p.dim() == 1 else 0.0))


# -- a tiny trained run on a random-word corpus (the package-level tests' fixtures) ----------------
WORDS = "the a cat dog ran sat on mat big small red blue happy sad tree house went saw".split()
MODEL = {"name": "memory_attention", "dim": 32, "n_layers": 2, "n_heads": 2, "chunk_size": 8}


def write_corpus(
    path: Path, docs: int = 300, seed: int = 0, words: Sequence[str] = WORDS, length: tuple[int, int] = (20, 80)
) -> Path:
    """``docs`` documents of random ``words`` (``length`` words each), joined by <|endoftext|>."""
    rng = random.Random(seed)
    text = "<|endoftext|>".join(
        " ".join(rng.choice(words) for _ in range(rng.randint(*length))) + "." for _ in range(docs)
    )
    path.write_text(text)
    return path


def tiny_config(corpus: Path, tmp: Path, tokenizer: str = "byte") -> dict:
    """A run config of a 2-layer Memory Attention model on ``corpus`` that trains 4 steps in seconds."""
    return {
        "model": dict(MODEL),
        "data": {
            "dataset": None,
            "text_files": [str(corpus)],
            "tokenizer": tokenizer,
            "vocab_size": 300,
            "dir": str(tmp / "prepared"),
        },
        "train": {
            "out_dir": str(tmp / "run"),
            "batch_size": 3,
            "seq_len": 32,
            "steps": 4,
            "warmup": 2,
            "precision": "fp32",
            "eval_every": 2,
            "eval_batches": 2,
            "save_every": 2,
            "log_every": 1,
            "loggers": [],
        },
    }


def ckpt_steps(run: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in run.glob("step_*"))


def run_config(corpus: Path, tmp: Path, model: dict | None = None, **train) -> RunConfig:
    """The trainer tests' run: a 2-layer Memory Attention model (``MODEL``; ``model``: another
    one, its name among its keys), 6 steps on ``corpus``; ``train``: overrides."""
    from recurformer.training.config import load_run_config

    over = [f"model.{k}={v}" for k, v in (model or MODEL).items()] + [
        "data.dataset=null",
        f"data.text_files=[{corpus}]",
        "data.tokenizer=byte",
        f"data.dir={tmp / 'prepared'}",
        f"train.out_dir={tmp / 'run'}",
        "train.batch_size=3",
        "train.seq_len=32",
        "train.steps=6",
        "train.warmup=2",
        "train.precision=fp32",
        "train.eval_every=3",
        "train.eval_batches=2",
        "train.save_every=3",
        "train.log_every=1",
    ]
    over += [f"train.{k}={v}" for k, v in train.items()]
    return load_run_config(None, over)
