// Softmax cross-entropy with an ignore index (one block per row of logits).
// Forward:  lse_n = log sum_v e^{z_nv},  loss_n = lse_n - z_{n,y_n} (0 where y_n == ignore).
// Backward: dz_nv = scale (e^{z_nv - lse_n} - [v = y_n]) for kept rows, 0 for ignored rows,
//           with scale = dL / count read from device memory (no host round trip).
// logits, dlogits: (N, V) row-major; targets: (N,) int64; lse, loss_rows: (N,).
// A kept target outside [0, V) gives loss_n = NaN (and NaN gradients) rather than a bad read.
// KERNELS: xent_fwd xent_bwd
#include "common.cu"

template <typename T>
__global__ void xent_fwd(const T* __restrict__ logits, const long long* __restrict__ targets,
                         T* __restrict__ lse, T* __restrict__ loss_rows, int N, int V,
                         long long ignore_index) {
    const int row = blockIdx.x;
    if (row >= N) return;
    const T* z = logits + (size_t)row * V;
    T m = ml_neg_inf<T>();
    for (int i = threadIdx.x; i < V; i += blockDim.x) m = ml_max(m, z[i]);
    m = block_max(m);
    T s = T(0);
    for (int i = threadIdx.x; i < V; i += blockDim.x) s += ml_exp(z[i] - m);
    s = block_sum(s);
    if (threadIdx.x == 0) {
        const T l = m + ml_log(s);
        const long long y = targets[row];
        lse[row] = l;
        if (y == ignore_index) loss_rows[row] = T(0);
        else if (y < 0 || y >= V) loss_rows[row] = ml_nan<T>();
        else loss_rows[row] = l - z[y];
    }
}

template <typename T>
__global__ void xent_bwd(const T* __restrict__ logits, const long long* __restrict__ targets,
                         const T* __restrict__ lse, const T* __restrict__ scale_ptr,
                         T* __restrict__ dlogits, int N, int V, long long ignore_index) {
    const int row = blockIdx.x;
    if (row >= N) return;
    const long long y = targets[row];
    const size_t base = (size_t)row * V;
    if (y == ignore_index) {
        for (int i = threadIdx.x; i < V; i += blockDim.x) dlogits[base + i] = T(0);
        return;
    }
    const T scale = scale_ptr[0];
    const T l = lse[row];
    const bool bad = y < 0 || y >= V;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const T p = ml_exp(logits[base + i] - l);
        dlogits[base + i] = bad ? ml_nan<T>() : scale * (p - (i == y ? T(1) : T(0)));
    }
}
