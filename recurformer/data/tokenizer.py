"""Tokenizers: a training-free byte tokenizer and a byte-level BPE trained with HF ``tokenizers``.

Both kinds live behind one small class and are saved as one ``tokenizer.json`` so that a prepared
dataset directory (and a checkpoint) carries everything needed to encode and decode text.
Special tokens: BOS (prepended to every document) and EOS. ``decode`` drops special tokens.

Long texts (books) are cut into ~64 KB pieces before they reach HF ``tokenizers``, which otherwise
needs ~1 GB of memory for one 3 MB string. The cuts are made only where the GPT-2 pre-tokenizer
always has a boundary (after a newline, before a non-space character), so encodings and BPE
training counts are the same as for the uncut text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from recurformer.config import RecurformerError

BOS, EOS = "<|bos|>", "<|eos|>"
FILENAME = "tokenizer.json"
PIECE_CHARS = 1 << 16
_CUT = re.compile(r"(?<=\n)(?=\S)")


def pieces(text: str, size: int = PIECE_CHARS) -> list[str]:
    """``text`` cut into pieces of about ``size`` characters at newline -> non-space boundaries."""
    if len(text) <= size:
        return [text]
    out, start = [], 0
    while len(text) - start > size:
        m = _CUT.search(text, start + size)
        if m is None:
            break
        out.append(text[start : m.start()])
        start = m.start()
    out.append(text[start:])
    return out


class Tokenizer:
    """``kind`` is ``"byte"`` (ids 0-255 are bytes, then BOS, EOS) or ``"bpe"`` (HF byte-level BPE)."""

    def __init__(self, kind: str, hf: HFTokenizer | None = None) -> None:
        self.kind = kind
        self._hf = hf
        if hf is None:
            self.vocab_size, self.bos_id, self.eos_id = 258, 256, 257
        else:
            self.vocab_size = hf.get_vocab_size()
            bos, eos = hf.token_to_id(BOS), hf.token_to_id(EOS)
            if bos is None or eos is None:
                raise RecurformerError(f"tokenizer has no {BOS} or {EOS} token")
            self.bos_id, self.eos_id = bos, eos

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size})"

    @staticmethod
    def byte() -> Tokenizer:
        return Tokenizer("byte")

    @staticmethod
    def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
        """Train a byte-level BPE (no normalisation, GPT-2 pre-tokenisation) with BOS=0, EOS=1."""
        if vocab_size < 258 or vocab_size > 1 << 20:
            raise RecurformerError(f"BPE vocab_size must be in [258, 2**20], got {vocab_size}")
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[BOS, EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator((p for t in texts for p in pieces(t)), trainer=trainer)
        return Tokenizer("bpe", hf)

    @property
    def lowercase(self) -> bool:
        """True for a BPE learned from (almost only) lower-case text: fewer than 1% of its merged
        tokens hold an ASCII capital (the bundled ``tinystories-repeat`` has two, from its "Repeat
        above." marker), so a capital letter falls apart into byte tokens the model has hardly seen."""
        if self._hf is None:
            return False
        merged = [t for t in self._hf.get_vocab() if len(t) > 1]
        capital = sum(any("A" <= c <= "Z" for c in t) for t in merged)
        return capital < 0.01 * len(merged)

    def lowercasing(self) -> Tokenizer:
        """This tokenizer with a lower-case normalizer in front (a BPE; a byte tokenizer is
        returned as it is): ``encode(text)`` then equals this one's ``encode(text.lower())``, in
        the saved ``tokenizer.json`` too, for users of the file through HF ``tokenizers``."""
        if self._hf is None:
            return self
        hf = HFTokenizer.from_str(self._hf.to_str())
        hf.normalizer = normalizers.Lowercase()
        return Tokenizer("bpe", hf)

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self._hf is None:
            return [list(t.encode("utf-8")) for t in texts]
        cut = [pieces(t) for t in texts]
        flat = self._hf.encode_batch([p for ps in cut for p in ps], add_special_tokens=False)
        out, i = [], 0
        for ps in cut:
            out.append([tok for e in flat[i : i + len(ps)] for tok in e.ids])
            i += len(ps)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        if self._hf is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self._hf.decode(ids, skip_special_tokens=True)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / FILENAME
        path.parent.mkdir(parents=True, exist_ok=True)
        if self._hf is None:
            path.write_text(json.dumps({"recurformer_tokenizer": "byte", "vocab_size": self.vocab_size}) + "\n")
        else:
            self._hf.save(str(path))
        return path

    @staticmethod
    def load(directory: str | Path) -> Tokenizer:
        path = Path(directory)
        path = path / FILENAME if path.is_dir() else path
        try:
            text = path.read_text(encoding="utf-8")
            data = json.loads(text)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RecurformerError(f"cannot read tokenizer {path}: {type(e).__name__}: {e}".splitlines()[0]) from None
        if isinstance(data, dict) and data.get("recurformer_tokenizer") == "byte":
            return Tokenizer.byte()
        try:
            tok = Tokenizer("bpe", HFTokenizer.from_str(text))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise RecurformerError(f"corrupt tokenizer file {path}: {e}".splitlines()[0]) from None
        if tok.bos_id is None or tok.eos_id is None:
            raise RecurformerError(f"tokenizer {path} has no {BOS}/{EOS} special tokens")
        return tok
