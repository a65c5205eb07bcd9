// Causal grouped-query attention on the tensor cores (float32 data, sm_80 and newer), in the
// FlashAttention-2 structure: a tile of query rows per block (16 rows per warp), K/V tiles
// streamed through shared memory, an online softmax in registers, the row log-sum-exp saved; the
// backward recomputes P tile by tile from it (dk/dv in one kernel per key tile, dq in another per
// query tile, so nothing is summed with atomics and the result does not depend on timing).
//
// Same shapes, row order and start-position rules as attention.cu (which documents them): q, out,
// dq, dout: (B, T, H, hd); k, v: (B, S, KVH, hd) with batch stride kv_bs; lse, dsum: (B, H, T);
// for one (b, kv head) the R = T G rows r = t G + g of the group share every K/V tile.
//
//   s_tj = q_t . k_j / sqrt(hd),  P = softmax_j(s),  o_t = sum_j P_tj v_j,  lse_t = log sum_j e^{s_tj}
//   dS_tj = P_tj (dO_t . v_j - D_t),  dq_t = sum_j dS_tj k_j / sqrt(hd),
//   dk_j = sum_{t, g} dS_tj q_t / sqrt(hd),  dv_j = sum_{t, g} P_tj dO_t
//
// Matrix products: mma.sync m16n8k8 with TF32 operands and float32 accumulation. SPLIT = true
// ("3xTF32") writes each operand x as hi + lo, hi = tf32(x), lo = tf32(x - hi), and adds
// a_lo b_hi + a_hi b_lo + a_hi b_hi: about float32 accuracy at three tensor-core products per
// step (the default for float32). SPLIT = false is plain TF32 (10-bit mantissa operands, about
// 1e-3 relative), the fast opt-in mode.
// Template arguments: HD the head dimension (64 or 128), SPLIT as above.
// KERNELS: flash_fwd<64,true> flash_fwd<64,false> flash_fwd<128,true> flash_fwd<128,false> flash_bwd_dq<64,true> flash_bwd_dq<64,false> flash_bwd_dq<128,true> flash_bwd_dq<128,false> flash_bwd_dkdv<64,true> flash_bwd_dkdv<64,false> flash_bwd_dkdv<128,true> flash_bwd_dkdv<128,false>
#include "common.cu"

#define FA_WARPS 4      // warps per block; each owns 16 rows (queries, or keys in dk/dv)
#define FA_BK 32        // keys per K/V tile (forward and dq)
#define FA_BQ_DKDV 16   // query rows per tile in the dk/dv kernel
#define FA_PAD 4        // floats of padding per shared-memory row (bank-conflict-free fragments)

