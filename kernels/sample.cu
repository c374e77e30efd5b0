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
// argmax was slower: docs/perf/code_figures.md). x must be 16-byte aligned.
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

// Index of the largest value, the lowest index among equals (as numpy.argmax); *mine is the
// largest value of this thread's share (scan_strided's), NEG_INF if it has none.
__device__ int block_argmax(const float* x, int n, float* mine) {
    __shared__ float sv[32];
    __shared__ int si[32];
    float best = NEG_INF;
    int idx = 0x7fffffff;
    scan_strided(x, n, [&](float v, int i) {  // increasing i: a later equal value keeps the lower index
        if (v > best) best = v, idx = i;
    });
    *mine = best;
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

// Prefix sums over the block in thread order (blockDim.x a multiple of 32): returns this
// thread's inclusive sum, *excl its exclusive one, *total the block's. A thread's exclusive sum
// is its predecessor's inclusive sum bit for bit, so [excl, incl) ranges tile [0, total) with no
// gap or overlap for a draw to fall through. scratch: 32 floats of shared memory.
__device__ float block_scan(float v, float* scratch, float* excl, float* total) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int o = 1; o < 32; o <<= 1) {
        float t = __shfl_up_sync(FULL_MASK, v, o);
        if (lane >= o) v += t;
    }
    float before_lane = __shfl_up_sync(FULL_MASK, v, 1);
    __syncthreads();  // a previous call may still be reading scratch
    if (lane == 31) scratch[warp] = v;
    __syncthreads();
    float before = 0.f, all = 0.f;
    for (int w = 0; w < warps; w++) {
        if (w == warp) before = all;
        all += scratch[w];
    }
    *excl = lane ? before + before_lane : before;
    *total = all;
    return before + v;
}

// Descending bitonic sort of a[0..n) in shared memory, n a power of two; every thread calls it.
__device__ void block_sort_desc(unsigned long long* a, int n) {
    for (int size = 2; size <= n; size <<= 1)
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            __syncthreads();
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                int j = i ^ stride;
                if (j > i) {
                    unsigned long long x = a[i], y = a[j];
                    if ((i & size) == 0 ? x < y : x > y) a[i] = y, a[j] = x;
                }
            }
        }
    __syncthreads();
}

