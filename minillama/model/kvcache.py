"""The key/value cache for incremental decoding, stored at GQA size."""

from __future__ import annotations

import contextlib

import numpy as np

from minillama.core.config import ModelConfig
from minillama.core.errors import MinillamaError

#: the choices of the cache's storage (``--kv-cache``): "f32" the model's compute dtype, "f16"
#: IEEE half precision, "auto" half where the model's products are block-quantized
KV_CACHE_TYPES = ("auto", "f32", "f16")


def kv_storage_dtype(kind: str, dtype, blocks: bool, backend) -> np.dtype:
    r"""The dtype a KV cache stores K and V in: ``dtype`` (the compute precision) for "f32", or
    float16 for "f16" and for "auto" on a model whose layers hold GGML block weights (``blocks``),
    on a float32 model and a backend that keeps half caches (``backend.half_kv_cache``).

    A half keeps 11 significant bits, a relative rounding of at most 2^{-11} per entry of K and V,
    and reads half the bytes of float32, which is what a decode step at a long context spends
    its time on. Block-quantized products already round their activations to 8-bit blocks (a
    relative step of up to 2^{-7} of each block's largest entry), far coarser, so "auto" takes
    half there; float weights keep float32 K and V, as the exact math they are compared with.
    """
    if kind not in KV_CACHE_TYPES:
        raise MinillamaError(f"KV cache type must be one of {', '.join(KV_CACHE_TYPES)}, "
                             f"got {kind!r}")
    half_ok = np.dtype(dtype) == np.float32 and getattr(backend, "half_kv_cache", False)
    if kind == "f16" and not half_ok:
        raise MinillamaError(f"a float16 KV cache needs a float32 model on a backend that keeps "
                             f"one (numba, numpy, reference), not {np.dtype(dtype).name} on "
                             f"{getattr(backend, 'name', backend)}")
    if kind == "f16" or (kind == "auto" and blocks and half_ok):
        return np.dtype(np.float16)
    return np.dtype(dtype)


class KVCache:
    r"""Per-layer K and V buffers of shape (B, S_max, KVH, hd), preallocated once.

    Only the KVH key/value heads are stored, never the H repeated query-head copies, so GQA and MQA
    shrink the cache by H / KVH; ``dtype`` float16 halves it again (:func:`kv_storage_dtype`;
    the writes round to the nearest half, the reads widen back). Its size is

        bytes = 2 \cdot L \cdot B \cdot S_{max} \cdot KVH \cdot hd \cdot itemsize.

    Each sequence b of the batch has its own write position, so prompts of different lengths can
    share one batch (see :meth:`update`).
    """

    def __init__(self, cfg: ModelConfig, batch_size: int, max_seq_len: int | None = None,
                 dtype=np.float32, xp=np):
        self.max_seq_len = int(max_seq_len or cfg.max_seq_len)
        if self.max_seq_len > cfg.max_seq_len:
            raise MinillamaError(
                f"KV cache length {self.max_seq_len} exceeds the model context {cfg.max_seq_len}")
        self.batch_size = int(batch_size)
        shape = (self.batch_size, self.max_seq_len, cfg.n_kv_heads, cfg.head_dim)
        self.k = [xp.zeros(shape, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [xp.zeros(shape, dtype=dtype) for _ in range(cfg.n_layers)]
        self.xp = xp

    def rows(self, lo: int, hi: int) -> KVCache:
        """A cache over sequences lo..hi-1 of this one that shares its memory (basic slices, so
        writes through the view land here): continuous batching decodes the first n slots of a
        fixed cache, or prefills one slot, without copying."""
        if not 0 <= lo < hi <= self.batch_size:
            raise MinillamaError(f"rows {lo}..{hi - 1} are outside the cache batch of "
                                 f"{self.batch_size}")
        view = object.__new__(KVCache)
        view.max_seq_len, view.batch_size, view.xp = self.max_seq_len, hi - lo, self.xp
        view.k = [a[lo:hi] for a in self.k]
        view.v = [a[lo:hi] for a in self.v]
        return view

    @contextlib.contextmanager
    def kept(self, seqs, positions):
        """Within it writes may land anywhere; at its end the K/V rows of sequences ``seqs`` at
        ``positions`` (equal-length int arrays) are put back as they were when it began."""
        at = (np.asarray(seqs, dtype=np.int64), np.asarray(positions, dtype=np.int64))
        if not at[0].size:  # nothing to keep (on any array library)
            yield
            return
        saved = [a[at].copy() for a in self.k + self.v]
        try:
            yield
        finally:
            for a, r in zip(self.k + self.v, saved):
                a[at] = r

    @property
    def nbytes(self) -> int:
        """2 * L * B * S_max * KVH * hd * itemsize."""
        return sum(int(a.nbytes) for a in self.k) + sum(int(a.nbytes) for a in self.v)

    def update(self, layer: int, k_new, v_new, start_pos):
        """Write k_new, v_new (B, T, KVH, hd) at positions start_pos .. start_pos+T-1 and return
        views of the cache (B, end, KVH, hd) up to the furthest written position.

        ``start_pos`` is an int (every sequence at the same position) or a (B,) integer array (each
        sequence at its own position; positions beyond a sequence's own are masked by attention).
        """
        T = k_new.shape[1]
        kc, vc = self.k[layer], self.v[layer]
        if np.ndim(start_pos) == 0:
            s = int(start_pos)
            end = s + T
            self._check(end)
            kc[:, s:end] = k_new
            vc[:, s:end] = v_new
        else:
            starts = np.asarray(start_pos, dtype=np.int64).reshape(-1)
            end = int(starts.max()) + T
            self._check(end)
            if T == 1:
                rows = self.xp.arange(kc.shape[0])
                idx = self.xp.asarray(starts)
                kc[rows, idx] = k_new[:, 0]
                vc[rows, idx] = v_new[:, 0]
            else:
                for b, s in enumerate(starts.tolist()):
                    kc[b, s:s + T] = k_new[b]
                    vc[b, s:s + T] = v_new[b]
        return kc[:, :end], vc[:, :end]

    def _check(self, end: int) -> None:
        if end > self.max_seq_len:
            raise MinillamaError(
                f"sequence of {end} positions exceeds the KV cache length {self.max_seq_len}")
