"""benchmarks/step_profile.py splits a profiled training step into matmul / attention /
elementwise / optimizer time by op name and ancestry, and reads matmul FLOPs from recorded shapes:
the rule on hand-written chains, and on a real profiled step the matmul FLOPs equal
FlopCounterMode's count and every bucket is found."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import step_profile  # noqa: E402

from recurformer import build_model  # noqa: E402

SDPA_BWD = "ScaledDotProductFlashAttentionForCpuBackward0"


@pytest.mark.parametrize(
    "chain, expected",
    [
        (["aten::mm", "aten::linear"], "matmul"),
        (["aten::addmm", "AddmmBackward0", "autograd::engine::evaluate_function: AddmmBackward0"], "matmul"),
        (["aten::mul_", "aten::lerp_", "Optimizer.step#AdamW.step", "optimizer"], "optimizer"),
        (["aten::mm", "Optimizer.step#AdamW.step", "optimizer"], "optimizer"),  # the range wins over the op
        (["optimizer"], "optimizer"),
        (
            ["aten::empty", "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention"],
            "attention",
        ),  # fmt: skip
        (
            [
                "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                SDPA_BWD,
                f"autograd::engine::evaluate_function: {SDPA_BWD}",
            ],
            "attention",
        ),  # fmt: skip
        ([SDPA_BWD, f"autograd::engine::evaluate_function: {SDPA_BWD}"], "attention"),  # the node's own time
        (["aten::scaled_dot_product_attention"], "attention"),
        (["aten::bmm", "aten::_scaled_dot_product_attention_math", "aten::scaled_dot_product_attention"], "matmul"),
        (["aten::_softmax_backward_data", "SoftmaxBackward0"], "elementwise"),
        (["aten::mul", "aten::rms_norm"], "elementwise"),
        (["aten::copy_", "aten::_to_copy", "aten::to"], "elementwise"),
    ],
)
def test_bucket(chain: list[str], expected: str) -> None:
    assert step_profile.bucket(chain) == expected


def test_matmul_dims() -> None:
    assert step_profile.matmul_dims("aten::mm", [[5, 7], [7, 3]]) == (1, 5, 7, 3)
    assert step_profile.matmul_dims("aten::addmm", [[3], [5, 7], [7, 3]]) == (1, 5, 7, 3)
    assert step_profile.matmul_dims("aten::bmm", [[4, 5, 7], [4, 7, 3]]) == (4, 5, 7, 3)
    assert step_profile.matmul_dims("aten::baddbmm", [[4, 5, 3], [4, 5, 7], [4, 7, 3]]) == (4, 5, 7, 3)


MATMUL_OPS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm}


@pytest.mark.parametrize("name, extra", [("llama", {}), ("transformer_xl", dict(segment_len=8, mem_len=8))])
def test_split_of_a_real_step(name: str, extra: dict) -> None:
    torch.manual_seed(0)
    model = build_model(name, dict(vocab_size=64, dim=16, n_layers=2, n_heads=2, **extra))
    x = torch.randint(0, 64, (2, 16))
    step = step_profile.train_step(model, x, "fp32")
    step()  # AdamW's state is created on the first step
    with FlopCounterMode(display=False) as counter:
        step()
    counted = sum(v for op, v in counter.get_flop_counts()["Global"].items() if op in MATMUL_OPS)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    seconds, elementwise, matmuls = step_profile.split(prof.events())
    assert sum(2 * b * m * k * n * calls for (b, m, k, n), (calls, _) in matmuls.items()) == counted > 0
    assert sum(seconds.values()) == pytest.approx(sum(e.self_cpu_time_total for e in prof.events()) / 1e6)
    assert seconds["matmul"] > 0 and seconds["optimizer"] > 0 and seconds["elementwise"] > 0
    assert "aten::mm" not in elementwise and "aten::addcdiv_" not in elementwise  # AdamW's update is the optimizer's
    # Llama attends through SDPA's fused kernel; Transformer-XL writes its relative attention in matmuls
    assert (seconds["attention"] > 0) == (name == "llama")


def test_alone_rate_of_a_tiny_matmul_on_a_coarse_clock() -> None:
    """A matmul of a few microseconds timed on a clock that ticks in 1 ms steps (as a process's
    CPU clock can): each sample must span many calls, so the rate comes out finite and within the
    range the same matmul reaches on the fine wall clock (no division by a zero reading)."""
    import time

    coarse = lambda: round(time.perf_counter(), 3)  # noqa: E731
    dims = (1, 8, 32, 32)
    rate = step_profile.alone_flops_per_s(dims, torch.float32, coarse, seconds=0.05)
    fine = step_profile.alone_flops_per_s(dims, torch.float32, time.perf_counter, seconds=0.05)
    assert 0 < rate < float("inf")
    assert rate <= 3 * fine
