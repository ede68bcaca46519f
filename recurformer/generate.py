"""Streaming generation through the streaming contract: the prompt is read in one call, then one
token per call, carrying the model state (a KV cache for Llama, a bounded cache for the sliding
window, memory + partial-chunk cache for Memory Attention, ...). Recurrent models therefore
generate with constant memory at any length. Reading runs without autograd, so layers may keep
decoding buffers next to their state (Llama's cache grows in place, Transformer-XL keeps its
memory's keys/values: ``KVRoom``, ``XLRoom``).

A ``Session`` (model state + next-token logits + sampler RNG) can be saved to a safetensors file
and continued later with exactly the result of one uninterrupted run."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Generator, Iterator, Sequence

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from .capture import CaptureFailed, DecodeGraphs
from .config import Checked, RecurformerError, check_values, option
from .device import device_option
from .files import atomic_write
from .state import State, StreamingModel


@dataclass
class GenerateOptions(Checked):
    """``recurformer generate`` (``api.generate_text``): what to continue and how to sample."""

    checkpoint: str = option(None, "a run, checkpoint or pretrained directory, or a Hub repo id", required=True)
    prompt: str = option("", "text to continue (lower-cased for a lower-case tokenizer)")
    max_new_tokens: int = option(200, "tokens to generate at most", range=">= 0")
    temperature: float = option(0.8, "sampling temperature; 0 = greedy", range=">= 0")
    top_k: int | None = option(None, "sample from the k most likely tokens only (default: all)", range=">= 1")
    top_p: float | None = option(
        None,
        "sample from the smallest set of tokens whose probability reaches p, in (0, 1] (default: all)",
        range="(0, 1]",
    )
    seed: int = option(0, "sampling seed")
    stop_at_eos: bool = option(True, "stop at the end of a document")
    save_state: str | None = option(None, "save the generation state (safetensors) to continue later", metavar="FILE")
    load_state: str | None = option(None, "continue a saved generation (the prompt is appended)", metavar="FILE")
    device: str = device_option()
    cuda_graphs: bool = option(
        False, "decode each new token through a captured CUDA graph, sampling included (a CUDA GPU)"
    )
    decode_block: int = option(
        16,
        "tokens decoded on the GPU between two reads of their ids by the host, through captured graphs",
        range=">= 1",
    )


DEFAULTS = GenerateOptions(checkpoint="")  # the command line's: the Python API generates with the same


@dataclass
class Session:
    """A generation in progress: ``state`` covers every token read or emitted so far and
    ``logits`` [B, V] are the next-token logits (None before the first token)."""

    state: State
    logits: Tensor | None = None
    generator: torch.Generator = field(default_factory=torch.Generator)


def new_session(model: StreamingModel, batch_size: int = 1, seed: int | None = None) -> Session:
    device = model.tok_emb.weight.device
    g = torch.Generator(device=device)
    g.manual_seed(0 if seed is None else seed)
    return Session(state=model.init_state(batch_size, device), generator=g)


def filter_logits(logits: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """Set logits outside the top-k set and outside the nucleus (the smallest set of tokens whose
    probability reaches ``top_p``) to -inf. At least one token always survives."""
    logits = logits.float()
    if top_k is not None and top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # probability mass strictly before each token
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(
    logits: Tensor, temperature: float, top_k: int | None, top_p: float | None, generator: torch.Generator
) -> Tensor:
    """[B, V] -> [B]. ``temperature == 0`` is greedy (argmax)."""
    check_values(GenerateOptions, temperature=temperature, top_k=top_k, top_p=top_p)
    if temperature == 0:
        return logits.argmax(-1)
    probs = filter_logits(logits / temperature, top_k, top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


Step = Callable[[Tensor, State], tuple[Tensor, State]]  # (tokens, state) -> (logits, new state)


def non_finite() -> RecurformerError:
    return RecurformerError("the model gives non-finite logits (nan/inf) although its weights load; it cannot generate")


@torch.no_grad()
def read(model: StreamingModel, session: Session, tokens: Tensor, step: Step | None = None) -> Session:
    """Feed ``tokens`` [B, T] (a prompt, or forced tokens) and update the session; through
    ``step`` (e.g. a captured decoding step, ``capture.DecodeGraphs``) instead of the model's call."""
    tokens = tokens.to(session.state.fresh.device)
    if step is None:
        out = model(tokens, state=session.state)
        all_logits, state = out.logits, out.state
    else:
        all_logits, state = step(tokens, session.state)
    logits = all_logits[:, -1].float()
    if not bool(torch.isfinite(logits).all()):
        raise non_finite()
    session.state = state
    session.logits = logits
    return session


