r"""The CuPy backend: the model on an NVIDIA GPU, cuBLAS for the matrix products (through CuPy) and
hand-written CUDA kernels (``kernels/*.cu``, built by :mod:`.build`) for the other ops.

Every op keeps the contract of :mod:`minillama.core.ops` (``*_forward(...) -> (out, ctx)``,
``*_backward(dout, ctx)``) and the arrays stay on the device. The kernels are templated for
float32 and float64, so the float64 gradient checks run on the kernels too; any other dtype (and
head dimensions above 128 for attention) falls back to the reference ops, which also run on CuPy.

Kernels per op (forward / backward):

* ``rmsnorm``: one block per row with a fused sum-of-squares reduction / a row kernel for dx and
  a column-partial-sum kernel for dg;
* ``rope``: one thread per rotated pair, in place when ``out`` is ``x``; the backward is the
  same kernel with the angle negated. The cos/sin tables are the model's device arrays;
* ``attention``: causal GQA, tiled with an online softmax (the (T, S) matrix is never stored), the
  row log-sum-exp saved for the backward, which recomputes the probabilities (dq in one kernel,
  dk/dv in another that sums the heads of a group without atomics); one query per sequence
  (T = 1) uses a decode kernel against the KV cache (a cache view is read in place);
* ``swiglu``: elementwise, the backward recomputes the sigmoid;
* ``cross_entropy``: one block per row for the log-sum-exp; the backward writes
  softmax - one-hot, masked and scaled, in one pass (the scale stays on the device);
* ``embedding``: gather / a scatter-add in a fixed order (tokens sorted, one block per run of
  equal tokens; no atomics anywhere in the training path, so a seed gives the same weights);
* :func:`adamw_update`: one fused AdamW step over a parameter buffer.

``linear`` is one cuBLAS GEMM per product (inputs flattened to 2-D).

This file holds the setup, the host/device moves, the linear layers (quantized ones included),
AdamW and sampling; the other ops are mixins, one concern each:
:class:`.backend_rows.RowOps` (embedding, RMSNorm, SwiGLU, cross-entropy) and
:class:`.backend_attention.AttentionOps` (RoPE, attention). :mod:`.common` holds ``cp`` (the cupy
module once bound) and the kernel-argument helpers they share.
"""

from __future__ import annotations

import numpy as np

from minillama.core import ops, quant
from minillama.core.errors import MinillamaError
from minillama.core.quant import QuantMatrix
from minillama.core.sampling import check_sampling

from ..reference import ReferenceBackend
from . import build as cb
from .backend_attention import AttentionOps
from .backend_rows import RowOps
from .common import QUANT_KERNELS, _c, _i32, _import_cupy, _KCtx, _launch, _scalar, _supported, cp


