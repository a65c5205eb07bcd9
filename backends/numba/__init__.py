"""The ``numba`` backend (derives from ``numpy``): ``backend`` holds the op overrides and the
greedy decoder, ``kernels`` the jitted attention/RoPE/norm/loss kernels, ``blas`` OpenBLAS's GEMM
called from kernels, ``gemv`` the small-batch products, ``decode`` the fused decode step, ``optim``
the one-pass AdamW.
"""
