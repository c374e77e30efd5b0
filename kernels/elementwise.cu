// Small per-element kernels: embedding rows, RoPE with the KV cache write, SiLU*mul, broadcast
// adds, and prefill's f16 GEMM operands. Positions come from device memory (pos0), so a captured decode
// graph replays without the host writing anything.
#include "common.cuh"

// Row t of out [T, cols] = row token[t] of a Q4_0 table; grid (column blocks, T).
extern "C" __global__ void embed_q4(const u8* qs, const u16* d, const int* token, float* out, int cols) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    out += (size_t)blockIdx.y * cols;
    if (c < cols) {
        size_t row = (size_t)token[blockIdx.y];
        int b = c / QK, j = c % QK;
        u8 byte = qs[row * (cols / 2) + b * (QK / 2) + (j & 15)];
        int code = j < 16 ? (byte & 15) : (byte >> 4);
        out[c] = h2f(d[row * (cols / QK) + b]) * (float)(code - 8);
    }
}

extern "C" __global__ void embed_exact(const u16* table, int bf16, const int* token, float* out, int cols) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    out += (size_t)blockIdx.y * cols;
    if (c < cols) out[c] = exact2f(table[(size_t)token[blockIdx.y] * cols + c], bf16);
}

// What a layer's prefill does between its q/k/v products and attention, in one launch (decode's
// attention does it itself): rotate q [T, heads, head_dim] in place and k [T, kv_heads,
// head_dim] (NeoX pairing (i, i + half), cos/sin [max_pos, half]) for token t at position
// pos0[0] + t, and store k and v in f16 at that position of the cache [ctx, kv_heads,
// head_dim]. Rows of q, k and v are `stride` floats apart.
extern "C" __global__ void rope_kv_store(float* q, const float* k, const float* v, int stride, const int* pos0,
                                         const float* cos_t, const float* sin_t, int T, int heads, int kv_heads,
                                         int half, u16* k_cache, u16* v_cache) {
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
            size_t dst = (pos * kv_heads + kh) * 2 * half;
            k_cache[dst + j] = f2h(rope_at(r, j, half, c, s));
            k_cache[dst + j + half] = f2h(rope_at(r, j + half, half, c, s));
            v_cache[dst + j] = f2h(w[j]);
            v_cache[dst + j + half] = f2h(w[j + half]);
        }
    }
}

// gate_up [T, 2f] (gate then up) -> out [T, f] = silu(gate) * up
extern "C" __global__ void silu_mul(const float* gate_up, float* out, int f, int T) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < T * f) {
        int t = i / f, j = i % f;
        float g = gate_up[(size_t)t * 2 * f + j];
        out[i] = g / (1.f + expf(-g)) * gate_up[(size_t)t * 2 * f + f + j];
    }
}

// x [T, n] += b [n] for every row (q, k and v biases)
extern "C" __global__ void add_rows(float* x, const float* b, int n, int T) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < T * n) x[i] += b[i % n];
}

// Prefill's GEMM operands are f16 (cuBLAS multiplies them on tensor cores, summing in f32): the
// kernels below round each value once to the nearest f16 (at most 2^-11 relative, as TF32's
// 10-bit mantissa rounded f32 operands before). A value past f16's range (65504) becomes inf, as
// in llama.cpp's cuBLAS path: q, k, v, gate and up read normalised rows and o an average of V
// rows; down's input, silu(gate) up, is the one without a bound.

// Q4_0 planes -> f16 [rows, cols], one thread per code byte (two weights): d (q - 8), exact in
// f32, rounded once (exact in f16 too when q - 8 is a power of two).
extern "C" __global__ void dequantize_q4(const u8* qs, const u16* d, u16* out, int rows, int cols) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (size_t)rows * (cols / 2)) {
        size_t row = i / (cols / 2);
        int k = i % (cols / 2), b = k / (QK / 2), j = k % (QK / 2);
        float scale = h2f(d[row * (cols / QK) + b]);
        u8 byte = qs[i];
        u16* o = out + row * cols + b * QK;
        o[j] = f2h(scale * (float)((byte & 15) - 8));
        o[j + 16] = f2h(scale * (float)((byte >> 4) - 8));
    }
}

// bf16 bits -> f16 (f16 weights are GEMM operands as stored). Exact from 2^-14 to 65504: a weight
// below that loses low bits as an f16 subnormal, a deviation under 2^-25 absolute.
extern "C" __global__ void bf16_to_half(const u16* w, u16* out, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f2h(bf2f(w[i]));
}

// f32 activations -> f16
extern "C" __global__ void to_half(const float* x, u16* out, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f2h(x[i]);
}
