"""The index of the ``numba`` backend's jitted kernels, by the name the backend calls them (its
``_k`` table): each lives in the module of its concern.

* :mod:`.fastmath`: the fast-math flags and jit options, the fast e^x and row maximum;
* :mod:`.rope`: rotary position embedding;
* :mod:`.attention`: attention forward, loop kernels (prefill/training and the decode shape);
* :mod:`.attention_backward`: attention backward, loop kernels;
* :mod:`.attention_blas`: attention forward and backward with OpenBLAS tile products;
* :mod:`.rows`: fused softmax cross-entropy and the loss head, RMSNorm, SwiGLU.

Importing it imports Numba but compiles nothing (every kernel compiles on its first call).
"""

from __future__ import annotations

from .attention import (
                        BC,
                        BR,
                        attn_dec_parallel,
                        attn_dec_serial,
                        attn_fwd_parallel,
                        attn_fwd_serial,
)
from .attention_backward import attn_bwd_parallel, attn_bwd_serial
from .attention_blas import attn_bwd_blas, attn_fwd_blas
from .fastmath import FASTMATH, fexp
from .rope import rope_parallel, rope_serial
from .rows import (
                        lce_fwd_blas,
                        rmsnorm_bwd_par,
                        rmsnorm_bwd_rows,
                        rmsnorm_fwd_par,
                        rmsnorm_fwd_rows,
                        swiglu_bwd_par,
                        swiglu_bwd_rows,
                        swiglu_fwd_par,
                        swiglu_fwd_rows,
                        xent_bwd,
                        xent_fwd,
                        xent_grad_rows,
)

__all__ = ["BC", "BR", "FASTMATH", "attn_bwd_blas", "attn_bwd_parallel", "attn_bwd_serial",
           "attn_dec_parallel", "attn_dec_serial", "attn_fwd_blas", "attn_fwd_parallel",
           "attn_fwd_serial", "fexp", "lce_fwd_blas", "rmsnorm_bwd_par", "rmsnorm_bwd_rows",
           "rmsnorm_fwd_par", "rmsnorm_fwd_rows", "rope_parallel", "rope_serial", "swiglu_bwd_par",
           "swiglu_bwd_rows", "swiglu_fwd_par", "swiglu_fwd_rows", "xent_bwd", "xent_fwd",
           "xent_grad_rows"]
