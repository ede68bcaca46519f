"""recurformer: recurrent transformer language models behind one streaming contract.

The Python API (see ``recurformer.api``): ``recurformer.train(config, **overrides)``,
``recurformer.load(path_or_repo_id)``, ``recurformer.evaluate(model, tokenizer, ...)``,
``recurformer.probe(model, tokenizer, ...)``, ``recurformer.export(run, out_dir)``."""

import os

# OpenMP's default wait policy lets idle threads spin; on a CPU shared with another busy process
# a spinning thread holds the core the other threads wait for, and every parallel region stalls
# (benchmarks/threads.py: generation and a training step ~20x slower on a loaded 2-core machine
# with 2 threads, as fast as 1 thread or faster with passive waiting). Set before torch loads its
# OpenMP runtime, so it applies where recurformer is imported before torch (the command line);
# a value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# the modules named like API functions are imported first, so that the functions, bound after them,
# keep the names: ``recurformer.train(...)`` is ``api.train``, ``from recurformer.train import Trainer``
# still reads the module
from . import evaluate as _evaluate  # noqa: E402, F401
from . import probe as _probe  # noqa: E402, F401
from . import train as _train  # noqa: E402, F401
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
