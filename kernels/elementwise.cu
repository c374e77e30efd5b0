// Small per-element kernels: embedding rows, RoPE with the KV cache write, SiLU*mul, broadcast
// adds, and prefill's f16 GEMM operands. Positions come from device memory (pos0), so a captured decode
// graph replays without the host writing anything.
#include "common.cuh"

// Row t of out [T, cols] = row token[t] of a Q4_0 table (d (q - 8)), or of a Q4_1 one (d q + m:
// OFFSETS, m its offsets); grid (column blocks, T). d q is exact in f32, so the sum rounds once,
// as ref's does.
template <bool OFFSETS>
__device__ __forceinline__ void embed_row(const u8* qs, const u16* d, const u16* m, const int* token, float* out,
                                          int cols) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    out += (size_t)blockIdx.y * cols;
    if (c < cols) {
        size_t row = (size_t)token[blockIdx.y];
        int b = c / QK, j = c % QK;
        u8 byte = qs[row * (cols / 2) + b * (QK / 2) + (j & 15)];
        int code = j < 16 ? (byte & 15) : (byte >> 4);
        float scale = h2f(d[row * (cols / QK) + b]);
        out[c] = OFFSETS ? scale * (float)code + h2f(m[row * (cols / QK) + b]) : scale * (float)(code - 8);
    }
}
extern "C" __global__ void embed_q4(const u8* qs, const u16* d, const int* token, float* out, int cols) {
    wait_prior_kernels();
    embed_row<false>(qs, d, nullptr, token, out, cols);
}
extern "C" __global__ void embed_q4_1(const u8* qs, const u16* d, const u16* m, const int* token, float* out,
                                      int cols) {
    wait_prior_kernels();
    embed_row<true>(qs, d, m, token, out, cols);
}

// Row t of out [T, cols] = row token[t] of a Q8_0 table (d q, exact in f32).
extern "C" __global__ void embed_q8_0(const signed char* q8, const u16* d, const int* token, float* out, int cols) {
    wait_prior_kernels();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    out += (size_t)blockIdx.y * cols;
    if (c < cols) {
        size_t row = (size_t)token[blockIdx.y];
        out[c] = h2f(d[row * (cols / QK) + c / QK]) * (float)q8[row * cols + c];
    }
}

extern "C" __global__ void embed_exact(const u16* table, int bf16, const int* token, float* out, int cols) {
    wait_prior_kernels();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    out += (size_t)blockIdx.y * cols;
    if (c < cols) out[c] = exact2f(table[(size_t)token[blockIdx.y] * cols + c], bf16);
}

// What a layer's prefill does between its q/k/v products and attention, in one launch (decode's
// attention does it itself): rotate q [T, heads, head_dim] in place and k [T, kv_heads,
// head_dim] (NeoX pairing (i, i + half), cos/sin [max_pos, half]) for token t at position
// pos0[0] + t, and store k and v in f16 at that position's row of the cache [ring, kv_heads,
// head_dim], row p % ring. Rows of q, k and v are `stride` floats apart.
extern "C" __global__ void rope_kv_store(float* q, const float* k, const float* v, int stride, const int* pos0,
                                         const float* cos_t, const float* sin_t, int T, int heads, int kv_heads,
                                         int half, u16* k_cache, u16* v_cache, int ring) {
    wait_prior_kernels();
    int i = blockIdx.x * blockDim.x + threadIdx.x, all = heads + kv_heads;
    if (i < T * all * half) {
        int t = i / (all * half), h = (i / half) % all, j = i % half;
        size_t pos = (size_t)(pos0[0] + t), row = (size_t)t * stride;
        const float *c = cos_t + pos * half, *s = sin_t + pos * half;
        if (h < heads) {
            float* r = q + row + h * 2 * half;
            float a = rope_at(r, j, half, c, s), b = rope_at(r, j + half, half, c, s);
            r[j] = a;
            r[j + half] = b;
        } else {
            int kh = h - heads;
            const float* r = k + row + kh * 2 * half;
            const float* w = v + row + kh * 2 * half;
            size_t dst = ((pos % ring) * kv_heads + kh) * 2 * half;
            k_cache[dst + j] = f2h(rope_at(r, j, half, c, s));
            k_cache[dst + j + half] = f2h(rope_at(r, j + half, half, c, s));
            v_cache[dst + j] = f2h(w[j]);
            v_cache[dst + j + half] = f2h(w[j + half]);
        }
    }
}

