// Shared device helpers for the minillama CUDA kernels.
//
// The loader (backends/cuda_build.py) pastes this file in place of the line
// `#include "common.cu"` with #line markers, so compiler messages keep naming the real file and
// line. It also compiles on its own (the CI check compiles every .cu file).
#pragma once

#define ML_FULL_MASK 0xffffffffu
#define ML_MAXD 128         // largest head dimension the attention kernels accept
#define ML_DPL (ML_MAXD / 32)  // head-dim elements held per lane

// ---- precision-generic math (float and double overloads) -----------------------------------
__device__ __forceinline__ float ml_exp(float x) { return expf(x); }
__device__ __forceinline__ double ml_exp(double x) { return exp(x); }
__device__ __forceinline__ float ml_log(float x) { return logf(x); }
__device__ __forceinline__ double ml_log(double x) { return log(x); }
__device__ __forceinline__ float ml_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double ml_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float ml_rsqrt(float x) { return rsqrtf(x); }
__device__ __forceinline__ double ml_rsqrt(double x) { return rsqrt(x); }
__device__ __forceinline__ float ml_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double ml_max(double a, double b) { return fmax(a, b); }
__device__ __forceinline__ float ml_abs(float a) { return fabsf(a); }
__device__ __forceinline__ double ml_abs(double a) { return fabs(a); }

template <typename T> __device__ __forceinline__ T ml_neg_inf();
template <> __device__ __forceinline__ float ml_neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double ml_neg_inf<double>() {
    return __longlong_as_double(0xfff0000000000000ULL);
}
template <typename T> __device__ __forceinline__ T ml_nan();
template <> __device__ __forceinline__ float ml_nan<float>() { return __int_as_float(0x7fc00000); }
template <> __device__ __forceinline__ double ml_nan<double>() {
    return __longlong_as_double(0x7ff8000000000000ULL);
}

// sigma(a) = 1 / (1 + e^{-a}) without overflow for large |a|
template <typename T> __device__ __forceinline__ T ml_sigmoid(T a) {
    T e = ml_exp(-ml_abs(a));
    return a >= T(0) ? T(1) / (T(1) + e) : e / (T(1) + e);
}

// ---- warp and block reductions (blockDim.x must be a multiple of 32) -----------------------
template <typename T> __device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(ML_FULL_MASK, v, o);
    return v;
}

template <typename T> __device__ __forceinline__ T warp_max(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = ml_max(v, __shfl_xor_sync(ML_FULL_MASK, v, o));
    return v;
}

// Sum (is_max == false) or maximum (is_max == true) of v over the whole block; every thread gets
// the result. Safe to call several times in a row (it synchronises before reusing its buffer).
template <typename T, bool is_max> __device__ T block_reduce(T v) {
    __shared__ T buf[32];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    v = is_max ? warp_max(v) : warp_sum(v);
    __syncthreads();
    if (lane == 0) buf[wid] = v;
    __syncthreads();
    if (wid == 0) {
        T r = lane < nwarps ? buf[lane] : (is_max ? ml_neg_inf<T>() : T(0));
        r = is_max ? warp_max(r) : warp_sum(r);
        if (lane == 0) buf[0] = r;
    }
    __syncthreads();
    return buf[0];
}

template <typename T> __device__ __forceinline__ T block_sum(T v) { return block_reduce<T, false>(v); }
template <typename T> __device__ __forceinline__ T block_max(T v) { return block_reduce<T, true>(v); }