class CupyBackend(AttentionOps, RowOps, ReferenceBackend):
    """NVIDIA GPU through CuPy: cuBLAS GEMMs and the CUDA kernels of ``kernels/*.cu``.

    Constructing it without CuPy, or without a usable GPU, raises one clear
    :class:`MinillamaError` line (never a traceback from inside CuPy).
    """

    name = "cupy"
    #: the kernels are instantiated for float64 too, so the float64 gradient checks run on them
    supports_float64 = True
    #: use the tensor-core attention kernels of flash_attention.cu for float32, head dimension 64
    #: or 128 and T > 1 (set in __init__: compute capability 8.0 or newer, and
    #: MINILLAMA_CUDA_FLASH is not "0")
    flash = False
    #: "fp32": the flash kernels split each operand into two TF32 parts (3xTF32, about float32
    #: accuracy); "tf32": one TF32 product (faster, about 1e-3 relative). From
    #: MINILLAMA_CUDA_ATTENTION when set.
    attention_precision = "fp32"
    #: float32 caches only: the CUDA-graph decoder writes float32 rows into the cache arrays
    half_kv_cache = False

    def __init__(self) -> None:  # documented on the class
        super().__init__()
        self.xp = _import_cupy()
        dev = cp.cuda.Device()
        try:
            props = cp.cuda.runtime.getDeviceProperties(dev.id)
            label = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        except Exception:  # the name is cosmetic
            label = "GPU"
        self.device = f"cuda:{dev.id} ({label})"
        import os

        try:
            cc = int(dev.compute_capability)
        except Exception:  # unknown: stay on the SIMT kernels
            cc = 0
        self.flash = cc >= 80 and os.environ.get("MINILLAMA_CUDA_FLASH", "1") != "0"
        prec = os.environ.get("MINILLAMA_CUDA_ATTENTION", "fp32").lower()
        if prec not in ("fp32", "tf32"):
            raise MinillamaError(f"MINILLAMA_CUDA_ATTENTION must be fp32 or tf32, got {prec!r}")
        self.attention_precision = prec
        self._dummy_start = {}
        self._start_cache = None

    # --- helpers -------------------------------------------------------------------------------
    def asarray(self, a, dtype=None):
        """A CuPy array on the current device (copied from the host when needed). A
        :class:`QuantMatrix` of a type in ``QUANT_KERNELS`` moves as its blocks; other quantized
        types are dequantized once into ``dtype``."""
        if isinstance(a, QuantMatrix):
            if a.qtype in QUANT_KERNELS:
                return QuantMatrix(a.qtype, a.shape, cp.asarray(a.data))
            return cp.asarray(quant.dequantize(a), dtype=dtype or np.float32)
        return cp.asarray(a, dtype=dtype)

    def to_numpy(self, a) -> np.ndarray:
        """A NumPy copy of ``a`` on the host."""
        return cp.asnumpy(a) if isinstance(a, cp.ndarray) else np.asarray(a)

    def synchronize(self) -> None:
        """Wait for the work queued on the current stream."""
        cp.cuda.get_current_stream().synchronize()

    def _start_args(self, start_pos, B: int):
        """(device int64 array, scalar, use_array) for the attention kernels' start position."""
        if isinstance(start_pos, cp.ndarray) and start_pos.size == B:
            # positions already on the device stay there (no host read: CUDA-graph capture)
            return _c(start_pos.reshape(-1).astype(cp.int64, copy=False)), np.int64(0), np.int32(1)
        if isinstance(start_pos, cp.ndarray) or np.ndim(start_pos) > 0:
            arr = start_pos if isinstance(start_pos, cp.ndarray) else np.asarray(start_pos)
            arr = arr.reshape(-1)
            if arr.size == 1:
                return self._dummy(), np.int64(int(arr[0])), np.int32(0)
            if arr.size != B:
                raise MinillamaError(f"start_pos has {arr.size} entries for a batch of {B}")
            if isinstance(arr, cp.ndarray):
                return _c(arr.astype(cp.int64, copy=False)), np.int64(0), np.int32(1)
            # every layer of one forward passes the same host positions: copy them once
            pos = np.asarray(arr, dtype=np.int64)
            key = (cp.cuda.Device().id, pos.tobytes())
            if self._start_cache is None or self._start_cache[0] != key:
                self._start_cache = (key, cp.asarray(pos))
            return self._start_cache[1], np.int64(0), np.int32(1)
        return self._dummy(), np.int64(int(start_pos)), np.int32(0)

    def _dummy(self):
        dev = cp.cuda.Device().id
        if dev not in self._dummy_start:
            self._dummy_start[dev] = cp.zeros(1, dtype=cp.int64)
        return self._dummy_start[dev]

    # --- linear (cuBLAS) ------------------------------------------------------------------------
    def linear_forward(self, x, w):
        r"""y = x W^T as one GEMM over the flattened rows. x: (..., in); w: (out, in)
        -> (..., out)."""
        if isinstance(w, QuantMatrix):
            return self._qlinear_forward(x, w)
        if not _supported(x, w):
            return ops.linear_forward(x, w)
        x2 = x.reshape(-1, x.shape[-1])
        y = (x2 @ w.T).reshape(tuple(x.shape[:-1]) + (w.shape[0],))
        return y, _KCtx((x2, w, tuple(x.shape)))

    def linear_backward(self, dy, ctx):
        r"""dx = dy W, dW = dy^T x (rows flattened). Returns (dx: (..., in), dW: (out, in))."""
        if not isinstance(ctx, _KCtx):
            return ops.linear_backward(dy, ctx)
        x2, w, xshape = ctx
        dy2 = dy.reshape(-1, dy.shape[-1])
        if isinstance(w, QuantMatrix):  # a frozen weight: dx only
            return (dy2 @ self._dequantize(w, dy.dtype)).reshape(xshape), None
        dx = (dy2 @ w).reshape(xshape)
        dw = dy2.T @ x2
        return dx, dw

    def _qlinear_forward(self, x, w):
        r"""y = x W^T with W in Q8_0, Q4_K or Q6_K blocks on the device: up to
        ``QUANT_MATVEC_ROWS`` rows of x go through the matvec kernel (weights read once, in their
        blocks); more rows dequantize W once and run one GEMM. x: (..., K); w: QuantMatrix
        (N, K) -> (..., N)."""
        N, K = w.shape
        if not _supported(x):
            raise MinillamaError(f"a {w.qtype} product on the GPU needs float32 or float64 "
                                 f"activations, got {x.dtype}")
        x2 = _c(x.reshape(-1, K))
        M = x2.shape[0]
        if M <= cb.QUANT_MATVEC_ROWS:
            y = cp.empty((M, N), dtype=x.dtype)
            grid, block = cb.quant_matvec_launch(N, M)
            _launch("quant", QUANT_KERNELS[w.qtype][0], x.dtype, grid, block,
                    (w.data, x2, y, _i32(N), _i32(K)))
        else:
            y = x2 @ self._dequantize(w, x.dtype).T
        return y.reshape(tuple(x.shape[:-1]) + (N,)), _KCtx((None, w, tuple(x.shape)))

    def _dequantize(self, w, dtype):
        """W (N, K) as ``dtype`` on the device, from its blocks (quant.cu *_dequant)."""
        N, K = w.shape
        out = cp.empty((N, K), dtype=dtype)
        grid, block = cb.elementwise_launch(N * K)
        _launch("quant", QUANT_KERNELS[w.qtype][1], dtype, grid, block,
                (w.data, out, _i32(N), _i32(K)))
        return out

    # --- optimiser and sampling helpers -----------------------------------------------------------
    def adamw_update(self, param, grad, m, v, lr, beta1, beta2, eps, wd, step):
        """See :func:`adamw_update`."""
        adamw_update(param, grad, m, v, lr, beta1, beta2, eps, wd, step)

    def sample_tokens(self, logits, temperature: float = 0.0, top_k=None, top_p=None,
                      rng: np.random.Generator | None = None, uniforms=None):
        """See :func:`sample_tokens`."""
        return sample_tokens(logits, temperature, top_k, top_p, rng, uniforms)


