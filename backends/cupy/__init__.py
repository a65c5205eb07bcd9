"""The ``cupy`` backend (NVIDIA GPU; derives from ``reference``): ``backend`` holds the op
overrides, ``kernels/*.cu`` the CUDA sources, ``build`` compiles and launches them, ``graph`` the
CUDA-graph greedy decoder, ``mixed_precision`` the TF32/bf16 training products.
"""
