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
from ..decode.float_step import SPAN
from ..quant.unpack import _F32, _I64, _at, _const, _fma, _load, _splat, _vec

#: float32 lanes per vector
LANES = 16
_V = _vec(_F32, LANES)


def _i64(n):
    return ir.Constant(_I64, n)


def _chains(nh, m, accumulate):
    """c_h += sum_{i < n} a_{h i} b_i for nh rows h (a_{h i} the float at pa + h lda + 4 i, b_i the
    m vectors at pb + i ldb, c_h the m vectors at po + h ldo), each lane one fused multiply-add
    chain over i in order from 0 (accumulate) or from 0.0."""
    def codegen(context, builder, signature, args):
        pa, lda, pb, ldb, n, po, ldo = args
        outs = [builder.add(po, builder.mul(_i64(h), ldo)) for h in range(nh)]
        accs = [cgutils.alloca_once_value(builder, _load(builder, outs[h], 4 * LANES * i, _V, 4)
                                          if accumulate else _const(_F32, LANES, 0.0))
                for h in range(nh) for i in range(m)]
        with cgutils.for_range(builder, n) as loop:
            j = loop.index
            row = builder.add(pb, builder.mul(j, ldb))
            bs = [_load(builder, row, 4 * LANES * i, _V, 4) for i in range(m)]
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