def adamw_update(param, grad, m, v, lr, beta1, beta2, eps, wd, step) -> None:
    r"""One fused AdamW step over one parameter buffer, in place (one kernel launch):

    m \leftarrow \beta_1 m + (1-\beta_1) g,\quad v \leftarrow \beta_2 v + (1-\beta_2) g^2,
    \theta \leftarrow \theta (1 - \eta\lambda) -
        \eta \frac{m / (1-\beta_1^t)}{\sqrt{v / (1-\beta_2^t)} + \epsilon}

    (the update of :class:`minillama.train.optim.AdamW`; pass ``wd = 0`` for parameters without
    decay). param, grad, m, v: CuPy arrays of one shape and dtype (any shape; C-contiguous, since
    they are updated in place); step t >= 1.
    """
    _import_cupy()
    if not _supported(param, grad, m, v):
        raise MinillamaError("adamw_update needs CuPy float32/float64 arrays of one dtype")
    if not (param.shape == grad.shape == m.shape == v.shape):
        raise MinillamaError(f"adamw_update: shapes differ: param {param.shape}, grad "
                             f"{grad.shape}, m {m.shape}, v {v.shape}")
    for label, a in (("param", param), ("m", m), ("v", v)):
        if not a.flags.c_contiguous:
            raise MinillamaError(f"adamw_update: {label} must be C-contiguous (updated in place)")
    step = int(step)
    if step < 1:
        raise MinillamaError(f"adamw_update: step must be >= 1, got {step}")
    dt = param.dtype
    bc1 = 1.0 - float(beta1) ** step
    bc2 = 1.0 - float(beta2) ** step
    n = param.size
    if n == 0:
        return
    grid, block = cb.elementwise_launch(n)
    f = _scalar
    _launch("adamw", "adamw_step", dt, grid, block,
            (param, _c(grad), m, v, np.int64(n), f(dt, lr), f(dt, beta1), f(dt, beta2),
             f(dt, eps), f(dt, wd), f(dt, bc1), f(dt, bc2)))


