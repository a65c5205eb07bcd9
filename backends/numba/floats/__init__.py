"""The ``numba`` backend's kernels on float arrays: RoPE, attention (loops, and tiles with
OpenBLAS products), the row ops, OpenBLAS's GEMM called from kernels, the GEMV of few rows and
AdamW, with the fast-math ground they share (``fastmath``). Indexed in :mod:`..kernels`; the
package imports nothing (each module imports Numba, compiling nothing until a kernel's first
call)."""
