// Decode matvecs, split over K: a block of MV_THREADS threads computes MV_ROWS rows; thread t
// takes the 32-weight blocks t, t + MV_THREADS, ... of every one of its rows, so each thread has
// MV_ROWS independent 16-byte weight loads in flight and reads the activations once for all of
// them (on an H100 this layout reached 49% of HBM bandwidth where a warp per few rows reached
// 32%: shared/gpu-peers). Q4_0 in nerva's two planes: qs [rows, cols/2] (byte j of a block holds
// element j in its low nibble and j + 16 in its high one), d f16 [rows, cols/32].
#include "common.cuh"

#define MV_THREADS 128
#define MV_ROWS 8

// sum_j (q_j - 8) * x_j over one block of 32 weights
__device__ __forceinline__ float q4_block_dot(uint4 c, const float4* x) {
    unsigned words[4] = {c.x, c.y, c.z, c.w};
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        float4 lo = x[k], hi = x[4 + k];  // elements 4k..4k+3 and 16+4k..16+4k+3
        unsigned w = words[k];
        s += (float)((int)(w & 15) - 8) * lo.x + (float)((int)((w >> 4) & 15) - 8) * hi.x;
        s += (float)((int)((w >> 8) & 15) - 8) * lo.y + (float)((int)((w >> 12) & 15) - 8) * hi.y;
        s += (float)((int)((w >> 16) & 15) - 8) * lo.z + (float)((int)((w >> 20) & 15) - 8) * hi.z;
        s += (float)((int)((w >> 24) & 15) - 8) * lo.w + (float)((int)(w >> 28) - 8) * hi.w;
    }
    return s;
}

// The block's MV_ROWS partial sums -> out[row0 ..]; every thread of the block must call it.
__device__ __forceinline__ void store_rows(float (&acc)[MV_ROWS], float* out, int row0, int rows) {
    __shared__ float part[MV_THREADS / 32][MV_ROWS];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int r = 0; r < MV_ROWS; r++) {
        float v = warp_sum(acc[r]);
        if (lane == 0) part[warp][r] = v;
    }
    __syncthreads();
    if ((int)threadIdx.x < MV_ROWS && row0 + (int)threadIdx.x < rows) {
        float v = 0.f;
        for (int w = 0; w < MV_THREADS / 32; w++) v += part[w][threadIdx.x];
        out[row0 + threadIdx.x] = v;
    }
}

extern "C" __global__ void matvec_q4_w4a16(const u8* __restrict__ qs, const u16* __restrict__ d,
                                           const float* __restrict__ x, float* __restrict__ out,
                                           int rows, int cols) {
    int row0 = blockIdx.x * MV_ROWS, nb = cols / QK, n = rows - row0 < MV_ROWS ? rows - row0 : MV_ROWS;
    float acc[MV_ROWS] = {};
    for (int b = threadIdx.x; b < nb; b += MV_THREADS) {
        const float4* xb = (const float4*)(x + b * QK);
#pragma unroll
        for (int r = 0; r < MV_ROWS; r++) {
            if (r < n) {
                size_t row = (size_t)(row0 + r);
                uint4 c = ((const uint4*)(qs + row * (cols / 2)))[b];
                acc[r] += h2f(d[row * nb + b]) * q4_block_dot(c, xb);
            }
        }
    }
    store_rows(acc, out, row0, rows);
}

