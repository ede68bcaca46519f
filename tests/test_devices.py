"""Devices (device.py): choosing one, clear errors for one this machine lacks, and CPU == CUDA
for every model where a GPU is present (skipped, not failed, without one)."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICES, TEST_CONFIGS, cuda, no_cuda, randomize_params

from recurformer import RecurformerError, build_model
from recurformer.cli import main as cli_main
from recurformer.device import (
    fast_matmuls,
    memory_kind,
    peak_memory_mb,
    pick_device,
    reset_peak_memory,
    resolve_precision,
    to_device,
)
from recurformer.modules import attend
from recurformer.optim import make_optimizer


def test_auto_picks_cuda_when_present() -> None:
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pick_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["tpu", "cuda:x", "banana"])
def test_unknown_device_is_one_line(name) -> None:
    with pytest.raises(RecurformerError, match="device"):
        pick_device(name)


@no_cuda
def test_cuda_without_a_gpu_is_one_line(capsys) -> None:
    with pytest.raises(RecurformerError, match="no CUDA GPU"):
        pick_device("cuda")
    assert (
        cli_main(["train", "--config", "tinystories-cpu", "--device", "cuda", "--set", "train.out_dir=/nonexistent/x"])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA GPU" in err[0]


def test_cpu_helpers() -> None:
    x = torch.arange(4)
    assert to_device(x, torch.device("cpu")) is x
    reset_peak_memory(torch.device("cpu"))
    assert peak_memory_mb(torch.device("cpu")) > 10  # the interpreter and torch are resident
    assert memory_kind(torch.device("cpu")) == "RSS"
    assert resolve_precision("fp32", torch.device("cpu")) == "fp32"


def test_tf32_is_on_inside_a_run_only(monkeypatch) -> None:
    """A training run turns TF32 on for CUDA and leaves the process as it found it, also when it
    fails: a program that trains and then checks fp32 results (the CUDA test rows after an
    in-process run) gets fp32. On the CPU, and with RECURFORMER_NO_TF32, nothing changes."""
    monkeypatch.delenv("RECURFORMER_NO_TF32", raising=False)
    flags = torch.backends.cuda.matmul, torch.backends.cudnn
    before = tuple(f.allow_tf32 for f in flags)
    try:
        for f in flags:
            f.allow_tf32 = False
        with pytest.raises(KeyError), fast_matmuls(torch.device("cuda")):
            assert all(f.allow_tf32 for f in flags)
            raise KeyError
        assert not any(f.allow_tf32 for f in flags)
        for dev, off in ((torch.device("cpu"), ""), (torch.device("cuda"), "1")):
            monkeypatch.setenv("RECURFORMER_NO_TF32", off)
            with fast_matmuls(dev):
                assert not any(f.allow_tf32 for f in flags)
    finally:
        for f, b in zip(flags, before):
            f.allow_tf32 = b


@cuda
@pytest.mark.parametrize("name", sorted(TEST_CONFIGS))
def test_cpu_and_cuda_agree(name) -> None:
    """float64 logits, final state and gradients of the same weights on CPU and CUDA, split across
    calls on CUDA: the device changes nothing but rounding."""
    cfg = TEST_CONFIGS[name][0]
    torch.manual_seed(0)
    cpu = build_model(name, cfg).double()
    randomize_params(cpu, 0.2)
    gpu = build_model(name, cfg).double()
    gpu.load_state_dict(cpu.state_dict())
    gpu.cuda()
    tokens = torch.randint(0, cfg["vocab_size"], (2, 45))
    ref = cpu(tokens, targets=tokens)
    ref.loss.backward()
    a = gpu(tokens[:, :20].cuda(), targets=tokens[:, :20].cuda())
    b = gpu(tokens[:, 20:].cuda(), state=a.state, targets=tokens[:, 20:].cuda())
    torch.testing.assert_close(torch.cat((a.logits, b.logits), 1).cpu(), ref.logits, rtol=1e-9, atol=1e-9)
    (a.loss * 20 / 45 + b.loss * 25 / 45).backward()
    for (n, p), q in zip(cpu.named_parameters(), gpu.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-8, atol=1e-9, msg=n)


@cuda
def test_cuda_attention_never_runs_cudnn() -> None:
    """``attend`` on CUDA keeps to SDPA's flash / memory-efficient / math kernels: no cuDNN kernel
    runs in a bf16 forward + backward with an explicit mask over 704 = 5 * 128 + 64 keys (the shape
    of PyTorch issue #196678, NaN query gradients from cuDNN's backward on H100/H200), and the
    gradients are finite and within bf16 rounding of float32's."""
    torch.manual_seed(0)
    B, H, T, d = 2, 4, 704, 64
    mask = torch.ones(T, T, dtype=torch.bool, device="cuda").tril()
    ref = [torch.randn(B, H, T, d, device="cuda", requires_grad=True) for _ in range(3)]
    half = [t.detach().bfloat16().requires_grad_() for t in ref]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        attend(*half, mask).float().square().sum().backward()
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    assert names and not [n for n in names if "cudnn" in n.lower()], names
    attend(*ref, mask).square().sum().backward()
    for t, r in zip(half, ref):
        assert t.grad is not None and r.grad is not None and torch.isfinite(t.grad).all()
        assert float((t.grad.float() - r.grad).norm()) <= 0.05 * float(r.grad.norm())


@pytest.mark.parametrize("device", DEVICES)
def test_the_optimizer_step_equals_the_reference_adamw(device) -> None:
    """The optimizer the trainer makes on each device (fused AdamW, on the CPU as on CUDA) takes
    the step of the reference single-tensor AdamW, and the device's memory is measured.
    (bf16 gradients against fp32 on every device: test_streaming.test_bf16_autocast_close_to_fp32.)"""
    dev = torch.device(device)
    model = build_model("memory_attention", TEST_CONFIGS["memory_attention"][0]).to(dev)
    ref = build_model("memory_attention", TEST_CONFIGS["memory_attention"][0]).to(dev)
    ref.load_state_dict(model.state_dict())
    opt = make_optimizer(model, 1e-2, 0.1, (0.9, 0.95))
    assert opt.param_groups[0]["fused"] is True
    decay = [p for p in ref.parameters() if p.dim() >= 2]  # weight decay on matrices only
    rest = [p for p in ref.parameters() if p.dim() < 2]
    plain = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        foreach=False,
        fused=False,
    )
    x = torch.randint(0, 61, (2, 32), device=dev)
    reset_peak_memory(dev)
    for _ in range(3):  # the same gradients for both: Adam's update of a near-zero gradient would
        # turn rounding differences in the parameters into larger ones in the next gradients
        model(x, targets=x).loss.backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = p.grad.clone()
        for o in (opt, plain):
            o.step()
            o.zero_grad()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=n)
    assert memory_kind(dev) == ("CUDA allocated" if dev.type == "cuda" else "RSS") and peak_memory_mb(dev) > 0


def test_graphs_or_eager_decides_and_names_the_device_problem() -> None:
    """One helper for every ``cuda_graphs`` option: eager (None) unless asked, captured ("cuda") on
    one CUDA GPU, else one line naming the option and where the work runs."""
    from recurformer.device import graphs_or_eager

    cpu, gpu = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU
    assert graphs_or_eager(False, cpu, "cuda_graphs", "this evaluation runs") is None
    assert graphs_or_eager(True, gpu, "cuda_graphs", "this evaluation runs") == "cuda"
    with pytest.raises(RecurformerError, match=r"^cuda_graphs needs a CUDA GPU; this model is on cpu$"):
        graphs_or_eager(True, cpu, "cuda_graphs", "this model is")
    fix = " (set train.cuda_graphs=false)"
    assert graphs_or_eager(True, gpu, "train.cuda_graphs", "this run trains", 1, fix) == "cuda"
    with pytest.raises(
        RecurformerError, match=r"^train.cuda_graphs needs one process on a CUDA GPU; this run trains on 2 processes \("
    ):
        graphs_or_eager(True, gpu, "train.cuda_graphs", "this run trains", 2, fix)
