"""minillama: a LLaMA-family language model in NumPy with hand-written backpropagation."""

from .backends import available_backends, get_backend
from .config import ModelConfig
from .errors import MinillamaError
from .kvcache import KVCache
from .model import Transformer

__all__ = ["ModelConfig", "Transformer", "KVCache", "MinillamaError", "get_backend",
           "available_backends", "__version__"]
__version__ = "0.1.0"
