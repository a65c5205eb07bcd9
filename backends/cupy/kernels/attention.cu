// Causal grouped-query attention: tiled forward with an online softmax, backward from the saved
// row log-sum-exp, and a decode kernel for one query per sequence against the KV cache.
//
// Shapes (size letters as in minillama.core.ops): q, out, dq, dout: (B, T, H, hd) contiguous;
// k, v: (B, S, KVH, hd) with the last two axes contiguous and batch stride kv_bs (elements), so a
// view of a longer KV cache works as is; dk, dv: (B, S, KVH, hd) contiguous;
// lse, dsum: (B, H, T). G = H / KVH; query head h reads KV head h / G.
// Query t of sequence b sits at position p_b + t (p_b = start[b] when use_arr, else start_scalar)
// and reads keys j <= p_b + t (and j < S).
//
//   s_tj = q_t . k_j / sqrt(hd),  P = softmax_j(s),  o_t = sum_j P_tj v_j,  lse_t = log sum_j e^{s_tj}
//   D_t = dO_t . o_t,  dP_tj = dO_t . v_j,  dS_tj = P_tj (dP_tj - D_t)
//   dq_t = sum_j dS_tj k_j / sqrt(hd),  dk_j = sum_{t, g in group} dS_tj q_t / sqrt(hd),
//   dv_j = sum_{t, g in group} P_tj dO_t
//
// Rows: for one (b, kv head) the G query heads of the group and the T positions form R = T G rows
// r = t G + g, so one K/V tile in shared memory serves every head of the group. The (T, S)
// probability matrix is never stored: the backward recomputes P_tj = e^{s_tj - lse_t}.
// hd <= ML_MAXD (128); blocks have ATT_WARPS warps.
// KERNELS: attn_fwd attn_bwd_dsum attn_bwd_dq attn_bwd_dkdv attn_decode
#include "common.cu"

#define ATT_WARPS 4
#define DEC_WARPS 8

template <typename T> struct AttnCfg;
template <> struct AttnCfg<float> {
    static constexpr int BK = 32;      // keys per K/V tile (one per lane)
    static constexpr int RPW = 4;      // forward: query rows per warp
    static constexpr int RPW_DQ = 2;   // dq kernel: query rows per warp
    static constexpr int BQ = 32;      // dk/dv kernel: query rows per tile (one per lane)
    static constexpr int KPW = 2;      // dk/dv kernel: keys per warp
    static constexpr int GMAX = 8;     // decode: query heads per block
};
template <> struct AttnCfg<double> {  // halves the tiles so static shared memory stays < 48 KiB
    static constexpr int BK = 16;
    static constexpr int RPW = 2;
    static constexpr int RPW_DQ = 1;
    static constexpr int BQ = 16;
    static constexpr int KPW = 1;
    static constexpr int GMAX = 4;
};

__device__ __forceinline__ long long attn_start(const long long* start, long long start_scalar,
                                                int use_arr, int b) {
    return use_arr ? start[b] : start_scalar;
}