// gate_up [T, 2f] (gate then up) -> out [T, f] = silu(gate) * up
extern "C" __global__ void silu_mul(const float* gate_up, float* out, int f, int T) {
    wait_prior_kernels();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < T * f) {
        int t = i / f, j = i % f;
        float g = gate_up[(size_t)t * 2 * f + j];
        out[i] = g / (1.f + expf(-g)) * gate_up[(size_t)t * 2 * f + f + j];
    }
}

// gate_up [T, 2f] (gate then up) -> out [T, f] = gelu(gate) * up (GeGLU, GeLU's tanh form)
extern "C" __global__ void gelu_mul(const float* gate_up, float* out, int f, int T) {
    wait_prior_kernels();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < T * f) {
        int t = i / f, j = i % f;
        out[i] = gelu_tanh(gate_up[(size_t)t * 2 * f + j]) * gate_up[(size_t)t * 2 * f + f + j];
    }
}

// x [n] *= s (Gemma's embedding, times sqrt(hidden))
extern "C" __global__ void scale(float* x, float s, int n) {
    wait_prior_kernels();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}

// x [n] = c tanh(x / c) (Gemma 2's final logits, capped)
extern "C" __global__ void softcap(float* x, float c, int n) {
    wait_prior_kernels();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = capped(x[i], c);
}

// x [T, n] += b [n] for every row (q, k and v biases)
extern "C" __global__ void add_rows(float* x, const float* b, int n, int T) {
    wait_prior_kernels();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < T * n) x[i] += b[i % n];
}

// Prefill's GEMM operands are f16 (cuBLAS multiplies them on tensor cores, summing in f32): the
// kernels below round each value once to the nearest f16 (at most 2^-11 relative, as TF32's
// 10-bit mantissa rounded f32 operands before). A value past f16's range (65504) becomes inf, as
// in llama.cpp's cuBLAS path: q, k, v, gate and up read normalised rows and o an average of V
// rows; down's input, silu(gate) up, is the one without a bound.

// Q4_0 planes -> f16, a thread a 32-weight block: qs (16 bytes a block), d (one scale a block)
// and out (32 halves a block) are a whole number of blocks, consecutive, so block b's codes,
// scale and output sit at b with no row arithmetic. Each weight is d (q - 8): exact in f32 (an
// f16 scale times a 4-bit integer), rounded once to f16. Q4_1 (dequantize_q4_1, OFFSETS) adds
// the block's offset m in f32 (d q exact, so one rounding, ref's) before the f16 rounding. Codes
// become floats as in the matvecs (q4_code: one LOP3 and one FADD), scaled by d / 16^s for the
// nibble's place (a power of two, so still exact), and pairs pack into half2 words: 152
// instructions for 32 weights (sm_90, by nvdisasm). A thread a code byte, as before, ran 94 for
// 2 weights, most of them index arithmetic (a 64-bit division by the row's length among it): at
// 7.5 billion weights a pass (8B shapes), about 1.1e10 warp instructions, 12 ms of an H100's
// issue slots at 1.75 GHz against 6.4 ms to move the 19 GB it reads and writes at 3 TB/s. Now
// 1e9: memory-bound.

// One weight as f16 from its code (ORed into MAGIC) at place s: Q4_0's bias 2^23 + 8 16^s leaves
// (q - 8) 16^s; Q4_1 subtracts 2^23 alone, leaving q 16^s. Times d / 16^s (exact), plus Q4_1's
// offset, one rounding.
template <bool OFFSETS>
__device__ __forceinline__ u16 q4_half(unsigned code, float q4_0_bias, float scale, float offset) {
    return f2h(OFFSETS ? fmaf(q4_code(code, 8388608.f), scale, offset) : q4_code(code, q4_0_bias) * scale);
}

// Two weights as a half2 word: codes a and b, each with its place's bias and scale.
template <bool OFFSETS>
__device__ __forceinline__ unsigned q4_pair(unsigned a, float bias_a, float scale_a, unsigned b, float bias_b,
                                            float scale_b, float offset) {
    return (unsigned)q4_half<OFFSETS>(a, bias_a, scale_a, offset)
           | ((unsigned)q4_half<OFFSETS>(b, bias_b, scale_b, offset) << 16);
}

