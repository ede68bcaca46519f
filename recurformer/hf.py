"""Every recurformer model as a ``transformers`` causal LM (the optional extra ``recurformer[hf]``).

Importing this module registers ``RecurformerConfig`` (``model_type = "recurformer"``) and
``RecurformerForCausalLM`` with ``AutoConfig`` / ``AutoModelForCausalLM``:

    import recurformer.hf  # registers the Auto classes
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("my-model")
    out = model.generate(input_ids, max_new_tokens=50, do_sample=False)

One directory serves both libraries: ``config.json`` holds ``model_type`` and our model section
under ``"model"`` (read by ``recurformer.load`` as in its own directories), and the weights are
our own under the prefix ``model.`` (the wrapped ``StreamingLM``), which ``recurformer.load``
strips. ``recurformer export --format transformers`` writes such a directory.

The model state (``recurformer.State``) is the generation cache: ``RecurformerCache`` holds it,
``generate`` returns it (``return_dict_in_generate=True``) and takes it back to continue, and
beam search reorders its rows. A state cannot forget tokens, so the model is declared stateful
(assisted decoding, which needs to crop a cache, refuses it) and a padded attention mask is an
error (a state cannot skip positions)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

try:
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        GenerationConfig,
        GenerationMixin,
        PretrainedConfig,
        PreTrainedModel,
    )
    from transformers.cache_utils import Cache
    from transformers.modeling_outputs import CausalLMOutputWithPast
except ImportError:  # pragma: no cover - the message is the point
    from .config import RecurformerError

    raise RecurformerError("recurformer.hf needs transformers>=4.57,<5.25: pip install 'recurformer[hf]'") from None

from .config import RecurformerError
from .data import Tokenizer
from .nn import IGNORE_INDEX, State, StreamingLM
from .registry import build_model, make_config, model_name

# transformers 5.24 renamed the cache from ``past_key_values`` to ``cache`` (argument and output field)
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


# the standard config attributes transformers reads (beam search: vocab_size), from our model section
DERIVED = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
}


class RecurformerConfig(PretrainedConfig):
    """``model``: our model section, ``{"name": <registered model>, <its config values>}``."""

    model_type = "recurformer"

    def __init__(self, model: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.model = dict(model or {})
        for key in DERIVED:  # written into config.json for tools that read them; the model section decides
            kwargs.pop(key, None)
        if "name" in self.model:  # the model name and every key checked here, before any weight is read
            cfg = make_config(self.model["name"], {k: v for k, v in self.model.items() if k != "name"})
            for key, ours in DERIVED.items():
                setattr(self, key, getattr(cfg, ours))
        self.use_cache = kwargs.pop("use_cache", True)
        kwargs.setdefault("tie_word_embeddings", False)  # the LM head reads the embedding itself
        super().__init__(**kwargs)


class RecurformerCache(Cache):
    """The model ``State`` as a ``transformers`` cache: ``get_seq_length`` is the number of tokens
    read, ``reorder_cache`` / ``batch_select_indices`` index the state's rows (beam search),
    ``batch_repeat_interleave`` repeats them. It cannot be cropped (a state holds no past tokens)."""

    def __init__(self, state: State | None = None) -> None:
        super().__init__(layers=[])
        self.state = state

    def __repr__(self) -> str:
        return f"RecurformerCache(pos={self.get_seq_length()}, batch={None if self.state is None else self.state.batch_size})"

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return 0 if self.state is None else self.state.pos

    def _rows(self, index: Tensor) -> None:
        if self.state is not None:
            self.state = self.state.map(lambda t: t.index_select(0, index.to(t.device)))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rows(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        self._rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            self.state = self.state.map(lambda t: t.repeat_interleave(repeats, 0))

    def reset(self) -> None:
        self.state = None

    def crop(self, max_length: int) -> None:
        raise RecurformerError("a recurformer state cannot be cropped: it holds no past tokens to drop")

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False


class RecurformerForCausalLM(PreTrainedModel, GenerationMixin):
    """Any registered recurformer model (``self.model``, a ``StreamingLM``) behind the
    ``transformers`` causal-LM interface. ``labels`` are the inputs (shifted inside, as in
    ``transformers``); positions of -100 are not scored."""

    config_class = RecurformerConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules: list[str] = []
    _is_stateful = True  # assisted decoding and other cache-cropping modes refuse the model

    def __init__(self, config: RecurformerConfig) -> None:
        super().__init__(config)
        values = dict(config.model)
        name = values.pop("name", None)
        if name is None:
            raise RecurformerError("config.json has no model.name: not a recurformer model directory")
        self.model: StreamingLM = build_model(name, values)
        self.post_init()

    @classmethod
    def from_model(cls, model: StreamingLM, tokenizer: Tokenizer | None = None) -> "RecurformerForCausalLM":
        """Wrap a trained ``StreamingLM`` (a copy of its weights; BOS/EOS ids from ``tokenizer``)."""
        ids = {} if tokenizer is None else {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
        config = RecurformerConfig(model={"name": model_name(model.config), **asdict(model.config)}, **ids)
        out = cls(config)
        out.model.load_state_dict(model.state_dict())
        out.generation_config = GenerationConfig(**ids)
        out.model.to(model.tok_emb.weight.device)
        return out.eval()

    # -- loading -------------------------------------------------------------------------------
    def _init_weights(self, module: nn.Module) -> None:
        """The wrapped model initialises its own weights when built; transformers' defaults would
        overwrite them. Non-persistent buffers are rebuilt (see ``rebuild_buffers``)."""
        init = getattr(module, "init_buffers", None)
        if callable(init):
            init()

    def rebuild_buffers(self) -> None:
        """Recompute every non-persistent buffer: transformers 5 builds the model on the meta
        device and leaves such buffers uninitialised after loading. Each module that holds one
        rebuilds it with ``init_buffers()``; a module without one is an error, not garbage."""
        for name, module in self.named_modules():
            if module._non_persistent_buffers_set:
                init = getattr(module, "init_buffers", None)
                if not callable(init):
                    raise RecurformerError(
                        f"module '{name}' ({type(module).__name__}) has non-persistent buffers but no init_buffers()"
                    )
                init()

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override, unused-ignore]
        model = super().from_pretrained(*args, **kwargs)
        out = model[0] if isinstance(model, tuple) else model  # output_loading_info=True
        out.rebuild_buffers()
        out.realign()
        return model

    def realign(self) -> None:
        """Copy every parameter and buffer that loading left at an address not a multiple of 64
        bytes (a tensor read in place from the safetensors file) into fresh, aligned memory: CPU
        BLAS picks its kernels by alignment, so a misaligned weight gives logits that differ from
        the saved model's in the last bits."""
        with torch.no_grad():
            for t in [*self.parameters(), *self.buffers()]:
                if t.data_ptr() % 64:
                    t.data = t.data.clone()

    def empty_cache(self) -> RecurformerCache:
        """A cache holding no state yet: pass it as ``past_key_values`` to read a long input in
        several calls (each call advances it)."""
        return RecurformerCache()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.tok_emb

    def set_input_embeddings(self, value: nn.Module) -> None:
        if not isinstance(value, nn.Embedding):
            raise RecurformerError(f"the input embedding must be an nn.Embedding, got a {type(value).__name__}")
        self.model.tok_emb = value

    def get_output_embeddings(self) -> None:
        return None  # tied: the LM head reads the input embedding

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the cache is ours, made in ``prepare_inputs_for_generation``

    # -- the forward ---------------------------------------------------------------------------
    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        past_key_values: RecurformerCache | None = None,
        cache: RecurformerCache | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs: Any,
    ) -> Any:
        """Read ``input_ids`` [B, T] after the state in the cache (``cache`` or, before
        transformers 5.24, ``past_key_values``); any other keyword is an error, so that a renamed
        cache argument can never be dropped silently (generating from a fresh state each step)."""
        if kwargs:
            raise RecurformerError(
                f"{type(self).__name__}.forward got unknown keyword argument(s) {', '.join(sorted(kwargs))}"
            )
        if past_key_values is not None and cache is not None:
            raise RecurformerError("give the cache as 'cache' or as 'past_key_values', not both")
        cache = cache if cache is not None else past_key_values
        if input_ids is None:
            raise RecurformerError("input_ids are required (inputs_embeds are not supported)")
        if output_attentions or output_hidden_states:
            raise RecurformerError("output_attentions / output_hidden_states are not supported by recurformer models")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise RecurformerError(
                "attention_mask has padded positions: a recurrent state cannot skip tokens; "
                "give rows of equal length without padding (or one row at a time)"
            )
        if cache is not None and not isinstance(cache, RecurformerCache):
            raise RecurformerError(f"the cache must be a RecurformerCache, got a {type(cache).__name__}")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        out = self.model(input_ids, state=cache.state if cache is not None else None)
        logits = out.logits[:, -logits_to_keep:] if logits_to_keep else out.logits
        loss = None
        if labels is not None:
            shift = out.logits[:, :-1].float().flatten(0, 1)
            loss = F.cross_entropy(shift, labels[:, 1:].flatten().to(shift.device), ignore_index=IGNORE_INDEX)
        new_cache = None
        if use_cache:
            new_cache = cache if cache is not None else RecurformerCache()
            new_cache.state = out.state
        fields: dict[str, Any] = {"loss": loss, "logits": logits, CACHE_FIELD: new_cache}
        result = CausalLMOutputWithPast(**fields)
        return result if return_dict is not False else result.to_tuple()

    def prepare_inputs_for_generation(  # type: ignore[override, unused-ignore]
        self,
        input_ids: Tensor,
        past_key_values: RecurformerCache | None = None,
        cache: RecurformerCache | None = None,
        attention_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        use_cache: bool | None = None,
        next_sequence_length: int | None = None,
        cache_position: Tensor | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The tokens the cache has not read yet (``input_ids`` is the whole sequence so far;
        without a cache, all of it), the cache (a fresh one at the first step) and the mask."""
        if inputs_embeds is not None:
            raise RecurformerError("inputs_embeds are not supported by recurformer models; give input_ids")
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if not use_cache:
            return {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}
        cache = cache if cache is not None else RecurformerCache()
        done = cache.get_seq_length()
        if next_sequence_length is not None:
            n = next_sequence_length
        elif cache_position is not None:
            n = int(cache_position.shape[0])
        else:
            n = (attention_mask.shape[1] if attention_mask is not None else input_ids.shape[1]) - done
        if not 0 < n <= input_ids.shape[1]:
            raise RecurformerError(
                f"the cache has read {done} tokens and the input holds {input_ids.shape[1]}: "
                "pass the whole sequence (the tokens the cache read, then the new ones)"
            )
        return {
            "input_ids": input_ids[:, -n:],
            "past_key_values": cache,
            "attention_mask": attention_mask,
            "use_cache": True,
        }


AutoConfig.register(RecurformerConfig.model_type, RecurformerConfig, exist_ok=True)
AutoModelForCausalLM.register(RecurformerConfig, RecurformerForCausalLM, exist_ok=True)


def tokenizer_config(tokenizer: Tokenizer) -> dict[str, Any]:
    """``tokenizer_config.json`` for ``AutoTokenizer``: our BPE ``tokenizer.json`` read by
    ``PreTrainedTokenizerFast`` with its BOS and EOS."""
    from .data.tokenizer import BOS, EOS

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "clean_up_tokenization_spaces": False,
    }


def with_bos(path: Path, tokenizer: Tokenizer) -> None:
    """Give the ``tokenizer.json`` at ``path`` a post-processor that puts BOS before every text
    (``AutoTokenizer`` and pipelines then encode a prompt as our documents begin); recurformer's
    own ``Tokenizer`` encodes without special tokens and is unaffected."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    from .data.tokenizer import BOS

    hf = HFTokenizer.from_file(str(path))
    hf.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tokenizer.bos_id)]
    )
    hf.save(str(path))


