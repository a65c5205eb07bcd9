"""The ``numba`` backend (derives from ``numpy``): NumPy arrays, with Numba-compiled kernels
where plain NumPy wastes time or memory. The Python of the backend sits here, its kernels in three
folders by job (:mod:`.kernels` indexes every kernel module):

* ``backend`` the class (setup, threads, linear layers, AdamW) with its op overrides by concern
  in mixins: ``backend_attention`` (RoPE, attention), ``backend_rows`` (RMSNorm, SwiGLU,
  cross-entropy), ``backend_decode`` (the fused decode step, greedy decoding);
* ``floats/``: kernels on float arrays: ``fastmath`` (flags, jit options, e^x), ``rope``,
  ``attention_forward`` (loops, the decode shape), ``attention_backward``, ``attention_blas``
  (tiles with OpenBLAS products), ``rows`` (cross-entropy, loss head, RMSNorm, SwiGLU), ``blas``
  (OpenBLAS's GEMM called from kernels), ``gemv`` (small-batch products), ``adamw`` (one-pass
  AdamW);
* ``quant/``: products with weights kept in GGML blocks: ``matmul`` (``qmatmul``, ``qmatmul_t``),
  ``block_types`` (type ids and block sizes as constants), ``unpack`` (block decoding as LLVM
  vector IR), ``int8_dots`` (integer dots with activations rounded to 8 bits, few rows),
  ``int8_gemm`` (integer GEMM tiles, many rows);
* ``decode/``: the fused decode steps, one compiled call per step: ``float_step`` (float
  weights), ``quant_step`` (GGML block weights);
* ``_cache`` keys every kernel's disk cache on all the sources of this folder and its subfolders.

The thread count of the decode steps, by measured speed, is ``backends/tuner.py``.
"""

import os

# Numba's parallel kernels run on GNU OpenMP, whose threads spin at each barrier for about 300,000
# iterations before they sleep. A decode step ends a few hundred parallel regions; on a machine
# where other processes want the cores, a thread spinning for a partner that lost its core holds
# that core from everyone. A short spin keeps the quiet speed (measured the same within noise:
# SmolLM2-135M Q4_1, 123 tokens/s either way) and lifts the contended one (31 -> 41 tokens/s with
# two busy processes on two cores; docs/BENCHMARKS.md, "Decode on a busy machine"). Read by
# libgomp when it loads, so set before the first parallel kernel runs; the user's value wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