def sample_tokens(logits, temperature: float = 0.0, top_k=None, top_p=None,
                  rng: np.random.Generator | None = None, uniforms=None) -> np.ndarray:
    r"""Next token ids for a (B, V) batch of device logits, chosen on the device; only the B ids
    cross to the host.

    \tau = 0: \arg\max_v z_v. Otherwise p = \mathrm{softmax}(z / \tau), restricted to the k most
    likely tokens (top-k) and to the shortest most-likely prefix whose mass reaches top_p (the
    token crossing the threshold is kept), renormalised, and sampled by inverse CDF with one
    uniform per row: ``uniforms`` (B,) when given (e.g. one draw from each sequence's own
    generator), else ``rng.random(B)``. With the same uniform, row b picks the token that
    :func:`minillama.core.sampling.sample` picks. Returns (B,) int64 ids on the host.
    """
    _import_cupy()
    check_sampling(temperature, top_k, top_p)
    z = cp.asarray(logits)
    if z.ndim == 1:
        z = z[None]
    B, V = z.shape
    if temperature == 0.0:
        return cp.asnumpy(cp.argmax(z, axis=-1)).astype(np.int64)
    if uniforms is None:
        if rng is None:
            raise MinillamaError("sampling with temperature > 0 needs a random generator")
        uniforms = rng.random(B)
    uniforms = np.asarray(uniforms, dtype=np.float64).reshape(-1)
    if uniforms.size != B:
        raise MinillamaError(f"sample_tokens: {uniforms.size} uniforms for {B} rows")
    zz = z.astype(cp.float64) / float(temperature)
    use_k = top_k is not None and int(top_k) < V
    use_p = top_p is not None and top_p < 1.0
    if top_k is not None or use_p:  # candidates by decreasing probability (minillama.core.sampling)
        order = cp.argsort(-zz, axis=-1)
    else:  # the whole vocabulary in id order
        order = cp.broadcast_to(cp.arange(V), (B, V))
    zs = cp.take_along_axis(zz, order, axis=-1)
    p = cp.exp(zs - zs.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    keep = cp.ones((B, V), dtype=bool)
    if use_k:
        keep[:, int(top_k):] = False
    if use_p:
        before = cp.cumsum(p, axis=-1) - p  # mass strictly before each token
        keep &= before < float(top_p)
    p = cp.where(keep, p, 0.0)
    c = cp.cumsum(p, axis=-1)
    u = cp.asarray(uniforms) * c[:, -1]
    j = cp.minimum((c <= u[:, None]).sum(axis=-1), keep.sum(axis=-1) - 1)
    ids = cp.take_along_axis(order, j[:, None], axis=-1)[:, 0]
    return cp.asnumpy(ids).astype(np.int64)
