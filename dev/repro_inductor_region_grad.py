"""Inductor's wrong gradient through a ``torch.compiler.nested_compile_region`` (torch 2.13, CPU):
a minimal reproduction, torch only.

    python dev/repro_inductor_region_grad.py           # exit 1: the bug shows; 0: it does not
    python dev/repro_inductor_region_grad.py --knobs   # also with each of two inductor settings off

A gated recurrence S_t = a * S_{t-1} with the gate a = sigmoid(bias), three steps, each step one
call of the region, the loss sum(S_3^2); the gradient of ``bias``, eager against compiled with
inductor. Through the region it is wrong; inlined (the body called directly, as
``recurformer.modules.compiled_region`` does where gradients are recorded) it equals eager's. With
two steps instead of three it is right.

Two ways a buffer that the backward still reads is overwritten, read from inductor's output code
(``TORCH_LOGS=output_code``); the state's size decides which one shows:

- size 1: the forward's memory planner reuses the buffer of S_2 (``# reuse``) for the loss's
  2 * S_3, though the region's partitioned forward returned S_2 itself as saved for backward; gone
  with ``torch._inductor.config.allow_buffer_reuse = False``. This is the one Gated DeltaNet's chunk
  step met: that setting alone makes all of its gradients right.
- size 4: the region's backward writes its output into its saved input ``a`` (a donated buffer),
  which the next step's backward reads; gone with ``torch._functorch.config.donated_buffer =
  False`` (PyTorch pull request 193960, "Keep subgraph inputs from inheriting donation indices").

Cut down from Gated DeltaNet's chunk step (two ``baddbmm``), every cut keeping the failure.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
SIZES = (1, 4)  # the state's size: one way of going wrong each
TOLERANCE = 1e-4  # relative; float32 rounding is ~1e-7 here
KNOBS = {
    "allow_buffer_reuse=False": (torch._inductor.config, "allow_buffer_reuse"),
    "donated_buffer=False": (torch._functorch.config, "donated_buffer"),
}


def body(S: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """One step of the recurrence: S_t = a * S_{t-1}."""
    return S * a


def loss_fn(step: Step) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """sum(S_3^2) after three calls of ``step`` with the gate a = sigmoid(bias)."""

    def loss(bias: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
        a = torch.sigmoid(bias)
        for _ in range(3):
            S = step(S, a)
        return (S**2).sum()

    return loss


def gradients(step: Step, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of ``bias`` (``size`` elements): eager with ``body``, then compiled by
    inductor with ``step``."""
    torch.manual_seed(0)
    bias, S = torch.randn(size, requires_grad=True), torch.randn(size)
    (eager,) = torch.autograd.grad(loss_fn(body)(bias, S), bias)
    torch._dynamo.reset()
    compiled_loss = torch.compile(loss_fn(step), backend="inductor", fullgraph=True)
    (compiled,) = torch.autograd.grad(compiled_loss(bias, S), bias)
    return eager, compiled


def relative_error(eager: torch.Tensor, compiled: torch.Tensor) -> float:
    return ((compiled - eager).norm() / eager.norm()).item()


def report(name: str, step: Step, size: int) -> float:
    """Print eager's and the compiled gradient and their relative error; return the error."""
    eager, compiled = gradients(step, size)
    err = relative_error(eager, compiled)
    print(
        f"size {size}, {name}:\n  eager    {eager.tolist()}\n  compiled {compiled.tolist()}\n  relative error {err:.3g}"
    )
    return err


def main() -> int:
    print(f"torch {torch.__version__}")
    region = torch.compiler.nested_compile_region(body)
    wrong = inlined_wrong = False
    for size in SIZES:
        wrong |= report("through the region", region, size) > TOLERANCE
        inlined_wrong |= report("the region inlined (the way around)", body, size) > TOLERANCE
        if "--knobs" in sys.argv:
            for name, (config, key) in KNOBS.items():
                # (no cached graph: the caches' keys may not hold these settings)
                with config.patch({key: False}), torch._inductor.config.patch(force_disable_caches=True):
                    report(f"through the region, {name}", region, size)
    if inlined_wrong:
        print("the inlined region differs from eager too")
        return 2
    print("the bug shows" if wrong else "no bug: the region's gradients equal eager's")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
