"""recurformer models in EleutherAI's lm-evaluation-harness (the optional extra ``recurformer[eval]``).

Importing this module registers the model type ``recurformer``; ``recurformer lm-eval ...`` does
so and then runs lm-eval's own command line with the arguments given (lm-eval 0.4.13 finds no
plugins by itself), on the device that is there unless ``--device`` says otherwise:

    recurformer lm-eval --model_args pretrained=runs/my-run --tasks lambada_openai --batch_size 8

model_args: ``pretrained`` (a run, checkpoint, pretrained directory or Hub id), ``batch_size``,
``chunk`` (tokens per model call; the state carries the rest) and ``max_gen_toks``.

What the requests mean here (Gao et al., "A framework for few-shot language model evaluation"):

- ``loglikelihood(context, continuation)``: log p(continuation | BOS, context), the context read
  after BOS as every training document was; rows of a batch are right-padded (the pads come
  after the scored tokens, which a causal model never reads).
- ``loglikelihood_rolling(text)``: sum_t log p(x_t | BOS, x_<t) over the whole document, read
  once through the state ``chunk`` tokens at a time: every token conditioned on everything
  before it, in memory that does not grow with the document for a model with a bounded state
  (lm-eval's ``hf`` route instead scores fixed windows that restart the context).
- ``generate_until(context, until)``: greedy (or sampled, ``do_sample``) continuation after
  BOS + context, cut at the first stop string or EOS."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

from .config import RecurformerError

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError:  # pragma: no cover - the message is the point
    raise RecurformerError("recurformer.lm_eval needs lm-eval 0.4.13: pip install 'recurformer[eval]'") from None

from .device import pick_device
from .generate import sample
from .hub import load


def _positive_int(value: Any, key: str) -> int:
    try:
        out = int(value)
    except (TypeError, ValueError):
        out = 0
    if out < 1:
        raise RecurformerError(f"recurformer model_args: '{key}' must be a positive integer, got {value!r}")
    return out


@register_model("recurformer")
class RecurformerLM(TemplateLM):
    """A recurformer checkpoint as an lm-eval model (see the module docstring)."""

    def __init__(
        self,
        pretrained: str | None = None,
        device: str | None = None,
        batch_size: int | str = 1,
        chunk: int | str = 256,
        max_gen_toks: int | str = 256,
        max_batch_size: Any = None,
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            raise RecurformerError(
                f"unknown recurformer model_args {', '.join(sorted(unknown))}; "
                "valid: pretrained, batch_size, chunk, max_gen_toks, device"
            )
        if pretrained is None:
            raise RecurformerError("recurformer model_args need pretrained=<run, checkpoint or pretrained directory>")
        self._device = pick_device(str(device) if device else "auto")
        loaded = load(pretrained, self.device)
        self.model, tok = loaded.model, loaded.tokenizer
        if tok is None:
            raise RecurformerError(f"{pretrained} has no tokenizer.json: lm-eval scores text")
        self.tokenizer_ = tok
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.chunk = _positive_int(chunk, "chunk")
        self.max_gen_toks = _positive_int(max_gen_toks, "max_gen_toks")

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer_.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer_.bos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tokenizer_.encode(string)

    def tok_decode(self, tokens: Sequence[int], **kwargs: Any) -> str:
        return self.tokenizer_.decode(tokens)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """BOS + context, and the continuation's tokens as they fall in context + continuation."""
        context_enc, continuation_enc = super()._encode_pair(context, continuation)
        return [self.prefix_token_id, *context_enc], continuation_enc

    # -- scoring -------------------------------------------------------------------------------
    @torch.no_grad()
    def score(self, seqs: list[list[int]], first: list[int]) -> list[tuple[float, bool]]:
        """For each row b: (sum over t >= first[b] of log p(seqs[b][t] | seqs[b][:t]), whether
        every such token is the argmax). One batch, right-padded, read ``chunk`` tokens per call
        with the state carried; only running sums are kept."""
        B, T = len(seqs), max(len(s) for s in seqs)
        x = torch.full((B, T), self.tokenizer_.eos_id, dtype=torch.long)
        for b, s in enumerate(seqs):
            x[b, : len(s)] = torch.tensor(s, dtype=torch.long)
        x = x.to(self.device)
        length = torch.tensor([len(s) for s in seqs], device=self.device)[:, None]
        lo = torch.tensor(first, device=self.device)[:, None]
        ll = torch.zeros(B, dtype=torch.float64, device=self.device)
        greedy = torch.ones(B, dtype=torch.bool, device=self.device)
        for a, out in zip(range(0, T - 1, self.chunk), self.model.read(x[:, : T - 1], self.chunk)):
            b_ = min(a + self.chunk, T - 1)
            logp = out.logits.log_softmax(-1)
            tgt = x[:, a + 1 : b_ + 1]
            pos = torch.arange(a + 1, b_ + 1, device=self.device)[None]
            scored = (pos >= lo) & (pos < length)
            lp = logp.gather(-1, tgt[..., None]).squeeze(-1)
            ll += torch.where(scored, lp, torch.zeros_like(lp)).sum(1).double()
            greedy &= ((logp.argmax(-1) == tgt) | ~scored).all(1)
        return list(zip(ll.tolist(), greedy.tolist()))

    def _batched(self, seqs: list[list[int]], first: list[int], disable_tqdm: bool = True) -> list[tuple[float, bool]]:
        """``score`` in batches of ``batch_size`` rows of similar length, in the requests' order."""
        from tqdm import tqdm

        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(seqs)
        for i in tqdm(range(0, len(order), self.batch_size), disable=disable_tqdm, desc="recurformer"):
            idx = order[i : i + self.batch_size]
            for j, r in zip(idx, self.score([seqs[j] for j in idx], [first[j] for j in idx])):
                out[j] = r
        return out

    def _loglikelihood_tokens(
        self, requests: list[Any], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        seqs = [[*ctx, *cont] for _, ctx, cont in requests]
        results = self._batched(seqs, [len(ctx) for _, ctx, _ in requests], disable_tqdm)
        for (key, _, _), r in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", key, r)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        seqs = [[self.prefix_token_id, *self.tok_encode(req.args[0])] for req in requests]
        results = [ll for ll, _ in self._batched(seqs, [1] * len(seqs), disable_tqdm)]
        for req, r in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), r)
        return results

    @torch.no_grad()
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in requests:
            context, kw = req.args[0], dict(req.args[1] or {})
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            steps = _positive_int(kw.pop("max_gen_toks", self.max_gen_toks), "max_gen_toks")
            temperature = float(kw.pop("temperature", 0.0)) if kw.pop("do_sample", False) else 0.0
            g = torch.Generator(device=self.device).manual_seed(int(kw.pop("seed", 0)))
            logits, state = self._read([self.prefix_token_id, *self.tok_encode(context)])
            new: list[int] = []
            text = ""
            for _ in range(steps):
                tok = int(sample(logits, temperature, None, None, g)[0])
                if tok == self.eot_token_id:
                    break
                new.append(tok)
                text = self.tok_decode(new)
                if any(s in text for s in until):
                    break
                logits, state = self._read([tok], state)
            for s in until:
                text = text.split(s)[0]
            self.cache_hook.add_partial("generate_until", (context, req.args[1]), text)
            out.append(text)
        return out

    def _read(self, tokens: list[int], state: Any = None) -> tuple[torch.Tensor, Any]:
        """Next-token logits [1, V] after ``tokens``, read in chunks, and the state."""
        x = torch.tensor([tokens], dtype=torch.long, device=self.device)
        for o in self.model.read(x, self.chunk, state):
            pass
        return o.logits[:, -1], o.state