#ifndef ML_EMULATED
#define ML_DYN_SMEM(name) extern __shared__ __align__(16) float name[]
// x rounded to TF32 (the 10-bit-mantissa operand format of the tensor cores), as raw bits
__device__ __forceinline__ unsigned ml_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}
// c (16x8) += a (16x8) b (8x8), one warp; fragment layout of the PTX ISA for m16n8k8 .tf32
// (g = lane / 4, t = lane % 4): a = A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4];
// b = B[t][g], B[t+4][g]; c = C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1]
__device__ __forceinline__ void ml_mma_tf32(float (&c)[4], const unsigned (&a)[4],
                                            const unsigned (&b)[2]) {
    asm(  // not volatile: the scheduler may interleave independent products
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

template <bool SPLIT>
__device__ __forceinline__ void fa_split(float x, unsigned& hi, unsigned& lo) {
    hi = ml_tf32(x);
    lo = SPLIT ? ml_tf32(x - __uint_as_float(hi)) : 0u;
}

// A fragment of the 16 x 8 block of A (row-major, stride lda) starting at column k0
template <bool SPLIT>
__device__ __forceinline__ void fa_load_a(const float* A, int lda, int k0, unsigned (&ah)[4],
                                          unsigned (&al)[4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    fa_split<SPLIT>(A[g * lda + k0 + t], ah[0], al[0]);
    fa_split<SPLIT>(A[(g + 8) * lda + k0 + t], ah[1], al[1]);
    fa_split<SPLIT>(A[g * lda + k0 + t + 4], ah[2], al[2]);
    fa_split<SPLIT>(A[(g + 8) * lda + k0 + t + 4], ah[3], al[3]);
}

// c[j] += a b[j] for NB independent products (the three 3xTF32 passes interleaved over j, so
// no product waits on the one before it; small terms first)
template <int NB, bool SPLIT>
__device__ __forceinline__ void fa_mma_group(float (&c)[NB][4], const unsigned (&ah)[4],
                                             const unsigned (&al)[4], const unsigned (&bh)[NB][2],
                                             const unsigned (&bl)[NB][2]) {
    if (SPLIT) {
#pragma unroll
        for (int j = 0; j < NB; ++j) ml_mma_tf32(c[j], al, bh[j]);
#pragma unroll
        for (int j = 0; j < NB; ++j) ml_mma_tf32(c[j], ah, bl[j]);
    }
#pragma unroll
    for (int j = 0; j < NB; ++j) ml_mma_tf32(c[j], ah, bh[j]);
}

// acc (16 x 8NT) += A (16 x 8KS, row-major, stride lda) B, with B[k][n] = Bt[n ldb + k]
// (a short sum over k: accumulated in place)
template <int KS, int NT, bool SPLIT>
__device__ __forceinline__ void fa_mma_nt(float (&acc)[NT][4], const float* A, int lda,
                                          const float* Bt, int ldb) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll 2  // (unrolled further, head dimension 128 with 3xTF32 spills registers)
    for (int ks = 0; ks < KS; ++ks) {
        unsigned ah[4], al[4], bh[NT][2], bl[NT][2];
        fa_load_a<SPLIT>(A, lda, ks * 8, ah, al);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const float* b = Bt + (n * 8 + g) * ldb + ks * 8;
            fa_split<SPLIT>(b[t], bh[n][0], bl[n][0]);
            fa_split<SPLIT>(b[t + 4], bh[n][1], bl[n][1]);
        }
        fa_mma_group<NT, SPLIT>(acc, ah, al, bh, bl);
    }
}

// acc (16 x 8NT) += A (16 x 8KS, row-major, stride lda) B, with B[k][n] = Bm[k ldb + n].
// The tile's product is formed in fresh registers and then added to acc with an ordinary
// (round-to-nearest) float add: the tensor cores' accumulation truncates, which over thousands
// of tiles (dk, dv summed over every query row) would drift by ~1e-4 relative.
template <int KS, int NT, bool SPLIT>
__device__ __forceinline__ void fa_mma_nn(float (&acc)[NT][4], const float* A, int lda,
                                          const float* Bm, int ldb) {
    // n-tiles per group (independent accumulators in flight); fewer when registers are short
    constexpr int NG = 4;
    static_assert(NT % NG == 0, "NT must be a multiple of NG");
    // A's fragments are loaded once, except with 3xTF32 and 16 n-tiles (head dimension 128),
    // where keeping them would spill registers: then they are reloaded per group
    constexpr bool KEEP_A = !(SPLIT && NT >= 16);
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    unsigned ah[KEEP_A ? KS : 1][4], al[KEEP_A ? KS : 1][4];
    if constexpr (KEEP_A) {
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) fa_load_a<SPLIT>(A, lda, ks * 8, ah[ks], al[ks]);
    }
#pragma unroll
    for (int n0 = 0; n0 < NT; n0 += NG) {
        float tmp[NG][4];
#pragma unroll
        for (int j = 0; j < NG; ++j) tmp[j][0] = tmp[j][1] = tmp[j][2] = tmp[j][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            unsigned bh[NG][2], bl[NG][2];
#pragma unroll
            for (int j = 0; j < NG; ++j) {
                const float* b = Bm + (ks * 8 + t) * ldb + (n0 + j) * 8 + g;
                fa_split<SPLIT>(b[0], bh[j][0], bl[j][0]);
                fa_split<SPLIT>(b[4 * ldb], bh[j][1], bl[j][1]);
            }
            if constexpr (KEEP_A) {
                fa_mma_group<NG, SPLIT>(tmp, ah[ks], al[ks], bh, bl);
            } else {
                fa_load_a<SPLIT>(A, lda, ks * 8, ah[0], al[0]);
                fa_mma_group<NG, SPLIT>(tmp, ah[0], al[0], bh, bl);
            }
        }
#pragma unroll
        for (int j = 0; j < NG; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[n0 + j][e] += tmp[j][e];
    }
}

__device__ __forceinline__ long long fa_start(const long long* start, long long start_scalar,
                                              int use_arr, int b) {
    return use_arr ? start[b] : start_scalar;
}

// rows [r0, r0 + n) of one (b, kv head) group of q-like (B, T, H, hd) data into s (stride ld),
// times mul; rows past R are zero. 16-byte loads and stores (HD and ld multiples of 4; the
// caller checks that the arrays are 16-byte aligned).
template <int HD>
__device__ __forceinline__ void fa_load_rows(float* s, int ld, const float* __restrict__ x, int b,
                                             int kvh, int r0, int n, int R, int G, int T_, int H,
                                             float mul) {
    constexpr int V = HD / 4;
    for (int e = threadIdx.x; e < n * V; e += blockDim.x) {
        const int rr = e / V, d = (e % V) * 4, r = r0 + rr;
        float4 val = make_float4(0.f, 0.f, 0.f, 0.f);
        if (r < R) {
            const int t = r / G, gg = r % G;
            val = *reinterpret_cast<const float4*>(
                x + (((size_t)b * T_ + t) * H + kvh * G + gg) * HD + d);
            val.x *= mul;
            val.y *= mul;
            val.z *= mul;
            val.w *= mul;
        }
        *reinterpret_cast<float4*>(s + rr * ld + d) = val;
    }
}

// keys [j0, j0 + n) of one (b, kv head) of k-like data (batch stride kv_bs) into s (stride ld);
// keys at or past kend are zero
template <int HD>
__device__ __forceinline__ void fa_load_keys(float* s, int ld, const float* __restrict__ x, int b,
                                             int kvh, int j0, int n, int kend, int KVH,
                                             long long kv_bs) {
    constexpr int V = HD / 4;
    for (int e = threadIdx.x; e < n * V; e += blockDim.x) {
        const int jj = e / V, d = (e % V) * 4, key = j0 + jj;
        float4 val = make_float4(0.f, 0.f, 0.f, 0.f);
        if (key < kend)
            val = *reinterpret_cast<const float4*>(
                x + (size_t)b * kv_bs + ((size_t)key * KVH + kvh) * HD + d);
        *reinterpret_cast<float4*>(s + jj * ld + d) = val;
    }
}

// ------------------------------------------------------------------------------------------
// Forward. grid (ceil(R / (16 FA_WARPS)), B KVH), block 32 FA_WARPS, dynamic shared memory
// (16 FA_WARPS + FA_BK) (HD + FA_PAD) + FA_BK (HD + 2 FA_PAD) + FA_WARPS 16 (FA_BK + FA_PAD) floats.
// ------------------------------------------------------------------------------------------
template <int HD, bool SPLIT>
__global__ void __launch_bounds__(32 * FA_WARPS, 1)
flash_fwd(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
          float* __restrict__ out, float* __restrict__ lse, const long long* __restrict__ start,
          long long start_scalar, int use_arr, int T_, int S, int H, int KVH, long long kv_bs,
          float scale) {
    constexpr int BQ = 16 * FA_WARPS, BK = FA_BK;
    constexpr int LQ = HD + FA_PAD, LV = HD + 2 * FA_PAD, LP = BK + FA_PAD;
    ML_DYN_SMEM(smem);
    float* sQ = smem;
    float* sK = sQ + BQ * LQ;
    float* sV = sK + BK * LQ;
    float* sP = sV + BK * LV;
    const int G = H / KVH;
    const int b = blockIdx.y / KVH, kvh = blockIdx.y % KVH;
    const int R = T_ * G;
    const int r0 = blockIdx.x * BQ;
    if (r0 >= R) return;
    const long long p0 = fa_start(start, start_scalar, use_arr, b);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float NEG = ml_neg_inf<float>();
    float* sPw = sP + warp * 16 * LP;

    fa_load_rows<HD>(sQ, LQ, q, b, kvh, r0, BQ, R, G, T_, H, scale);
    // the two rows of this thread: ra = r0 + 16 warp + g and rb = ra + 8 (lim -1: padding row)
    const int ra = r0 + warp * 16 + g, rb = ra + 8;
    const long long lim_a = ra < R ? p0 + ra / G : -1, lim_b = rb < R ? p0 + rb / G : -1;

    float m_a = NEG, m_b = NEG, l_a = 0.f, l_b = 0.f;
    float o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

    const int r_last = min(r0 + BQ, R) - 1;
    const long long kend_ll = p0 + r_last / G + 1;
    const int kend = (int)(kend_ll < (long long)S ? kend_ll : (long long)S);

    for (int k0 = 0; k0 < kend; k0 += BK) {
        __syncthreads();  // the previous tile is used up (and sQ written, on the first pass)
        fa_load_keys<HD>(sK, LQ, k, b, kvh, k0, BK, kend, KVH, kv_bs);
        fa_load_keys<HD>(sV, LV, v, b, kvh, k0, BK, kend, KVH, kv_bs);
        __syncthreads();
        float s[BK / 8][4];
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
        fa_mma_nt<HD / 8, BK / 8, SPLIT>(s, sQ + warp * 16 * LQ, LQ, sK, LQ);
        float mx_a = NEG, mx_b = NEG;
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const long long key = k0 + n * 8 + 2 * t + (e & 1);
                const bool vis = key < kend && key <= (e < 2 ? lim_a : lim_b);
                s[n][e] = vis ? s[n][e] : NEG;
            }
            mx_a = ml_max(mx_a, ml_max(s[n][0], s[n][1]));
            mx_b = ml_max(mx_b, ml_max(s[n][2], s[n][3]));
        }
        mx_a = ml_max(mx_a, __shfl_xor_sync(ML_FULL_MASK, mx_a, 1));
        mx_a = ml_max(mx_a, __shfl_xor_sync(ML_FULL_MASK, mx_a, 2));
        mx_b = ml_max(mx_b, __shfl_xor_sync(ML_FULL_MASK, mx_b, 1));
        mx_b = ml_max(mx_b, __shfl_xor_sync(ML_FULL_MASK, mx_b, 2));
        const float mn_a = ml_max(m_a, mx_a), mn_b = ml_max(m_b, mx_b);
        // a row that has seen nothing yet keeps m = -inf: use 0 as its shift (all p are 0)
        const float sh_a = mn_a == NEG ? 0.f : mn_a, sh_b = mn_b == NEG ? 0.f : mn_b;
        const float al_a = ml_exp(m_a - sh_a), al_b = ml_exp(m_b - sh_b);
        m_a = mn_a;
        m_b = mn_b;
        float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) {
            const float p0a = ml_exp(s[n][0] - sh_a), p1a = ml_exp(s[n][1] - sh_a);
            const float p0b = ml_exp(s[n][2] - sh_b), p1b = ml_exp(s[n][3] - sh_b);
            sum_a += p0a + p1a;
            sum_b += p0b + p1b;
            sPw[g * LP + n * 8 + 2 * t] = p0a;
            sPw[g * LP + n * 8 + 2 * t + 1] = p1a;
            sPw[(g + 8) * LP + n * 8 + 2 * t] = p0b;
            sPw[(g + 8) * LP + n * 8 + 2 * t + 1] = p1b;
        }
        sum_a += __shfl_xor_sync(ML_FULL_MASK, sum_a, 1);
        sum_a += __shfl_xor_sync(ML_FULL_MASK, sum_a, 2);
        sum_b += __shfl_xor_sync(ML_FULL_MASK, sum_b, 1);
        sum_b += __shfl_xor_sync(ML_FULL_MASK, sum_b, 2);
        l_a = l_a * al_a + sum_a;
        l_b = l_b * al_b + sum_b;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
            o[n][0] *= al_a;
            o[n][1] *= al_a;
            o[n][2] *= al_b;
            o[n][3] *= al_b;
        }
        __syncwarp();
        fa_mma_nn<BK / 8, HD / 8, SPLIT>(o, sPw, LP, sV, LV);
        __syncwarp();  // sPw is read before the next tile overwrites it
    }

