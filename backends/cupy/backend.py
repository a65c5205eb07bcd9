r"""The CuPy backend: the model on an NVIDIA GPU, cuBLAS for the matrix products (through CuPy) and
hand-written CUDA kernels (``kernels/*.cu``, built by :mod:`.build`) for the other ops.

Every op keeps the contract of :mod:`minillama.ops` (``*_forward(...) -> (out, ctx)``,
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
"""

from __future__ import annotations

import math

import numpy as np

from ... import ops
from ... import quant
from ...errors import MinillamaError
from ...quant import QuantMatrix
from . import build as cb
from ..reference import (ReferenceBackend, composed_linear_cross_entropy_backward,
                                composed_linear_cross_entropy_forward)

#: block types kept in their blocks on the device, with their (matvec, dequantize) kernels in
#: quant.cu; other quantized types are widened once when the model moves to the device
QUANT_KERNELS = {"Q8_0": ("q8_0_matvec", "q8_0_dequant"), "Q4_K": ("q4_k_matvec", "q4_k_dequant")}

INSTALL_HINT = ('install the GPU extra: pip install "minillama[gpu]" (CUDA 12; '
                '"minillama[gpu-cuda13]" for CUDA 13, as nvidia-smi shows)')

cp = None  # the cupy module, bound by CupyBackend() once a GPU is confirmed


def _import_cupy():
    """``cupy`` or a one-line :class:`MinillamaError` saying what is missing."""
    global cp
    if cp is not None:
        return cp
    try:
        import cupy  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install raising anything
        detail = "" if isinstance(e, ModuleNotFoundError) else f" ({_first_line(e)})"
        raise MinillamaError(f"CuPy is not installed{detail}; {INSTALL_HINT}") from None
    try:
        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # noqa: BLE001 - CUDARuntimeError without a driver, etc.
        raise MinillamaError(f"no CUDA GPU found ({_first_line(e)})") from None
    if n < 1:
        raise MinillamaError("no CUDA GPU found (the CUDA runtime sees 0 devices)")
    cp = cupy
    return cp


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class _KCtx(tuple):
    """A ctx built by a kernel forward of this backend (a plain tuple otherwise)."""


def _supported(*arrays) -> bool:
    """True when every array is a CuPy array of one dtype the kernels are built for."""
    if cp is None:
        return False
    dt = None
    for a in arrays:
        if not isinstance(a, cp.ndarray):
            return False
        if dt is None:
            dt = a.dtype
        elif a.dtype != dt:
            return False
    return dt in cb.CTYPES


def _c(a):
    return cp.ascontiguousarray(a)


def _scalar(dtype, value):
    return np.dtype(dtype).type(value)


def _i32(v) -> np.int32:
    v = int(v)
    if v >= 2 ** 31:
        raise MinillamaError(f"size {v} is too large for the CUDA kernels (int32 sizes)")
    return np.int32(v)


def _aligned16(*arrays) -> bool:
    """True when every array's data starts on a 16-byte boundary (float4 loads)."""
    for a in arrays:
        ptr = a.data.ptr if hasattr(a.data, "ptr") else a.ctypes.data
        if ptr % 16:
            return False
    return True


def _launch(file: str, kernel: str, dtype, grid, block, args) -> None:
    cb.get_kernel(file, kernel, dtype)(grid, block, args)