// A candidate as one sortable word: its key above, its index's complement below, so a
// descending sort orders by value, then by index ascending among equal values.
__device__ __forceinline__ unsigned long long candidate(unsigned key, int i) {
    return ((unsigned long long)key << 32) | (unsigned)~i;
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

// Top-k's candidates, at most a thread each, gathered and sorted in shared memory. The k-th
// largest of the threads' maxima is at most the k-th largest logit (the maxima are k distinct
// logits), so one pass keeping what reaches it keeps the whole top k, and little else: of
// 128256 normal random logits, 41 on average for k = 40, 503 for k = 400. Top-p alone (top_k 0)
// takes the TOP_P_RANK largest as its candidates and one more pass for the whole vocabulary's
// mass: the candidates are a prefix by value, so if they hold top_p of that mass, the top-p set
// is among them. Returns false, having drawn nothing, when more than SAMPLE_CAP logits reach the
// floor (ties, or k near the thread count) or top-p's set is wider than its candidates, for
// sample_by_bisection to draw instead.
#define SAMPLE_CAP 1024
#define TOP_P_RANK 512
__device__ bool sample_sorted(const float* logits, int vocab, float mine, float mx, float temperature, int top_k,
                              float top_p, unsigned min_key, float u01, int* chosen) {
    __shared__ unsigned long long cand[SAMPLE_CAP];
    __shared__ float scratch[32];
    __shared__ int n_cand;
    __shared__ unsigned kp_shared;
    __shared__ float kept_mass;
    int tid = threadIdx.x, nt = blockDim.x, rank = top_k > 0 ? top_k : TOP_P_RANK;
    if (nt != SAMPLE_CAP || rank > SAMPLE_CAP) return false;  // both uniform across the block
    // the rank-th largest of the maxima's keys: 32 rounds of a barrier that counts (a 1024-entry
    // sort took 55 rounds of shared-memory exchanges)
    unsigned my_key = order_key(mine);
    unsigned floor_key = bisect(0u, [&](unsigned key) { return (float)__syncthreads_count(my_key >= key); },
                                (float)rank);
    if (tid == 0) n_cand = 0;
    __syncthreads();
    scan_strided(logits, vocab, [&](float v, int i) {
        unsigned key = order_key(v);
        if (key >= floor_key) {
            int slot = atomicAdd(&n_cand, 1);
            if (slot < SAMPLE_CAP) cand[slot] = candidate(key, i);
        }
    });
    __syncthreads();
    int n = n_cand, size = 2;
    if (n > SAMPLE_CAP) return false;
    while (size < n) size <<= 1;
    if (tid >= n && tid < size) cand[tid] = 0;  // below every real key (key 0 is a NaN's)
    block_sort_desc(cand, size);
    // thread i holds the i-th largest candidate; the top k are those reaching the k-th's key
    unsigned kth = top_k > 0 ? (unsigned)(cand[top_k - 1] >> 32) : 0u, key = (unsigned)(cand[tid] >> 32);
    int idx = (int)~(unsigned)cand[tid];
    bool in_k = tid < n && key >= kth;
    float w = in_k ? expf((logits[idx] - mx) / temperature) : 0.f, below, total;
    if (tid == 0) kp_shared = kth;  // no top-p cut (nor one found, should the sums be inf or NaN)
    float upto = block_scan(w, scratch, &below, &total);  // its barriers order that write first
    float mass = total;  // top-p's share is of the top k's mass, or of the whole vocabulary's
    if (top_k == 0) {
        float all = 0.f;
        scan_strided(logits, vocab, [&](float v, int) { all += expf((v - mx) / temperature); });
        mass = block_sum(all, scratch);
        if (!(total >= top_p * mass)) return false;  // uniform: block_sum's result is every thread's
    }
    // top-p: the keys down to the first whose running mass reaches p of that mass, all of that
    // key's ties included (the bisection's rule); the thread that crosses is the only one
    float target = top_p * mass;
    if (top_p < 1.f && in_k && upto >= target && below < target) kp_shared = key;
    __syncthreads();
    unsigned cut = kp_shared > min_key ? kp_shared : min_key;  // top-p's cut, or min-p's where higher
    bool keep = tid < n && key >= cut;  // a prefix of the sorted candidates
    bool last = keep && (tid + 1 == n || (unsigned)(cand[tid + 1] >> 32) < cut);
    if (last) kept_mass = upto;
    __syncthreads();
    float u = u01 * kept_mass;
    if (keep && u >= below && u < upto) *chosen = idx;
    return true;
}

// What sample_sorted leaves (and temperature alone, which needs no threshold): any top-k and
// top-p over the whole vocabulary, thresholds on the keys by bisection, each round a pass over
// the logits (about 66 passes with both on), then a draw by chunk sums in index order.
__device__ void sample_by_bisection(const float* logits, int vocab, float mx, float temperature, int top_k,
                                    float top_p, unsigned min_key, float u01, int* chosen) {
    __shared__ float scratch[32];
    int tid = threadIdx.x, nt = blockDim.x;
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
    if (kp < min_key) kp = min_key;  // min-p's cut, after top-p's as ollama's
    // draw u in [0, total): contiguous chunks (whole float4s) a thread, the chunks' prefix sums
    int per = 4 * ((vocab + 4 * nt - 1) / (4 * nt)), c0 = tid * per < vocab ? tid * per : vocab;
    int c1 = c0 + per < vocab ? c0 + per : vocab;
    float local = 0.f, below, total;
    scan_chunk(logits, c0, c1, [&](float v, int) {
        if (order_key(v) >= kp) local += expf((v - mx) / temperature);
    });
    float upto = block_scan(local, scratch, &below, &total);
    float u = u01 * total;
    if (u >= below && u < upto) {  // one thread's range holds u
        int pick = -1, last = -1;
        float run = below;
        scan_chunk(logits, c0, c1, [&](float v, int i) {
            if (pick < 0 && order_key(v) >= kp) {
                run += expf((v - mx) / temperature);
                last = i;
                if (u < run) pick = i;
            }
        });
        *chosen = pick >= 0 ? pick : last;  // summed again in another order, the chunk may end short of u
    }
}

extern "C" __global__ void sample(float* logits, int vocab, int* state, int* recent, int recent_n,
                                  float temperature, int top_k, float top_p, float min_p, float penalty,
                                  unsigned seed, int advance) {
    wait_prior_kernels();
    __shared__ int chosen;
    int tid = threadIdx.x;
    // llama.cpp's rule, once per distinct recent token: positive logits / penalty, negative * penalty
    int seen = state[3] < recent_n ? state[3] : recent_n;
    if (penalty != 1.f && tid < seen) {
        int tok = recent[tid];
        bool first = true;
        for (int j = 0; j < tid; j++) first = first && recent[j] != tok;
        if (first) logits[tok] = logits[tok] > 0.f ? logits[tok] / penalty : logits[tok] * penalty;
    }
    __syncthreads();
    float mine;
    int best = block_argmax(logits, vocab, &mine);
    if (tid == 0) chosen = best;
    __syncthreads();
    if (temperature > 0.f) {
        float mx = logits[best], u01 = uniform01(seed, (unsigned)state[2]);
        int k = top_k < vocab ? top_k : 0;  // 0: none
        // min-p keeps weights exp((v - mx) / temperature) >= min_p: the logits from this one up
        unsigned min_key = min_p > 0.f ? order_key(mx + temperature * logf(min_p)) : 0u;
        bool drawn = (k > 0 || top_p < 1.f) && sample_sorted(logits, vocab, mine, mx, temperature, k, top_p, min_key,
                                                             u01, &chosen);
        if (!drawn) sample_by_bisection(logits, vocab, mx, temperature, top_k, top_p, min_key, u01, &chosen);
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