// ------------------------------------------------------------------------------------------
// Forward. grid (ceil(R / (ATT_WARPS RPW)), B KVH), block 32 ATT_WARPS.
// ------------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(32 * ATT_WARPS)
attn_fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
         T* __restrict__ out, T* __restrict__ lse, const long long* __restrict__ start,
         long long start_scalar, int use_arr, int T_, int S, int H, int KVH, int hd,
         long long kv_bs, T scale) {
    constexpr int BK = AttnCfg<T>::BK, RPW = AttnCfg<T>::RPW, ROWS = ATT_WARPS * RPW;
    __shared__ T sK[BK][ML_MAXD + 1];
    __shared__ T sV[BK][ML_MAXD];
    __shared__ T sQ[ROWS][ML_MAXD];
    const int G = H / KVH;
    const int b = blockIdx.y / KVH, kvh = blockIdx.y % KVH;
    const int R = T_ * G;
    const int r0 = blockIdx.x * ROWS;
    if (r0 >= R) return;
    const long long p0 = attn_start(start, start_scalar, use_arr, b);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const T NEG = ml_neg_inf<T>();

    for (int e = threadIdx.x; e < ROWS * hd; e += blockDim.x) {
        const int rr = e / hd, d = e % hd, r = r0 + rr;
        T val = T(0);
        if (r < R) {
            const int t = r / G, g = r % G;
            val = q[(((size_t)b * T_ + t) * H + kvh * G + g) * hd + d] * scale;
        }
        sQ[rr][d] = val;
    }

    T m_i[RPW], l_i[RPW], o_i[RPW][ML_DPL];
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
        m_i[i] = NEG;
        l_i[i] = T(0);
#pragma unroll
        for (int c = 0; c < ML_DPL; ++c) o_i[i][c] = T(0);
    }

    const int r_last = min(r0 + ROWS, R) - 1;
    const long long kend_ll = p0 + r_last / G + 1;
    const int kend = (int)(kend_ll < (long long)S ? kend_ll : (long long)S);

    for (int k0 = 0; k0 < kend; k0 += BK) {
        __syncthreads();  // previous tile fully used (and sQ written, on the first pass)
        for (int e = threadIdx.x; e < BK * hd; e += blockDim.x) {
            const int j = e / hd, d = e % hd, key = k0 + j;
            T kv = T(0), vv = T(0);
            if (key < kend) {
                const size_t off = (size_t)b * kv_bs + ((size_t)key * KVH + kvh) * hd + d;
                kv = k[off];
                vv = v[off];
            }
            sK[j][d] = kv;
            sV[j][d] = vv;
        }
        __syncthreads();
        const int nk = min(BK, kend - k0);
#pragma unroll
        for (int i = 0; i < RPW; ++i) {
            const int rr = warp * RPW + i, r = r0 + rr;
            if (r < R) {  // uniform over the warp
                const long long lim = p0 + r / G;
                const int key = k0 + lane;
                T s = NEG;
                if (lane < nk && key <= lim) {
                    T acc = T(0);
                    for (int d = 0; d < hd; ++d) acc += sQ[rr][d] * sK[lane][d];
                    s = acc;
                }
                const T m_new = ml_max(m_i[i], warp_max(s));
                if (m_new != NEG) {  // uniform; false only when nothing is visible yet
                    const T pj = (s == NEG) ? T(0) : ml_exp(s - m_new);
                    const T alpha = ml_exp(m_i[i] - m_new);
                    l_i[i] = l_i[i] * alpha + warp_sum(pj);
                    m_i[i] = m_new;
#pragma unroll
                    for (int c = 0; c < ML_DPL; ++c) o_i[i][c] *= alpha;
                    for (int j = 0; j < nk; ++j) {
                        const T pb = __shfl_sync(ML_FULL_MASK, pj, j);
#pragma unroll
                        for (int c = 0; c < ML_DPL; ++c) {
                            const int d = lane + 32 * c;
                            if (d < hd) o_i[i][c] += pb * sV[j][d];
                        }
                    }
                }
            }
        }
    }

#pragma unroll
    for (int i = 0; i < RPW; ++i) {
        const int r = r0 + warp * RPW + i;
        if (r < R) {
            const int t = r / G, g = r % G, h = kvh * G + g;
            const T inv = T(1) / l_i[i];
            T* orow = out + (((size_t)b * T_ + t) * H + h) * hd;
#pragma unroll
            for (int c = 0; c < ML_DPL; ++c) {
                const int d = lane + 32 * c;
                if (d < hd) orow[d] = o_i[i][c] * inv;
            }
            if (lane == 0) lse[((size_t)b * H + h) * T_ + t] = m_i[i] + ml_log(l_i[i]);
        }
    }
}

