"""How much state a model carries per batch row, measured from the state itself (every model alike):
the numbers a row holds once every layer's reach is filled, and how many more each further token
adds (0 for a bounded state; a KV cache's keys and values for full attention). Used by ``info``, by
the synthetic evaluation's memory budget and by recall-against-state-size comparisons (Arora et al.,
"Zoology: Measuring and Improving Recall in Efficient Language Models", §4)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .models import build_model, model_name
from .nn import StreamingLM


@dataclass(frozen=True)
class StateSize:
    numbers: int  # floating-point numbers per row after ``after`` tokens
    per_token: float  # numbers each further token adds (0: bounded)
    after: int  # tokens read when ``numbers`` was measured (past every layer's reach)
    period: int  # tokens between the two measurements (the model's reset period)

    @property
    def bounded(self) -> bool:
        return self.per_token == 0

    def at(self, tokens: int) -> float:
        """Numbers per row after ``tokens`` tokens (at least ``after``; linear past it)."""
        return self.numbers + self.per_token * max(0, tokens - self.after)


def measure(model: StreamingLM) -> StateSize:
    """Measured past every layer's reach: c is the longest span a layer reads directly (its window,
    segment and memory, block, ...; at least 64, the reset period and the model's context field),
    rounded up to the reset period P; sizes after c + P - 1 and c + 2P - 1 tokens (the same chunk
    phase, partial-chunk buffers at their fullest) differ only when a state grows with the text.
    Measured on a copy with a 2-token vocabulary: the state does not depend on it, and the output
    head is most of the work."""
    P, big = model.reset_boundary, 1 << 40
    spans = [big + j - r + 1 for layer in model.layers for j in range(P) if (r := layer.reach(big + j)) is not None]
    field = model.config.context_field
    c = max([64, P, int(getattr(model.config, field) or 1) if field else 1, *spans])
    c = -(-c // P) * P
    probe = build_model(model_name(model.config), {**dataclasses.asdict(model.config), "vocab_size": 2}).eval()
    sizes = []
    with torch.inference_mode():
        state = probe.init_state(1, "cpu")
        for n in (c + P - 1, P):
            state = probe(torch.zeros(1, n, dtype=torch.long), state=state).state
            sizes.append(sum(t.numel() for t in state.to_flat().values() if t.is_floating_point()))
    return StateSize(sizes[1], (sizes[1] - sizes[0]) / P, c + 2 * P - 1, P)


def state_size_line(model: StreamingLM) -> str:
    """The state's size per batch row, measured (``statesize.measure``)."""
    size = measure(model)
    if not size.bounded:
        return f"state size per row (measured): grows with the text, {size.numbers:,} numbers after {size.after:,} tokens ({size.per_token:,.0f} per token)"
    return (
        f"state size per row (measured): {size.numbers:,} numbers ({4 * size.numbers / 2**20:.2f} MiB at fp32), the same at any length "
        f"(measured after {size.after - size.period:,} and {size.after:,} tokens, past every layer's reach)"
    )
