// float32 -> bfloat16 conversion for the mixed-precision matrix products (backends/mixed_precision.py):
// the bf16 bit pattern of x, rounded to nearest with ties to even on the float32 bits u:
//   r = (u + 0x7fff + ((u >> 16) & 1)) >> 16;  NaN -> a quiet NaN of the same sign
// (the same integer arithmetic as mixed_precision.bf16_bits, so both give the same bits; overflow
// rounds to infinity as IEEE rounding does). x: n floats, out: n unsigned shorts (bf16 storage).
// KERNELS: to_bf16<float>
#include "common.cu"

template <typename T>
__global__ void to_bf16(const T* __restrict__ x, unsigned short* __restrict__ out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const unsigned u = __float_as_uint((float)x[i]);
        unsigned r;
        if ((u & 0x7fffffffu) > 0x7f800000u) r = (u >> 16) | 0x40u;  // NaN: keep it a NaN
        else r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        out[i] = (unsigned short)r;
    }
}
