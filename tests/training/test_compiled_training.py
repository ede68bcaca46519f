"""``train.compile`` (regional compilation: ``StreamingLM.compile_layers``, inductor, each layer's
forward and backward compiled) trains every registered model as eager training does: three
optimizer steps of two accumulated segments each, the state carried from segment to segment
(Llama's and the Recurrent Transformer's, whose caches grow without bound, reset each
segment), the same seed. Every
step's loss, the gradients it applied and the weights after it, and the carried state at the end
agree to float32 rounding.

The tolerances are relative to each tensor's scale (the largest magnitude of the eager tensor),
not elementwise: inductor fuses and reorders float32 reductions, which moves every value by a
few units of float32 rounding of the largest terms it sums (~1e-7 relative), and a gradient's
near-zero entries carry that absolute error, not a relative one. Eager and compiled differ here
by at most ~1e-6 of a tensor's scale (losses ~1e-7); 1e-4 leaves room for accumulation over three
steps while still catching a wrong gradient: the one torch 2.13's inductor gave Gated DeltaNet's
write-gate bias through a compiled region was off by a relative 4.7
(tests/test_compiled_regions.py). The weights after each AdamW step are held to the same 1e-4
of their scale (observed: at most ~1e-6 absolute), though AdamW normalises each entry's update: an
entry whose gradient were pure rounding noise (|g| near AdamW's eps, 1e-8) could move differently by
up to the learning rate; none did in these runs.

Inductor compiles for minutes on a 2-core CPU with a cold cache (one to two per model), so every
case is ``slow``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import run_config

from recurformer.models import build_model, model_names
from recurformer.training.trainer import Trainer

# a tiny model of each kind whose chunk / segment / block divides the tokens of a segment (SEQ)
EXTRA: dict[str, dict[str, Any]] = {
    "block_recurrent": dict(block_size=4, query_tile=2, recurrent_layers=[0]),
    "gated_deltanet": dict(chunk_size=8),
    "memory_attention": dict(chunk_size=8),
    "recurrent_transformer": dict(block_size=4),
    "rmt": dict(segment_len=8, memory_size=3),
    "sliding_window": dict(window=6),
    "transformer_xl": dict(segment_len=8),
}
# tokens per segment (8 unless said): one unit of most models' loops (a smaller graph to compile), two
# blocks of the Block-Recurrent Transformer (its recurrent gates are read only from the second block on)
SEQ: dict[str, int] = {}
STEPS = 3
REL = 1e-4  # of a tensor's scale (see the module docstring)


def train(corpus, tmp, name: str, compile: bool) -> tuple[Trainer, list[dict[str, Any]]]:  # type: ignore[no-untyped-def]
    """``STEPS`` optimizer steps; per step its loss, the gradients it applied (read as the
    optimizer steps) and the weights after it."""
    model = dict(dim=32, n_layers=2, n_heads=4, **EXTRA.get(name, {}))
    state = {} if build_model(name, model).bounded_state else dict(state="reset")  # (a cache without bound)
    model["name"] = name
    cfg = run_config(
        corpus, tmp, model=model, seq_len=SEQ.get(name, 8), grad_accum=2, compile=compile, save_every=100, **state
    )
    tr = Trainer(cfg, show_progress=False)
    steps: list[dict[str, Any]] = []
    real = tr.opt.step

    def record(*a: Any, **k: Any) -> Any:
        steps[-1]["grads"] = {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}
        return real(*a, **k)

    tr.opt.step = record  # type: ignore[method-assign]
    for _ in range(STEPS):
        steps.append({})
        steps[-1]["loss"] = tr.train_step()
        steps[-1]["weights"] = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    return tr, steps


def assert_near(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """``got`` within ``REL`` of ``want``'s largest magnitude everywhere."""
    scale = float(want.abs().max()) if want.numel() else 0.0
    err = float((got.double() - want.double()).abs().max()) if want.numel() else 0.0
    assert err <= REL * scale, f"{what}: off by {err:.3g} (scale {scale:.3g})"


@pytest.mark.slow
@pytest.mark.parametrize("name", model_names())
def test_compiled_training_equals_eager(corpus, tmp_path, name: str) -> None:
    eager, want = train(corpus, tmp_path / "eager", name, compile=False)
    compiled, got = train(corpus, tmp_path / "compiled", name, compile=True)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5), f"step {step} loss"
        assert g["grads"].keys() == w["grads"].keys() == dict(eager.model.named_parameters()).keys()
        for n in w["grads"]:
            assert_near(g["grads"][n], w["grads"][n], f"step {step} gradient of {n}")
            assert_near(g["weights"][n], w["weights"][n], f"step {step} weights {n}")
    fg, fw = compiled.state.to_flat(), eager.state.to_flat()
    assert fg.keys() == fw.keys()
    for k, t in fw.items():
        if t.is_floating_point():
            assert_near(fg[k], t, f"carried state {k}")
        else:
            assert torch.equal(fg[k], t), k
