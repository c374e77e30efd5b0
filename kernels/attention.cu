// Attention over the f16 KV cache [ctx, kv_heads, head_dim], GQA-native (query head h reads kv
// head h / (heads / kv_heads)), f32 online softmax. Each warp keeps a running max m, denominator
// l and unnormalised output acc for the positions it visits; partial results merge by rescaling
// with exp(m_part - m_total), which is exact algebra, so any split of the positions gives the
// same softmax.
#include "common.cuh"

#define ATT_WARPS 4
#define ATT_UNROLL 4
#define ATT_LONG_CHUNK 16  // planes/cuda/launch.py's: positions a decode block takes before more blocks do
// Query heads of one kv group that a decode block attends for, reading each K and V row once for
// all of them, where a head is 33 to 64 or 97 to 128 wide (2 or 4 elements a lane: the widths
// models have; over 128, two heads' accumulators spilled, 392 bytes a thread in sass_mix.py's
// count, and every other width grouped would add its instantiation's compile time for none).
// planes/cuda/launch.py's decode_heads_per_block passes the count; a block per query head read
// every row once a head, 4 times over for Llama-3's groups (docs/perf/gpu_h200.md).
#define ATT_GROUP 4

// A lane holds NI consecutive elements of a head, lane * NI .. lane * NI + NI - 1 (NI = ceil(hd /
// 32), a template argument: the kernels switch on it, so a 128-wide head does 4 elements a lane,
// not the 8 that MAX_HEAD_DIM would, and loads them as one 8-byte word).
template <int NI>
struct Partial {
    float m, l, acc[NI];
};

// K or V elements e0 .. e0 + NI - 1 of a row (those past hd read as 0): one vector load when NI
// is 2, 4 or 8 and the lane's elements are all in the row, else NI predicated ones.
template <int NI>
__device__ __forceinline__ void load_halves(const u16* row, int e0, int hd, u16 (&h)[NI]) {
    if constexpr (NI == 2 || NI == 4 || NI == 8) {
        if (e0 + NI <= hd) {
            unsigned w[NI / 2];
            if constexpr (NI == 2) {
                w[0] = *(const unsigned*)(row + e0);
            } else if constexpr (NI == 4) {
                uint2 v = *(const uint2*)(row + e0);
                w[0] = v.x, w[1] = v.y;
            } else {
                uint4 v = *(const uint4*)(row + e0);
                w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
            }
#pragma unroll
            for (int i = 0; i < NI; i++) h[i] = (u16)(w[i / 2] >> (16 * (i & 1)));
            return;
        }
    }
#pragma unroll
    for (int i = 0; i < NI; i++) h[i] = e0 + i < hd ? row[e0 + i] : (u16)0;
}

// Decode's new K and V rows in f16 (K, then V at + MAX_HEAD_DIM), which the block whose split
// holds the new position writes and attend folds in: one shared array both find.
__device__ __forceinline__ u16* new_rows() {
    __shared__ uint4 rows[MAX_HEAD_DIM / 4];  // 16-byte aligned for load_halves
    return (u16*)rows;
}

// q . K row, its NI elements a lane (qr is 0 past hd): every lane must call it, for the shuffle.
template <int NI>
__device__ __forceinline__ float score(const float (&qr)[NI], const u16 (&kh)[NI]) {
    float a = 0.f;
#pragma unroll
    for (int i = 0; i < NI; i++) a += qr[i] * h2f(kh[i]);
    return warp_sum(a);
}

// U positions' scores s (NEG_INF: no position, weight 0) and V rows into a warp's running
// partial: the online softmax's rescale-and-add.
template <int NI, int U>
__device__ __forceinline__ void absorb(Partial<NI>& r, const float (&s)[U], const u16 (&vh)[U][NI]) {
    float m = r.m;
#pragma unroll
    for (int u = 0; u < U; u++) m = fmaxf(m, s[u]);
    float corr = expf(r.m - m);  // exp(-inf) = 0 on the first round
    r.l *= corr;
#pragma unroll
    for (int i = 0; i < NI; i++) r.acc[i] *= corr;
#pragma unroll
    for (int u = 0; u < U; u++) {
        float w = expf(s[u] - m);
        r.l += w;
#pragma unroll
        for (int i = 0; i < NI; i++) r.acc[i] += w * h2f(vh[u][i]);
    }
    r.m = m;
}