@torch.no_grad()
def stream(
    model: StreamingModel,
    prompt: Tensor | Sequence[int] | None,
    max_new_tokens: int = DEFAULTS.max_new_tokens,
    temperature: float = DEFAULTS.temperature,
    top_k: int | None = DEFAULTS.top_k,
    top_p: float | None = DEFAULTS.top_p,
    seed: int | None = DEFAULTS.seed,
    session: Session | None = None,
    stop_tokens: Sequence[int] = (),
    step: Step | None = None,
    graphs: DecodeGraphs | None = None,
    block: int = DEFAULTS.decode_block,
    note: Callable[[str], object] = print,
) -> Iterator[Tensor]:
    """Yield new tokens [B] one step at a time, sampled by default as ``recurformer generate``
    samples (``DEFAULTS``; ``temperature=0`` is greedy). Rows that produced a stop token yield -1
    from then on; the iterator ends when every row has stopped or after ``max_new_tokens``. ``session``
    continues an earlier generation (and is updated in place); ``step`` reads each new token
    (the prompt is read by the model's own call).

    ``graphs``: the sampling and the reading of each new token as one captured step
    (``DecodeGraphs.sampler``), run ``block`` steps at a time with one host read of their tokens;
    the same tokens, the same count and the same session as without, the tokens as host tensors.
    A model the graphs cannot hold, or a capture that fails, says so in one line to ``note`` and
    decodes eagerly from there."""
    check_values(
        GenerateOptions,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        decode_block=block,
    )
    if step is not None and graphs is not None:
        raise RecurformerError("give stream() a step or graphs, not both")
    was_training = model.training
    model.eval()
    try:
        if prompt is not None and not isinstance(prompt, Tensor):
            prompt = torch.tensor([list(prompt)], dtype=torch.long)
        if session is None:
            if prompt is None or prompt.numel() == 0:
                raise RecurformerError("generation needs a prompt (or a session to continue)")
            session = new_session(model, prompt.shape[0], seed)
        if prompt is not None and prompt.numel() > 0:
            read(model, session, prompt)
        if session.logits is None:
            raise RecurformerError("the session has no next-token logits: give a prompt")
        B = session.logits.shape[0]
        done = torch.zeros(B, dtype=torch.bool, device=session.logits.device)
        left = max_new_tokens
        if graphs is not None:
            sampling = (temperature, top_k, top_p)
            left, done = yield from blocks(graphs, session, sampling, stop_tokens, left, block, note)
        stops = torch.tensor(list(stop_tokens), dtype=torch.long, device=done.device)
        for _ in range(left):
            tok = sample(session.logits, temperature, top_k, top_p, session.generator)
            read(model, session, tok[:, None], step)
            yield torch.where(done, torch.full_like(tok, -1), tok)
            done |= torch.isin(tok, stops)
            if bool(done.all()):
                break
    finally:
        model.train(was_training)


def blocks(
    graphs: DecodeGraphs,
    session: Session,
    sampling: tuple[float, int | None, float | None],
    stop_tokens: Sequence[int],
    n: int,
    block: int,
    note: Callable[[str], object],
) -> Generator[Tensor, None, tuple[int, Tensor]]:
    """``stream``'s loop through ``graphs.sampler``: blocks of ``block`` captured steps, each read
    by the host once, the session moved to the end of the last token yielded (a block that ends
    early, at a stop, a non-finite logit or a consumer that stops asking, is run again to there
    from its start: the state and the generator restored). Returns, where it gives way to the
    eager loop, the tokens left and the rows done (no tokens left once every row has stopped)."""
    B = session.logits.shape[0] if session.logits is not None else 0
    done = torch.zeros(B, dtype=torch.bool, device=session.state.fresh.device)
    model, state = graphs.model, session.state
    if graphs.why_not is not None:
        note(f"[{graphs.backend} graphs: {graphs.why_not}; decoding eagerly]")
        return n, done
    if state.pos % model.reset_boundary and state.any_fresh is not False:  # a loaded session mid-chunk: ask once
        if state.any_fresh or bool(state.fresh.any()):
            return n, done  # the model's own call says why it cannot go on
        state = session.state = replace(state, any_fresh=False)
    temperature, top_k, top_p = sampling
    generator = session.generator if temperature > 0 else None
    pick = functools.partial(sample, temperature=temperature, top_k=top_k, top_p=top_p, generator=session.generator)
    assert session.logits is not None
    steps = graphs.sampler(sampling, pick, generator, state, session.logits, stop_tokens, block)

    def back(to: int) -> None:
        """The block run again from its start to ``to`` steps, and the session moved there."""
        steps.load(first, first_logits, first_done)
        if generator is not None and drawn is not None:
            generator.set_state(drawn)
        steps.run(to)
        session.state, session.logits = steps.state(), steps.logits.clone()

    while n:
        k = min(block, n)
        first, first_logits, first_done = session.state, session.logits, steps.done.clone()
        drawn = generator.get_state() if generator is not None else None
        try:
            steps.run(k)
        except CaptureFailed as e:  # before any step of the block ran: the session is at its start
            note(f"[{e}; decoding eagerly]")
            return n, first_done
        tokens, finite, stopped = steps.read(k)
        good = finite.index(False) if False in finite else k  # the steps before a non-finite logit
        stop = next((i for i in range(good) if stopped[i]), None)  # the step after which every row stopped
        end = good if stop is None else stop + 1
        if end < k:
            back(end)
        else:
            session.state, session.logits = steps.state(), steps.logits.clone()
        for i in range(end):
            try:
                yield tokens[:, i]
            except GeneratorExit:  # the consumer stops after token i: the session as if read to there
                if i + 1 < end:
                    back(i + 1)
                raise
        if stop is not None:
            return 0, steps.done.clone()
        if good < k:
            raise non_finite()
        n -= k
    return 0, steps.done.clone()


