// Token embedding: forward gather h_n = E[x_n]; backward scatter-add dE[x_n] += dh_n with atomics
// (repeated tokens in a batch add into the same row). One block per token row, threads over D.
// weight, dweight: (V, D); tokens: (N,) int64; out, dout: (N, D).
// KERNELS: embedding_fwd embedding_bwd
#include "common.cu"

template <typename T>
__global__ void embedding_fwd(const T* __restrict__ weight, const long long* __restrict__ tokens,
                              T* __restrict__ out, int N, int D) {
    const int n = blockIdx.x;
    if (n >= N) return;
    const T* src = weight + (size_t)tokens[n] * D;
    T* dst = out + (size_t)n * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) dst[i] = src[i];
}

template <typename T>
__global__ void embedding_bwd(const T* __restrict__ dout, const long long* __restrict__ tokens,
                              T* __restrict__ dweight, int N, int D) {
    const int n = blockIdx.x;
    if (n >= N) return;
    T* dst = dweight + (size_t)tokens[n] * D;
    const T* src = dout + (size_t)n * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) atomicAdd(dst + i, src[i]);
}
