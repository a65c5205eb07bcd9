"""The two products of a prompt row's attention over one span of the cache
(:func:`.attention_forward.attend_rows`), written as LLVM vector IR: the outputs in the lanes of
16-float vectors, each output one chain of fused multiply-adds in a fixed order, so its value
depends on its own inputs only (not on the span's length, the row, the tile or the threads),
with no horizontal sums and the accumulators in registers.

* :func:`span_scores1` / :func:`span_scores2` (one or two query rows): s_j = sum_d q_d k_{jd}
  for the :data:`SPAN` keys j of a span, K transposed (row d holds k_{jd} for consecutive j),
  the chain over d = 0, 1, ..., hd - 1;
* :func:`span_values4`, :func:`span_values4x2` (two heads), :func:`span_values1`:
  o_d += sum_j w_j v_{jd} for 64 or 16 consecutive d, the chain over j = 0, 1, ..., L - 1.

The decode steps (:func:`..decode.float_step._attend_span`) read the keys and values where the
cache holds them, row j of the span at a stride, float32 or half (uint16 bits), and compute the
same chains: :func:`cache_scores1` / :func:`cache_scores2` (``h``: on half caches) gather 16
keys' k_{jd} into the lanes for each d (a half widened exactly), and the value kernels read the
cache's rows as they are (``h``: halves widened). So a score, a weight and an output are the
same floats in a decode step as in a prompt row.

Which kernel computes an output does not change its value: every lane's chain is the same. Two
rows per call give the core 8 independent chains to overlap (one chain's fused multiply-adds
wait on each other).

Addresses are byte addresses (``a.ctypes.data``), strides in bytes; float32 only.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .. import _cache  # noqa: F401  (the kernels' cache stamp, before any @njit)
from ..quant.unpack import (
    _F32,
    _I32,
    _I64,
    NATIVE_HALF,
    _at,
    _const,
    _fma,
    _fn,
    _half_bits,
    _load,
    _shuf,
    _splat,
    _vec,
)

#: cache rows per span of the attention of the decode steps and of the prompt rows: the spans
#: of a sequence at position p are rows [0, SPAN), [SPAN, 2 SPAN), ... whatever the thread
#: count, so the order of its sums, and its logits, do not depend on how many threads share
#: the spans
SPAN = 64
#: float32 lanes per vector
LANES = 16
_V = _vec(_F32, LANES)
_H = _vec(ir.HalfType(), LANES)
#: 32-bit gathers by ``vpgatherdd`` (two of 8 lanes) where the host has AVX2; else 16 loads
_AVX2 = "+avx2" in _cache.target_features()


def _i64(n):
    return ir.Constant(_I64, n)


def _chains(nh, m, accumulate, half=False):
    """c_h += sum_{i < n} a_{h i} b_i for nh rows h (a_{h i} the float at pa + h lda + 4 i, b_i the
    m vectors at pb + i ldb, c_h the m vectors at po + h ldo), each lane one fused multiply-add
    chain over i in order from 0 (accumulate) or from 0.0; with ``half`` the b_i are halves
    (uint16 bits), widened exactly."""
    size = 2 if half else 4

    def row_vector(builder, row, i):
        if half:
            bits = _load(builder, row, size * LANES * i, _vec(ir.IntType(16), LANES), 2)
            return _widen(builder, bits)
        return _load(builder, row, size * LANES * i, _V, 4)

    def codegen(context, builder, signature, args):
        pa, lda, pb, ldb, n, po, ldo = args
        outs = [builder.add(po, builder.mul(_i64(h), ldo)) for h in range(nh)]
        accs = [cgutils.alloca_once_value(builder, _load(builder, outs[h], 4 * LANES * i, _V, 4)
                                          if accumulate else _const(_F32, LANES, 0.0))
                for h in range(nh) for i in range(m)]
        with cgutils.for_range(builder, n) as loop:
            j = loop.index
            row = builder.add(pb, builder.mul(j, ldb))
            bs = [row_vector(builder, row, i) for i in range(m)]
            for h in range(nh):
                at = builder.add(builder.add(pa, builder.mul(_i64(h), lda)),
                                 builder.mul(j, _i64(4)))
                a = _splat(builder, _load(builder, at, 0, _F32, 4), LANES)
                for i in range(m):
                    acc = accs[h * m + i]
                    builder.store(_fma(builder, a, bs[i], builder.load(acc)), acc)
        for h in range(nh):
            for i in range(m):
                builder.store(builder.load(accs[h * m + i]),
                              _at(builder, outs[h], 4 * LANES * i, _V), align=4)
        return context.get_dummy_value()

    return codegen


_SIG = types.none(*([types.int64] * 7))


@intrinsic
def span_scores1(typingctx, pq, ldq, pk, ldk, hd, ps, lds):
    r"""s_j = \sum_{d < hd} q_d k_{dj} for j < SPAN: q at pq (hd floats), K^T rows at
    pk + d ldk (SPAN floats each, all readable), s at ps (SPAN floats)."""
    return _SIG, _chains(1, SPAN // LANES, False)


@intrinsic
def span_scores2(typingctx, pq, ldq, pk, ldk, hd, ps, lds):
    """:func:`span_scores1` for two query rows (pq, pq + ldq) into (ps, ps + lds), each key
    loaded once for both."""
    return _SIG, _chains(2, SPAN // LANES, False)


@intrinsic
def span_values4(typingctx, pw, ldw, pv, ldv, L, po, ldo):
    r"""o_d += \sum_{j < L} w_j v_{jd} for the 64 floats o at po: w at pw, row j of v at
    pv + j ldv."""
    return _SIG, _chains(1, 4, True)


@intrinsic
def span_values4x2(typingctx, pw, ldw, pv, ldv, L, po, ldo):
    """:func:`span_values4` for two heads (weights pw, pw + ldw; outputs po, po + ldo), each
    value row loaded once for both."""
    return _SIG, _chains(2, 4, True)


@intrinsic
def span_values1(typingctx, pw, ldw, pv, ldv, L, po, ldo):
    """:func:`span_values4` for 16 floats."""
    return _SIG, _chains(1, 1, True)


def _widen(builder, bits):
    """The 16 halves whose bits are the <16 x i16> ``bits`` as float32 (exact): ``fpext`` where
    the target converts halves in instructions, else integer operations on the bits."""
    if NATIVE_HALF:
        return builder.fpext(builder.bitcast(bits, _H), _V)
    return _half_bits(builder, builder.zext(bits, _vec(_I32, LANES)))


def _gather(builder, base, offs):
    """The 16 32-bit words at byte addresses base + offs (offs <16 x i32>, non-negative)."""
    if not _AVX2:
        out = ir.Constant(_vec(_I32, LANES), None)
        for lane in range(LANES):
            off = builder.zext(builder.extract_element(offs, ir.Constant(_I32, lane)), _I64)
            word = builder.load(_at(builder, builder.add(base, off), 0, _I32), align=2)
            out = builder.insert_element(out, word, ir.Constant(_I32, lane))
        return out
    v8 = _vec(_I32, 8)
    fn = _fn(builder, "llvm.x86.avx2.gather.d.d.256", v8,
                  [v8, ir.PointerType(), v8, v8, ir.IntType(8)])
    ptr = builder.inttoptr(base, ir.PointerType())
    ones = _const(_I32, 8, -1)
    halves = [builder.call(fn, [ir.Constant(v8, None), ptr, _shuf(builder, offs, range(h, h + 8)),
                                ones, ir.Constant(ir.IntType(8), 1)])
              for h in (0, 8)]
    return builder.shuffle_vector(halves[0], halves[1], _const(_I32, LANES, range(LANES)))


def _cache_scores(nh, half):
    """s_{h j} = sum_{d < hd} q_{h d} k_{j d} for nh query heads h (q_h at pq + h ldq) and the
    nk <= 16 keys j at pk + j ldk (float32, or halves with ``half``), into s_h at ps + h lds (16
    floats: lanes j >= nk hold the last key's score): each lane one fused multiply-add chain
    over d = 0, 1, ..., hd - 1 from 0.0, :func:`span_scores1`'s. The keys' entries come in by
    gathers, one 32-bit word per key and d (float32) or per pair of d (two halves)."""
    def codegen(context, builder, signature, args):
        pq, ldq, pk, ldk, hd, ps, lds, nk = args
        iota = _const(_I32, LANES, range(LANES))
        last = _splat(builder, builder.trunc(builder.sub(nk, _i64(1)), _I32), LANES)
        rows = builder.select(builder.icmp_signed("<", iota, last), iota, last)
        offs = builder.mul(rows, _splat(builder, builder.trunc(ldk, _I32), LANES))
        accs = [cgutils.alloca_once_value(builder, _const(_F32, LANES, 0.0)) for _ in range(nh)]
        qs = [builder.add(pq, builder.mul(_i64(h), ldq)) for h in range(nh)]
        step = 2 if half else 1
        with cgutils.for_range(builder, builder.sdiv(hd, _i64(step))) as loop:
            i = loop.index
            words = _gather(builder, builder.add(pk, builder.mul(i, _i64(4))), offs)
            if half:
                ks = [_widen(builder, builder.trunc(w, _vec(ir.IntType(16), LANES)))
                      for w in (words, builder.lshr(words, _const(_I32, LANES, 16)))]
            else:
                ks = [builder.bitcast(words, _V)]
            for t, kv in enumerate(ks):
                d = builder.add(builder.mul(i, _i64(step)), _i64(t))
                for h in range(nh):
                    a = _splat(builder, _load(builder, builder.add(qs[h], builder.mul(d, _i64(4))),
                                              0, _F32, 4), LANES)
                    builder.store(_fma(builder, a, kv, builder.load(accs[h])), accs[h])
        for h in range(nh):
            out = builder.add(ps, builder.mul(_i64(h), lds))
            builder.store(builder.load(accs[h]), _at(builder, out, 0, _V), align=4)
        return context.get_dummy_value()

    return codegen


_SIG8 = types.none(*([types.int64] * 8))


@intrinsic
def cache_scores1(typingctx, pq, ldq, pk, ldk, hd, ps, lds, nk):
    r"""s_j = \sum_{d < hd} q_d k_{jd} for the nk <= 16 float32 keys at pk + j ldk, in the
    order of :func:`span_scores1` (see :func:`_cache_scores`)."""
    return _SIG8, _cache_scores(1, False)


@intrinsic
def cache_scores2(typingctx, pq, ldq, pk, ldk, hd, ps, lds, nk):
    """:func:`cache_scores1` for two query heads (pq, pq + ldq) into (ps, ps + lds)."""
    return _SIG8, _cache_scores(2, False)


@intrinsic
def cache_scores1h(typingctx, pq, ldq, pk, ldk, hd, ps, lds, nk):
    """:func:`cache_scores1` on a half cache."""
    return _SIG8, _cache_scores(1, True)


@intrinsic
def cache_scores2h(typingctx, pq, ldq, pk, ldk, hd, ps, lds, nk):
    """:func:`cache_scores2` on a half cache."""
    return _SIG8, _cache_scores(2, True)


@intrinsic
def span_values4h(typingctx, pw, ldw, pv, ldv, L, po, ldo):
    """:func:`span_values4` on rows of halves (a half cache's values, uint16 bits): the same
    chains on the exactly widened values."""
    return _SIG, _chains(1, 4, True, half=True)


@intrinsic
def span_values4x2h(typingctx, pw, ldw, pv, ldv, L, po, ldo):
    """:func:`span_values4x2` on rows of halves."""
    return _SIG, _chains(2, 4, True, half=True)


@intrinsic
def span_values1h(typingctx, pw, ldw, pv, ldv, L, po, ldo):
    """:func:`span_values1` on rows of halves."""
    return _SIG, _chains(1, 1, True, half=True)
