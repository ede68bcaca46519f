"""recurformer: recurrent transformer language models behind one streaming contract.

The Python API (see ``recurformer.api``): ``recurformer.train(config, **overrides)``,
``recurformer.load(path_or_repo_id)``, ``recurformer.evaluate(model, tokenizer, ...)``,
``recurformer.probe(model, tokenizer, ...)``, ``recurformer.export(run, out_dir)``."""

# first, before anything imports torch: OpenMP's wait policy (see openmp.py)
from . import openmp as _openmp  # noqa: F401

# isort: split
# the modules named like API functions are imported first, so that the functions, bound after them,
# keep the names: ``recurformer.evaluate(...)`` is ``api.evaluate``, ``from recurformer.evaluate import
# evaluate_lengths`` still reads the module
from . import evaluate as _evaluate  # noqa: E402, F401
from . import probe as _probe  # noqa: E402, F401
from .api import Run, evaluate, export, load, probe, train  # noqa: E402
from .config import RecurformerError
from .data import Tokenizer
from .models import build_model, make_config, model_names
from .nn import Output, State, StreamingLM

__version__ = "0.1.0"

__all__ = [
    "RecurformerError",
    "Run",
    "Tokenizer",
    "build_model",
    "evaluate",
    "export",
    "load",
    "make_config",
    "model_names",
    "probe",
    "train",
    "Output",
    "State",
    "StreamingLM",
]
