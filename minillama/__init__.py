"""minillama: a LLaMA-family language model in NumPy with hand-written backpropagation."""

from minillama.backends import available_backends, get_backend
from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError
from minillama.model.kvcache import KVCache
from minillama.model.transformer import Transformer

__all__ = ["ModelConfig", "Transformer", "KVCache", "MinillamaError", "get_backend",
           "available_backends", "__version__"]
__version__ = "0.1.0"
