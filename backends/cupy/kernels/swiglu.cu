// SwiGLU gate h = silu(a) b, silu(a) = a sigma(a); backward
//   db = dh silu(a),  da = dh b sigma(a) (1 + a (1 - sigma(a))).
// a, b, h, dh, da, db: n elements, contiguous. The backward recomputes sigma(a).
// KERNELS: swiglu_fwd swiglu_bwd
#include "common.cu"

template <typename T>
__global__ void swiglu_fwd(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ h,
                           long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const T av = a[i];
        h[i] = av * ml_sigmoid(av) * b[i];
    }
}

template <typename T>
__global__ void swiglu_bwd(const T* __restrict__ dh, const T* __restrict__ a,
                           const T* __restrict__ b, T* __restrict__ da, T* __restrict__ db,
                           long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const T av = a[i], s = ml_sigmoid(av), d = dh[i];
        db[i] = d * av * s;
        da[i] = d * b[i] * s * (T(1) + av * (T(1) - s));
    }
}
