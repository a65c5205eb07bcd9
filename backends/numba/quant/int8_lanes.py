r"""Few-row products with GGML block weights in the integer GEMM's order: 16 rows of W in the 16
lanes of a vector, so that each output is the float32 value :func:`.int8_gemm.gemm` gives it,
bit for bit, whatever the number of rows multiplied (the decode steps' products, written as
LLVM IR through Numba intrinsics like :mod:`.int8_dots`).

The GEMM writes each output y_n = x . W_n as one chain over the sub-blocks b of K, in order:

    acc <- fma(float(I_b), d_b A_b, acc),  acc <- fma(s_b, C_b, acc),   acc_0 = 0,

with I_b = \sum_{k in b} u_k xq_k the exact integer dot of W's codes with x's 8-bit codes,
d_b x's block scale, A_b and C_b the sub-block's scale and offset (w = A u + C; the
decomposition of :mod:`.int8_gemm`) and s_b = d_b \sum_{k in b} xq_k (the two scaled sums of 16
added, for a sub-block of 32). Here one call computes the chains of 16 rows of W at once, each
lane of a vector one row: per pair of blocks the 16 rows' codes are decoded as for the row
kernels of :mod:`.int8_dots` and dotted with x's 64 codes (``vpdpbusd``: 16 partial sums of 4
per row), a tree of shuffles and integer adds turns the 16 x 16 partial sums into each row's
I_b (exact, so their order does not matter), and the float32 steps above run on vectors of the
16 rows' A_b and C_b. Q8_0's signed codes are dotted as q + 128 and 128 \sum xq subtracted
(an integer). So a row's result depends on nothing but its own bytes and x.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .. import _cache  # noqa: F401  (the kernels' cache stamp, before any @njit)
from .block_types import BY_ID, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from .int8_dots import GFNI, VNNI, _block32, _cat, _dot4, _kchunk, _pair32, fits16, quantize_rows
from .int8_gemm import GROUP, kaffine
from .unpack import _F32, _I8, _I32, _I64, _at, _const, _fma, _load, _splat, _vec

#: the GGML type ids of blocks of 32 with a lanes kernel
LANE_TYPES32 = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)
#: the K-quants (super-blocks of 256: sub-blocks of 32 for Q4_K and Q5_K, of 16 for the others)
LANE_TYPESK = (Q4_K, Q5_K, Q6_K, Q3_K, Q2_K)
#: the GGML type ids with a lanes kernel: every type of the integer GEMM
LANE_TYPES = LANE_TYPES32 + LANE_TYPESK
#: rows of W per call
LANES = 16


def lane_sums(builder, vs, group):
    r"""The integer sums of ``group`` consecutive lanes of each of the 16 vectors ``vs`` (<16 x
    i32>, vs[r] lane j a partial sum of row r), as 16 // group vectors whose lane r is row r's
    sum of lanes group s .. group s + group - 1 (s the vector's index): pairs of vectors summed
    lane pair by lane pair (evens plus odds of the two concatenated) until each lane holds a
    whole group, then the lanes gathered into place by shuffles."""
    n = len(vs)
    items = [(v, [(r, frozenset([j])) for j in range(16)]) for r, v in enumerate(vs)]
    width = 1
    while width < group:
        half = len(items) // 2
        nxt = []
        for a, b in zip(items[:half], items[half:]):
            labels = a[1] + b[1]
            ev = builder.shuffle_vector(a[0], b[0], _const(_I32, 16, range(0, 32, 2)))
            od = builder.shuffle_vector(a[0], b[0], _const(_I32, 16, range(1, 32, 2)))
            merged = []
            for k in range(16):
                (r0, j0), (r1, j1) = labels[2 * k], labels[2 * k + 1]
                assert r0 == r1
                merged.append((r0, j0 | j1))
            nxt.append((builder.add(ev, od), merged))
        items = nxt
        width *= 2
    out = []
    for s in range(16 // group):
        want = [(r, frozenset(range(group * s, group * s + group))) for r in range(n)]
        level = items
        while len(level) > 1:  # two sources per shuffle: merge the wanted lanes pairwise
            nxt = []
            for i in range(0, len(level), 2):
                (a, la), (b, lb) = level[i], level[i + 1]
                mask, labels = [], []
                for t in range(16):
                    if want[t] in la:
                        mask.append(la.index(want[t]))
                        labels.append(want[t])
                    elif want[t] in lb:
                        mask.append(16 + lb.index(want[t]))
                        labels.append(want[t])
                    else:
                        mask.append(0)
                        labels.append(None)
                nxt.append((builder.shuffle_vector(a, b, _const(_I32, 16, mask)), labels))
            level = nxt
        assert level[0][1] == want
        out.append(level[0][0])
    return out


def _gather(builder, values):
    """The 16 float scalars ``values`` as a <16 x float>."""
    v = ir.Constant(_vec(_F32, 16), None)
    for r, s in enumerate(values):
        v = builder.insert_element(v, s, ir.Constant(_I32, r))
    return v


def _isum(builder, v, lo, n):
    """The integer sum of lanes lo .. lo + n - 1 of v."""
    part = builder.shuffle_vector(v, v, _const(_I32, n, range(lo, lo + n)))
    fn = builder.module.globals.get(f"llvm.vector.reduce.add.v{n}i32") or ir.Function(
        builder.module, ir.FunctionType(_I32, [part.type]), f"llvm.vector.reduce.add.v{n}i32")
    return builder.call(fn, [part])


def _prefetch(builder, addr):
    ptr = builder.inttoptr(addr, _I8.as_pointer())
    fn = builder.module.globals.get("llvm.prefetch.p0i8") or ir.Function(
        builder.module, ir.FunctionType(ir.VoidType(), [ptr.type, _I32, _I32, _I32]),
        "llvm.prefetch.p0i8")
    builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 2), ir.Constant(_I32, 1)])


#: pairs of blocks per chunk: the rows are read one after another over a chunk (as the row
#: kernels read them; 16 rows side by side are more streams than the hardware prefetchers
#: follow), their partial sums kept on the stack (CHUNK KiB) for the sums by lanes
CHUNK = 8


def _c64(v):
    return ir.Constant(_I64, v)


_ZERO16 = ir.Constant(_vec(_F32, 16), [0.0] * 16)


def _chain(builder, qt, acc, isums, scales, b0, x, pd, ps):
    """The GEMM's two fused multiply-adds of sub-blocks b0, b0 + 1, ... into acc (one x row: its
    scales at pd, its scaled sums of 16 at ps; x its codes' dot with ones for Q8_0)."""
    a = builder.load(acc)
    for k, (isum, (A, C)) in enumerate(zip(isums, scales)):
        b = builder.add(b0, _c64(k))
        if qt == Q8_0:  # the codes were q + 128
            isum = builder.sub(isum, _splat(builder, builder.mul(
                _isum(builder, x, 8 * k, 8), ir.Constant(_I32, 128)), 16))
        dx = _load(builder, builder.add(pd, builder.mul(b, _c64(4))), 0, _F32, 4)
        s0 = builder.add(ps, builder.mul(b, _c64(8)))
        xs = builder.fadd(_load(builder, s0, 0, _F32, 4), _load(builder, s0, 4, _F32, 4))
        f = builder.sitofp(isum, _vec(_F32, 16))
        a = _fma(builder, f, builder.fmul(_splat(builder, dx, 16), A), a)
        a = _fma(builder, _splat(builder, xs, 16), C, a)
    builder.store(a, acc)


def _phase1(builder, k, pw, stride, nrows, i0, n, xq, sv, sa):
    """The rows one after another (memory order): each W row's pairs of blocks decoded once, its
    integer partial sums with each x row and its scales stored for phase 2."""
    qt, vnni, R, chunk, size = k
    with cgutils.for_range(builder, nrows) as rl:
        r = rl.index
        row = builder.add(pw, builder.add(builder.mul(r, stride),
                                          builder.mul(i0, _c64(2 * size))))
        with cgutils.for_range(builder, n) as il:
            i = il.index
            u, a2, m2 = _pair32(qt, builder, builder.add(row, builder.mul(
                i, _c64(2 * size))), vnni and GFNI)
            for j in range(R):
                xv = _load(builder, builder.add(xq[j], builder.mul(
                    builder.add(i0, i), _c64(64))), 0, _vec(_I8, 64))
                slot = builder.add(builder.mul(builder.add(builder.mul(
                    _c64(j), _c64(chunk)), i), _c64(LANES)), r)
                builder.store(_dot4(builder, u, xv, vnni, fits16=fits16(qt)),
                              builder.gep(sv, [slot]))
            for kk in range(2):
                for jj, v in enumerate((a2, m2)):
                    at = builder.add(builder.mul(builder.add(builder.mul(
                        i, _c64(4)), _c64(2 * kk + jj)), _c64(LANES)), r)
                    builder.store(builder.extract_element(v, ir.Constant(_I32, kk)),
                                  builder.gep(sa, [at]))


def _phase2(builder, k, i0, i, x, sv, sa, accs):
    """Pair of blocks i of the chunk at i0: the 16 rows' sums by lanes and the GEMM's float
    steps, for each x row (x: its codes, scales and sums' addresses)."""
    qt, vnni, R, chunk, size = k
    xq, xd, xsum = x

    def scale(kk, jj):
        at = builder.mul(builder.add(builder.mul(i, _c64(4)), _c64(2 * kk + jj)), _c64(LANES))
        ptr = builder.bitcast(builder.gep(sa, [at]), _vec(_F32, 16).as_pointer())
        return builder.load(ptr, align=4)

    blk = builder.add(i0, i)
    scales = [(scale(kk, 0), _ZERO16 if qt == Q8_0 else scale(kk, 1)) for kk in range(2)]
    for j in range(R):
        base = builder.mul(builder.add(builder.mul(_c64(j), _c64(chunk)), i), _c64(LANES))
        vs = [builder.load(builder.gep(sv, [builder.add(base, _c64(r))])) for r in range(LANES)]
        ones = None
        if qt == Q8_0:
            xv = _load(builder, builder.add(xq[j], builder.mul(blk, _c64(64))), 0, _vec(_I8, 64))
            ones = _dot4(builder, _const(_I8, 64, 1), xv, vnni, fits16=True)
        _chain(builder, qt, accs[j], lane_sums(builder, vs, 8), scales,
               builder.mul(blk, _c64(2)), ones, xd[j], xsum[j])


def _odd_block(builder, k, b, rows, x, accs):
    """The last block alone (an odd count): its codes beside zeros, for each x row."""
    qt, vnni, R, chunk, size = k
    xq, xd, xsum = x
    zeros = ir.Constant(_vec(_I8, 32), [0] * 32)
    us, A, C = [], [], []
    for r in range(LANES):
        u, a, c = _block32(qt, builder, builder.add(rows[r], builder.mul(b, _c64(size))))
        us.append(_cat(builder, u, zeros))
        A.append(a)
        C.append(c)
    scales = [(_gather(builder, A), _ZERO16 if qt == Q8_0 else _gather(builder, C))]
    for j in range(R):
        xv = _cat(builder, _load(builder, builder.add(xq[j], builder.mul(b, _c64(32))), 0,
                                 _vec(_I8, 32)), zeros)
        isum = lane_sums(builder, [_dot4(builder, u, xv, vnni, fits16=fits16(qt))
                                   for u in us], 8)[0]
        ones = _dot4(builder, _const(_I8, 64, 1), xv, vnni, fits16=True) if qt == Q8_0 else None
        _chain(builder, qt, accs[j], [isum], scales, b, ones, xd[j], xsum[j])


def _over_chunks(builder, pw, stride, units, chunk, phase1, phase2):
    """The 16 rows' ``units`` (pairs of blocks, super-blocks) in chunks of ``chunk``: phase1(i0,
    n) reads the rows' n units from unit i0, phase2(i0, i) sums unit i0 + i by lanes. The next
    16 rows' cache lines are prefetched, a share per unit of phase 2 (which reads no memory of
    its own): the loads of phase 1 then find them."""
    ahead = builder.add(pw, builder.mul(stride, _c64(LANES)))
    lines = builder.sdiv(builder.mul(stride, _c64(LANES)), _c64(64))
    per = builder.sdiv(builder.add(lines, builder.sub(units, _c64(1))), builder.select(
        builder.icmp_signed(">", units, _c64(0)), units, _c64(1)))
    nchunk = builder.sdiv(builder.add(units, _c64(chunk - 1)), _c64(chunk))
    with cgutils.for_range(builder, nchunk) as chunks:
        i0 = builder.mul(chunks.index, _c64(chunk))
        n = builder.sub(units, i0)
        n = builder.select(builder.icmp_signed("<", n, _c64(chunk)), n, _c64(chunk))
        phase1(i0, n)
        with cgutils.for_range(builder, n) as il:
            with cgutils.for_range(builder, per) as pf:
                line = builder.add(builder.mul(builder.add(i0, il.index), per), pf.index)
                _prefetch(builder, builder.add(ahead, builder.mul(line, _c64(64))))
            phase2(i0, il.index)


def _store_rows(builder, outs, py, ldy, nrows):
    """Lane r < nrows of outs[j] (the R x rows' <16 x float> results) at py + j ldy + 4 r."""
    for j, out in enumerate(outs):
        yj = builder.add(py, builder.mul(_c64(j), ldy))
        for r in range(LANES):
            with builder.if_then(builder.icmp_signed("<", _c64(r), nrows)):
                builder.store(builder.extract_element(out, ir.Constant(_I32, r)),
                              _at(builder, yj, 4 * r, _F32), align=4)


def _lanes32(qt, vnni, R=1):
    """The kernel of :func:`_make`: R rows of x, each W row's pairs of blocks decoded once for
    all R (each x row's chains its own, as with R = 1). Pairs of blocks per chunk: R rows of x
    keep R times the partial sums on the stack, so fewer (8 KiB of them for 4 rows: 1.3x faster
    than CHUNK on SmolLM2's FFN matrices)."""
    chunk = CHUNK // 2 if R > 1 else CHUNK
    k = (qt, vnni, R, chunk, BY_ID[qt].block_bytes)

    def codegen(context, builder, signature, args):
        pw, stride, nrows, pq, ldq, pd, ldd, ps, lds, nb, py, ldy = args
        x = tuple([builder.add(p, builder.mul(_c64(j), ld)) for j in range(R)]
                  for p, ld in ((pq, ldq), (pd, ldd), (ps, lds)))
        last = builder.sub(nrows, _c64(1))
        rows = [builder.add(pw, builder.mul(builder.select(  # rows past nrows repeat the last
            builder.icmp_signed("<", _c64(r), nrows), _c64(r), last), stride))
            for r in range(LANES)]
        accs = [cgutils.alloca_once_value(builder, _ZERO16) for _ in range(R)]
        sv = cgutils.alloca_once(builder, _vec(_I32, 16), size=chunk * LANES * R)
        sa = cgutils.alloca_once(builder, _F32, size=chunk * 4 * LANES)
        npair = builder.sdiv(nb, _c64(2))
        _over_chunks(builder, pw, stride, npair, chunk,
                     lambda i0, n: _phase1(builder, k, pw, stride, nrows, i0, n, x[0], sv, sa),
                     lambda i0, i: _phase2(builder, k, i0, i, x, sv, sa, accs))
        with builder.if_then(builder.icmp_signed("!=", builder.mul(npair, _c64(2)), nb)):
            _odd_block(builder, k, builder.sub(nb, _c64(1)), rows, x, accs)
        _store_rows(builder, [builder.load(a) for a in accs], py, ldy, nrows)
        return context.get_dummy_value()

    return codegen


def _phase1k(builder, k, pw, stride, nrows, i0, n, xq, sv, sa):
    """:func:`_phase1` for K super-blocks: each W row's chunks of 64 codes decoded once, their
    integer partial sums with each x row stored, and the row's A and C of its sub-blocks as two
    vectors (turned into the 16 rows' vectors per sub-block by :func:`transpose16`)."""
    qt, vnni, R, chunk, size = k
    nsub = 256 // GROUP[qt]
    with cgutils.for_range(builder, nrows) as rl:
        r = rl.index
        row = builder.add(pw, builder.add(builder.mul(r, stride), builder.mul(i0, _c64(size))))
        with cgutils.for_range(builder, n) as il:
            i = il.index
            blk = builder.add(row, builder.mul(i, _c64(size)))
            for c in range(4):
                u = _kchunk(qt, builder, blk, c)
                for j in range(R):
                    xv = _load(builder, builder.add(xq[j], builder.add(builder.mul(
                        builder.add(i0, i), _c64(256)), _c64(64 * c))), 0, _vec(_I8, 64))
                    slot = builder.add(builder.mul(builder.add(builder.mul(builder.add(
                        builder.mul(_c64(j), _c64(chunk)), i), _c64(4)), _c64(c)),
                        _c64(LANES)), r)
                    builder.store(_dot4(builder, u, xv, vnni, fits16=True),
                                  builder.gep(sv, [slot]))
            for h, v in enumerate(kaffine(qt, builder, blk)):  # the row's A, C as vectors
                if nsub == 8:
                    v = builder.shuffle_vector(v, v, _const(_I32, 16, list(range(8)) * 2))
                at = builder.add(builder.mul(builder.add(builder.mul(i, _c64(2)), _c64(h)),
                                             _c64(LANES)), r)
                builder.store(v, builder.gep(sa, [at]))


def transpose16(builder, vs):
    """The 16 x 16 transpose of the 16 vectors vs (<16 x float>): out[s] lane r = vs[r] lane s.
    Four stages, one per bit w of the index: rows r and r + w (bit w clear in r) trade the
    lanes whose bit w is set in r's for those whose bit is clear in r + w's."""
    vs = list(vs)
    for w in (8, 4, 2, 1):
        lo_mask = [16 + s - w if s & w else s for s in range(16)]
        hi_mask = [s + w if not s & w else 16 + s for s in range(16)]
        for r in range(16):
            if r & w:
                continue
            a, b = vs[r], vs[r + w]
            vs[r] = builder.shuffle_vector(a, b, _const(_I32, 16, lo_mask))
            vs[r + w] = builder.shuffle_vector(a, b, _const(_I32, 16, hi_mask))
    return vs


def _phase2k(builder, k, i0, i, x, sv, sa, accs):
    """Super-block i of the chunk at i0: the 16 rows' sums by lanes per sub-block and the
    GEMM's two fused multiply-adds of each, in order, for each x row (x: the addresses and row
    strides of its scales and sums; accs: R vectors). One loop over the x rows and the four
    chunks of 64 codes, in order for each row (one copy of its body: the IR of four rows of x
    unrolled took the compiler minutes)."""
    qt, vnni, R, chunk, size = k
    G = GROUP[qt]
    nsub, per = 256 // G, 64 // G
    pd, ldd, ps, lds, st = x
    sb = builder.mul(builder.add(i0, i), _c64(nsub))  # the super-block's first sub-block
    for h in range(2):  # the 16 rows' A (C) of each sub-block as one vector, st[h nsub + s]
        rows = [builder.load(builder.gep(sa, [builder.add(builder.mul(builder.add(
            builder.mul(i, _c64(2)), _c64(h)), _c64(LANES)), _c64(r))])) for r in range(LANES)]
        for t, v in enumerate(transpose16(builder, rows)[:nsub]):
            builder.store(v, builder.gep(st, [_c64(h * nsub + t)]))
    with cgutils.for_range(builder, _c64(4 * R)) as loop:
        j = builder.sdiv(loop.index, _c64(4))
        c = builder.srem(loop.index, _c64(4))
        base = builder.mul(builder.add(builder.mul(builder.add(builder.mul(
            j, _c64(chunk)), i), _c64(4)), c), _c64(LANES))
        vs = [builder.load(builder.gep(sv, [builder.add(base, _c64(r))]))
              for r in range(LANES)]
        pdj = builder.add(pd, builder.mul(j, ldd))
        psj = builder.add(ps, builder.mul(j, lds))
        acc = builder.gep(accs, [j])
        a = builder.load(acc)
        for t, isum in enumerate(lane_sums(builder, vs, G // 4)):
            s = builder.add(builder.mul(c, _c64(per)), _c64(t))
            b = builder.add(sb, s)
            dx = _load(builder, builder.add(pdj, builder.mul(
                builder.sdiv(builder.mul(b, _c64(G)), _c64(32)), _c64(4))), 0, _F32, 4)
            s0 = builder.add(psj, builder.mul(b, _c64(4 * G // 16)))
            xs = _load(builder, s0, 0, _F32, 4)
            if G == 32:
                xs = builder.fadd(xs, _load(builder, s0, 4, _F32, 4))
            scales = [builder.load(builder.gep(st, [builder.add(_c64(h * nsub), s)]))
                      for h in range(2)]
            f = builder.sitofp(isum, _vec(_F32, 16))
            a = _fma(builder, f, builder.fmul(_splat(builder, dx, 16), scales[0]), a)
            a = _fma(builder, _splat(builder, xs, 16), scales[1], a)
        builder.store(a, acc)


def _lanesk(qt, vnni, R=1):
    """The kernel of :func:`_make` for a K-quant: as :func:`_lanes32` by super-blocks of 256
    (the chunks of 64 codes of :func:`.int8_dots._kchunk`, the sub-blocks' A and C of
    :func:`.int8_gemm.kaffine`), the chain over sub-blocks of GROUP[qt] values; one
    super-block per chunk (4 KiB of partial sums per x row: 2 or 4 were slower on the s110
    shapes)."""
    chunk = 1
    nsub = 256 // GROUP[qt]
    k = (qt, vnni, R, chunk, BY_ID[qt].block_bytes)

    def codegen(context, builder, signature, args):
        pw, stride, nrows, pq, ldq, pd, ldd, ps, lds, nb, py, ldy = args
        xq = [builder.add(pq, builder.mul(_c64(j), ldq)) for j in range(R)]
        accs = cgutils.alloca_once(builder, _vec(_F32, 16), size=R)
        for j in range(R):
            builder.store(_ZERO16, builder.gep(accs, [_c64(j)]))
        sv = cgutils.alloca_once(builder, _vec(_I32, 16), size=chunk * 4 * LANES * R)
        sa = cgutils.alloca_once(builder, _vec(_F32, 16), size=chunk * 2 * LANES)
        st = cgutils.alloca_once(builder, _vec(_F32, 16), size=2 * nsub)
        nsb = builder.sdiv(nb, _c64(8))  # super-blocks of the row
        _over_chunks(builder, pw, stride, nsb, chunk,
                     lambda i0, n: _phase1k(builder, k, pw, stride, nrows, i0, n, xq, sv, sa),
                     lambda i0, i: _phase2k(builder, k, i0, i, (pd, ldd, ps, lds, st), sv, sa,
                                            accs))
        _store_rows(builder, [builder.load(builder.gep(accs, [_c64(j)])) for j in range(R)],
                    py, ldy, nrows)
        return context.get_dummy_value()

    return codegen


def _make(qt, vnni, R=1):
    gen = _lanesk(qt, vnni, R) if qt in LANE_TYPESK else _lanes32(qt, vnni, R)

    @intrinsic
    def ilanes(typingctx, pw, stride, nrows, pq, ldq, pd, ldd, ps, lds, nblocks, py, ldy):
        r"""y_{jr} = \sum_k W_{rk} x_{jk} for the ``nrows`` (<= 16) rows of ``nblocks`` blocks
        at pw + r stride and R rows j of 8-bit activation blocks at pq + j ldq (codes),
        pd + j ldd (scales), ps + j lds (scaled sums of 16), stored as float32 at
        py + j ldy + 4 r: the integer GEMM's value of each."""
        return types.none(*([types.int64] * 12)), gen

    return ilanes


#: x rows per call of the kernels of several rows (W's codes decoded once for them)
XROWS = 4
(ilanes_q8_0, ilanes_q4_0, ilanes_q4_1, ilanes_q5_0, ilanes_q5_1, ilanes_q4_k, ilanes_q5_k,
 ilanes_q6_k, ilanes_q3_k, ilanes_q2_k) = (_make(t, VNNI) for t in LANE_TYPES)
# the K-quants have no kernel of several x rows: five more bodies in the decode step of several
# rows took the compiler about a minute more (their x rows take the one-row kernel each, as
# their row kernels did before)
ilanes4_q8_0, ilanes4_q4_0, ilanes4_q4_1, ilanes4_q5_0, ilanes4_q5_1 = (
    _make(t, VNNI, XROWS) for t in LANE_TYPES32)

_opts = dict(cache=True, fastmath=True, nogil=True, error_model="numpy")


@njit(inline="always", **_opts)
def has_lanes(qt):  # pragma: no cover - compiled
    """Whether GGML type qt has a lanes kernel (:data:`LANE_TYPES`)."""
    return (qt == Q8_0 or qt == Q4_0 or qt == Q4_1 or qt == Q5_0 or qt == Q5_1
            or qt == Q4_K or qt == Q5_K or qt == Q6_K or qt == Q3_K or qt == Q2_K)


@njit(inline="always", **_opts)
def idot_lanes(qt, w, n0, nrows, xq, xd, xs, y):  # pragma: no cover - compiled
    """y[n0 + r] = row n0 + r of the block matrix w (a type of :data:`LANE_TYPES`) times the
    8-bit activation row (xq, xd, xs) for r < nrows <= 16, in the integer GEMM's order."""
    args = (w.ctypes.data + n0 * w.shape[1], w.shape[1], nrows, xq.ctypes.data, 0,
            xd.ctypes.data, 0, xs.ctypes.data, 0, xd.shape[0], y.ctypes.data + n0 * 4, 0)
    if qt == Q8_0:
        ilanes_q8_0(*args)
    elif qt == Q4_0:
        ilanes_q4_0(*args)
    elif qt == Q4_1:
        ilanes_q4_1(*args)
    elif qt == Q5_0:
        ilanes_q5_0(*args)
    elif qt == Q5_1:
        ilanes_q5_1(*args)
    elif qt == Q4_K:
        ilanes_q4_k(*args)
    elif qt == Q5_K:
        ilanes_q5_k(*args)
    elif qt == Q6_K:
        ilanes_q6_k(*args)
    elif qt == Q3_K:
        ilanes_q3_k(*args)
    else:
        ilanes_q2_k(*args)


@njit(inline="always", **_opts)
def has_lanes4(qt):  # pragma: no cover - compiled
    """Whether GGML type qt has a kernel of :data:`XROWS` x rows (:func:`idot_lanes4`: the
    blocks of 32)."""
    return qt == Q8_0 or qt == Q4_0 or qt == Q4_1 or qt == Q5_0 or qt == Q5_1


@njit(inline="always", **_opts)
def idot_lanes4(qt, w, n0, nrows, xq, xd, xs, b, y, c0):  # pragma: no cover - compiled
    """y[b + j, c0 + n0 + r] = row n0 + r of w times the 8-bit activation row b + j of (xq, xd,
    xs) (2-d, rows of K codes, K/32 scales, K/16 sums) for j < :data:`XROWS` and r < nrows <= 16:
    :func:`idot_lanes` of each, W's codes decoded once for the :data:`XROWS` rows; a type of
    blocks of 32 (:func:`has_lanes4`)."""
    args = (w.ctypes.data + n0 * w.shape[1], w.shape[1], nrows, xq[b].ctypes.data,
            xq.strides[0], xd[b].ctypes.data, xd.strides[0], xs[b].ctypes.data, xs.strides[0],
            xd.shape[1], y[b].ctypes.data + (c0 + n0) * 4, y.strides[0])
    if qt == Q8_0:
        ilanes4_q8_0(*args)
    elif qt == Q4_0:
        ilanes4_q4_0(*args)
    elif qt == Q4_1:
        ilanes4_q4_1(*args)
    elif qt == Q5_0:
        ilanes4_q5_0(*args)
    else:
        ilanes4_q5_1(*args)


@njit(**_opts)
def mv_lanes(qt, w, xq, xd, xs, y, lo, hi):  # pragma: no cover - compiled
    """y[n] for lo <= n < hi: :func:`idot_lanes` 16 rows at a time (y (N,) contiguous)."""
    for n0 in range(lo, hi, LANES):
        idot_lanes(qt, w, n0, min(LANES, hi - n0), xq, xd, xs, y)


@njit(parallel=True, **_opts)
def _gemv(qt, xq, xd, xs, w, y, parts):  # pragma: no cover - compiled
    N = w.shape[0]
    step = (N + parts - 1) // parts
    for t in prange(parts):
        lo, hi = t * step, min(N, t * step + step)
        for n0 in range(lo, hi, LANES):
            for m in range(xq.shape[0]):
                idot_lanes(qt, w, n0, min(LANES, hi - n0), xq[m], xd[m], xs[m], y[m])


def gemv(qt: int, x: np.ndarray, w: np.ndarray, y: np.ndarray, parts: int) -> None:
    """y = x W^T (y (M, N) C-contiguous) for the block matrix w (uint8 rows of a type in
    :data:`LANE_TYPES`) and float32 x (M, K) rounded to 8-bit blocks, over ``parts`` threads:
    each output the integer GEMM's value (:func:`.int8_gemm.gemm`), whatever M."""
    M, K = x.shape
    xq = np.empty((M, K), dtype=np.int8)
    xd = np.empty((M, K // 32), dtype=np.float32)
    xs = np.empty((M, K // 16), dtype=np.float32)
    quantize_rows(x, xq, xd, xs)
    _gemv(qt, xq, xd, xs, w, y, max(1, parts))
