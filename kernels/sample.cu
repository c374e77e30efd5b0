// Sampling on the device that holds the logits: repetition penalty, greedy, temperature, top-k,
// top-p, in one block. The sampled token goes to state[1], where the next decode step's embedding
// reads it, and into the ring of recent tokens the penalty looks at; the host copies it out
// asynchronously. state: [0] position of the token to feed next, [1] that token, [2] draws made
// (the random stream's counter), [3] tokens sampled (the ring's write index).
#include "common.cuh"

// Floats ordered as unsigned integers, so a threshold on values can be found by bisection.
__device__ __forceinline__ unsigned order_key(float f) {
    unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// A uniform float in [0, 1) from (seed, counter): a 32-bit integer hash, no state to keep.
__device__ __forceinline__ float uniform01(unsigned seed, unsigned counter) {
    unsigned x = seed * 0x9E3779B9u ^ (counter + 0x7F4A7C15u);
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    return (float)(x >> 8) * (1.f / 16777216.f);
}

// Passes over the logits keep SCAN_LOADS float4 loads in flight a thread: one block reads them
// all, so a pass is as fast as its rounds of loads (one float at a time, greedy sampling's
// argmax took 24 us for 128256 logits on an H100, in gpu_profile.py). x must be 16-byte aligned.
#define SCAN_LOADS 4

// f(v, i) for x[i], i in [c0, c1) in increasing order, the float4s c0 / 4 + k stride (k = 0, 1, ...)
// of that range; c0 a multiple of 4. The elements of the last, partial float4 come one at a time.
template <class F>
__device__ __forceinline__ void scan(const float* x, int c0, int c1, int stride, F f) {
    const float4* x4 = (const float4*)x;
    int q1 = c1 / 4;
    for (int q0 = c0 / 4; q0 < q1; q0 += SCAN_LOADS * stride) {
        float4 v[SCAN_LOADS];
#pragma unroll
        for (int j = 0; j < SCAN_LOADS; j++) v[j] = q0 + j * stride < q1 ? x4[q0 + j * stride] : float4{};
#pragma unroll
        for (int j = 0; j < SCAN_LOADS; j++) {
            int q = q0 + j * stride;
            if (q < q1) {
                f(v[j].x, 4 * q);
                f(v[j].y, 4 * q + 1);
                f(v[j].z, 4 * q + 2);
                f(v[j].w, 4 * q + 3);
            }
        }
    }
}

// This thread's share of x[0..n) in increasing index: float4s tid, tid + nt, ..., then the tail
// past the last whole float4, an element a thread.
template <class F>
__device__ __forceinline__ void scan_strided(const float* x, int n, F f) {
    scan(x, 4 * threadIdx.x, n & ~3, blockDim.x, f);
    for (int i = (n & ~3) + threadIdx.x; i < n; i += blockDim.x) f(x[i], i);
}

// This thread's contiguous chunk [c0, c1) of x in increasing index (c0 a multiple of 4).
template <class F>
__device__ __forceinline__ void scan_chunk(const float* x, int c0, int c1, F f) {
    scan(x, c0, c1 & ~3, 1, f);
    for (int i = (c1 & ~3) > c0 ? (c1 & ~3) : c0; i < c1; i++) f(x[i], i);  // c0 past c1 & ~3: an empty chunk
}

// Index of the largest value, the lowest index among equals (as numpy.argmax).
__device__ int block_argmax(const float* x, int n) {
    __shared__ float sv[32];
    __shared__ int si[32];
    float best = NEG_INF;
    int idx = 0x7fffffff;
    scan_strided(x, n, [&](float v, int i) {  // increasing i: a later equal value keeps the lower index
        if (v > best) best = v, idx = i;
    });
    for (int o = 16; o > 0; o >>= 1) {
        float v = __shfl_xor_sync(FULL_MASK, best, o);
        int j = __shfl_xor_sync(FULL_MASK, idx, o);
        if (v > best || (v == best && j < idx)) { best = v; idx = j; }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) { sv[warp] = best; si[warp] = idx; }
    __syncthreads();
    best = lane < warps ? sv[lane] : NEG_INF;
    idx = lane < warps ? si[lane] : 0x7fffffff;
    for (int o = 16; o > 0; o >>= 1) {
        float v = __shfl_xor_sync(FULL_MASK, best, o);
        int j = __shfl_xor_sync(FULL_MASK, idx, o);
        if (v > best || (v == best && j < idx)) { best = v; idx = j; }
    }
    return idx;
}

// Largest key K >= lo with f(K) >= target, for f decreasing in K and f(lo) >= target: 32 rounds.
template <class F>
__device__ __forceinline__ unsigned bisect(unsigned lo, F f, float target) {
    unsigned hi = 0xffffffffu;
    while (lo < hi) {
        unsigned mid = lo + (unsigned)(((unsigned long long)hi - lo + 1) >> 1);
        if (f(mid) >= target) lo = mid; else hi = mid - 1;
    }
    return lo;
}

extern "C" __global__ void sample(float* logits, int vocab, int* state, int* recent, int recent_n,
                                  float temperature, int top_k, float top_p, float penalty, unsigned seed,
                                  int advance) {
    __shared__ float scratch[32];
    __shared__ float chunk_sum[1024];
    __shared__ int chosen;
    int tid = threadIdx.x, nt = blockDim.x;
    // llama.cpp's rule, once per distinct recent token: positive logits / penalty, negative * penalty
    int seen = state[3] < recent_n ? state[3] : recent_n;
    if (penalty != 1.f && tid < seen) {
        int tok = recent[tid];
        bool first = true;
        for (int j = 0; j < tid; j++) first = first && recent[j] != tok;
        if (first) logits[tok] = logits[tok] > 0.f ? logits[tok] / penalty : logits[tok] * penalty;
    }
    __syncthreads();
    int best = block_argmax(logits, vocab);
    if (tid == 0) chosen = best;
    if (temperature > 0.f) {
        float mx = logits[best];
        auto count_ge = [&](unsigned key) {
            float c = 0.f;
            scan_strided(logits, vocab, [&](float v, int) { c += order_key(v) >= key ? 1.f : 0.f; });
            return block_sum(c, scratch);
        };
        auto mass_ge = [&](unsigned key) {
            float s = 0.f;
            scan_strided(logits, vocab, [&](float v, int) {
                if (order_key(v) >= key) s += expf((v - mx) / temperature);
            });
            return block_sum(s, scratch);
        };
        // keys below kmin are outside top-k; below kp, outside top-p (the smallest set reaching it)
        unsigned kmin = top_k > 0 && top_k < vocab ? bisect(0u, count_ge, (float)top_k) : 0u;
        unsigned kp = top_p < 1.f ? bisect(kmin, mass_ge, top_p * mass_ge(kmin)) : kmin;
        // draw u in [0, total) and find its token: contiguous chunks (whole float4s), prefix sums
        // of the chunks
        int per = 4 * ((vocab + 4 * nt - 1) / (4 * nt)), c0 = tid * per < vocab ? tid * per : vocab;
        int c1 = c0 + per < vocab ? c0 + per : vocab;
        float local = 0.f;
        scan_chunk(logits, c0, c1, [&](float v, int) {
            if (order_key(v) >= kp) local += expf((v - mx) / temperature);
        });
        chunk_sum[tid] = local;
        __syncthreads();
        if (tid == 0) {
            float run = 0.f;
            for (int t = 0; t < nt; t++) { float v = chunk_sum[t]; chunk_sum[t] = run; run += v; }
            scratch[0] = run;
        }
        __syncthreads();
        float u = uniform01(seed, (unsigned)state[2]) * scratch[0], run = chunk_sum[tid];
        if (u >= run && u < run + local) {  // at most one thread's range holds u
            int pick = -1;
            scan_chunk(logits, c0, c1, [&](float v, int i) {
                if (pick < 0 && order_key(v) >= kp) {
                    run += expf((v - mx) / temperature);
                    if (u < run) pick = i;
                }
            });
            if (pick >= 0) chosen = pick;
        }
    }
    __syncthreads();
    if (tid == 0) {
        state[1] = chosen;
        recent[state[3] % recent_n] = chosen;
        state[3] += 1;
        state[2] += 1;
        if (advance) state[0] += 1;
    }
}
