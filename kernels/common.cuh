// Helpers shared by every kernel. The kernels include no CUDA headers (an NVRTC wheel ships
// none), so half conversions are inline PTX. These sources also build as C++ on the CPU for the
// tests (tests/cuda_emu), which is what the host branch below is for.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;

#define FULL_MASK 0xffffffffu
#define MAX_HEAD_DIM 256
#define QK 32
#define NEG_INF __int_as_float(0xff800000)  // no math header under NVRTC

#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#else
inline float h2f(u16 h) { _Float16 v; __builtin_memcpy(&v, &h, 2); return (float)v; }
inline u16 f2h(float f) { _Float16 v = (_Float16)f; u16 h; __builtin_memcpy(&h, &v, 2); return h; }
#endif

// A Q4_0 code n at bits 4s..4s+3 of a word ORed into the bits of 2^23 (MAGIC, with and_or below)
// reads as the float 2^23 + n 16^s; q4_code with bias 2^23 + 8 16^s gives (n - 8) 16^s exactly,
// with no integer conversion (matvec.cu says why that matters).
#define MAGIC 0x4B000000u  // 2^23
__device__ __forceinline__ float q4_code(unsigned bits, float bias) { return __uint_as_float(bits) - bias; }

// (a & MASK) | c in one LOP3 with MASK as its immediate: written in C, ptxas makes c the
// immediate instead and rebuilds MASK in a register for every use (one MOV per LOP3).
template <unsigned MASK>
__device__ __forceinline__ unsigned and_or(unsigned a, unsigned c) {
#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
    unsigned r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "n"(MASK), "r"(c));
    return r;
#else
    return (a & MASK) | c;
#endif
}

// A load from L2, past this SM's L1 (ld.global.cg): for data other blocks of the same launch
// wrote and published with __threadfence, which L1, not coherent, may hold stale. Not a plain
// volatile load, which the compiler keeps from batching.
__device__ __forceinline__ float load_l2(const float* p) {
#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
#else
    return *(const volatile float*)p;
#endif
}

// Four floats from L2 (16-byte aligned), as load_l2.
__device__ __forceinline__ float4 load_l2_4(const float* p) {
#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p)
                 : "memory");
    return v;
#else
    const volatile float* q = &((const float4*)p)->x;  // the member access checks the 16-byte alignment
    return float4{q[0], q[1], q[2], q[3]};
#endif
}

// Element j of head row r rotated (NeoX pairing (i, i + half)) by the position whose cos and sin
// rows are c and s [half]: the one RoPE formula, for prefill's rope_kv_store and decode attention.
__device__ __forceinline__ float rope_at(const float* r, int j, int half, const float* c, const float* s) {
    return j < half ? r[j] * c[j] - r[j + half] * s[j] : r[j] * c[j - half] + r[j - half] * s[j - half];
}

// Programmatic dependent launch (sm_90 on; the host launches every kernel with it where the GPU
// and driver take it: planes/cuda/dependent_launch.py). A kernel so launched may start while the kernel
// before it in the stream still runs, so each kernel calls wait_prior_kernels before it touches
// global memory a kernel writes (any store, any read but of weights): griddepcontrol.wait returns
// once the kernels before have finished and their stores are visible. It then lets the next
// kernel launch (griddepcontrol.launch_dependents; the next one's own wait still holds it back
// from this one's results): the next launch's start-up and its blocks' first weight loads
// overlap this one's work and tail, where a graph otherwise leaves the GPU idle between launches
// (gpu_h100.md; docs/perf/code_figures.md). Launched without the attribute, or before sm_90, both
// do nothing.
// The CPU emulation (tests/cuda_emu) checks the rule: a store, or a read not through weights(),
// before the wait ends the launch with an error.
__device__ __forceinline__ void wait_prior_kernels() {
#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
#else
    emu::prior_kernels_waited();
#endif
}

// A read of weights (codes, scales, offsets): memory no kernel writes, which a kernel may read
// before wait_prior_kernels (its first round of loads, issued while the kernel before finishes).
template <class T>
__device__ __forceinline__ T weights(const T* p) {
#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
    return *p;
#else
    emu::weights_reading(true);
    T v = *p;
    emu::weights_reading(false);
    return v;
#endif
}

// Gemma 2's logit capping: cap tanh(s / cap) where cap > 0 (attention scores, final logits), else s
__device__ __forceinline__ float capped(float s, float cap) { return cap > 0.f ? cap * tanhf(s / cap) : s; }

// GeLU's tanh form (Gemma's gelu_pytorch_tanh): 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))
__device__ __forceinline__ float gelu_tanh(float g) {
    return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

// bf16 is the top half of an f32.
__device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float(((unsigned)b) << 16); }

// An exact-variant weight: f16 or bf16 bits.
__device__ __forceinline__ float exact2f(u16 w, int bf16) { return bf16 ? bf2f(w) : h2f(w); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ int warp_sum_int(int v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sum over the whole block, returned to every thread; every thread must call it.
// scratch: 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();  // a previous call may still be reading scratch
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_sum(lane < warps ? scratch[lane] : 0.f);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_max(lane < warps ? scratch[lane] : NEG_INF);
}
