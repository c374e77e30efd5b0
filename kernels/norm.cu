// RMSNorm over rows, one block per row (x [rows, n]). The residual add that precedes a layer's
// second norm is fused into the o matvec's store (matvec.cu).
// A thread holds its NORM_VEC float4s of the row in registers between the sum of squares and the
// scaling, and issues them all at once: a decode row is one vector, so the kernel is as fast as
// one round of loads (a strided loop of scalar loads was slower: docs/perf/code_figures.md).
// n must be a multiple of 4 and at most 4 * NORM_VEC * blockDim.x.
#include "common.cuh"

#define NORM_VEC 4

// v: the row's float4s this thread holds (index threadIdx.x + j * blockDim.x); -> 1 / rms
__device__ __forceinline__ float inv_rms(const float4 (&v)[NORM_VEC], float eps, int n) {
    __shared__ float scratch[32];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < NORM_VEC; j++) ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
    return 1.f / sqrtf(block_sum(ss, scratch) / (float)n + eps);
}

__device__ __forceinline__ void scale_out(const float4 (&v)[NORM_VEC], float inv, const float* w, float* out, int n) {
#pragma unroll
    for (int j = 0; j < NORM_VEC; j++) {
        int i = threadIdx.x + j * blockDim.x;
        if (i < n / 4) {
            float4 g = ((const float4*)w)[i], o;
            o.x = v[j].x * inv * g.x;
            o.y = v[j].y * inv * g.y;
            o.z = v[j].z * inv * g.z;
            o.w = v[j].w * inv * g.w;
            ((float4*)out)[i] = o;
        }
    }
}

// each thread writes only what it read itself, so out may be x
extern "C" __global__ void rmsnorm(const float* x, const float* w, float eps, float* out, int n) {
    wait_prior_kernels();
    size_t row = (size_t)blockIdx.x * n;
    float4 v[NORM_VEC];
#pragma unroll
    for (int j = 0; j < NORM_VEC; j++) {
        int i = threadIdx.x + j * blockDim.x;
        v[j] = i < n / 4 ? ((const float4*)(x + row))[i] : float4{0.f, 0.f, 0.f, 0.f};
    }
    scale_out(v, inv_rms(v, eps, n), w, out + row, n);
}
