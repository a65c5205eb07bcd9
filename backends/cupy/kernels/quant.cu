// Linear layers with GGML block-quantized weights: y[m, n] = sum_k x[m, k] W[n, k].
//
// W (N, K) is kept as its file's blocks, row after row (row n is K / values-per-block blocks):
//   Q8_0, 34 bytes for 32 values:  fp16 d, int8 q[32];                W = d q
//   Q4_K, 144 bytes for 256 values: fp16 d, fp16 dmin, 12 bytes holding eight 6-bit scales sc_j
//         and mins m_j (one pair per sub-block j of 32 values), 128 bytes of 4-bit q;
//                                                                     W = d sc_j q - dmin m_j
//   In a Q4_K block, byte 32 c + l of q (c = 0..3, l = 0..31) holds value 64 c + l in its low
//   nibble (sub-block 2 c) and value 64 c + 32 + l in its high nibble (sub-block 2 c + 1).
// fp16 fields are read byte by byte (little-endian): blocks are not 2-byte aligned.
//
// *_matvec: few rows of x (decode). One warp per (output row n, input row m): the 32 lanes read
//   one block together (consecutive bytes, coalesced), multiply by x in T, and the warp sums.
// *_dequant: W as T (N, K), for prefill: dequantize once, then one cuBLAS GEMM.
// KERNELS: q8_0_matvec q4_k_matvec q8_0_dequant q4_k_dequant
#include "common.cu"

#define ML_Q8_0_BYTES 34
#define ML_Q4_K_BYTES 144
#define ML_QUANT_WARPS 4  // warps (output rows) per block of the matvec kernels

// IEEE half (as two little-endian bytes) to float
__device__ __forceinline__ float ml_half_at(const unsigned char* p) {
    const unsigned h = (unsigned)p[0] | ((unsigned)p[1] << 8);
    const unsigned sign = (h & 0x8000u) << 16, e = (h >> 10) & 31u, man = h & 1023u;
    float v;
    if (e == 0) {
        v = (float)man * 5.9604644775390625e-08f;  // subnormal: man 2^-24
        return sign ? -v : v;
    }
    if (e == 31) return __uint_as_float(sign | 0x7f800000u | (man << 13));  // inf / nan
    return __uint_as_float(sign | ((e + 112u) << 23) | (man << 13));
}

// scale and min of sub-block j (0..7) from the 12 packed bytes s of a Q4_K block
__device__ __forceinline__ void ml_q4k_scale_min(const unsigned char* s, int j, float& sc,
                                                 float& mn) {
    if (j < 4) {
        sc = (float)(s[j] & 63);
        mn = (float)(s[j + 4] & 63);
    } else {
        sc = (float)((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
        mn = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

// grid (ceil(N / ML_QUANT_WARPS), M), block 32 * ML_QUANT_WARPS
template <typename T>
__global__ void q8_0_matvec(const unsigned char* __restrict__ w, const T* __restrict__ x,
                            T* __restrict__ y, int N, int K) {
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * ML_QUANT_WARPS + (threadIdx.x >> 5), m = blockIdx.y;
    if (n >= N) return;  // the whole warp leaves together
    const int nb = K / 32;
    const unsigned char* row = w + (long long)n * nb * ML_Q8_0_BYTES;
    const T* xm = x + (long long)m * K;
    T acc = T(0);
    for (int b = 0; b < nb; ++b) {
        const unsigned char* blk = row + b * ML_Q8_0_BYTES;
        const T d = (T)ml_half_at(blk);
        acc += d * (T)(signed char)blk[2 + lane] * xm[b * 32 + lane];
    }
    acc = warp_sum(acc);
    if (lane == 0) y[(long long)m * N + n] = acc;
}

// grid (ceil(N / ML_QUANT_WARPS), M), block 32 * ML_QUANT_WARPS
template <typename T>
__global__ void q4_k_matvec(const unsigned char* __restrict__ w, const T* __restrict__ x,
                            T* __restrict__ y, int N, int K) {
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * ML_QUANT_WARPS + (threadIdx.x >> 5), m = blockIdx.y;
    if (n >= N) return;
    const int nb = K / 256;
    const unsigned char* row = w + (long long)n * nb * ML_Q4_K_BYTES;
    const T* xm = x + (long long)m * K;
    T acc = T(0);
    for (int b = 0; b < nb; ++b) {
        const unsigned char* blk = row + b * ML_Q4_K_BYTES;
        const float d = ml_half_at(blk), dmin = ml_half_at(blk + 2);
        const unsigned char* q = blk + 16;
        const T* xb = xm + b * 256;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            float sc0, m0, sc1, m1;
            ml_q4k_scale_min(blk + 4, 2 * c, sc0, m0);
            ml_q4k_scale_min(blk + 4, 2 * c + 1, sc1, m1);
            const unsigned byte = q[32 * c + lane];
            const T lo = (T)(d * sc0 * (float)(byte & 15u) - dmin * m0);
            const T hi = (T)(d * sc1 * (float)(byte >> 4) - dmin * m1);
            acc += lo * xb[64 * c + lane] + hi * xb[64 * c + 32 + lane];
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) y[(long long)m * N + n] = acc;
}

// out (N, K) = W; grid-stride over the N K elements
template <typename T>
__global__ void q8_0_dequant(const unsigned char* __restrict__ w, T* __restrict__ out, int N,
                             int K) {
    const long long total = (long long)N * K;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long n = i / K;
        const int k = (int)(i - n * K);
        const unsigned char* blk = w + (n * (K / 32) + k / 32) * ML_Q8_0_BYTES;
        out[i] = (T)(ml_half_at(blk) * (float)(signed char)blk[2 + k % 32]);
    }
}

template <typename T>
__global__ void q4_k_dequant(const unsigned char* __restrict__ w, T* __restrict__ out, int N,
                             int K) {
    const long long total = (long long)N * K;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long n = i / K;
        const int k = (int)(i - n * K);
        const unsigned char* blk = w + (n * (K / 256) + k / 256) * ML_Q4_K_BYTES;
        const int r = k % 256, c = r / 64, hi = (r % 64) >= 32, l = r % 32;
        float sc, mn;
        ml_q4k_scale_min(blk + 4, 2 * c + hi, sc, mn);
        const unsigned byte = blk[16 + 32 * c + l];
        const float q = (float)(hi ? (byte >> 4) : (byte & 15u));
        out[i] = (T)(ml_half_at(blk) * sc * q - ml_half_at(blk + 2) * mn);
    }
}
