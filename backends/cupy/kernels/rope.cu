// Rotary position embedding on interleaved pairs (2i, 2i+1), forward (sign = +1) and backward
// (sign = -1, the inverse rotation):
//   y_{2i}   = x_{2i} cos - sign x_{2i+1} sin
//   y_{2i+1} = sign x_{2i} sin + x_{2i+1} cos
// x, y: (B, T, nh, hd) contiguous; y may alias x (in place: each thread reads its pair first).
// cos, sin: (T, hd/2) (cs_bstride = 0) or (B, T, hd/2) (cs_bstride = T * hd/2).
// KERNELS: rope_apply
#include "common.cu"

template <typename T>
__global__ void rope_apply(const T* x, T* y, const T* __restrict__ cos_t,
                           const T* __restrict__ sin_t, long long n_pairs, int T_, int nh,
                           int half, long long cs_bstride, T sign) {
    for (long long p = blockIdx.x * (long long)blockDim.x + threadIdx.x; p < n_pairs;
         p += (long long)gridDim.x * blockDim.x) {
        const int i = (int)(p % half);
        long long rest = p / half;
        rest /= nh;  // drop the head index
        const int t = (int)(rest % T_);
        const long long b = rest / T_;
        const long long cs = b * cs_bstride + (long long)t * half + i;
        const T c = cos_t[cs], s = sign * sin_t[cs];
        const T x0 = x[2 * p], x1 = x[2 * p + 1];
        y[2 * p] = x0 * c - x1 * s;
        y[2 * p + 1] = x0 * s + x1 * c;
    }
}
