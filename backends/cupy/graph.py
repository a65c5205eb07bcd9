r"""Greedy decoding on the GPU with the whole decode step captured once as a CUDA graph.

One decode step of a :class:`minillama.model.transformer.Transformer` on the CuPy backend is a few
dozen kernel launches (per layer: RMSNorm, three projections, RoPE, the cache write, attention, the
output projection, the FFN) whose host-side cost dominates at batch 1. :class:`GraphDecoder`
records that step once with CuPy's stream capture and then replays it: the token ids and the
positions live in device buffers that the step itself advances, so a replay needs no host work
and the n new ids cross to the host once, at the end.

The step is the model's own forward (the same backend ops, the same weights), with four
differences that keep it free of host synchronisation: the RoPE tables are gathered at the
positions held on the device, the new K/V rows are written by a small kernel at those positions,
the matrix-vector products y = x W^T run in a small CUDA kernel (one warp per output row; CuPy
refuses cuBLAS calls inside a stream capture), and attention reads the whole preallocated cache (the
decode kernel stops at each sequence's own position, so the unused tail is never read). The next
token is :math:`\arg\max_v z_v` on the device (greedy; sampling with a temperature stays on the
eager path).

A private CuPy memory pool holds the step's intermediate arrays, so the buffers the graph
replays into are never handed to other code. Needs a CUDA GPU; the eager decode of
:mod:`minillama.infer.generate` is the reference it is checked against
(tests/backends/cupy/test_backend.py, scripts/bench_gpu.py).
"""

from __future__ import annotations

import numpy as np

from minillama.core.decoding import (
    ChunkDecoder,
    stream_greedy,  # noqa: F401  (the loop that drives a GraphDecoder)
)
from minillama.core.errors import MinillamaError
from minillama.core.quant import QuantMatrix

from .common import QUANT_KERNELS

_STEP_SRC = r"""
extern "C" __global__ void cache_write(float* __restrict__ kc, float* __restrict__ vc,
                                       const float* __restrict__ k, const float* __restrict__ v,
                                       const long long* __restrict__ pos, int B, int S, int W) {
    // k, v: (B, W) rows of the new position; kc, vc: (B, S, W); row b goes to position pos[b]
    const int b = blockIdx.y;
    const long long p = pos[b];
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < W; i += gridDim.x * blockDim.x) {
        const size_t dst = ((size_t)b * S + p) * W + i;
        kc[dst] = k[(size_t)b * W + i];
        vc[dst] = v[(size_t)b * W + i];
    }
}

// y (B, N) = x (B, K) W^T, W (N, K) row-major: one warp per output row, 16-byte loads of W
// along K, the B rows of x read from L1/L2; B <= NB. A fixed summation order (deterministic).
template <int NB>
__device__ void gemv_rows(const float* __restrict__ x, const float* __restrict__ w,
                          float* __restrict__ y, int B, int N, int K) {
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    for (int row = blockIdx.x * warps + (threadIdx.x >> 5); row < N; row += gridDim.x * warps) {
        const float4* wr = reinterpret_cast<const float4*>(w + (size_t)row * K);
        float acc[NB];
#pragma unroll
        for (int b = 0; b < NB; ++b) acc[b] = 0.f;
        for (int i = lane; i < K / 4; i += 32) {
            const float4 wv = wr[i];
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                if (b < B) {
                    const float4 xv = reinterpret_cast<const float4*>(x + (size_t)b * K)[i];
                    acc[b] += wv.x * xv.x + wv.y * xv.y + wv.z * xv.z + wv.w * xv.w;
                }
            }
        }
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            float a = acc[b];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
            if (lane == 0 && b < B) y[(size_t)b * N + row] = a;
        }
    }
}
extern "C" __global__ void gemv1(const float* x, const float* w, float* y, int B, int N, int K) {
    gemv_rows<1>(x, w, y, B, N, K);
}
extern "C" __global__ void gemv8(const float* x, const float* w, float* y, int B, int N, int K) {
    gemv_rows<8>(x, w, y, B, N, K);
}

extern "C" __global__ void advance(const long long* __restrict__ nxt, long long* __restrict__ tok,
                                   long long* __restrict__ pos, long long* __restrict__ out,
                                   int* __restrict__ step, int B, int cap) {
    // tok <- nxt; pos += 1; out[step] <- nxt; step += 1 (one block of >= B threads)
    const int b = threadIdx.x;
    const int s = step[0];
    if (b < B) {
        tok[b] = nxt[b];
        pos[b] += 1;
        if (s < cap) out[(size_t)s * B + b] = nxt[b];
    }
    __syncthreads();
    if (b == 0) step[0] = s + 1;
}
"""


#: most sequences one graph decodes at once (the gemv8 kernel's accumulators)
MAX_BATCH = 8


