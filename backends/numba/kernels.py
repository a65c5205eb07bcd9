"""The index of the ``numba`` backend's jitted kernels: every kernel module by folder, and the
kernels the backend calls by name (its ``_k`` table: the names imported below).

Float kernels, ``floats/``:

* :mod:`.floats.fastmath`: the fast-math flags and jit options, the fast e^x and row maximum;
* :mod:`.floats.rope`: rotary position embedding;
* :mod:`.floats.attention_forward`: attention forward, loop kernels (prefill/training, the decode
  shape, a prompt's rows each on its own);
* :mod:`.floats.attention_backward`: attention backward, loop kernels;
* :mod:`.floats.attention_blas`: attention forward and backward with OpenBLAS tile products;
* :mod:`.floats.rows`: fused softmax cross-entropy and the loss head, RMSNorm, SwiGLU;
* :mod:`.floats.blas`: OpenBLAS's GEMM called from kernels (every other linear GEMM);
* :mod:`.floats.gemv`: products of a few rows (decoding);
* :mod:`.floats.adamw`: AdamW in one pass per parameter.

GGML block kernels, ``quant/`` (linear layers whose weights stay in their blocks):

* :mod:`.quant.matmul`: y = x W^T and dx = dy W from the blocks (``qmatmul``, ``qmatmul_t``), with
  the float32 row and tile kernels;
* :mod:`.quant.block_types`: the GGML type ids and block sizes as the kernels' constants;
* :mod:`.quant.unpack`: the blocks' decoding as LLVM vector IR;
* :mod:`.quant.int8_dots`: integer dots with activations rounded to 8-bit blocks (few rows);
* :mod:`.quant.int8_gemm`: integer GEMM tiles on those activations (many rows: prompts).

The fused decode steps, ``decode/``: :mod:`.decode.float_step` (float weights) and
:mod:`.decode.quant_step` (GGML block weights).

The backend reaches the modules outside the ``_k`` table by module, each on its first use:
``floats.gemv``, ``floats.blas``, ``floats.adamw``, ``quant.matmul`` and ``quant.int8_dots`` from
:mod:`.backend`, the decode steps from :mod:`.backend_decode`.

Importing it imports Numba but compiles nothing (every kernel compiles on its first call).
"""

from __future__ import annotations

from .floats.attention_backward import attn_bwd_parallel, attn_bwd_serial
from .floats.attention_blas import attn_bwd_blas, attn_fwd_blas
from .floats.attention_forward import (
                        BC,
                        BR,
                        attn_dec_parallel,
                        attn_dec_serial,
                        attn_fwd_parallel,
                        attn_fwd_serial,
)
from .floats.fastmath import FASTMATH, fexp
from .floats.rope import rope_parallel, rope_serial
from .floats.rows import (
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