// ------------------------------------------------------------------------------------------
// Backward, step 1: D_t = dO_t . o_t for every (b, t, h). One warp per row; block 32 ATT_WARPS.
// ------------------------------------------------------------------------------------------
template <typename T>
__global__ void attn_bwd_dsum(const T* __restrict__ dout, const T* __restrict__ out,
                              T* __restrict__ dsum, int B, int T_, int H, int hd) {
    const long long row = (long long)blockIdx.x * ATT_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= (long long)B * T_ * H) return;  // uniform over the warp
    const T* a = dout + row * hd;
    const T* o = out + row * hd;
    T acc = T(0);
    for (int d = lane; d < hd; d += 32) acc += a[d] * o[d];
    acc = warp_sum(acc);
    if (lane == 0) {
        const int h = (int)(row % H);
        const long long bt = row / H;
        const int t = (int)(bt % T_);
        const long long b = bt / T_;
        dsum[(b * H + h) * T_ + t] = acc;
    }
}

// ------------------------------------------------------------------------------------------
// Backward, step 2: dq. Same tiling as the forward: grid (ceil(R / (ATT_WARPS RPW_DQ)), B KVH).
// ------------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(32 * ATT_WARPS)
attn_bwd_dq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
            const T* __restrict__ dout, const T* __restrict__ lse, const T* __restrict__ dsum,
            T* __restrict__ dq, const long long* __restrict__ start, long long start_scalar,
            int use_arr, int T_, int S, int H, int KVH, int hd, long long kv_bs, T scale) {
    constexpr int BK = AttnCfg<T>::BK, RPW = AttnCfg<T>::RPW_DQ, ROWS = ATT_WARPS * RPW;
    __shared__ T sK[BK][ML_MAXD + 1];
    __shared__ T sV[BK][ML_MAXD + 1];
    __shared__ T sQ[ROWS][ML_MAXD];
    __shared__ T sdO[ROWS][ML_MAXD];
    const int G = H / KVH;
    const int b = blockIdx.y / KVH, kvh = blockIdx.y % KVH;
    const int R = T_ * G;
    const int r0 = blockIdx.x * ROWS;
    if (r0 >= R) return;
    const long long p0 = attn_start(start, start_scalar, use_arr, b);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    for (int e = threadIdx.x; e < ROWS * hd; e += blockDim.x) {
        const int rr = e / hd, d = e % hd, r = r0 + rr;
        T qv = T(0), ov = T(0);
        if (r < R) {
            const int t = r / G, g = r % G;
            const size_t off = (((size_t)b * T_ + t) * H + kvh * G + g) * hd + d;
            qv = q[off] * scale;
            ov = dout[off];
        }
        sQ[rr][d] = qv;
        sdO[rr][d] = ov;
    }
    T lse_i[RPW], D_i[RPW], acc_i[RPW][ML_DPL];
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
        const int r = r0 + warp * RPW + i;
        lse_i[i] = T(0);
        D_i[i] = T(0);
        if (r < R) {
            const int t = r / G, h = kvh * G + r % G;
            lse_i[i] = lse[((size_t)b * H + h) * T_ + t];
            D_i[i] = dsum[((size_t)b * H + h) * T_ + t];
        }
#pragma unroll
        for (int c = 0; c < ML_DPL; ++c) acc_i[i][c] = T(0);
    }

    const int r_last = min(r0 + ROWS, R) - 1;
    const long long kend_ll = p0 + r_last / G + 1;
    const int kend = (int)(kend_ll < (long long)S ? kend_ll : (long long)S);

    for (int k0 = 0; k0 < kend; k0 += BK) {
        __syncthreads();
        for (int e = threadIdx.x; e < BK * hd; e += blockDim.x) {
            const int j = e / hd, d = e % hd, key = k0 + j;
            T kv = T(0), vv = T(0);
            if (key < kend) {
                const size_t off = (size_t)b * kv_bs + ((size_t)key * KVH + kvh) * hd + d;
                kv = k[off];
                vv = v[off];
            }
            sK[j][d] = kv;
            sV[j][d] = vv;
        }
        __syncthreads();
        const int nk = min(BK, kend - k0);
#pragma unroll
        for (int i = 0; i < RPW; ++i) {
            const int rr = warp * RPW + i, r = r0 + rr;
            if (r < R) {
                const long long lim = p0 + r / G;
                const int key = k0 + lane;
                T ds = T(0);
                if (lane < nk && key <= lim) {
                    T s = T(0), dp = T(0);
                    for (int d = 0; d < hd; ++d) {
                        s += sQ[rr][d] * sK[lane][d];
                        dp += sdO[rr][d] * sV[lane][d];
                    }
                    ds = ml_exp(s - lse_i[i]) * (dp - D_i[i]);
                }
                for (int j = 0; j < nk; ++j) {
                    const T db = __shfl_sync(ML_FULL_MASK, ds, j);
#pragma unroll
                    for (int c = 0; c < ML_DPL; ++c) {
                        const int d = lane + 32 * c;
                        if (d < hd) acc_i[i][c] += db * sK[j][d];
                    }
                }
            }
        }
    }