def unsupported_reason(model, batch_size: int = 1) -> str | None:
    """None when :class:`GraphDecoder` can decode ``model`` for ``batch_size`` sequences, else
    why not (a phrase that follows "the CUDA-graph decoder ..."). Needs no GPU: it reads only the
    model's backend name, dtype, config and parameter shapes."""
    if model.backend.name != "cupy":
        return f"needs the cupy backend (this model is on {model.backend.name})"
    if np.dtype(model.dtype) != np.float32:
        return f"decodes float32 models (this one computes in {np.dtype(model.dtype)})"
    if not 1 <= int(batch_size) <= MAX_BATCH:
        return f"decodes 1 to {MAX_BATCH} sequences at once, not {batch_size}"
    cfg = model.cfg
    if not cfg.is_llama:
        return ("decodes LLaMA blocks (pre-norm RMSNorm, RoPE, SwiGLU, logit scale 1); this "
                "model has architecture variants")
    sc = getattr(cfg, "rope_scaling", None) or {}
    if any(k.endswith(".bias") for k in model.params) or getattr(cfg, "sliding_window", None) \
            or sc.get("rope_type") == "dynamic":
        return "decodes plain LLaMA blocks (no biases, no sliding window, no dynamic RoPE scaling)"
    quant = [k for k, v in model.params.items()
             if isinstance(v, QuantMatrix) and v.qtype not in QUANT_KERNELS]
    if quant:
        return (f"decodes float and {'/'.join(QUANT_KERNELS)} weights ({quant[0]} is a quantized "
                f"{model.params[quant[0]].qtype} matrix, which the op-by-op path runs)")
    bad = [k for k, v in model.params.items() if v.ndim == 2 and v.shape[1] % 4]
    if bad:
        return (f"needs weight input widths divisible by 4 ({bad[0]} is "
                f"{model.params[bad[0]].shape})")
    return None


