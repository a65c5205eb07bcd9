"""The ``numpy`` backend: the reference math made fast on the CPU (row threads, single-threaded
BLAS, in-place buffers). ``backend`` holds the op overrides, ``threads`` the row threads and
OpenBLAS thread control that the numba backend reuses.
"""
