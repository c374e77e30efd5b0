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

// Index of the largest value, the lowest index among equals (as numpy.argmax).
__device__ int block_argmax(const float* x, int n) {
    __shared__ float sv[32];
    __shared__ int si[32];
    float best = NEG_INF;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        if (x[i] > best) { best = x[i]; idx = i; }
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
            for (int i = tid; i < vocab; i += nt) c += order_key(logits[i]) >= key ? 1.f : 0.f;
            return block_sum(c, scratch);
        };
        auto mass_ge = [&](unsigned key) {
            float s = 0.f;
            for (int i = tid; i < vocab; i += nt)
                if (order_key(logits[i]) >= key) s += expf((logits[i] - mx) / temperature);
            return block_sum(s, scratch);
        };
        // keys below kmin are outside top-k; below kp, outside top-p (the smallest set reaching it)
        unsigned kmin = top_k > 0 && top_k < vocab ? bisect(0u, count_ge, (float)top_k) : 0u;
        unsigned kp = top_p < 1.f ? bisect(kmin, mass_ge, top_p * mass_ge(kmin)) : kmin;
        // draw u in [0, total) and find its token: contiguous chunks, prefix sums of the chunks
        int per = (vocab + nt - 1) / nt, c0 = tid * per, c1 = c0 + per < vocab ? c0 + per : vocab;
        float local = 0.f;
        for (int i = c0; i < c1; i++)
            if (order_key(logits[i]) >= kp) local += expf((logits[i] - mx) / temperature);
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
            for (int i = c0; i < c1; i++) {
                if (order_key(logits[i]) < kp) continue;
                run += expf((logits[i] - mx) / temperature);
                if (u < run) { chosen = i; break; }
            }
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