#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = half ? rb : ra;
        if (r < R) {
            const int tt = r / G, h = kvh * G + r % G;
            const float l = half ? l_b : l_a, m = half ? m_b : m_a;
            const float inv = 1.f / l;
            float* orow = out + (((size_t)b * T_ + tt) * H + h) * HD;
#pragma unroll
            for (int n = 0; n < HD / 8; ++n) {
                orow[n * 8 + 2 * t] = o[n][2 * half] * inv;
                orow[n * 8 + 2 * t + 1] = o[n][2 * half + 1] * inv;
            }
            if (t == 0) lse[((size_t)b * H + h) * T_ + tt] = m + ml_log(l);
        }
    }
}

// ------------------------------------------------------------------------------------------
// Backward, dq. Tiling of the forward: grid (ceil(R / (16 FA_WARPS)), B KVH), block 32 FA_WARPS,
// dynamic shared memory 2 (16 FA_WARPS + FA_BK) (HD + FA_PAD) + FA_WARPS 16 (FA_BK + FA_PAD)
// floats. dsum (B, H, T) holds D_t = dO_t . o_t (attn_bwd_dsum of attention.cu).
// ------------------------------------------------------------------------------------------
template <int HD, bool SPLIT>
__global__ void __launch_bounds__(32 * FA_WARPS, 1)
flash_bwd_dq(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
             const float* __restrict__ dout, const float* __restrict__ lse,
             const float* __restrict__ dsum, float* __restrict__ dq,
             const long long* __restrict__ start, long long start_scalar, int use_arr, int T_,
             int S, int H, int KVH, long long kv_bs, float scale) {
    constexpr int BQ = 16 * FA_WARPS, BK = FA_BK;
    constexpr int LQ = HD + FA_PAD, LP = BK + FA_PAD;
    ML_DYN_SMEM(smem);
    float* sQ = smem;
    float* sdO = sQ + BQ * LQ;
    float* sK = sdO + BQ * LQ;
    float* sV = sK + BK * LQ;
    float* sS = sV + BK * LQ;
    const int G = H / KVH;
    const int b = blockIdx.y / KVH, kvh = blockIdx.y % KVH;
    const int R = T_ * G;
    const int r0 = blockIdx.x * BQ;
    if (r0 >= R) return;
    const long long p0 = fa_start(start, start_scalar, use_arr, b);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float* sSw = sS + warp * 16 * LP;

    fa_load_rows<HD>(sQ, LQ, q, b, kvh, r0, BQ, R, G, T_, H, scale);
    fa_load_rows<HD>(sdO, LQ, dout, b, kvh, r0, BQ, R, G, T_, H, 1.f);
    const int ra = r0 + warp * 16 + g, rb = ra + 8;
    const long long lim_a = ra < R ? p0 + ra / G : -1, lim_b = rb < R ? p0 + rb / G : -1;
    float L_a = 0.f, L_b = 0.f, D_a = 0.f, D_b = 0.f;
    if (ra < R) {
        const size_t i = ((size_t)b * H + kvh * G + ra % G) * T_ + ra / G;
        L_a = lse[i];
        D_a = dsum[i];
    }
    if (rb < R) {
        const size_t i = ((size_t)b * H + kvh * G + rb % G) * T_ + rb / G;
        L_b = lse[i];
        D_b = dsum[i];
    }
    float acc[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

    const int r_last = min(r0 + BQ, R) - 1;
    const long long kend_ll = p0 + r_last / G + 1;
    const int kend = (int)(kend_ll < (long long)S ? kend_ll : (long long)S);

    for (int k0 = 0; k0 < kend; k0 += BK) {
        __syncthreads();
        fa_load_keys<HD>(sK, LQ, k, b, kvh, k0, BK, kend, KVH, kv_bs);
        fa_load_keys<HD>(sV, LQ, v, b, kvh, k0, BK, kend, KVH, kv_bs);
        __syncthreads();
        float s[BK / 8][4], dp[BK / 8][4];
#pragma unroll
        for (int n = 0; n < BK / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
        fa_mma_nt<HD / 8, BK / 8, SPLIT>(s, sQ + warp * 16 * LQ, LQ, sK, LQ);
        fa_mma_nt<HD / 8, BK / 8, SPLIT>(dp, sdO + warp * 16 * LQ, LQ, sV, LQ);
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const long long key = k0 + n * 8 + 2 * t + (e & 1);
                const bool vis = key < kend && key <= (e < 2 ? lim_a : lim_b);
                const float p = vis ? ml_exp(s[n][e] - (e < 2 ? L_a : L_b)) : 0.f;
                const float ds = p * (dp[n][e] - (e < 2 ? D_a : D_b));
                sSw[(g + 8 * (e >> 1)) * LP + n * 8 + 2 * t + (e & 1)] = ds;
            }
        }
        __syncwarp();
        fa_mma_nn<BK / 8, HD / 8, SPLIT>(acc, sSw, LP, sK, LQ);
        __syncwarp();
    }

#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = half ? rb : ra;
        if (r < R) {
            float* row = dq + (((size_t)b * T_ + r / G) * H + kvh * G + r % G) * HD;
#pragma unroll
            for (int n = 0; n < HD / 8; ++n) {
                row[n * 8 + 2 * t] = acc[n][2 * half] * scale;
                row[n * 8 + 2 * t + 1] = acc[n][2 * half + 1] * scale;
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// Backward, dk and dv. grid (ceil(S / (16 FA_WARPS)), B KVH), block 32 FA_WARPS: a block owns
// 16 FA_WARPS keys (16 per warp) and walks every query row r = t G + g of the group that can see
// them, FA_BQ_DKDV rows at a time, so the heads of a group are summed without atomics. With
// gridDim.z > 1 (few key blocks: GQA/MQA, small batches) block z takes rows [z r_chunk,
// (z + 1) r_chunk) and writes partial sums to dk/dv + z B S KVH HD, which the caller adds in a
// fixed order. Dynamic
// shared memory 2 (16 FA_WARPS + FA_BQ_DKDV) (HD + FA_PAD) + 2 FA_WARPS 16 (FA_BQ_DKDV + FA_PAD)
// + 2 FA_BQ_DKDV floats.
// ------------------------------------------------------------------------------------------
// One walk over the query rows of this block's share, accumulating dV (DO_DV) and/or dK
// (DO_DK) for the warp's 16 keys, then writing them. sK/sV hold the block's keys.
template <int HD, bool SPLIT, bool DO_DV, bool DO_DK>
__device__ __forceinline__ void fa_dkdv_pass(
        float* smem, const float* __restrict__ q, const float* __restrict__ dout,
        const float* __restrict__ lse, const float* __restrict__ dsum, float* __restrict__ dk,
        float* __restrict__ dv, long long p0, int b, int kvh, int j0, int r_begin, int r_hi,
        int T_, int S, int H, int KVH, int G, float scale) {
    constexpr int KEYS = 16 * FA_WARPS, BQ = FA_BQ_DKDV;
    constexpr int LQ = HD + FA_PAD, LP = BQ + FA_PAD;
    float* sK = smem;
    float* sV = sK + KEYS * LQ;
    float* sQ = sV + KEYS * LQ;
    float* sdO = sQ + BQ * LQ;
    float* sP = sdO + BQ * LQ;
    float* sdS = sP + FA_WARPS * 16 * LP;
    float* sL = sdS + FA_WARPS * 16 * LP;
    float* sD = sL + BQ;
    const int R = T_ * G;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float* sPw = sP + warp * 16 * LP;
    float* sdSw = sdS + warp * 16 * LP;
    const int key_a = j0 + warp * 16 + g, key_b = key_a + 8;  // the two keys of this thread

    float acc_v[DO_DV ? HD / 8 : 1][4], acc_k[DO_DK ? HD / 8 : 1][4];
#pragma unroll
    for (int n = 0; n < (DO_DV ? HD / 8 : 1); ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_v[n][e] = 0.f;
#pragma unroll
    for (int n = 0; n < (DO_DK ? HD / 8 : 1); ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_k[n][e] = 0.f;

    for (int q0 = r_begin; q0 < r_hi; q0 += BQ) {
        __syncthreads();  // sK/sV loaded (first pass), or the previous query tile used up
        fa_load_rows<HD>(sQ, LQ, q, b, kvh, q0, BQ, R, G, T_, H, scale);
        fa_load_rows<HD>(sdO, LQ, dout, b, kvh, q0, BQ, R, G, T_, H, 1.f);
        for (int i = threadIdx.x; i < BQ; i += blockDim.x) {
            const int r = q0 + i;
            float lv = 0.f, dvv = 0.f;
            if (r < R) {
                const size_t idx = ((size_t)b * H + kvh * G + r % G) * T_ + r / G;
                lv = lse[idx];
                dvv = dsum[idx];
            }
            sL[i] = lv;
            sD[i] = dvv;
        }
        __syncthreads();
        float st[BQ / 8][4], dpt[BQ / 8][4];
#pragma unroll
        for (int n = 0; n < BQ / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.f;
        // S^T (16 keys x BQ rows) = K_w Q^T and dP^T = V_w dO^T
        fa_mma_nt<HD / 8, BQ / 8, SPLIT>(st, sK + warp * 16 * LQ, LQ, sQ, LQ);
        if constexpr (DO_DK) fa_mma_nt<HD / 8, BQ / 8, SPLIT>(dpt, sV + warp * 16 * LQ, LQ, sdO, LQ);
#pragma unroll
        for (int n = 0; n < BQ / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c = n * 8 + 2 * t + (e & 1), r = q0 + c;
                const int key = e < 2 ? key_a : key_b;
                const bool vis = r < r_hi && key < S && (long long)key <= p0 + r / G;
                const float p = vis ? ml_exp(st[n][e] - sL[c]) : 0.f;
                const int at = (g + 8 * (e >> 1)) * LP + c;
                if (DO_DV) sPw[at] = p;
                if (DO_DK) sdSw[at] = p * (dpt[n][e] - sD[c]);
            }
        }
        __syncwarp();
        if constexpr (DO_DV) fa_mma_nn<BQ / 8, HD / 8, SPLIT>(acc_v, sPw, LP, sdO, LQ);   // dV += P^T dO
        if constexpr (DO_DK) fa_mma_nn<BQ / 8, HD / 8, SPLIT>(acc_k, sdSw, LP, sQ, LQ);   // dK += dS^T Q s
        __syncwarp();
    }

#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int key = half ? key_b : key_a;
        if (key < S) {  // share z writes its partial sums at dk/dv + z B S KVH HD
            const size_t off = (((size_t)(blockIdx.z * (gridDim.y / KVH) + b) * S + key) * KVH
                                + kvh) * HD;
#pragma unroll
            for (int n = 0; n < HD / 8; ++n) {
                if (DO_DK) {
                    dk[off + n * 8 + 2 * t] = acc_k[DO_DK ? n : 0][2 * half];
                    dk[off + n * 8 + 2 * t + 1] = acc_k[DO_DK ? n : 0][2 * half + 1];
                }
                if (DO_DV) {
                    dv[off + n * 8 + 2 * t] = acc_v[DO_DV ? n : 0][2 * half];
                    dv[off + n * 8 + 2 * t + 1] = acc_v[DO_DV ? n : 0][2 * half + 1];
                }
            }
        }
    }
}

template <int HD, bool SPLIT>
__global__ void __launch_bounds__(32 * FA_WARPS, 1)
flash_bwd_dkdv(const float* __restrict__ q, const float* __restrict__ k,
               const float* __restrict__ v, const float* __restrict__ dout,
               const float* __restrict__ lse, const float* __restrict__ dsum,
               float* __restrict__ dk, float* __restrict__ dv,
               const long long* __restrict__ start, long long start_scalar, int use_arr, int T_,
               int S, int H, int KVH, long long kv_bs, float scale, int r_chunk) {
    constexpr int KEYS = 16 * FA_WARPS;
    constexpr int LQ = HD + FA_PAD;
    ML_DYN_SMEM(smem);
    const int G = H / KVH;
    const int b = blockIdx.y / KVH, kvh = blockIdx.y % KVH;
    const int R = T_ * G;
    const int j0 = blockIdx.x * KEYS;
    if (j0 >= S) return;
    const long long p0 = fa_start(start, start_scalar, use_arr, b);
    fa_load_keys<HD>(smem, LQ, k, b, kvh, j0, KEYS, S, KVH, kv_bs);
    fa_load_keys<HD>(smem + KEYS * LQ, LQ, v, b, kvh, j0, KEYS, S, KVH, kv_bs);
    // the first query position that can see key j0 is t = j0 - p0
    long long t_min = (long long)j0 - p0;
    if (t_min < 0) t_min = 0;
    const long long r_begin_ll = t_min * G;
    // this block's share of the rows: [z r_chunk, (z + 1) r_chunk) (r_chunk a multiple of BQ)
    const int r_lo = blockIdx.z * r_chunk, r_hi = min(R, r_lo + r_chunk);
    const int r_begin = max(r_lo, (int)(r_begin_ll < (long long)R ? r_begin_ll : (long long)R));
    if constexpr (SPLIT && HD >= 128) {  // dV, then dK: both accumulators at once would spill registers
        fa_dkdv_pass<HD, SPLIT, true, false>(smem, q, dout, lse, dsum, dk, dv, p0, b, kvh, j0,
                                             r_begin, r_hi, T_, S, H, KVH, G, scale);
        fa_dkdv_pass<HD, SPLIT, false, true>(smem, q, dout, lse, dsum, dk, dv, p0, b, kvh, j0,
                                             r_begin, r_hi, T_, S, H, KVH, G, scale);
    } else {
        fa_dkdv_pass<HD, SPLIT, true, true>(smem, q, dout, lse, dsum, dk, dv, p0, b, kvh, j0,
                                            r_begin, r_hi, T_, S, H, KVH, G, scale);
    }
}
