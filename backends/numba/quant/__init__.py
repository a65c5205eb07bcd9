"""The ``numba`` backend's products with weights kept in GGML blocks
(:class:`minillama.core.quant.QuantMatrix`): ``matmul`` the entry points (``qmatmul``,
``qmatmul_t``) and float32 kernels, ``block_types`` the types as the kernels' constants, ``unpack``
the blocks' decoding as LLVM vector IR, ``int8_dots`` and ``int8_gemm`` the integer products with
activations rounded to 8-bit blocks. Indexed in :mod:`..kernels`; the package imports nothing."""
