"""The plots' labels, read back from the figure objects, and the step profile's matmul dimensions."""

from __future__ import annotations

import torch


def _results(*lengths: int):
    from recurformer.evaluate.results import LengthResult

    return [
        LengthResult(L, 3.0 - 0.1 * i, 2.9 - 0.1 * i, 3.1 - 0.1 * i, 0.3, 100, 4, 4, "windows", 1000.0, 10.0)
        for i, L in enumerate(lengths)
    ]


def test_eval_plot_labels_follow_last_and_training_lengths() -> None:
    import matplotlib.pyplot as plt

    from recurformer.evaluate.results import figure

    fig = figure({"a": _results(128, 512), "b": _results(128, 512)}, "t", last=128, trained={"a": 256, "b": 1024})
    ax = fig.axes[0]
    assert ax.get_ylabel() == "loss on the last 128 tokens (95% interval)"
    assert ax.get_xlabel() == "sequence length L (trained at: a 256, b 1024)"
    plt.close(fig)
    fig = figure({"a": _results(256)}, "t", last=64, trained={"a": 512})
    assert (
        fig.axes[0].get_xlabel() == "sequence length L (trained at 512)"
        and fig.axes[0].get_ylabel() == "loss on the last 64 tokens (95% interval)"
    )
    plt.close(fig)
    fig = figure({"a": _results(256)}, "t", last=64)
    assert fig.axes[0].get_xlabel() == "sequence length L"
    plt.close(fig)


def test_generation_plot_starts_memory_at_zero_and_has_a_title() -> None:
    import matplotlib.pyplot as plt

    from benchmarks.generation import figure

    marks = [{"tokens": n, "mem_mb": 400 + n / 100, "tok_per_s": 500.0} for n in (1024, 8192)]
    fig = figure({"llama": {"marks": marks}, "memory_attention": {"marks": marks}})
    memory, speed = fig.axes
    assert memory.get_ylim()[0] == 0 and speed.get_ylim()[0] == 0 and memory.get_ylabel().startswith("memory (MB)")
    assert fig._suptitle is not None and fig._suptitle.get_text().startswith("Streaming generation")
    plt.close(fig)


def test_synthetic_grid_has_one_legend_titled_panels_and_visible_markers() -> None:
    import matplotlib.pyplot as plt

    from benchmarks.synthetic import figure

    results = [
        {"task": t, "model": m, "accuracy": 0.5, "by_length": {"16": 1.0, "64": 1.0} if t == "passkey" else {}}
        for t in ("passkey", "in_context_recall")
        for m in ("llama", "memory_attention", "transformer_xl")
    ]
    fig = figure(results)
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in fig.axes)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["llama", "memory_attention", "transformer_xl"]
    assert all(ax.get_title() for ax in fig.axes) and len(fig.axes) == 2
    lines = fig.axes[1].get_lines()
    assert len({ln.get_marker() for ln in lines}) == 3  # equal values still show three distinct hollow markers
    assert all(ln.get_markerfacecolor() == "none" and ln.get_markersize() >= 6 for ln in lines)
    plt.close(fig)


def test_step_profile_reads_matmul_dims_from_recorded_shapes() -> None:
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.step_profile import MATMULS, matmul_dims

    lin = torch.nn.Linear(5, 7)
    a, b = torch.randn(3, 4, 6), torch.randn(3, 6, 2)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        lin(torch.randn(11, 5))  # addmm: bias, x, W^T
        lin.weight.t() @ torch.randn(7, 9)  # mm
        torch.bmm(a, b)
    dims = {
        ev.key: matmul_dims(ev.key, ev.input_shapes)
        for ev in prof.key_averages(group_by_input_shape=True)
        if ev.key in MATMULS
    }
    assert dims == {"aten::addmm": (1, 11, 5, 7), "aten::mm": (1, 5, 7, 9), "aten::bmm": (3, 4, 6, 2)}
