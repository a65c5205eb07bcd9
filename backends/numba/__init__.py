"""The ``numba`` backend (derives from ``numpy``): ``backend`` holds the op overrides and the
greedy decoder, ``kernels`` the index of the jitted kernels, which live in ``fastmath`` (flags,
e^x), ``rope``, ``attention`` (forward loops), ``attention_backward``, ``attention_blas`` (tiled
with BLAS) and ``rows`` (cross-entropy, RMSNorm, SwiGLU); ``blas`` OpenBLAS's GEMM called from
kernels, ``gemv`` the small-batch products, ``decode`` the fused decode step, ``optim`` the one-pass
AdamW.
"""