def export(checkpoint: str | Path, out: str | Path, overwrite: bool) -> Path:
    """A run, checkpoint or pretrained directory -> a directory that ``AutoModelForCausalLM`` /
    ``AutoTokenizer`` and ``recurformer.load`` all read: ``config.json``, ``model.safetensors``,
    ``generation_config.json`` (stops at EOS), ``tokenizer.json`` + ``tokenizer_config.json``
    (BOS/EOS; a byte tokenizer has no ``transformers`` form and gets no ``tokenizer_config.json``;
    a tokenizer learned from lower-case text lower-cases its input, as ``recurformer generate``
    does) and the model card. Every file is written whole or not at all; ``out`` is claimed as
    ``api.export_pretrained`` claims it (no run; else an earlier export of the same run, or ``overwrite``)."""
    from .hub import claim_export_dir, load, model_card, run_config_of, shareable

    loaded = load(checkpoint)
    model, tok, config = loaded.model, loaded.tokenizer, loaded.config
    dest = Path(out)
    cfg = shareable(run_config_of(model, config))
    claim_export_dir(dest, cfg, overwrite)
    lower = tok is not None and tok.lowercase
    if tok is not None and lower:
        tok = tok.lowercasing()
    hf = RecurformerForCausalLM.from_model(model, tok)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".tmp_") as tmp:
        t = Path(tmp)
        hf.save_pretrained(t)
        if tok is not None:
            tok.save(t)
            if tok.kind == "bpe":
                with_bos(t / "tokenizer.json", tok)
                (t / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok), indent=2) + "\n")
        model_card(model, cfg, lower_case=lower).save(t / "README.md")
        for f in t.iterdir():
            os.replace(f, dest / f.name)
    return dest


__all__ = ["RecurformerCache", "RecurformerConfig", "RecurformerForCausalLM", "export", "tokenizer_config"]