#pragma unroll
    for (int i = 0; i < RPW; ++i) {
        const int r = r0 + warp * RPW + i;
        if (r < R) {
            const int t = r / G, g = r % G;
            T* row = dq + (((size_t)b * T_ + t) * H + kvh * G + g) * hd;
#pragma unroll
            for (int c = 0; c < ML_DPL; ++c) {
                const int d = lane + 32 * c;
                if (d < hd) row[d] = acc_i[i][c] * scale;
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// Backward, step 3: dk and dv. grid (ceil(S / (ATT_WARPS KPW)), B KVH): a block owns KPW keys per
// warp and walks every query row r = t G + g of its group that can see them, BQ rows (one per
// lane) at a time, so the group's heads are summed without atomics.
// ------------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(32 * ATT_WARPS)
attn_bwd_dkdv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
              const T* __restrict__ dout, const T* __restrict__ lse, const T* __restrict__ dsum,
              T* __restrict__ dk, T* __restrict__ dv, const long long* __restrict__ start,
              long long start_scalar, int use_arr, int T_, int S, int H, int KVH, int hd,
              long long kv_bs, T scale) {
    constexpr int BQ = AttnCfg<T>::BQ, KPW = AttnCfg<T>::KPW, KEYS = ATT_WARPS * KPW;
    __shared__ T sQ[BQ][ML_MAXD + 1];
    __shared__ T sdO[BQ][ML_MAXD + 1];
    __shared__ T sK[KEYS][ML_MAXD];
    __shared__ T sV[KEYS][ML_MAXD];
    __shared__ T sL[BQ];
    __shared__ T sD[BQ];
    const int G = H / KVH;
    const int b = blockIdx.y / KVH, kvh = blockIdx.y % KVH;
    const int R = T_ * G;
    const int j0 = blockIdx.x * KEYS;
    if (j0 >= S) return;
    const long long p0 = attn_start(start, start_scalar, use_arr, b);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    for (int e = threadIdx.x; e < KEYS * hd; e += blockDim.x) {
        const int jj = e / hd, d = e % hd, key = j0 + jj;
        T kv = T(0), vv = T(0);
        if (key < S) {
            const size_t off = (size_t)b * kv_bs + ((size_t)key * KVH + kvh) * hd + d;
            kv = k[off];
            vv = v[off];
        }
        sK[jj][d] = kv;
        sV[jj][d] = vv;
    }
    T dk_a[KPW][ML_DPL], dv_a[KPW][ML_DPL];
#pragma unroll
    for (int u = 0; u < KPW; ++u)
#pragma unroll
        for (int c = 0; c < ML_DPL; ++c) dk_a[u][c] = dv_a[u][c] = T(0);

    // the first query position that can see key j0 is t = j0 - p0
    long long t_min = (long long)j0 - p0;
    if (t_min < 0) t_min = 0;
    const long long r_begin_ll = t_min * G;
    const int r_begin = (int)(r_begin_ll < (long long)R ? r_begin_ll : (long long)R);

    for (int q0 = r_begin; q0 < R; q0 += BQ) {
        __syncthreads();  // sK/sV loaded (first pass) or the previous query tile fully used
        for (int e = threadIdx.x; e < BQ * hd; e += blockDim.x) {
            const int ii = e / hd, d = e % hd, r = q0 + ii;
            T qv = T(0), ov = T(0);
            if (r < R) {
                const int t = r / G, g = r % G;
                const size_t off = (((size_t)b * T_ + t) * H + kvh * G + g) * hd + d;
                qv = q[off];
                ov = dout[off];
            }
            sQ[ii][d] = qv;
            sdO[ii][d] = ov;
        }
        for (int ii = threadIdx.x; ii < BQ; ii += blockDim.x) {
            const int r = q0 + ii;
            T lv = T(0), dvv = T(0);
            if (r < R) {
                const int t = r / G, h = kvh * G + r % G;
                lv = lse[((size_t)b * H + h) * T_ + t];
                dvv = dsum[((size_t)b * H + h) * T_ + t];
            }
            sL[ii] = lv;
            sD[ii] = dvv;
        }
        __syncthreads();
        const int nq = min(BQ, R - q0);
#pragma unroll
        for (int u = 0; u < KPW; ++u) {
            const int jj = warp * KPW + u, key = j0 + jj;
            if (key < S) {  // uniform over the warp
                const int r = q0 + lane;
                T p = T(0), ds = T(0);
                if (lane < nq && (long long)key <= p0 + r / G) {
                    T s = T(0), dp = T(0);
                    for (int d = 0; d < hd; ++d) {
                        s += sQ[lane][d] * sK[jj][d];
                        dp += sdO[lane][d] * sV[jj][d];
                    }
                    p = ml_exp(s * scale - sL[lane]);
                    ds = p * (dp - sD[lane]);
                }
                for (int i = 0; i < nq; ++i) {
                    const T pb = __shfl_sync(ML_FULL_MASK, p, i);
                    const T db = __shfl_sync(ML_FULL_MASK, ds, i);
#pragma unroll
                    for (int c = 0; c < ML_DPL; ++c) {
                        const int d = lane + 32 * c;
                        if (d < hd) {
                            dv_a[u][c] += pb * sdO[i][d];
                            dk_a[u][c] += db * sQ[i][d];
                        }
                    }
                }
            }
        }
    }

#pragma unroll
    for (int u = 0; u < KPW; ++u) {
        const int key = j0 + warp * KPW + u;
        if (key < S) {
            const size_t off = (((size_t)b * S + key) * KVH + kvh) * hd;
#pragma unroll
            for (int c = 0; c < ML_DPL; ++c) {
                const int d = lane + 32 * c;
                if (d < hd) {
                    dk[off + d] = dk_a[u][c] * scale;
                    dv[off + d] = dv_a[u][c];
                }
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// Decode: one query (T = 1) per sequence against the cache. grid (B KVH, ceil(G / GMAX)),
// block 32 DEC_WARPS. Warp w takes keys w, w + DEC_WARPS, ... (lanes across hd, coalesced) and
// keeps an online softmax per head; the warps' partial (m, l, o) are merged at the end.
// Writes out (B, 1, H, hd) and lse (B, H, 1) like the forward, so the backward applies as is.
// ------------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(32 * DEC_WARPS)
attn_decode(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
            T* __restrict__ out, T* __restrict__ lse, const long long* __restrict__ start,
            long long start_scalar, int use_arr, int S, int H, int KVH, int hd, long long kv_bs,
            T scale) {
    constexpr int GMAX = AttnCfg<T>::GMAX;
    __shared__ T sQ[GMAX][ML_MAXD];
    __shared__ T sO[DEC_WARPS][GMAX][ML_MAXD];
    __shared__ T sM[DEC_WARPS][GMAX];
    __shared__ T sLs[DEC_WARPS][GMAX];
    const int G = H / KVH;
    const int b = blockIdx.x / KVH, kvh = blockIdx.x % KVH;
    const int g0 = blockIdx.y * GMAX;
    const int ng = min(GMAX, G - g0);
    const long long p0 = attn_start(start, start_scalar, use_arr, b);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const T NEG = ml_neg_inf<T>();

    for (int e = threadIdx.x; e < GMAX * hd; e += blockDim.x) {
        const int gg = e / hd, d = e % hd;
        sQ[gg][d] = gg < ng ? q[((size_t)b * H + kvh * G + g0 + gg) * hd + d] * scale : T(0);
    }
    __syncthreads();
    T m[GMAX], l[GMAX], o[GMAX][ML_DPL];
#pragma unroll
    for (int gg = 0; gg < GMAX; ++gg) {
        m[gg] = NEG;
        l[gg] = T(0);
#pragma unroll
        for (int c = 0; c < ML_DPL; ++c) o[gg][c] = T(0);
    }
    const long long kend_ll = p0 + 1;
    const int kend = (int)(kend_ll < (long long)S ? kend_ll : (long long)S);
    for (int j = warp; j < kend; j += DEC_WARPS) {
        const T* kr = k + (size_t)b * kv_bs + ((size_t)j * KVH + kvh) * hd;
        const T* vr = v + (size_t)b * kv_bs + ((size_t)j * KVH + kvh) * hd;
        T kk[ML_DPL], vv[ML_DPL];
#pragma unroll
        for (int c = 0; c < ML_DPL; ++c) {
            const int d = lane + 32 * c;
            kk[c] = d < hd ? kr[d] : T(0);
            vv[c] = d < hd ? vr[d] : T(0);
        }
#pragma unroll
        for (int gg = 0; gg < GMAX; ++gg) {
            if (gg < ng) {
                T part = T(0);
#pragma unroll
                for (int c = 0; c < ML_DPL; ++c) {
                    const int d = lane + 32 * c;
                    if (d < hd) part += sQ[gg][d] * kk[c];
                }
                const T s = warp_sum(part);
                const T m_new = ml_max(m[gg], s);
                const T alpha = ml_exp(m[gg] - m_new);
                const T p = ml_exp(s - m_new);
                l[gg] = l[gg] * alpha + p;
                m[gg] = m_new;
#pragma unroll
                for (int c = 0; c < ML_DPL; ++c) o[gg][c] = o[gg][c] * alpha + p * vv[c];
            }
        }
    }
#pragma unroll
    for (int gg = 0; gg < GMAX; ++gg) {
        if (lane == 0) {
            sM[warp][gg] = m[gg];
            sLs[warp][gg] = l[gg];
        }
#pragma unroll
        for (int c = 0; c < ML_DPL; ++c) {
            const int d = lane + 32 * c;
            if (d < hd) sO[warp][gg][d] = o[gg][c];
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < ng * hd; e += blockDim.x) {
        const int gg = e / hd, d = e % hd;
        T mx = NEG;
        for (int w = 0; w < DEC_WARPS; ++w) mx = ml_max(mx, sM[w][gg]);
        T lsum = T(0), acc = T(0);
        for (int w = 0; w < DEC_WARPS; ++w) {
            const T f = sM[w][gg] == NEG ? T(0) : ml_exp(sM[w][gg] - mx);
            lsum += sLs[w][gg] * f;
            acc += sO[w][gg][d] * f;
        }
        const int h = kvh * G + g0 + gg;
        out[((size_t)b * H + h) * hd + d] = acc / lsum;
        if (d == 0) lse[(size_t)b * H + h] = mx + ml_log(lsum);
    }
}