// Rows p0, p0 + step, ... < p1 of one kv head's cache into a warp's partials for the `count` query
// heads of its group that qr holds (G at most), ATT_UNROLL rows a round: their K and V rows are
// loaded before any is used, so a warp has that many rows in flight (one position at a time,
// decode attention was a chain of dependent loads, far below the memory's bandwidth:
// docs/perf/code_figures.md), and each row loaded serves every head. CAP: scores capped by softcap.
template <int NI, int G, bool CAP>
__device__ __forceinline__ void attend_rows(const float (&qr)[G][NI], const u16* kc, const u16* vc, int row, int hd,
                                            float softcap, int p0, int p1, int step, int count,
                                            Partial<NI> (&r)[G]) {
    int e0 = (threadIdx.x & 31) * NI;
    for (int p = p0; p < p1; p += step * ATT_UNROLL) {
        u16 kh[ATT_UNROLL][NI], vh[ATT_UNROLL][NI];
#pragma unroll
        for (int u = 0; u < ATT_UNROLL; u++) {
            int pu = p + u * step < p1 ? p + u * step : p;  // past the end: a row already read, weight 0
            load_halves<NI>(kc + (size_t)pu * row, e0, hd, kh[u]);
            load_halves<NI>(vc + (size_t)pu * row, e0, hd, vh[u]);
        }
#pragma unroll
        for (int g = 0; g < G; g++) {
            if (g < count) {  // the same for the whole block
                float sc[ATT_UNROLL];
#pragma unroll
                for (int u = 0; u < ATT_UNROLL; u++) {
                    float t = score<NI>(qr[g], kh[u]);
                    if constexpr (CAP) t = capped(t, softcap);
                    sc[u] = p + u * step < p1 ? t : NEG_INF;
                }
                absorb<NI, ATT_UNROLL>(r[g], sc, vh);
            }
        }
    }
}

// Positions p0, p0 + step, ... < p1 of one kv head for `count` query heads (q: their rotated rows,
// MAX_HEAD_DIM floats apart) into a warp's partials (attend_rows); then, if fold_new (attend_block
// sets it for warp 0 alone), one more position: decode's new token, whose K and V rows the block
// wrote to new_rows() behind a barrier. GEMMA: Gemma's layers, whose scores may be capped
// (softcap > 0, Gemma 2) and whose sliding-window caches hold `ring` rows, position p in row p %
// ring (cache_rows in arena.py): the positions run through the rows in at most two runs, the
// second from row 0. The other layers' instantiation has neither: inlined into its loop, a cap and
// the ring's arithmetic took decode's spill loads from 4 to 84-268 bytes (sass_mix.py, sm_90).
template <int NI, int G, bool GEMMA>
__device__ __forceinline__ void attend(const float* q, const u16* kc, const u16* vc, int row, int ring, int hd,
                                       float scale, float softcap, int p0, int p1, int step, int count,
                                       bool fold_new, Partial<NI> (&r)[G]) {
    int e0 = (threadIdx.x & 31) * NI;
    float qr[G][NI];
#pragma unroll
    for (int g = 0; g < G; g++) {
#pragma unroll
        for (int i = 0; i < NI; i++) {
            qr[g][i] = g < count && e0 + i < hd ? q[g * MAX_HEAD_DIM + e0 + i] * scale : 0.f;
            r[g].acc[i] = 0.f;
        }
        r[g].m = NEG_INF;
        r[g].l = 0.f;
    }
    if constexpr (GEMMA) {
        for (int base = p0 - p0 % ring, lo = p0; lo < p1; base += ring) {
            int end = p1 < base + ring ? p1 - base : ring;  // this run's rows: lo - base .. end - 1
            attend_rows<NI, G, true>(qr, kc, vc, row, hd, softcap, lo - base, end, step, count, r);
            lo += (base + end - lo + step - 1) / step * step;  // the warp's first position past the run
        }
    } else {
        attend_rows<NI, G, false>(qr, kc, vc, row, hd, softcap, p0, p1, step, count, r);
    }
    if (fold_new) {
        u16 kh[1][NI], vh[1][NI];
        load_halves<NI>(new_rows(), e0, hd, kh[0]);
        load_halves<NI>(new_rows() + MAX_HEAD_DIM, e0, hd, vh[0]);
#pragma unroll
        for (int g = 0; g < G; g++) {
            if (g < count) {
                float sc[1] = {score<NI>(qr[g], kh[0])};
                if constexpr (GEMMA) sc[0] = capped(sc[0], softcap);
                absorb<NI, 1>(r[g], sc, vh);
            }
        }
    }
}

