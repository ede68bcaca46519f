"""Checkpoints and saved states of format 1 (before the per-layer state; main up to ec70819), and
weights of format 2 with names since changed, in today's names. Format 2 is written in the metadata
of ``model.safetensors``.

Weights: Memory Attention's stacked ``init_memory`` [L, C, D] and the Block-Recurrent
Transformer's ``initial_state`` [R, S, D] become per-layer parameters; the Block-Recurrent
Transformer's attention moved under ``layers.<i>.attn``; a layer's short convolution, the
parameter ``conv_weight`` up to 31288d4, is the module ``conv`` (``modules.ShortConvolution``).
States: the per-field lists ``<field>.<i>`` become ``layers.<i>.<field>``, the model-level
``pos``/``start`` are derived where the old state had none (a chunked layer's offset;
Transformer-XL's ``mem_valid``), and Transformer-XL's memory, which held the layer's raw inputs,
holds them normed."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

FORMAT = 2
_BRT_ATTN = re.compile(r"^layers\.(\d+)\.(wq|wk|wv|wq2|wo|rel_bias|qk|qk2|cell)\.")


def upgrade_weights(model: Any, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Earlier weight names -> today's (an identity on today's weights); the prefix ``model.`` of a
    directory written by ``transformers`` is dropped."""
    own = model.state_dict()
    if tensors and all(k.startswith("model.") for k in tensors) and not any(k.startswith("model.") for k in own):
        tensors = {k[len("model.") :]: v for k, v in tensors.items()}  # written by transformers (recurformer.hf)
    out: dict[str, Tensor] = {}
    for k, v in tensors.items():
        if k in ("init_memory", "initial_state") and k not in own:  # stacked per-layer initial states
            owners = [i for i in range(len(model.layers)) if f"layers.{i}.attn.{k}" in own]
            out.update({f"layers.{i}.attn.{k}": v[j] for j, i in enumerate(owners)})
        elif k not in own and _BRT_ATTN.match(k):
            out[_BRT_ATTN.sub(r"layers.\1.attn.\2.", k)] = v
        elif k.endswith(".conv_weight") and k not in own:  # the short convolution became a module
            out[k.removesuffix("_weight") + ".weight"] = v
        else:
            out[k] = v
    return out


def upgrade_state(model: Any, flat: dict[str, Tensor]) -> dict[str, Tensor]:
    """A format-1 ``State.to_flat`` -> the format-2 one (``layers.n``, ``layers.<i>.<field>``)."""
    n = len(model.layers)
    out = {"fresh": flat["fresh"], "layers.n": torch.tensor(n)}
    B = flat["fresh"].shape[0]
    lists = {k.rsplit(".", 1)[0] for k in flat if k.endswith(".n")}
    for name in lists:
        items = [flat[f"{name}.{j}"] for j in range(int(flat[f"{name}.n"]))]
        owners = list(range(n)) if len(items) == n else [i for i in range(n) if _has_field(model, i, name)]
        out.update({f"layers.{i}.{name}": t for i, t in zip(owners, items)})
    # position: the old states without one are only ever read modulo their chunk length
    pos = int(flat["pos"]) if "pos" in flat else 0
    if "pos" not in flat:
        layer = model.layers[0]
        ref = layer.init_state(1, "meta", torch.float32)
        for fname, d in ref.partial.items():
            pos = out[f"layers.0.{fname}"].shape[d] - getattr(ref, fname).shape[d]
            break
    out["pos"] = torch.tensor(pos)
    if "start" in flat:
        out["start"] = flat["start"]
    elif "mem_valid" in flat:  # Transformer-XL: mem_valid positions of the memory are in the document
        out["start"] = pos - pos % model.reset_boundary - flat["mem_valid"]
    else:
        out["start"] = torch.zeros(B, dtype=torch.long)
    for i, layer in enumerate(model.layers):  # Transformer-XL kept the raw inputs, now the normed ones
        if layer.kind == "xl":
            norm = layer.attn_norm
            with torch.no_grad():
                for f in ("mem", "seg"):
                    out[f"layers.{i}.{f}"] = norm(out[f"layers.{i}.{f}"].to(norm.weight.dtype))
    return out


def _has_field(model: Any, i: int, name: str) -> bool:
    return getattr(model.layers[i].init_state(1, "meta", torch.float32), name, None) is not None
