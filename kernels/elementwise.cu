// Small per-element kernels: embedding rows, RoPE, SiLU*mul, broadcast adds, the KV cache write,
// and prefill's dequantisation. Positions come from device memory (pos0), so a captured decode
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

// x [T, heads, head_dim] with rows `stride` floats apart; token t is at position pos0[0] + t.
// NeoX pairing (i, i + half), cos/sin [max_pos, half].
extern "C" __global__ void rope(float* x, int stride, const int* pos0, const float* cos_t, const float* sin_t,
                                int T, int heads, int half) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < T * heads * half) {
        int t = i / (heads * half), h = (i / half) % heads, j = i % half;
        float* r = x + (size_t)t * stride + h * 2 * half;
        size_t p = (size_t)(pos0[0] + t) * half + j;
        float c = cos_t[p], s = sin_t[p], a = r[j], b = r[j + half];
        r[j] = a * c - b * s;
        r[j + half] = b * c + a * s;
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

// x [T, n] += b [n] for every row (biases; with T = 1 the residual add)
extern "C" __global__ void add_rows(float* x, const float* b, int n, int T) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < T * n) x[i] += b[i % n];
}

// K/V rows [T, kv_dim] (rows `stride` floats apart) -> f16 cache rows pos0[0] .. pos0[0] + T - 1
extern "C" __global__ void kv_store(const float* k, const float* v, int stride, u16* k_cache, u16* v_cache,
                                    const int* pos0, int T, int kv_dim) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < T * kv_dim) {
        int t = i / kv_dim, j = i % kv_dim;
        size_t dst = (size_t)(pos0[0] + t) * kv_dim + j;
        k_cache[dst] = f2h(k[(size_t)t * stride + j]);
        v_cache[dst] = f2h(v[(size_t)t * stride + j]);
    }
}

// Q4_0 planes -> f32 [rows, cols], one thread per code byte (two weights)
extern "C" __global__ void dequantize_q4(const u8* qs, const u16* d, float* out, int rows, int cols) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (size_t)rows * (cols / 2)) {
        size_t row = i / (cols / 2);
        int k = i % (cols / 2), b = k / (QK / 2), j = k % (QK / 2);
        float scale = h2f(d[row * (cols / QK) + b]);
        u8 byte = qs[i];
        float* o = out + row * cols + b * QK;
        o[j] = scale * (float)((byte & 15) - 8);
        o[j + 16] = scale * (float)((byte >> 4) - 8);
    }
}

// f16/bf16 bits -> f32
extern "C" __global__ void widen_exact(const u16* w, int bf16, float* out, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = exact2f(w[i], bf16);
}