def generate(
    model: StreamingModel,
    prompt: Tensor | Sequence[int] | None,
    max_new_tokens: int = DEFAULTS.max_new_tokens,
    temperature: float = DEFAULTS.temperature,
    top_k: int | None = DEFAULTS.top_k,
    top_p: float | None = DEFAULTS.top_p,
    seed: int | None = DEFAULTS.seed,
    session: Session | None = None,
    stop_tokens: Sequence[int] = (),
) -> list[list[int]]:
    """The generated tokens of every row (a stop token ends its row and is included)."""
    steps = list(stream(model, prompt, max_new_tokens, temperature, top_k, top_p, seed, session, stop_tokens))
    if not steps:
        return []
    out = torch.stack(steps, 1).tolist()
    return [[t for t in row if t >= 0] for row in out]


def save_session(session: Session, path: str | Path, model_name: str) -> None:
    """Write a session to one safetensors file (atomically)."""
    p = Path(path)
    tensors = {f"state.{k}": v.cpu() for k, v in session.state.to_flat().items()}
    if session.logits is not None:
        tensors["logits"] = session.logits.cpu()
    tensors["generator"] = session.generator.get_state()
    meta = {"model": model_name, "state_class": type(session.state).__name__}
    atomic_write(p, lambda tmp: save_file(tensors, tmp, metadata=meta), "session")


def load_session(path: str | Path, model: StreamingModel, model_name: str) -> Session:
    p = Path(path)
    if not p.is_file():
        raise RecurformerError(f"session file not found: {p}")
    try:
        with safe_open(p, "pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(p)
    except (SafetensorError, OSError) as e:
        raise RecurformerError(f"cannot read session {p}: {str(e).splitlines()[0]}") from None
    if meta.get("model") != model_name:
        raise RecurformerError(f"session {p} was made by a '{meta.get('model')}' model, not '{model_name}'")
    device = model.tok_emb.weight.device
    flat = {k[len("state.") :]: v for k, v in tensors.items() if k.startswith("state.")}
    state = model.state_from_flat(flat).to(device)
    model.check_state(state, state.batch_size)
    g = torch.Generator(device=device)
    g.set_state(tensors["generator"])
    logits = tensors.get("logits")
    return Session(state=state, logits=None if logits is None else logits.to(device), generator=g)


class GenerationMixin:
    """``generate`` and ``stream`` as methods of a model (``nn.StreamingLM`` inherits them)."""

    def generate(
        self: StreamingModel,
        prompt: Any,
        max_new_tokens: int = DEFAULTS.max_new_tokens,
        temperature: float = DEFAULTS.temperature,
        **kwargs: Any,
    ) -> list[list[int]]:
        """Sample ``max_new_tokens`` after ``prompt`` (see ``recurformer.generate.generate``), with
        the command line's defaults; ``temperature=0`` is greedy."""
        return generate(self, prompt, max_new_tokens, temperature, **kwargs)

    def stream(
        self: StreamingModel,
        prompt: Any,
        max_new_tokens: int = DEFAULTS.max_new_tokens,
        temperature: float = DEFAULTS.temperature,
        **kwargs: Any,
    ) -> Iterator[Tensor]:
        """Iterator form of ``generate``: yields the new tokens [B] one step at a time."""
        return stream(self, prompt, max_new_tokens, temperature, **kwargs)