class GraphDecoder(ChunkDecoder):
    """Greedy decoding of ``model`` (a float32 CuPy-backend Transformer) for ``batch_size``
    sequences of up to ``max_seq_len`` positions, one CUDA graph replay per token.

    >>> dec = GraphDecoder(model, batch_size=1, max_seq_len=256)     # doctest: +SKIP
    >>> ids = dec.generate(prompt_ids, n_new=128)                     # (B, 128) on the host
    """

    def __init__(self, model, batch_size: int, max_seq_len: int | None = None):
        why = unsupported_reason(model, batch_size)
        if why is not None:
            raise MinillamaError(f"the CUDA-graph decoder {why}")
        import cupy as cp

        self.cp = cp
        self.model = model
        self.B = int(batch_size)
        self.cache = model.new_cache(self.B, max_seq_len)
        self.S = self.cache.max_seq_len
        self.tok = cp.zeros((self.B, 1), dtype=cp.int64)
        self.pos = cp.zeros(self.B, dtype=cp.int64)
        self.step = cp.zeros(1, dtype=cp.int32)
        self.out = cp.zeros((self.S, self.B), dtype=cp.int64)
        mod = cp.RawModule(code=_STEP_SRC)
        self._cache_write = mod.get_function("cache_write")
        self._advance = mod.get_function("advance")
        self._gemv = {1: mod.get_function("gemv1"), 8: mod.get_function("gemv8")}
        self.pool = cp.cuda.MemoryPool()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.graph = None
        self._P = None  # prompt length of the current sequence batch (host copy)
        self._done = 0  # ids decoded so far for it, the prefill's included (host copy)

    # ------------------------------------------------------------------------------------------
    def _linear(self, x, w):
        """y = x W^T for the B rows of one position: (B, 1, K) or (B, K) -> (B, 1, N) / (B, N).
        A CUDA kernel rather than cuBLAS (CuPy refuses cuBLAS calls inside a stream capture):
        gemv for float W, the backend's matvec kernel over the blocks for a quantized W."""
        cp = self.cp
        K, N = w.shape[1], w.shape[0]
        x2 = cp.ascontiguousarray(x.reshape(self.B, K))
        if isinstance(w, QuantMatrix):  # B <= MAX_BATCH = the matvec kernel's rows
            y, _ = self.model.backend.linear_forward(x2, w)
            return y.reshape(tuple(x.shape[:-1]) + (N,))
        y = cp.empty((self.B, N), dtype=cp.float32)
        fn = self._gemv[1 if self.B == 1 else 8]
        fn((min(-(-N // 8), 4096),), (256,), (x2, w, y, np.int32(self.B), np.int32(N),
                                               np.int32(K)))
        return y.reshape(tuple(x.shape[:-1]) + (N,))

    def _step(self) -> None:
        """One decode step from the device buffers (tok, pos): the model's forward at one
        position, then tok <- argmax, pos += 1, out[step] <- tok. No host synchronisation."""
        cp, m = self.cp, self.model
        be, p, cfg = m.backend, m.params, m.cfg
        B, S = self.B, self.S
        H, KVH, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        eps = cfg.norm_eps
        cos = m.cos[self.pos][:, None]  # (B, 1, hd/2), gathered on the device
        sin = m.sin[self.pos][:, None]
        x, _ = be.embedding_forward(p["tok_embeddings.weight"], self.tok)
        W = KVH * hd
        for layer in range(cfg.n_layers):
            pre = f"layers.{layer}."
            h, _ = be.rmsnorm_forward(x, p[pre + "attention_norm.weight"], eps)
            q = self._linear(h, p[pre + "attention.wq.weight"])
            k = self._linear(h, p[pre + "attention.wk.weight"])
            v = self._linear(h, p[pre + "attention.wv.weight"])
            q, _ = be.rope_forward(q.reshape(B, 1, H, hd), cos, sin)
            k, _ = be.rope_forward(k.reshape(B, 1, KVH, hd), cos, sin)
            kc, vc = self.cache.k[layer], self.cache.v[layer]
            self._cache_write((max(1, min(8, (W + 255) // 256)), B), (256,),
                              (kc, vc, cp.ascontiguousarray(k), cp.ascontiguousarray(v),
                               self.pos, np.int32(B), np.int32(S), np.int32(W)))
            a, _ = be.attention_forward(q, kc, vc, self.pos)
            o = self._linear(a.reshape(B, 1, H * hd), p[pre + "attention.wo.weight"])
            x = x + o
            h2, _ = be.rmsnorm_forward(x, p[pre + "ffn_norm.weight"], eps)
            a1 = self._linear(h2, p[pre + "feed_forward.w1.weight"])
            b3 = self._linear(h2, p[pre + "feed_forward.w3.weight"])
            g, _ = be.swiglu_forward(a1, b3)
            f = self._linear(g, p[pre + "feed_forward.w2.weight"])
            x = x + f
        hn, _ = be.rmsnorm_forward(x[:, 0], p["norm.weight"], eps)
        logits = self._linear(hn, m.output_weight)
        nxt = cp.argmax(logits, axis=-1).astype(cp.int64)
        self._advance((1,), (max(32, -(-B // 32) * 32),),
                      (nxt, self.tok, self.pos, self.out, self.step, np.int32(B),
                       np.int32(self.S)))

    def _capture(self) -> None:
        cp = self.cp
        saved = (self.tok.copy(), self.pos.copy(), self.step.copy())
        with cp.cuda.using_allocator(self.pool.malloc), self.stream:
            self._step()  # compiles every kernel and creates the library handles first
            self.stream.synchronize()
            self.tok[...] = saved[0]
            self.pos[...] = saved[1]
            self.step[...] = saved[2]
            self.stream.synchronize()
            self.stream.begin_capture()
            try:
                self._step()
            finally:
                self.graph = self.stream.end_capture()
        self.stream.synchronize()

    # ------------------------------------------------------------------------------------------
    def prefill(self, prompt) -> np.ndarray:
        """Run the (B, P) prompt through the model eagerly, filling the cache; the first new id
        (argmax of the last position) goes to the device token buffer and is returned, (B,)."""
        cp, m = self.cp, self.model
        prompt = np.asarray(prompt, dtype=np.int64)
        if prompt.ndim != 2 or prompt.shape[0] != self.B:
            raise MinillamaError(f"prompt must be ({self.B}, P) token ids, got {prompt.shape}")
        P = prompt.shape[1]
        if not 1 <= P <= self.S:
            raise MinillamaError(f"a prompt of {P} tokens does not fit the cache of {self.S}")
        logits = m.forward(prompt, 0, self.cache, last_only=True)
        first = cp.argmax(logits, axis=-1).astype(cp.int64)
        self.tok[:, 0] = first
        self.pos[...] = P
        self.step[...] = 1
        self.out[0] = first
        self._P, self._done = P, 1
        return cp.asnumpy(first)

    def more(self, k: int) -> np.ndarray:
        """Replay the step ``k`` times; the k new ids of every sequence, (B, k) on the host (one
        synchronisation per call)."""
        k = self._check_more(k)
        if k == 0:
            return np.zeros((self.B, 0), dtype=np.int64)
        if self.graph is None:
            self._capture()
        for _ in range(k):
            self.graph.launch(self.stream)
        self.stream.synchronize()
        ids = self.cp.asnumpy(self.out[self._done:self._done + k]).T.copy()
        self._done += k
        return ids

    def decode(self, n_new: int) -> np.ndarray:
        """Replay the step until ``n_new`` ids (counting the prefill's) are decoded; (B, n_new)."""
        n_new = int(n_new)
        if self._P is None:
            raise MinillamaError("GraphDecoder.decode: call prefill first")
        if n_new < self._done or n_new - self._done > self.room():
            raise MinillamaError(f"{n_new} new tokens after position {self._P} exceed the cache "
                                 f"length {self.S}")
        self.more(n_new - self._done)  # synchronises the stream
        return self.cp.asnumpy(self.out[:n_new]).T.copy()

    def generate(self, prompt, n_new: int) -> np.ndarray:
        """:meth:`prefill` then :meth:`decode`: the greedy continuation (B, n_new) on the host."""
        self.prefill(prompt)
        return self.decode(n_new)