class CupyBackend(ReferenceBackend):
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

    def __init__(self) -> None:  # noqa: D107 - documented on the class
        super().__init__()
        self.xp = _import_cupy()
        dev = cp.cuda.Device()
        try:
            props = cp.cuda.runtime.getDeviceProperties(dev.id)
            label = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        except Exception:  # noqa: BLE001 - the name is cosmetic
            label = "GPU"
        self.device = f"cuda:{dev.id} ({label})"
        import os  # noqa: PLC0415

        try:
            cc = int(dev.compute_capability)
        except Exception:  # noqa: BLE001 - unknown: stay on the SIMT kernels
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

    # --- embedding ------------------------------------------------------------------------------
    def embedding_forward(self, weight, tokens):
        r"""h_{b,t} = E[x_{b,t}] (gather kernel). weight: (V, D); tokens: (B, T). Returns (B, T, D)."""
        if not _supported(weight):
            return ops.embedding_forward(weight, tokens)
        tok = _c(cp.asarray(tokens).astype(cp.int64, copy=False))
        V, D = weight.shape
        N = tok.size
        out = cp.empty(tuple(tok.shape) + (D,), dtype=weight.dtype)
        grid, block = cb.row_launch(N, D)
        _launch("embedding", "embedding_fwd", weight.dtype, grid, block,
                (_c(weight), tok, out, _i32(N), _i32(D)))
        return out, _KCtx((tok, weight.shape))

    def embedding_backward(self, dout, ctx):
        r"""dE_v = \sum_{(b,t): x_{b,t} = v} dh_{b,t}, summed in a fixed order (tokens sorted on the
        device, one block per run of equal tokens; no atomics, so repeatable bit for bit).
        dout: (B, T, D) -> (V, D)."""
        if not (isinstance(ctx, _KCtx) and _supported(dout)):
            return ops.embedding_backward(dout, ctx)
        tok, shape = ctx
        D = shape[1]
        flat = tok.reshape(-1)
        N = flat.size
        dw = cp.zeros(shape, dtype=dout.dtype)
        if N == 0:
            return dw
        order = _c(cp.argsort(flat).astype(cp.int64, copy=False))
        sorted_tok = _c(flat[order])
        grid, block = cb.row_launch(N, D)
        _launch("embedding", "embedding_bwd", dout.dtype, grid, block,
                (_c(dout), sorted_tok, order, dw, _i32(N), _i32(D)))
        return dw

    # --- linear (cuBLAS) ------------------------------------------------------------------------
    def linear_forward(self, x, w):
        r"""y = x W^T as one GEMM over the flattened rows. x: (..., in); w: (out, in) -> (..., out)."""
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
        r"""y = x W^T with W in Q8_0 or Q4_K blocks on the device: up to ``QUANT_MATVEC_ROWS`` rows
        of x go through the matvec kernel (weights read once, in their blocks); more rows
        dequantize W once and run one GEMM. x: (..., K); w: QuantMatrix (N, K) -> (..., N)."""
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

    # --- RMSNorm --------------------------------------------------------------------------------
    def rmsnorm_forward(self, x, g, eps):
        r"""y = x r g, r = 1/\sqrt{\mathrm{mean}(x^2) + \epsilon}. x: (..., D); g: (D,).

        Saves (x, r (..., 1), g), the reference ctx layout."""
        if not _supported(x, g):
            return ops.rmsnorm_forward(x, g, eps)
        xc, gc = _c(x), _c(g)
        D = x.shape[-1]
        N = x.size // D if D else 0
        y = cp.empty_like(xc)
        rstd = cp.empty(tuple(x.shape[:-1]) + (1,), dtype=x.dtype)
        if N:
            grid, block = cb.row_launch(N, D)
            _launch("rmsnorm", "rmsnorm_fwd", x.dtype, grid, block,
                    (xc, gc, y, rstd, _i32(N), _i32(D), _scalar(x.dtype, eps)))
        return y, (xc, rstd, gc)

    def rmsnorm_backward(self, dy, ctx):
        r"""dx = r (u - \hat{x}\,\mathrm{mean}(u \hat{x})), u = dy g; dg = \sum_{rows} dy \hat{x}.

        dy: (..., D). Returns (dx: (..., D), dg: (D,))."""
        x, rstd, g = ctx
        if not _supported(dy, x, rstd, g):
            return ops.rmsnorm_backward(dy, ctx)
        dyc, xc, rc = _c(dy), _c(x), _c(rstd)
        D = x.shape[-1]
        N = x.size // D if D else 0
        dx = cp.empty_like(xc)
        if N == 0:
            return dx, cp.zeros_like(g)
        grid, block = cb.row_launch(N, D)
        _launch("rmsnorm", "rmsnorm_bwd_dx", x.dtype, grid, block,
                (dyc, xc, rc, _c(g), dx, _i32(N), _i32(D)))
        grid, block, parts = cb.rms_dg_launch(N, D)
        part = cp.empty((parts, D), dtype=x.dtype)
        _launch("rmsnorm", "rmsnorm_bwd_dg", x.dtype, grid, block,
                (dyc, xc, rc, part, _i32(N), _i32(D)))
        dg = part[0] if parts == 1 else part.sum(axis=0)
        return dx, dg

    # --- RoPE -----------------------------------------------------------------------------------
    def _rope(self, x, cos, sin, sign: float, out=None):
        B, T, nh, hd = x.shape
        half = hd // 2
        xc, cc, sc = _c(x), _c(cos), _c(sin)
        if out is None:
            out = cp.empty_like(xc)
        elif out is not x or not x.flags.c_contiguous:
            raise MinillamaError("rope out= must be x itself (a C-contiguous array)")
        cs_bstride = 0 if cos.ndim == 2 else T * half
        n_pairs = x.size // 2
        if n_pairs:
            grid, block = cb.elementwise_launch(n_pairs)
            _launch("rope", "rope_apply", x.dtype, grid, block,
                    (xc, out, cc, sc, np.int64(n_pairs), _i32(T), _i32(nh), _i32(half),
                     np.int64(cs_bstride), _scalar(x.dtype, sign)))
        return out

    @staticmethod
    def _rope_shapes_ok(x, cos, sin) -> bool:
        if x.ndim != 4 or x.shape[-1] % 2 or cos.shape != sin.shape:
            return False
        B, T, _, hd = x.shape
        if cos.ndim == 2:
            return cos.shape == (T, hd // 2)
        return cos.ndim == 3 and cos.shape == (B, T, hd // 2)

    def rope_forward(self, x, cos, sin, out=None):
        r"""y_{2i} = x_{2i}\cos(m\theta_i) - x_{2i+1}\sin(m\theta_i),
        y_{2i+1} = x_{2i}\sin(m\theta_i) + x_{2i+1}\cos(m\theta_i).

        x: (B, T, nh, hd); cos, sin: (T, hd/2) or (B, T, hd/2). ``out=x`` rotates in place.
        Returns y: (B, T, nh, hd)."""
        if not (_supported(x, cos, sin) and self._rope_shapes_ok(x, cos, sin)):
            return ops.rope_forward(x, cos, sin)
        return self._rope(x, cos, sin, 1.0, out), _KCtx((cos, sin))

    def rope_backward(self, dy, ctx):
        r"""dx = R(-m\theta_i) dy (the inverse rotation). dy: (B, T, nh, hd) -> dx (same)."""
        cos, sin = ctx
        if not (isinstance(ctx, _KCtx) and _supported(dy, cos, sin)
                and self._rope_shapes_ok(dy, cos, sin)):
            return ops.rope_backward(dy, ctx)
        return self._rope(dy, cos, sin, -1.0)

    # --- attention ------------------------------------------------------------------------------
    @staticmethod
    def _kv_layout(k, v):
        """(k, v, batch stride in elements): reads a KV-cache view (B, S, KVH, hd) in place when
        its last three axes are packed and both share one batch stride; copies otherwise."""
        B, S, KVH, hd = k.shape
        isz = k.dtype.itemsize
        packed = (KVH * hd * isz, hd * isz, isz)

        def ok(a):
            return (a.strides[1:] == packed or S == 1 and a.strides[2:] == packed[1:]) \
                and a.strides[0] % isz == 0 and a.strides[0] >= 0

        if ok(k) and ok(v) and k.strides[0] == v.strides[0]:
            bs = k.strides[0] // isz if B > 1 else S * KVH * hd
            return k, v, bs
        k, v = _c(k), _c(v)
        return k, v, S * KVH * hd

    def _flash_expr(self, dtype, hd: int, T: int):
        """``"<hd,split>"`` of the flash_attention.cu kernels for this call, or None (SIMT
        kernels of attention.cu: float64, other head dimensions, T = 1, GPUs before sm_80)."""
        if not self.flash or np.dtype(dtype) != np.float32 or hd not in cb.FLASH_HEAD_DIMS \
                or T < 2:
            return None
        return f"<{hd},{'false' if self.attention_precision == 'tf32' else 'true'}>"

    def attention_forward(self, q, k, v, start_pos=0):
        r"""Causal GQA attention, S_{tj} = q_t \cdot k_j / \sqrt{hd} (-\infty for j > p + t),
        P = \mathrm{softmax}_j(S), o_t = \sum_j P_{tj} v_j; query head h reads KV head h // G.

        q: (B, T, H, hd); k, v: (B, S, KVH, hd) (a KV-cache view is fine); start_pos: int or (B,).
        Returns o: (B, T, H, hd). Saves q, k, v, o and the row log-sum-exp (B, H, T)."""
        if not _supported(q, k, v) or q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
            return ops.attention_forward(q, k, v, start_pos)
        B, T, H, hd = q.shape
        S, KVH = k.shape[1], k.shape[2]
        if hd > cb.ATTN_MAX_HD or hd < 1 or KVH < 1 or H % KVH or k.shape[0] != B \
                or k.shape[3] != hd or S < 1 or T < 1:
            return ops.attention_forward(q, k, v, start_pos)
        G = H // KVH
        dt = q.dtype
        qc = _c(q)
        kk, vv, kv_bs = self._kv_layout(k, v)
        start_arr, start_s, use_arr = self._start_args(start_pos, B)
        scale = 1.0 / math.sqrt(hd)
        out = cp.empty((B, T, H, hd), dtype=dt)
        lse = cp.empty((B, H, T), dtype=dt)
        common = (start_arr, start_s, use_arr)
        flash = self._flash_expr(dt, hd, T)
        if flash is not None and not (_aligned16(qc, kk, vv) and kv_bs % 4 == 0):
            qc = qc.copy() if not _aligned16(qc) else qc
            if not (_aligned16(kk, vv) and kv_bs % 4 == 0):
                kk, vv = kk.copy(order="C"), vv.copy(order="C")
                kv_bs = S * KVH * hd
        if flash is not None:
            grid, block = cb.flash_launch("fwd", B, T, S, KVH, G)
            cb.launch_expr("flash_attention", f"flash_fwd{flash}", grid, block,
                           (qc, kk, vv, out, lse, *common, _i32(T), _i32(S), _i32(H), _i32(KVH),
                            np.int64(kv_bs), _scalar(dt, scale)), cb.flash_smem("fwd", hd))
        elif T == 1:
            grid, block = cb.attn_decode_launch(B, KVH, G, dt)
            _launch("attention", "attn_decode", dt, grid, block,
                    (qc, kk, vv, out, lse, *common, _i32(S), _i32(H), _i32(KVH), _i32(hd),
                     np.int64(kv_bs), _scalar(dt, scale)))
        else:
            grid, block = cb.attn_fwd_launch(B, T, KVH, G, dt)
            _launch("attention", "attn_fwd", dt, grid, block,
                    (qc, kk, vv, out, lse, *common, _i32(T), _i32(S), _i32(H), _i32(KVH),
                     _i32(hd), np.int64(kv_bs), _scalar(dt, scale)))
        return out, _KCtx((qc, kk, vv, kv_bs, out, lse, common, scale))

    def attention_backward(self, dout, ctx):
        r"""dP = dO V^T, dS = P \odot (dP - D), D_t = dO_t \cdot o_t, dQ = dS K / \sqrt{hd},
        dK = \sum_{g} dS^T Q / \sqrt{hd}, dV = \sum_{g} P^T dO with P recomputed from the saved
        log-sum-exp. dout: (B, T, H, hd). Returns (dq (B, T, H, hd), dk, dv (B, S, KVH, hd))."""
        if not (isinstance(ctx, _KCtx) and _supported(dout)):
            return ops.attention_backward(dout, ctx)
        qc, kk, vv, kv_bs, out, lse, common, scale = ctx
        B, T, H, hd = qc.shape
        S, KVH = kk.shape[1], kk.shape[2]
        G = H // KVH
        dt = qc.dtype
        doc = _c(dout)
        dsum = cp.empty((B, H, T), dtype=dt)
        grid, block = cb.attn_dsum_launch(B * T * H)
        _launch("attention", "attn_bwd_dsum", dt, grid, block,
                (doc, out, dsum, _i32(B), _i32(T), _i32(H), _i32(hd)))
        dq = cp.empty_like(qc)
        dk = cp.empty((B, S, KVH, hd), dtype=dt)
        dv = cp.empty((B, S, KVH, hd), dtype=dt)
        flash = self._flash_expr(dt, hd, T)
        if flash is not None:
            if not _aligned16(doc):
                doc = doc.copy()
            sizes = (_i32(T), _i32(S), _i32(H), _i32(KVH), np.int64(kv_bs), _scalar(dt, scale))
            grid, block = cb.flash_launch("dq", B, T, S, KVH, G)
            cb.launch_expr("flash_attention", f"flash_bwd_dq{flash}", grid, block,
                           (qc, kk, vv, doc, lse, dsum, dq, *common, *sizes),
                           cb.flash_smem("dq", hd))
            grid, block = cb.flash_launch("dkdv", B, T, S, KVH, G)
            nsplit, r_chunk = cb.flash_dkdv_split(grid[0] * grid[1], T * G)
            if nsplit > 1:
                dk = cp.empty((nsplit, B, S, KVH, hd), dtype=dt)
                dv = cp.empty((nsplit, B, S, KVH, hd), dtype=dt)
            cb.launch_expr("flash_attention", f"flash_bwd_dkdv{flash}", grid + (nsplit,), block,
                           (qc, kk, vv, doc, lse, dsum, dk, dv, *common, *sizes, _i32(r_chunk)),
                           cb.flash_smem("dkdv", hd))
            if nsplit > 1:  # the row shares' partial sums, added in a fixed order
                dk, dv = dk.sum(axis=0), dv.sum(axis=0)
            return dq, dk, dv
        sizes = (_i32(T), _i32(S), _i32(H), _i32(KVH), _i32(hd), np.int64(kv_bs),
                 _scalar(dt, scale))
        grid, block = cb.attn_dq_launch(B, T, KVH, G, dt)
        _launch("attention", "attn_bwd_dq", dt, grid, block,
                (qc, kk, vv, doc, lse, dsum, dq, *common, *sizes))
        grid, block = cb.attn_dkdv_launch(B, S, KVH, dt)
        _launch("attention", "attn_bwd_dkdv", dt, grid, block,
                (qc, kk, vv, doc, lse, dsum, dk, dv, *common, *sizes))
        return dq, dk, dv

    # --- SwiGLU ---------------------------------------------------------------------------------
    def swiglu_forward(self, a, b):
        r"""h = \mathrm{silu}(a) \odot b, \mathrm{silu}(a) = a\sigma(a). a, b: (..., F) -> h (..., F)."""
        if not _supported(a, b) or a.shape != b.shape:
            return ops.swiglu_forward(a, b)
        ac, bc = _c(a), _c(b)
        h = cp.empty_like(ac)
        n = a.size
        if n:
            grid, block = cb.elementwise_launch(n)
            _launch("swiglu", "swiglu_fwd", a.dtype, grid, block, (ac, bc, h, np.int64(n)))
        return h, _KCtx((ac, bc))

    def swiglu_backward(self, dh, ctx):
        r"""db = dh\,\mathrm{silu}(a), da = dh\, b\, \sigma(a)(1 + a(1 - \sigma(a))).
        dh: (..., F). Returns (da, db)."""
        if not (isinstance(ctx, _KCtx) and _supported(dh)):
            return ops.swiglu_backward(dh, ctx)
        ac, bc = ctx
        dhc = _c(dh)
        da, db = cp.empty_like(ac), cp.empty_like(ac)
        n = ac.size
        if n:
            grid, block = cb.elementwise_launch(n)
            _launch("swiglu", "swiglu_bwd", ac.dtype, grid, block,
                    (dhc, ac, bc, da, db, np.int64(n)))
        return da, db

    # --- cross-entropy --------------------------------------------------------------------------
    def cross_entropy_forward(self, logits, targets, ignore_index: int = -1):
        r"""L = \frac{1}{|\mathcal{V}|}\sum_{n \in \mathcal{V}} (\log\sum_v e^{z_{nv}} - z_{n,y_n}),
        \mathcal{V} the rows whose target is not ``ignore_index`` (L = 0 when none is kept).

        logits: (N, V); targets: (N,). Returns the loss (0-d device array) and saves the row
        log-sum-exp (N,) instead of the probabilities."""
        if not _supported(logits) or logits.ndim != 2:
            return ops.cross_entropy_forward(logits, targets, ignore_index)
        N, V = logits.shape
        z = _c(logits)
        t = _c(cp.asarray(targets).reshape(-1).astype(cp.int64, copy=False))
        if t.size != N:
            raise MinillamaError(f"cross_entropy: {t.size} targets for {N} rows of logits")
        lse = cp.empty(N, dtype=z.dtype)
        rows = cp.empty(N, dtype=z.dtype)
        if N:
            grid, block = cb.row_launch(N, V)
            _launch("cross_entropy", "xent_fwd", z.dtype, grid, block,
                    (z, t, lse, rows, _i32(N), _i32(V), np.int64(ignore_index)))
        count = cp.maximum((t != ignore_index).sum(), 1)
        loss = (rows.sum() / count).astype(z.dtype)
        return loss, _KCtx((z, t, lse, count, int(ignore_index)))

    # the loss head: this backend's linear and cross-entropy kernels one after the other
    linear_cross_entropy_forward = composed_linear_cross_entropy_forward
    linear_cross_entropy_backward = composed_linear_cross_entropy_backward

    def cross_entropy_backward(self, dloss, ctx):
        r"""\partial L/\partial z_{nv} = dL\,(p_{nv} - [v = y_n]) / |\mathcal{V}| for kept rows, 0 for
        ignored ones, p = e^{z - \mathrm{lse}} (one fused pass). Returns dlogits: (N, V)."""
        if not isinstance(ctx, _KCtx):
            return ops.cross_entropy_backward(dloss, ctx)
        z, t, lse, count, ignore_index = ctx
        N, V = z.shape
        scale = (cp.asarray(dloss, dtype=z.dtype) / count).astype(z.dtype).reshape(1)
        dz = cp.empty_like(z)
        if N:
            grid, block = cb.row_launch(N, V)
            _launch("cross_entropy", "xent_bwd", z.dtype, grid, block,
                    (z, t, lse, scale, dz, _i32(N), _i32(V), np.int64(ignore_index)))
        return dz

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
    \theta \leftarrow \theta (1 - \eta\lambda) - \eta \frac{m / (1-\beta_1^t)}{\sqrt{v / (1-\beta_2^t)} + \epsilon}

    (the update of :class:`minillama.optim.AdamW`; pass ``wd = 0`` for parameters without decay).
    param, grad, m, v: CuPy arrays of one shape and dtype (any shape; C-contiguous, since they are
    updated in place); step t >= 1.
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
    :func:`minillama.sampling.sample` picks. Returns (B,) int64 ids on the host.
    """
    from ...sampling import check_sampling  # noqa: PLC0415

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
    if top_k is not None or use_p:  # candidates by decreasing probability (minillama.sampling)
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
