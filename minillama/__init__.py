"""minillama: a LLaMA-family language model in NumPy with hand-written backpropagation.

The package is in layers, each importing only those below it (``tests/project/test_layers.py``):
``core`` (the math) <- ``backends`` <- ``model`` <- ``io`` <- ``infer`` and ``train`` <- ``cli``.
The main entry points of each are named here; those of ``io`` and ``infer`` load on first use,
so that importing a lower layer never loads a higher one.
"""

import importlib

from minillama.backends import available_backends, get_backend
from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError
from minillama.core.sampling import SamplingParams
from minillama.model.kvcache import KVCache
from minillama.model.transformer import Transformer

#: name -> the module that defines it, imported when the name is first read
_LAZY = {"load_model": "minillama.io.load", "render_chat": "minillama.io.chat_template",
         "generate": "minillama.infer.generate", "stream": "minillama.infer.generate"}

__all__ = ["ModelConfig", "Transformer", "KVCache", "MinillamaError", "SamplingParams",
           "get_backend", "available_backends", *_LAZY, "__version__"]
__version__ = "0.2.0"


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'minillama' has no attribute {name!r}")