template <bool OFFSETS>
__device__ __forceinline__ void dequantize_block(const u8* qs, const u16* d, const u16* m, u16* out, int blocks) {
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= blocks) return;
    uint4 c = ((const uint4*)qs)[b];
    float s = h2f(d[b]), s16 = s * 0.0625f, s256 = s * 0.00390625f, s4096 = s * 0.000244140625f;
    float off = OFFSETS ? h2f(m[b]) : 0.f;
    unsigned words[4] = {c.x, c.y, c.z, c.w}, lo[8], hi[8];  // halves 0..15, then 16..31, in pairs
#pragma unroll
    for (int k = 0; k < 4; k++) {
        // bytes 4k, 4k + 1 in w's low half and 4k + 2, 4k + 3 in u's: weights 4k.. in their low
        // nibbles (bits 0..3 and 8..11), 16 + 4k.. in their high ones (bits 4..7 and 12..15)
        unsigned w = words[k], u = w >> 16;
        lo[2 * k] = q4_pair<OFFSETS>(and_or<0xFu>(w, MAGIC), 8388616.f, s, and_or<0xF00u>(w, MAGIC), 8390656.f,
                                     s256, off);
        lo[2 * k + 1] = q4_pair<OFFSETS>(and_or<0xFu>(u, MAGIC), 8388616.f, s, and_or<0xF00u>(u, MAGIC), 8390656.f,
                                         s256, off);
        hi[2 * k] = q4_pair<OFFSETS>(and_or<0xF0u>(w, MAGIC), 8388736.f, s16, and_or<0xF000u>(w, MAGIC), 8421376.f,
                                     s4096, off);
        hi[2 * k + 1] = q4_pair<OFFSETS>(and_or<0xF0u>(u, MAGIC), 8388736.f, s16, and_or<0xF000u>(u, MAGIC),
                                         8421376.f, s4096, off);
    }
    uint4* o = (uint4*)(out + (size_t)b * QK);
    for (int i = 0; i < 2; i++) {
        uint4 l = {lo[4 * i], lo[4 * i + 1], lo[4 * i + 2], lo[4 * i + 3]};
        uint4 h = {hi[4 * i], hi[4 * i + 1], hi[4 * i + 2], hi[4 * i + 3]};
        o[i] = l;
        o[2 + i] = h;
    }
}
extern "C" __global__ void dequantize_q4(const u8* qs, const u16* d, u16* out, int blocks) {
    wait_prior_kernels();
    dequantize_block<false>(qs, d, nullptr, out, blocks);
}
extern "C" __global__ void dequantize_q4_1(const u8* qs, const u16* d, const u16* m, u16* out, int blocks) {
    wait_prior_kernels();
    dequantize_block<true>(qs, d, m, out, blocks);
}

// Q8_0 -> f16 for prefill's GEMMs (the lm_head): a thread a block of 32, d q (exact in f32)
// rounded once to f16, 16 bytes of codes in and four 16-byte stores out.
extern "C" __global__ void dequantize_q8_0(const signed char* q8, const u16* d, u16* out, int blocks) {
    wait_prior_kernels();
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= blocks) return;
    float s = h2f(d[b]);
    const uint4* codes = (const uint4*)(q8 + (size_t)b * QK);
    uint4* o = (uint4*)(out + (size_t)b * QK);
#pragma unroll
    for (int i = 0; i < 2; i++) {
        uint4 c = codes[i];
        unsigned words[4] = {c.x, c.y, c.z, c.w}, halves[8];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            unsigned w = words[k];
            halves[2 * k] = (unsigned)f2h(s * (float)(signed char)(w & 0xffu))
                          | (unsigned)f2h(s * (float)(signed char)((w >> 8) & 0xffu)) << 16;
            halves[2 * k + 1] = (unsigned)f2h(s * (float)(signed char)((w >> 16) & 0xffu))
                              | (unsigned)f2h(s * (float)(signed char)(w >> 24)) << 16;
        }
        o[2 * i] = uint4{halves[0], halves[1], halves[2], halves[3]};
        o[2 * i + 1] = uint4{halves[4], halves[5], halves[6], halves[7]};
    }
}

// bf16 bits -> f16 (f16 weights are GEMM operands as stored). Exact from 2^-14 to 65504: a weight
// below that loses low bits as an f16 subnormal, a deviation under 2^-25 absolute.
extern "C" __global__ void bf16_to_half(const u16* w, u16* out, long long n) {
    wait_prior_kernels();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f2h(bf2f(w[i]));
}

// f32 activations -> f16
extern "C" __global__ void to_half(const float* x, u16* out, long long n) {
    wait_prior_kernels();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f2h(x[i]);
}
