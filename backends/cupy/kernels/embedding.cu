// Token embedding: forward gather h_n = E[x_n]; backward dE_v = sum_{n: x_n = v} dh_n, summed in a
// fixed order (no atomics), so training is bit-for-bit repeatable on the GPU.
// weight, dweight: (V, D); tokens: (N,) int64; out, dout: (N, D).
// The backward takes the tokens sorted (sorted_tok, (N,)) and the positions in that order
// (order, (N,)): the first block of each run of equal tokens sums the run's rows in sorted order
// and writes the row once; every other block returns at once. Rows of absent tokens stay zero.
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
__global__ void embedding_bwd(const T* __restrict__ dout, const long long* __restrict__ sorted_tok,
                              const long long* __restrict__ order, T* __restrict__ dweight, int N,
                              int D) {
    const int n = blockIdx.x;
    if (n >= N) return;
    const long long tok = sorted_tok[n];
    if (n > 0 && sorted_tok[n - 1] == tok) return;  // not the first of its run
    int end = n + 1;
    while (end < N && sorted_tok[end] == tok) ++end;
    T* dst = dweight + (size_t)tok * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        // four partial sums (more loads in flight), combined in a fixed order
        T a0 = T(0), a1 = T(0), a2 = T(0), a3 = T(0);
        int m = n;
        for (; m + 4 <= end; m += 4) {
            a0 += dout[(size_t)order[m] * D + i];
            a1 += dout[(size_t)order[m + 1] * D + i];
            a2 += dout[(size_t)order[m + 2] * D + i];
            a3 += dout[(size_t)order[m + 3] * D + i];
        }
        for (; m < end; ++m) a0 += dout[(size_t)order[m] * D + i];
        dst[i] = (a0 + a1) + (a2 + a3);
    }
}