// Merges the block's ATT_WARPS partials into shared memory: the total m and l, and the
// unnormalised output acc[head_dim]. A warp that saw no position has m = -inf, l = 0.
struct Merged {
    float m, l, acc[MAX_HEAD_DIM];
};

// The warps' partials in shared memory, declared once (attend_block) rather than in the template,
// whose every instantiation would get its own.
struct WarpPartials {
    float m[ATT_WARPS], l[ATT_WARPS], acc[ATT_WARPS][MAX_HEAD_DIM];
};

template <int NI>
__device__ __forceinline__ void merge_warps(const Partial<NI>& r, int hd, WarpPartials& wp, Merged& out) {
    float* sm = wp.m;
    float* sl = wp.l;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();  // the merge before (another head's) is done with wp and out
    if (lane == 0) {
        sm[warp] = r.m;
        sl[warp] = r.l;
    }
#pragma unroll
    for (int i = 0; i < NI; i++)
        if (lane * NI + i < hd) wp.acc[warp][lane * NI + i] = r.acc[i];
    __syncthreads();
    float m = NEG_INF;
    for (int w = 0; w < ATT_WARPS; w++) m = fmaxf(m, sm[w]);
    for (int e = threadIdx.x; e < hd; e += blockDim.x) {
        float a = 0.f;
        for (int w = 0; w < ATT_WARPS; w++)
            if (sm[w] != NEG_INF) a += wp.acc[w][e] * expf(sm[w] - m);
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

// A merged partial [m, l, acc[hd]] to `to` (a head's split's place in decode's partials).
__device__ __forceinline__ void store_partial(const Merged& mg, float* to, int hd) {
    if (threadIdx.x == 0) {
        to[0] = mg.m;
        to[1] = mg.l;
    }
    for (int e = threadIdx.x; e < hd; e += blockDim.x) to[2 + e] = mg.acc[e];
}

// One kv head's positions p0 + warp, p0 + warp + ATT_WARPS, ... < p1 for `count` query heads (q:
// their rotated rows, MAX_HEAD_DIM floats apart), each merged over the block's warps and stored
// at part + g * head_stride (hd + 2 floats), for the NI that hd needs (hd <= MAX_HEAD_DIM) and
// the heads a block takes with it (ATT_GROUP where a lane holds 2 or 4 elements, else one:
// count must not be more). fold_new: decode's new position, folded in by warp 0 (attend).
template <bool GEMMA>
__device__ __forceinline__ void attend_block(const float* q, const u16* kc, const u16* vc, int row, int ring, int hd,
                                             float scale, float softcap, int p0, int p1, int count, bool fold_new,
                                             float* part, size_t head_stride) {
    __shared__ WarpPartials wp;
    __shared__ Merged mg;
    int warp = threadIdx.x >> 5;
#define ATTEND_CASE(ni)                                                                           \
    case ni: {                                                                                    \
        constexpr int G = ni == 2 || ni == 4 ? ATT_GROUP : 1;                                     \
        Partial<ni> r[G];                                                                         \
        attend<ni, G, GEMMA>(q, kc, vc, row, ring, hd, scale, softcap, p0 + warp, p1, ATT_WARPS, count, \
                             fold_new && !warp, r);                                               \
        _Pragma("unroll") for (int g = 0; g < G; g++) {                                           \
            if (g < count) {                                                                      \
                merge_warps<ni>(r[g], hd, wp, mg);                                                \
                store_partial(mg, part + g * head_stride, hd);                                    \
            }                                                                                     \
        }                                                                                         \
        break;                                                                                    \
    }
    switch ((hd + 31) / 32) {
        ATTEND_CASE(1) ATTEND_CASE(2) ATTEND_CASE(3) ATTEND_CASE(4)
        ATTEND_CASE(5) ATTEND_CASE(6) ATTEND_CASE(7) ATTEND_CASE(8)
    }
#undef ATTEND_CASE
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

// Decode, split over the context: grid (blocks, most), ATT_WARPS warps a block, where a block
// takes `per_block` query heads of one kv group (decode_heads_per_block in planes/cuda/launch.py:
// at most ATT_GROUP where a lane holds 2 or 4 elements of a head, else one), so blocks =
// kv_heads * ceil(group / per_block), and reads each of its K and V rows once for all of them.
// The caches hold `ring`
// rows, position p in row p % ring (at least the window's, where window > 0). n = pos[0] + 1
// positions (the last `window` of them where window > 0: a sliding-window layer's; scores capped
// where softcap > 0, Gemma 2's; pos is read on the device, so a replayed graph needs no new
// arguments) go to `least` blocks of each head set, or more when each would take more than
// ATT_LONG_CHUNK, up to the grid's `most` (attention_splits in planes/cuda/launch.py); the blocks
// beyond return at once. The last position is the new token's: q, k_new and v_new are its q/k/v
// products before RoPE. Each block rotates its q heads itself, and the block whose split holds
// the new position makes that position's K row (rotated) and V row in f16 for itself; the
// group's first block also stores them in the cache for later launches. (A separate
// rope_kv_store launch did this before, at a cost beyond its launch gap:
// docs/perf/code_figures.md.) Each block writes its (head, split) partials [m, l, acc[head_dim]]
// to part, [heads][most], and counts itself in done[block]; the last block of a head set merges
// each head's into out and resets the count for the next launch (a separate combine kernel's
// time was mostly its launch).
// The launch bounds hold both attention kernels to 96 registers, 5 blocks an SM, as before the
// head-dim template. GEMMA: attend's (attention_decode_gemma for Gemma's layers).
// (The kernels spell their parameters out: tests/cuda_emu reads them from the source.)
#define DECODE_ARGS \
    q, k_new, v_new, cos_t, sin_t, k_cache, v_cache, ring, pos, part, done, out, heads, kv_heads, per_block, hd, \
        scale, least, window, softcap
template <bool GEMMA>
__device__ __forceinline__ void decode(const float* q, const float* k_new, const float* v_new, const float* cos_t,
                                       const float* sin_t, u16* k_cache, u16* v_cache, int ring, const int* pos,
                                       float* part, int* done, float* out, int heads, int kv_heads, int per_block,
                                       int hd, float scale, int least, int window, float softcap) {
    wait_prior_kernels();
    int set = blockIdx.x, split = blockIdx.y, most = gridDim.y, n = pos[0] + 1;
    int start = window > 0 && n > window ? n - window : 0;  // a sliding window's first position
    int splits = (n - start + ATT_LONG_CHUNK - 1) / ATT_LONG_CHUNK;
    splits = splits < least ? least : splits > most ? most : splits;
    if (split >= splits) return;  // the whole block, before any barrier
    int group = heads / kv_heads, sets = (group + per_block - 1) / per_block;
    int kvh = set / sets, g0 = set % sets * per_block, h0 = kvh * group + g0;
    int count = group - g0 < per_block ? group - g0 : per_block;
    int cur = n - 1, chunk = (n - start + splits - 1) / splits, half = hd / 2;
    int p0 = start + split * chunk, p1 = p0 + chunk < n ? p0 + chunk : n;
    int row = kv_heads * hd;
    const float *c = cos_t + (size_t)cur * half, *s = sin_t + (size_t)cur * half;
    bool has_new = p0 <= cur && cur < p1;  // this block's split holds the new position, its last
    // q rotated through shared memory: rotated in registers inside attend, it cost the hd-128 loop
    // 38 instructions a round (389, not 351) and spilled in the hd-224 one (sass_mix.py, sm_90)
    __shared__ float q_rot[ATT_GROUP][MAX_HEAD_DIM];
    for (int g = 0; g < count; g++)
        for (int e = threadIdx.x; e < hd; e += blockDim.x) q_rot[g][e] = rope_at(q + (h0 + g) * hd, e, half, c, s);
    if (has_new) {
        size_t at = ((size_t)(GEMMA ? cur % ring : cur) * kv_heads + kvh) * hd;
        u16 *k_row = new_rows(), *v_row = new_rows() + MAX_HEAD_DIM;
        for (int e = threadIdx.x; e < hd; e += blockDim.x) {
            k_row[e] = f2h(rope_at(k_new + kvh * hd, e, half, c, s));
            v_row[e] = f2h(v_new[kvh * hd + e]);
            if (g0 == 0) {
                k_cache[at + e] = k_row[e];
                v_cache[at + e] = v_row[e];
            }
        }
    }
    __syncthreads();
    size_t stride = (size_t)most * (hd + 2);  // a head's partials
    attend_block<GEMMA>(&q_rot[0][0], k_cache + kvh * hd, v_cache + kvh * hd, row, ring, hd, scale, softcap, p0,
                        has_new ? cur : p1, count, has_new, part + h0 * stride + (size_t)split * (hd + 2), stride);
    __threadfence();  // this block's partials are visible device-wide before it is counted
    __syncthreads();
    __shared__ int last;
    if (threadIdx.x == 0) last = atomicAdd(done + set, 1) == splits - 1;
    __syncthreads();
    if (!last) return;
    for (int g = 0; g < count; g++) {
        __syncthreads();  // the head before's merge is done with combine_splits' shared weights
        combine_splits(part + (h0 + g) * stride, out + (size_t)(h0 + g) * hd, splits, hd);
    }
    if (threadIdx.x == 0) done[set] = 0;
}

extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32, 5)
    attention_decode(const float* q, const float* k_new, const float* v_new, const float* cos_t, const float* sin_t,
                     u16* k_cache, u16* v_cache, int ring, const int* pos, float* part, int* done, float* out,
                     int heads, int kv_heads, int per_block, int hd, float scale, int least, int window,
                     float softcap) {
    decode<false>(DECODE_ARGS);
}

extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32, 5)
    attention_decode_gemma(const float* q, const float* k_new, const float* v_new, const float* cos_t,
                           const float* sin_t, u16* k_cache, u16* v_cache, int ring, const int* pos, float* part,
                           int* done, float* out, int heads, int kv_heads, int per_block, int hd, float scale,
                           int least, int window, float softcap) {
    decode<true>(DECODE_ARGS);
}
#undef DECODE_ARGS

// Prefill, causal, in tiles: a block takes R query rows a warp, ATT_WARPS * R in all, of one kv
// group. Row f of the group is query t = f / group of q head kvh * group + f % group, so a
// 4-head group's block of 32 rows holds 8 queries' 4 heads, all reading the same K and V. The
// block copies PF_TILE positions' K and V rows to shared memory at a time, once for all its rows:
// a block per query and head, as before, read every K and V row before its query from L2 again,
// about 2 GB a layer for a 512-token prompt at Llama-3-8B's shapes (32 heads, 8 kv heads, hd
// 128), where 32-row tiles read 1/32 of that. Scores: lane j takes position p0 + j for each of
// the warp's rows, the q rows (scaled) broadcast from shared memory, the K tile's rows an odd
// number of words apart so that the 32 lanes' loads hit 32 banks. Output: a lane holds NI
// consecutive elements of each row, as decode's lanes do, and the tile's softmax weights come
// through shared memory, 4 positions a load. Every stride in shared memory is a constant of the
// template, so loads take immediate offsets instead of address arithmetic.
#define PF_TILE 32
#define PF_SHARED_BYTES 42112  // the largest variant's: NI 8, R 2 (pf_layout)

// Where each array of a (NI, R) variant sits in the kernel's shared buffer, in bytes.
template <int NI, int R>
struct pf_layout {
    static constexpr int q_row = 32 * NI;         // floats: a row of q, zeros past hd
    static constexpr int v_row = 32 * NI;         // halves: a V row (16-byte aligned rows)
    static constexpr int k_row = 16 * NI + 1;     // words: a K row, an odd count
    static constexpr int q_at = 0, p_at = q_at + ATT_WARPS * R * q_row * 4;
    static constexpr int v_at = p_at + ATT_WARPS * R * PF_TILE * 4, k_at = v_at + PF_TILE * v_row * 2;
    static constexpr int bytes = k_at + PF_TILE * k_row * 4;
    static_assert(bytes <= PF_SHARED_BYTES, "the shared buffer is sized for the largest variant");
};

// GEMMA: Gemma's layers (attend's): capped scores, ring caches, and the tiles below the block's
// first window skipped, which the others' instantiation leaves out of its loop.
template <int NI, int R, bool GEMMA>
__device__ __forceinline__ void prefill_rows(const float* q, int q_stride, const u16* kc, const u16* vc, int ring,
                                             int pos0, float* out, float* part, int* done, int T, int heads,
                                             int kv_heads, int hd, float scale, int window, float softcap,
                                             unsigned char* smem) {
    typedef pf_layout<NI, R> L;
    float* qs = (float*)(smem + L::q_at);
    float* ps = (float*)(smem + L::p_at);
    u16* vs = (u16*)(smem + L::v_at);
    unsigned* ks = (unsigned*)(smem + L::k_at);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, group = heads / kv_heads, kvh = blockIdx.y;
    int row = kv_heads * hd, words = hd / 2;
    int first = blockIdx.x * ATT_WARPS * R, mine = first + warp * R;
    int last_t = (first + ATT_WARPS * R - 1) / group;
    int n = pos0 + (last_t < T ? last_t : T - 1) + 1;  // positions the block's last query sees
    // from the tile of the first position its first query sees: 0, or that query's window's start
    int seen0 = GEMMA && window > 0 ? pos0 + first / group + 1 - window : 0;
    int base = seen0 > 0 ? seen0 / PF_TILE * PF_TILE : 0;
    int splits = gridDim.z, tiles = (n - base + PF_TILE - 1) / PF_TILE, chunk = (tiles + splits - 1) / splits;
    int from = base + (int)blockIdx.z * chunk * PF_TILE, to = from + chunk * PF_TILE < n ? from + chunk * PF_TILE : n;
    // the block's q rows, scaled; a row past the prompt is zeros, sees position 0 and is not stored
    for (int r = warp; r < ATT_WARPS * R; r += ATT_WARPS) {
        int t = (first + r) / group, h = kvh * group + (first + r) % group;
        for (int e = lane; e < L::q_row; e += 32)
            qs[r * L::q_row + e] = t < T && e < hd ? q[(size_t)t * q_stride + h * hd + e] * scale : 0.f;
    }
    int lim[R], lo[R];  // a row sees positions lo .. lim - 1 (lo: a sliding window's first)
    float m[R], l[R], acc[R][NI];
#pragma unroll
    for (int i = 0; i < R; i++) {
        int t = (mine + i) / group;
        lim[i] = t < T ? pos0 + t + 1 : 1;
        lo[i] = window > 0 && lim[i] > window ? lim[i] - window : 0;
        m[i] = NEG_INF;
        l[i] = 0.f;
#pragma unroll
        for (int e = 0; e < NI; e++) acc[i][e] = 0.f;
    }
    const unsigned *kb = (const unsigned*)(kc + kvh * hd), *vb = (const unsigned*)(vc + kvh * hd);
    const float* qw = qs + warp * R * L::q_row;
    float* pw = ps + warp * R * PF_TILE;
    int e0 = lane * NI;
    for (int p0 = from; p0 < to; p0 += PF_TILE) {
        __syncthreads();  // q is in place, and every warp is done with the last tile
#pragma unroll
        for (int j = warp; j < PF_TILE; j += ATT_WARPS) {
            bool in = p0 + j < n;  // past n: zeros, which weight 0 keeps out (garbage could be NaN; 0 * NaN is NaN)
            size_t at = (size_t)(in ? (GEMMA ? (p0 + j) % ring : p0 + j) : 0) * (row / 2);
            for (int w = lane; w < words; w += 32) {
                ks[j * L::k_row + w] = in ? kb[at + w] : 0u;
                ((unsigned*)vs)[j * (L::v_row / 2) + w] = in ? vb[at + w] : 0u;
            }
        }
        __syncthreads();
        float s[R];
#pragma unroll
        for (int i = 0; i < R; i++) s[i] = 0.f;
        const unsigned* kj = ks + lane * L::k_row;
        for (int w = 0; w < words; w++) {
            unsigned kk = kj[w];
            float k0 = h2f((u16)kk), k1 = h2f((u16)(kk >> 16));
#pragma unroll
            for (int i = 0; i < R; i++) {
                float2 qq = *(const float2*)(qw + i * L::q_row + 2 * w);  // one address for the warp: a broadcast
                s[i] = fmaf(qq.x, k0, s[i]);
                s[i] = fmaf(qq.y, k1, s[i]);
            }
        }
#pragma unroll
        for (int i = 0; i < R; i++) {
            float si = p0 + lane < lim[i] && p0 + lane >= lo[i] ? (GEMMA ? capped(s[i], softcap) : s[i]) : NEG_INF;
            float mi = fmaxf(m[i], warp_max(si));  // -inf while a split's row has seen no position
            float corr = mi == NEG_INF ? 1.f : expf(m[i] - mi), w = mi == NEG_INF ? 0.f : expf(si - mi);
            m[i] = mi;
            l[i] = l[i] * corr + w;  // this lane's positions; summed over the warp at the end
#pragma unroll
            for (int e = 0; e < NI; e++) acc[i][e] *= corr;
            pw[i * PF_TILE + lane] = w;
        }
        __syncwarp();
        for (int j = 0; j < PF_TILE; j += 4) {
            float v[4][NI];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                u16 vh[NI];
                load_halves<NI>(vs + (j + u) * L::v_row, e0, L::v_row, vh);  // past hd: acc elements never stored
#pragma unroll
                for (int e = 0; e < NI; e++) v[u][e] = h2f(vh[e]);
            }
#pragma unroll
            for (int i = 0; i < R; i++) {
                float4 wt = *(const float4*)(pw + i * PF_TILE + j);
#pragma unroll
                for (int e = 0; e < NI; e++) {
                    float a = fmaf(wt.x, v[0][e], acc[i][e]);
                    a = fmaf(wt.y, v[1][e], a);
                    a = fmaf(wt.z, v[2][e], a);
                    acc[i][e] = fmaf(wt.w, v[3][e], a);
                }
            }
        }
    }
    // One split: the rows' outputs. Several: each row's partial [m, l, acc[hd]] at
    // part[((block * rows + row) * splits + split) * (hd + 2)], and the block's last split to
    // finish merges them (as attention_decode's last block does a head's).
    int rows = ATT_WARPS * R, block = blockIdx.y * gridDim.x + blockIdx.x;
#pragma unroll
    for (int i = 0; i < R; i++) {
        int t = (mine + i) / group, h = kvh * group + (mine + i) % group;
        float total = warp_sum(l[i]);
        if (splits == 1) {
            if (t < T)
#pragma unroll
                for (int e = 0; e < NI; e++)
                    if (e0 + e < hd) out[((size_t)t * heads + h) * hd + e0 + e] = acc[i][e] / total;
        } else {
            float* p = part + (((size_t)block * rows + warp * R + i) * splits + blockIdx.z) * (hd + 2);
            if (lane == 0) {
                p[0] = m[i];
                p[1] = total;
            }
#pragma unroll
            for (int e = 0; e < NI; e++)
                if (e0 + e < hd) p[2 + e0 + e] = acc[i][e];
        }
    }
    if (splits == 1) return;
    __threadfence();  // this block's partials are visible device-wide before it is counted
    __syncthreads();
    __shared__ int last;
    if (threadIdx.x == 0) last = atomicAdd(done + block, 1) == splits - 1;
    __syncthreads();
    if (!last) return;
    for (int r = 0; r < rows; r++) {
        int t = (first + r) / group, h = kvh * group + (first + r) % group;
        __syncthreads();  // the last row's merge is done with combine_splits' shared weights
        if (t < T)
            combine_splits(part + (size_t)(block * rows + r) * splits * (hd + 2), out + ((size_t)t * heads + h) * hd,
                           splits, hd);
    }
    if (threadIdx.x == 0) done[block] = 0;  // for the next launch
}

