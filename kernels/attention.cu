// Attention over the f16 KV cache [ctx, kv_heads, head_dim], GQA-native (query head h reads kv
// head h / (heads / kv_heads)), f32 online softmax. Each warp keeps a running max m, denominator
// l and unnormalised output acc for the positions it visits; partial results merge by rescaling
// with exp(m_part - m_total), which is exact algebra, so any split of the positions gives the
// same softmax.
#include "common.cuh"

#define ATT_WARPS 4
#define PER_LANE (MAX_HEAD_DIM / 32)
#define ATT_UNROLL 4

struct Partial {
    float m, l, acc[PER_LANE];  // lane's elements lane, lane + 32, ...
};

// Positions p0, p0 + step, ... < p1 of one head into a warp's partial, ATT_UNROLL positions a
// round: their K and V rows are loaded before any is used, so a warp has that many rows in
// flight (one position at a time, decode attention was a chain of dependent loads: about 18 us
// a layer at 512 cached tokens on an H100, for 2 MB of cache).
__device__ __forceinline__ void attend(const float* q, const u16* kc, const u16* vc, int row, int hd,
                                       float scale, int p0, int p1, int step, Partial& r) {
    int lane = threadIdx.x & 31;
    float qr[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) {
        int e = lane + 32 * i;
        qr[i] = e < hd ? q[e] * scale : 0.f;
        r.acc[i] = 0.f;
    }
    r.m = NEG_INF;
    r.l = 0.f;
    for (int p = p0; p < p1; p += step * ATT_UNROLL) {
        u16 kh[ATT_UNROLL][PER_LANE], vh[ATT_UNROLL][PER_LANE];
#pragma unroll
        for (int u = 0; u < ATT_UNROLL; u++) {
            int pu = p + u * step < p1 ? p + u * step : p;  // past the end: a row already read, weight 0
            const u16* k = kc + (size_t)pu * row;
            const u16* v = vc + (size_t)pu * row;
#pragma unroll
            for (int i = 0; i < PER_LANE; i++) {
                bool in = lane + 32 * i < hd;
                kh[u][i] = in ? k[lane + 32 * i] : (u16)0;
                vh[u][i] = in ? v[lane + 32 * i] : (u16)0;
            }
        }
        float s[ATT_UNROLL], m = r.m;
#pragma unroll
        for (int u = 0; u < ATT_UNROLL; u++) {
            float a = 0.f;
#pragma unroll
            for (int i = 0; i < PER_LANE; i++) a += qr[i] * h2f(kh[u][i]);  // qr is 0 past hd
            float t = warp_sum(a);  // every lane, every round: the shuffle needs the whole warp
            s[u] = p + u * step < p1 ? t : NEG_INF;
            m = fmaxf(m, s[u]);
        }
        float corr = expf(r.m - m);  // exp(-inf) = 0 on the first round
        r.l *= corr;
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) r.acc[i] *= corr;
#pragma unroll
        for (int u = 0; u < ATT_UNROLL; u++) {
            float w = expf(s[u] - m);
            r.l += w;
#pragma unroll
            for (int i = 0; i < PER_LANE; i++) r.acc[i] += w * h2f(vh[u][i]);
        }
        r.m = m;
    }
}

// Merges the block's ATT_WARPS partials into shared memory: the total m and l, and the
// unnormalised output acc[head_dim]. A warp that saw no position has m = -inf, l = 0.
struct Merged {
    float m, l, acc[MAX_HEAD_DIM];
};

__device__ __forceinline__ void merge_warps(const Partial& r, int hd, Merged& out) {
    __shared__ float sm[ATT_WARPS], sl[ATT_WARPS], sacc[ATT_WARPS][MAX_HEAD_DIM];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        sm[warp] = r.m;
        sl[warp] = r.l;
    }
#pragma unroll
    for (int i = 0; i < PER_LANE; i++)
        if (lane + 32 * i < hd) sacc[warp][lane + 32 * i] = r.acc[i];
    __syncthreads();
    float m = NEG_INF;
    for (int w = 0; w < ATT_WARPS; w++) m = fmaxf(m, sm[w]);
    for (int e = threadIdx.x; e < hd; e += blockDim.x) {
        float a = 0.f;
        for (int w = 0; w < ATT_WARPS; w++)
            if (sm[w] != NEG_INF) a += sacc[w][e] * expf(sm[w] - m);
        out.acc[e] = a;
    }
    if (threadIdx.x == 0) {
        float l = 0.f;
        for (int w = 0; w < ATT_WARPS; w++)
            if (sm[w] != NEG_INF) l += sl[w] * expf(sm[w] - m);
        out.m = m;
        out.l = l;
    }
    __syncthreads();
}

