"""recurformer: recurrent transformer language models behind one streaming contract."""

from .config import RecurformerError
from .models import build_model, make_config, model_names
from .nn import Output, State, StreamingLM

__all__ = ["RecurformerError", "build_model", "make_config", "model_names", "Output", "State", "StreamingLM"]
__version__ = "0.1.0"