// W4A8: per block d_w * d_x * (sum q_w q_x - 8 sum q_x). The -8 of every weight code is applied
// once per block through the activation code sum xs (deferred bias correction), so dp4a runs on
// the raw 0..15 codes, which fit a signed byte. The integer part is exact.
extern "C" __global__ void matvec_q4_w4a8(const u8* __restrict__ qs, const u16* __restrict__ d,
                                          const signed char* __restrict__ xq, const float* __restrict__ xd,
                                          const int* __restrict__ xs, float* __restrict__ out,
                                          int rows, int cols) {
    int row0 = blockIdx.x * MV_ROWS, nb = cols / QK, n = rows - row0 < MV_ROWS ? rows - row0 : MV_ROWS;
    float acc[MV_ROWS] = {};
    for (int b = threadIdx.x; b < nb; b += MV_THREADS) {
        const int4* xv = (const int4*)(xq + b * QK);
        int4 x0 = xv[0], x1 = xv[1];  // elements 0..15, 16..31
        float dx = xd[b];
        int bias = 8 * xs[b];
#pragma unroll
        for (int r = 0; r < MV_ROWS; r++) {
            if (r < n) {
                size_t row = (size_t)(row0 + r);
                uint4 c = ((const uint4*)(qs + row * (cols / 2)))[b];
                int s = 0;
                s = __dp4a((int)(c.x & 0x0F0F0F0Fu), x0.x, s);
                s = __dp4a((int)(c.y & 0x0F0F0F0Fu), x0.y, s);
                s = __dp4a((int)(c.z & 0x0F0F0F0Fu), x0.z, s);
                s = __dp4a((int)(c.w & 0x0F0F0F0Fu), x0.w, s);
                s = __dp4a((int)((c.x >> 4) & 0x0F0F0F0Fu), x1.x, s);
                s = __dp4a((int)((c.y >> 4) & 0x0F0F0F0Fu), x1.y, s);
                s = __dp4a((int)((c.z >> 4) & 0x0F0F0F0Fu), x1.z, s);
                s = __dp4a((int)((c.w >> 4) & 0x0F0F0F0Fu), x1.w, s);
                acc[r] += (h2f(d[row * nb + b]) * dx) * (float)(s - bias);
            }
        }
    }
    store_rows(acc, out, row0, rows);
}

// Exact variants: f16/bf16 weights as stored, 8 per 16-byte load; cols must be a multiple of 8.
extern "C" __global__ void matvec_exact(const u16* __restrict__ w, int bf16, const float* __restrict__ x,
                                        float* __restrict__ out, int rows, int cols) {
    int row0 = blockIdx.x * MV_ROWS, n = rows - row0 < MV_ROWS ? rows - row0 : MV_ROWS;
    float acc[MV_ROWS] = {};
    for (int c = threadIdx.x; c < cols / 8; c += MV_THREADS) {
        float4 a = ((const float4*)x)[2 * c], b = ((const float4*)x)[2 * c + 1];
#pragma unroll
        for (int r = 0; r < MV_ROWS; r++) {
            if (r < n) {
                uint4 p = ((const uint4*)(w + (size_t)(row0 + r) * cols))[c];
                acc[r] += exact2f(p.x & 0xffff, bf16) * a.x + exact2f(p.x >> 16, bf16) * a.y
                        + exact2f(p.y & 0xffff, bf16) * a.z + exact2f(p.y >> 16, bf16) * a.w
                        + exact2f(p.z & 0xffff, bf16) * b.x + exact2f(p.z >> 16, bf16) * b.y
                        + exact2f(p.w & 0xffff, bf16) * b.z + exact2f(p.w >> 16, bf16) * b.w;
            }
        }
    }
    store_rows(acc, out, row0, rows);
}

// One 32-group per warp: scale d = max|x| / 127, codes round-half-away(x / d) in -127..127,
// exactly as the NumPy reference does (IEEE division; no fast math).
__device__ __forceinline__ int quantize_lane(float v, float* d_out) {
    float d = warp_max(fabsf(v)) / 127.f;
    float inv = d > 0.f ? 1.f / d : 0.f;
    *d_out = d;
    return (int)fminf(fmaxf(roundf(v * inv), -127.f), 127.f);
}

// x [n] -> codes xq, scale xd and code sum xs per 32-group (W4A8's activations)
extern "C" __global__ void quantize_act_q8(const float* x, signed char* xq, float* xd, int* xs, int n) {
    int lane = threadIdx.x & 31, g = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (g < n / QK) {
        float d;
        int q = quantize_lane(x[g * QK + lane], &d);
        xq[g * QK + lane] = (signed char)q;
        int sum = warp_sum_int(q);
        if (lane == 0) {
            xd[g] = d;
            xs[g] = sum;
        }
    }
}

// Prefill's W4A8: rows of x quantised per 32-group and scaled back (a GEMM over them gives the
// integer kernel's products). n = all elements, a multiple of 32.
extern "C" __global__ void fake_quantize_q8(const float* x, float* out, long long n) {
    long long g = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (g < n / QK) {
        float d;
        int q = quantize_lane(x[g * QK + lane], &d);
        out[g * QK + lane] = (float)q * d;
    }
}