def _values(args: list[str], *flags: str) -> list[str]:
    """The values given after any of ``flags`` (``--flag v1 v2``, ``--flag=v``, comma lists)."""
    out: list[str] = []
    for i, a in enumerate(args):
        if a in flags:
            for v in args[i + 1 :]:
                if v.startswith("-"):
                    break
                out += [p for p in v.split(",") if p]
        elif "=" in a and a.split("=", 1)[0] in flags:
            out += [p for p in a.split("=", 1)[1].split(",") if p]
    return out


def launch(argv: list[str]) -> None:
    """``recurformer lm-eval ARGS``: lm-eval's command line with the model type registered,
    ``--model recurformer`` and ``--device`` (what is there) unless given. Task files and
    ``--include_path`` that do not exist are one-line errors before anything runs."""
    args = list(argv)
    for path in _values(args, "--include_path"):
        if not os.path.isdir(path):
            raise RecurformerError(f"--include_path {path} is not a directory")
    for task in _values(args, "--tasks", "-t"):
        if (task.endswith((".yaml", ".yml")) or os.sep in task) and not os.path.exists(task):
            raise RecurformerError(f"--tasks {task}: no such task file or directory")
    if not args or args[0] not in ("ls", "validate"):
        if not _values(args, "--model", "-M"):
            args += ["--model", "recurformer"]
        if not _values(args, "--device"):
            args += ["--device", str(pick_device("auto"))]
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm-eval", *args]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved


__all__ = ["RecurformerLM", "launch"]