// Prefill, causal: grid (ceil(T * group / rows), kv_heads, splits), ATT_WARPS warps a block,
// where rows is ATT_WARPS * 8 up to 128-wide heads and ATT_WARPS * 2 above (their accumulators
// would need 64 registers a lane at 8 rows a warp; planes/cuda/launch.py's prefill_block_rows). Query
// t (rows q_stride floats apart) at position pos0[0] + t sees cache positions 0 .. pos0[0] + t, or
// with window > 0 the last `window` of them. out [T, heads, hd]. splits (1 to 32) divide each
// block's positions between that many blocks, so that a short prompt after a long context still
// fills the GPU; with more than one, part holds their partials [row blocks x rows x splits x (hd
// + 2)] and done a count a row block, zero before and after. attention_prefill_gemma, for Gemma's
// layers, caps the scaled scores where softcap > 0 (Gemma 2) and reads caches of `ring` rows,
// position p in row p % ring (at least window + T - 1 of them); attention_prefill takes neither.
template <bool GEMMA>
__device__ __forceinline__ void prefill(const float* q, int q_stride, const u16* k_cache, const u16* v_cache, int ring,
                                        const int* pos0, float* out, float* part, int* done, int T, int heads,
                                        int kv_heads, int hd, float scale, int window, float softcap) {
    wait_prior_kernels();
    __shared__ uint4 smem[PF_SHARED_BYTES / 16];
#define PREFILL_CASE(ni, r)                                                                                    \
    case ni:                                                                                                   \
        prefill_rows<ni, r, GEMMA>(q, q_stride, k_cache, v_cache, ring, pos0[0], out, part, done, T, heads,   \
                                   kv_heads, hd, scale, window, softcap, (unsigned char*)smem);               \
        break;
    switch ((hd + 31) / 32) {
        PREFILL_CASE(1, 8) PREFILL_CASE(2, 8) PREFILL_CASE(3, 8) PREFILL_CASE(4, 8)
        PREFILL_CASE(5, 2) PREFILL_CASE(6, 2) PREFILL_CASE(7, 2) PREFILL_CASE(8, 2)
    }
#undef PREFILL_CASE
}

#define PREFILL_ARGS \
    q, q_stride, k_cache, v_cache, ring, pos0, out, part, done, T, heads, kv_heads, hd, scale, window, softcap
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
    attention_prefill(const float* q, int q_stride, const u16* k_cache, const u16* v_cache, int ring, const int* pos0,
                      float* out, float* part, int* done, int T, int heads, int kv_heads, int hd, float scale,
                      int window, float softcap) {
    prefill<false>(PREFILL_ARGS);
}

extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
    attention_prefill_gemma(const float* q, int q_stride, const u16* k_cache, const u16* v_cache, int ring,
                            const int* pos0, float* out, float* part, int* done, int T, int heads, int kv_heads,
                            int hd, float scale, int window, float softcap) {
    prefill<true>(PREFILL_ARGS);
}
#undef PREFILL_ARGS