// One head's split partials [splits][m, l, acc[hd]] -> out[hd] = merged acc / merged l. Warp 0
// takes the splits' m and l a lane each (splits <= 32), so every load of a round is in flight
// at once; an empty split has m = -inf, l = 0 and acc = 0, and weight 0.
__device__ __forceinline__ void combine_splits(const float* p, float* out, int splits, int hd) {
    __shared__ float weight[32], total;
    int lane = threadIdx.x & 31, stride = hd + 2;
    if (threadIdx.x < 32) {
        float m_s = lane < splits ? load_l2(p + lane * stride) : NEG_INF;
        float l_s = lane < splits ? load_l2(p + lane * stride + 1) : 0.f;
        float m = warp_max(m_s), w = m_s == NEG_INF ? 0.f : expf(m_s - m);
        float l = warp_sum(l_s * w);
        weight[lane] = w;
        if (lane == 0) total = l;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < hd; e += blockDim.x) {
        float a = 0.f;
#pragma unroll 8
        for (int s = 0; s < splits; s++) a += load_l2(p + s * stride + 2 + e) * weight[s];
        out[e] = a / total;
    }
}

// Decode, split over the context: grid (heads, splits), ATT_WARPS warps a block. n = pos[0] + 1
// positions (read on the device, so a replayed graph needs no new arguments). Each block writes
// its (head, split) partial [m, l, acc[head_dim]] to part and counts itself in done[head]; the
// head's last block merges them into out and resets the count for the next launch. (A separate
// combine kernel took 3.3 us a layer in gpu_profile.py on an H100, for under 50 KB of reads.)
extern "C" __global__ void attention_decode(const float* q, const u16* k_cache, const u16* v_cache,
                                            const int* pos, float* part, int* done, float* out, int heads,
                                            int kv_heads, int hd, float scale) {
    int h = blockIdx.x, split = blockIdx.y, splits = gridDim.y, warp = threadIdx.x >> 5;
    int n = pos[0] + 1, chunk = (n + splits - 1) / splits;
    int p0 = split * chunk, p1 = p0 + chunk < n ? p0 + chunk : n;
    int row = kv_heads * hd, kvh = h / (heads / kv_heads);
    Partial r;
    attend(q + h * hd, k_cache + kvh * hd, v_cache + kvh * hd, row, hd, scale, p0 + warp, p1, ATT_WARPS, r);
    __shared__ Merged mg;
    merge_warps(r, hd, mg);
    float* mine = part + ((size_t)h * splits + split) * (hd + 2);
    if (threadIdx.x == 0) {
        mine[0] = mg.m;
        mine[1] = mg.l;
    }
    for (int e = threadIdx.x; e < hd; e += blockDim.x) mine[2 + e] = mg.acc[e];
    __threadfence();  // this block's partial is visible device-wide before it is counted
    __syncthreads();
    __shared__ int last;
    if (threadIdx.x == 0) last = atomicAdd(done + h, 1) == splits - 1;
    __syncthreads();
    if (last) {
        combine_splits(part + (size_t)h * splits * (hd + 2), out + (size_t)h * hd, splits, hd);
        if (threadIdx.x == 0) done[h] = 0;
    }
}

// Prefill, causal: grid (T, heads); query t (rows q_stride floats apart) at position pos0[0] + t
// sees cache positions 0 .. pos0[0] + t. out [T, heads, hd].
extern "C" __global__ void attention_prefill(const float* q, int q_stride, const u16* k_cache,
                                             const u16* v_cache, const int* pos0, float* out, int heads,
                                             int kv_heads, int hd, float scale) {
    int t = blockIdx.x, h = blockIdx.y, warp = threadIdx.x >> 5;
    int n = pos0[0] + t + 1, row = kv_heads * hd, kvh = h / (heads / kv_heads);
    Partial r;
    attend(q + (size_t)t * q_stride + h * hd, k_cache + kvh * hd, v_cache + kvh * hd, row, hd, scale, warp, n,
           ATT_WARPS, r);
    __shared__ Merged mg;
    merge_warps(r, hd, mg);
    for (int e = threadIdx.x; e < hd; e += blockDim.x) out[((size_t)t * heads + h) * hd + e] = mg.acc[e] / mg.l;
}
