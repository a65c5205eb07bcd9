"""The ``numba`` backend's fused decode steps: a whole KV-cached step of the model in one
compiled call, ``float_step`` for float weights, ``quant_step`` for GGML block weights (taken by
:class:`~minillama.backends.numba.backend_decode.FusedDecode`). Indexed in :mod:`..kernels`; the
package imports nothing."""
