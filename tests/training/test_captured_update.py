"""The optimizer step as one captured call (``tbptt.CapturedUpdate``, ``train.cuda_graphs``):
clipping, AdamW (fused, ``capturable``, the learning rate a tensor set in place) and zeroing the
gradients in place. On the CPU with the "eager" and "trace" backends, N steps with a warmup of the
learning rate and clipping that clips give the plain ``Update``'s weights and optimizer state in
float64, across a resume from a checkpoint mid-run too; a capture that fails is one line and the
steps go on eagerly, nothing lost; the trainer uses it where ``train.cuda_graphs`` is on."""

from __future__ import annotations

import json

import pytest
import torch

import recurformer.tbptt as tbptt
from recurformer.optim import make_optimizer, optimizer_from_flat, optimizer_to_flat
from recurformer.tbptt import CapturedUpdate, Update

STEPS, CLIP = 8, 0.05


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3)
        )
        self.unused = torch.nn.Linear(2, 2)  # never gets a gradient: AdamW leaves it alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def model() -> Net:
    torch.manual_seed(0)
    return Net().double()


def update(m: torch.nn.Module, backend: str | None, note: object = print) -> Update:
    """The trainer's AdamW and schedule (warmup 3 of 8 steps, cosine to 1e-3), clipped at CLIP."""
    opt = make_optimizer(m, 1e-2, 0.1, (0.9, 0.99))
    if backend is None:
        return Update(m, opt, 1e-2, 1e-3, 3, STEPS, CLIP)
    return CapturedUpdate(m, opt, 1e-2, 1e-3, 3, STEPS, CLIP, backend, note)  # type: ignore[arg-type]


def train(m: torch.nn.Module, u: Update, steps: range) -> list[float]:
    """The steps' gradient norms before clipping (so the test sees that clipping clips)."""
    norms = []
    for i in steps:
        u.begin(i)
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
        m(x).pow(2).sum().backward()
        norms.append(float(torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]).norm()))
        u.finish()
    return norms


def assert_same(a: tuple[torch.nn.Module, Update], b: tuple[torch.nn.Module, Update]) -> None:
    """The weights and AdamW's moments and step counts, to float64's rounding."""
    for (n, p), q in zip(a[0].named_parameters(), b[0].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-15, msg=n)
        sa, sb = a[1].opt.state.get(p, {}), b[1].opt.state.get(q, {})
        assert sa.keys() == sb.keys(), n
        for k in sa:
            torch.testing.assert_close(sa[k].double(), sb[k].double(), rtol=1e-12, atol=1e-15, msg=f"{n}.{k}")


@pytest.mark.parametrize("backend", ["eager", "trace"])
def test_captured_steps_give_the_plain_updates_weights_and_state(backend) -> None:
    plain = model(), None
    plain = plain[0], update(plain[0], None)
    norms = train(*plain, range(STEPS))
    assert sum(n > CLIP for n in norms) >= STEPS - 1  # clipping clips
    m = model()
    u = update(m, backend)
    train(m, u, range(STEPS))
    assert isinstance(u, CapturedUpdate) and u.replay is not None and not u.plain  # steps 3..8 replayed
    assert all(p.grad is not None and not p.grad.any() for p in m.net.parameters())  # zeroed in place
    assert m.unused.weight.grad is None and m.unused.weight not in u.opt.state
    assert_same((m, u), plain)


@pytest.mark.parametrize("backend", ["eager", "trace"])
def test_a_resume_mid_run_goes_on_as_one_run(backend) -> None:
    """4 captured steps, the optimizer saved as the checkpoint saves it (JSON groups: the tensor
    learning rate as its value), loaded into a new model and optimizer, 4 more: as 8 plain ones."""
    m0 = model()
    plain = m0, update(m0, None)
    train(*plain, range(STEPS))
    m = model()
    u = update(m, backend)
    train(m, u, range(4))
    tensors, meta = optimizer_to_flat(u.opt)
    meta = json.loads(json.dumps(meta))
    weights = {k: v.clone() for k, v in m.state_dict().items()}
    m2 = model()
    m2.load_state_dict(weights)
    u2 = update(m2, backend)
    optimizer_from_flat(u2.opt, {k: v.clone() for k, v in tensors.items()}, meta)
    assert all(g["capturable"] for g in u2.opt.param_groups)
    train(m2, u2, range(4, STEPS))
    assert_same((m2, u2), plain)


def test_a_capture_that_fails_is_one_line_and_the_steps_go_on_eagerly(monkeypatch) -> None:
    m0 = model()
    plain = m0, update(m0, None)
    train(*plain, range(STEPS))

    def oom(*args: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\ndetail")

    monkeypatch.setattr(tbptt, "record", oom)
    notes: list[str] = []
    m = model()
    u = update(m, "eager", notes.append)
    train(m, u, range(STEPS))
    assert len(notes) == 1 and notes[0].count("\n") == 0, notes
    assert "CUDA out of memory. Tried to allocate 2.00 GiB" in notes[0] and "steps eagerly" in notes[0]
    assert_same((m, u), plain)
