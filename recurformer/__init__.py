"""recurformer: recurrent transformer language models behind one streaming contract.

The Python API (see ``recurformer.api``): ``recurformer.train(config, **overrides)``,
``recurformer.load(path_or_repo_id)``, ``recurformer.evaluate(model, tokenizer, ...)``,
``recurformer.probe(model, tokenizer, ...)``, ``recurformer.export(run, out_dir)``."""

import types

from . import evaluate, probe, train
from .api import Run, export, load
from .config import RecurformerError
from .data import Tokenizer
from .models import build_model, make_config, model_names
from .nn import Output, State, StreamingLM

__version__ = "0.1.0"


class _CallableModule(types.ModuleType):
    """``recurformer.train`` (``evaluate``, ``probe``) is the module of that name, so that
    ``from recurformer.train import Trainer`` keeps working, and also the API function."""

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        from . import api

        return getattr(api, self.__name__.rsplit(".", 1)[1])(*args, **kwargs)


for _module in (train, evaluate, probe):
    _module.__class__ = _CallableModule

__all__ = [
    "RecurformerError", "Run", "Tokenizer", "build_model", "evaluate", "export", "load", "make_config",
    "model_names", "probe", "train", "Output", "State", "StreamingLM",
]
