"""``recurformer info``: a model's configuration, parameter counts and state size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import RecurformerError, load_yaml, merge, option
from .models import build_model, model_names
from .statesize import state_size_line
from .training.config import merge_config


@dataclass
class InfoOptions:
    """``recurformer info`` (``model_info``): the model to describe, by name or by a run config."""

    model: str | None = option(None, f"one of: {', '.join(model_names())}")
    config: str | None = option(None, "a YAML config file (its model section is used)")


def model_info(o: InfoOptions, over: dict[str, Any]) -> list[str]:
    """The lines of ``recurformer info``: the configuration of the model that ``o`` names (with the
    config overrides ``over``), its parameter counts by group, and its state size (``statesize``)."""
    overridden, over = " with --set overrides" if over else "", dict(over)
    values = merge(over.pop("model", {}), over)  # "dim=288" and "model.dim=288" both accepted
    if o.model:
        values.setdefault("name", o.model)
    if o.config:  # the model a run of this config trains (its per_model entry included)
        values = dict(merge_config(load_yaml(o.config), {"model": values}).get("model", {}))
    name = values.pop("name", None)
    if not name:
        raise RecurformerError("give --model NAME (or a --config with model.name)")
    model = build_model(name, values)
    if o.config:
        lines = [f"model: {name}, the model section of {o.config}{overridden}"]
    else:
        lines = [
            f"model: {name}, its defaults (the size of its paper){overridden}"
            "; --config tinystories-cpu shows the model the bundled default run trains"
        ]
    lines += [f"  {k}: {v}" for k, v in vars(model.config).items()]
    n = model.num_params()
    lines.append(
        f"parameters: {n:,} ({n / 1e6:.2f}M; token embedding {model.tok_emb.weight.numel():,}, tied with the output head)"
    )
    lines += [f"  {group}: {count:,}" for group, count in model.param_groups().items()]
    return lines + model.info_lines() + [state_size_line(model)]  # measured (statesize.py)
