// Fused AdamW step over a flat parameter buffer (Loshchilov & Hutter, decoupled weight decay):
//   m = b1 m + (1 - b1) g,   v = b2 v + (1 - b2) g^2
//   p = p (1 - lr wd) - lr (m / bc1) / (sqrt(v / bc2) + eps),  bc1 = 1 - b1^t, bc2 = 1 - b2^t
// p, g, m, v: n elements, contiguous, same dtype. Hyper-parameters are passed already in T.
// KERNELS: adamw_step
#include "common.cu"

template <typename T>
__global__ void adamw_step(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                           T* __restrict__ v, long long n, T lr, T b1, T b2, T eps, T wd, T bc1,
                           T bc2) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const T gi = g[i];
        const T mi = b1 * m[i] + (T(1) - b1) * gi;
        const T vi = b2 * v[i] + (T(1) - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        const T upd = (mi / bc1) / (ml_sqrt(vi / bc2) + eps);
        p[i] = p[i] * (T(1) - lr * wd) - lr * upd;
    }
}
