// RMSNorm, forward and backward.
//   y = x r g,  r = 1 / sqrt(mean(x^2) + eps)                    (one block per row)
//   dx = r (u - xhat mean(u xhat)),  u = dy g,  xhat = x r       (one block per row)
//   dg = sum_rows dy xhat                                         (column partial sums)
// x, y, dy, dx: (N, D) row-major; g, dg: (D,); rstd: (N,).
// KERNELS: rmsnorm_fwd rmsnorm_bwd_dx rmsnorm_bwd_dg
#include "common.cu"

template <typename T>
__global__ void rmsnorm_fwd(const T* __restrict__ x, const T* __restrict__ g, T* __restrict__ y,
                            T* __restrict__ rstd, int N, int D, T eps) {
    const int row = blockIdx.x;
    if (row >= N) return;  // uniform over the block
    const T* xr = x + (size_t)row * D;
    T ss = T(0);
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        T a = xr[i];
        ss += a * a;
    }
    ss = block_sum(ss);
    const T r = T(1) / ml_sqrt(ss / T(D) + eps);
    if (threadIdx.x == 0) rstd[row] = r;
    T* yr = y + (size_t)row * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) yr[i] = xr[i] * r * g[i];
}

template <typename T>
__global__ void rmsnorm_bwd_dx(const T* __restrict__ dy, const T* __restrict__ x,
                               const T* __restrict__ rstd, const T* __restrict__ g,
                               T* __restrict__ dx, int N, int D) {
    const int row = blockIdx.x;
    if (row >= N) return;
    const size_t base = (size_t)row * D;
    const T r = rstd[row];
    T dot = T(0);  // sum_i dy_i g_i x_i
    for (int i = threadIdx.x; i < D; i += blockDim.x) dot += dy[base + i] * g[i] * x[base + i];
    dot = block_sum(dot);
    const T c = dot * r * r / T(D);  // mean(u xhat) * r
    for (int i = threadIdx.x; i < D; i += blockDim.x)
        dx[base + i] = r * (dy[base + i] * g[i] - x[base + i] * c);
}

// block (32, RMS_DG_ROWS); grid (ceil(D/32), P): block (cx, p) sums rows p, p+P, ... of its 32
// columns into part[p, col]; the caller adds the P partial rows (P = 1 needs no second pass).
#define RMS_DG_ROWS 8
template <typename T>
__global__ void rmsnorm_bwd_dg(const T* __restrict__ dy, const T* __restrict__ x,
                               const T* __restrict__ rstd, T* __restrict__ part, int N, int D) {
    __shared__ T acc[RMS_DG_ROWS][33];
    const int col = blockIdx.x * 32 + threadIdx.x;
    const int step = RMS_DG_ROWS * gridDim.y;
    T s = T(0);
    if (col < D) {
        for (int n = blockIdx.y * RMS_DG_ROWS + threadIdx.y; n < N; n += step) {
            const size_t o = (size_t)n * D + col;
            s += dy[o] * x[o] * rstd[n];
        }
    }
    acc[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < D) {
        T t = T(0);
#pragma unroll
        for (int k = 0; k < RMS_DG_ROWS; ++k) t += acc[k][threadIdx.x];
        part[(size_t)blockIdx.y * D + col] = t;
    }
}
