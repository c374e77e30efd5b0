// Decode matvecs, split over K: a block of blockDim.x threads (a multiple of 32, at most
// MV_MAX_THREADS; the host sizes it to the row's blocks) computes MV_ROWS rows; thread t takes the
// 32-weight blocks t, t + blockDim.x, ... of every one of its rows. A thread issues all MV_ROWS
// 16-byte weight loads (and their scales) before it uses any of them: decode reads each weight
// once, so what bounds it is the bytes in flight per SM (with one load in flight at a time this
// kernel read a small part of the bandwidth: docs/perf/code_figures.md). Rows past the end are
// read as the last row and not stored, so the loads need no predicates. Q4_0 in nerva's two
// planes: qs [rows, cols/2] (byte j of a block holds element j in its low nibble and j + 16 in
// its high one), d f16 [rows, cols/32]; Q4_1 adds a third, its offsets m f16 [rows, cols/32]
// (weight d q + m), through the *_q4_1_* entry points.
#include "common.cuh"

#ifndef MV_ROWS
#define MV_ROWS 8
#endif
#ifndef MV_MAX_THREADS
#define MV_MAX_THREADS 128  // planes/cuda/launch.py's MV_THREADS (gpu_matvec_sweep.py sets both)
#endif
// At least 640 threads of a Q4_0 matvec resident per SM, which holds it to 96 registers a thread
// at 128 a block: W4A16's GLU kernel took 100 and W4A8 (quantising x in the loop) 127, which the
// register file's allocation unit (256 a warp) turns into 4 blocks an SM instead of 5. Bounded,
// the GLU kernels and W4A16 do not spill; the plain W4A8 matvecs did (matvec_q4_w4a8 80 bytes,
// NVRTC 13.5, sm_75 to sm_90: its 8 rows and row pointers, stored before the loop and reloaded
// every round, 14 LDL of 611 instructions). Those two take MV_W4A8_MIN_BLOCKS instead: 512
// threads an SM, 128 registers, no spill for Q4_0 (596 instructions); Q4_1's spilled 112 bytes at
// 96, 32 at 128, and since q4_rounds none on sm_90 and 8 on sm_75. matvec_q4_w4a8 read an 8B
// step's matrices faster at 4 blocks an SM than at 5; at 4 blocks W4A16 would take 121 registers
// (no spill either way) and read them slower, so W4A16 stays at 5 (docs/perf/code_figures.md).
// (The exact kernels need fewer registers: a bound would let ptxas spend up to 96 on them.)
// Bounded at 96, glu_q4_1_w4a8 spills 24 bytes (20 before q4_rounds on sm_75 to sm_89), and Q4_1's
// W4A16 kernels, which did not spill but for matvec_q4_1_w4a16's 24 on sm_90, spill 8 (matvec)
// and 48 (glu) on sm_86 and sm_89, 40 and 28 on sm_90 (NVRTC 13.5), in their peeled first round
// but for one reload a round in matvec_q4_1_w4a16's loop on sm_90; Q4_0's loops are as they
// were (938, 912 and 596 instructions, scripts/sass_mix.py).
#ifndef MV_MIN_BLOCKS
#define MV_MIN_BLOCKS (640 / MV_MAX_THREADS)
#endif
#ifndef MV_W4A8_MIN_BLOCKS
#define MV_W4A8_MIN_BLOCKS (512 / MV_MAX_THREADS)
#endif

// W4A16 turns a code n into the float n - 8 without an int conversion. (float)((int)n - 8) made
// the loop 1399 instructions per 8 rows of a block, 973 of them integer (I2FP, shift, mask,
// subtract; scripts/sass_mix.py, sm_90), and the integer pipe issues at half the FP32 rate, a
// bound below the memory's bandwidth (docs/perf/code_figures.md).
// Instead a nibble n at bits 4s..4s+3 (s < 4), ORed into the bits of 2^23, reads as the float
// 2^23 + n 16^s, exactly, and subtracting 2^23 + 8 16^s leaves (n - 8) 16^s, exactly: one LOP3
// and one FADD a weight and a shift per 8, 906 instructions, 327 of them integer (938 with
// norm_tail below in the kernel). The x it meets was divided by 16^s (a power of two: exact), so
// each product is (n - 8) x rounded once, as before.
// (MAGIC and q4_code are in common.cuh: prefill's dequantize_q4 decodes codes the same way.)

// sum_j (q_j - 8) x_j over one block of 32 weights, x[k] holding elements 4k..4k+3 divided by
// 16^s for their nibble: 1, 16^2, 1, 16^2 for the low nibbles (k < 4); 16, 16^3, 16, 16^3 after.
__device__ __forceinline__ float q4_block_dot(uint4 c, const float4 (&x)[8]) {
    unsigned words[4] = {c.x, c.y, c.z, c.w};
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        float4 lo = x[k], hi = x[4 + k];  // elements 4k..4k+3 and 16+4k..16+4k+3
        unsigned w = words[k], u = w >> 16;  // bytes 4k, 4k+1 in w's low half; 4k+2, 4k+3 in u's
        s = fmaf(q4_code(and_or<0xFu>(w, MAGIC), 8388616.f), lo.x, s);
        s = fmaf(q4_code(and_or<0xF0u>(w, MAGIC), 8388736.f), hi.x, s);
        s = fmaf(q4_code(and_or<0xF00u>(w, MAGIC), 8390656.f), lo.y, s);
        s = fmaf(q4_code(and_or<0xF000u>(w, MAGIC), 8421376.f), hi.y, s);
        s = fmaf(q4_code(and_or<0xFu>(u, MAGIC), 8388616.f), lo.z, s);
        s = fmaf(q4_code(and_or<0xF0u>(u, MAGIC), 8388736.f), hi.z, s);
        s = fmaf(q4_code(and_or<0xF00u>(u, MAGIC), 8390656.f), lo.w, s);
        s = fmaf(q4_code(and_or<0xF000u>(u, MAGIC), 8421376.f), hi.w, s);
    }
    return s;
}

// A launch covers up to three matrices that share the input vector (a layer's q, k and v; gate
// and up): one launch instead of three, and the small k and v no longer run alone on a GPU they
// cannot fill. Blocks go to matrix 0's rows first, then 1's, then 2's; a matrix of 0 rows is
// absent. Each matrix: weights, scales (unused by exact weights), out, rows.
#define MATRICES const void *w0, const u16 *d0, float *out0, int rows0, const void *w1, const u16 *d1, \
                 float *out1, int rows1, const void *w2, const u16 *d2, float *out2, int rows2
#define PICK(i, a0, a1, a2) ((i) == 0 ? (a0) : (i) == 1 ? (a1) : (a2))
#define HALF (MV_ROWS / 2)

// Where a block's MV_ROWS row slots come from. A plain launch: MV_ROWS consecutive rows of one
// matrix. A GLU launch (matrix 0 gate, 1 up, out0 = silu(gate x) * up x): slots r < HALF are gate
// rows and the rest the same rows of up, so a block holds both factors of each of its outputs
// and the silu_mul launch goes. Rows past the end are read as the last row and not stored.
struct Slots {
    const void* w[2];
    const u16 *d[2], *m[2];  // m: Q4_1's offsets (null for Q4_0 and exact weights)
    float* out;
    int row0, rows;
};

template <bool GLU>
__device__ __forceinline__ Slots block_slots(MATRICES, const u16* m0, const u16* m1, const u16* m2) {
    Slots s;
    if (GLU) {
        s.w[0] = w0, s.d[0] = d0, s.m[0] = m0, s.w[1] = w1, s.d[1] = d1, s.m[1] = m1;
        s.out = out0, s.row0 = blockIdx.x * HALF, s.rows = rows0;
        return s;
    }
    int b = blockIdx.x, n0 = (rows0 + MV_ROWS - 1) / MV_ROWS, n1 = (rows1 + MV_ROWS - 1) / MV_ROWS;
    int i = b < n0 ? 0 : b < n0 + n1 ? 1 : 2;
    s.w[0] = s.w[1] = PICK(i, w0, w1, w2);
    s.d[0] = s.d[1] = PICK(i, d0, d1, d2);
    s.m[0] = s.m[1] = PICK(i, m0, m1, m2);
    s.out = PICK(i, out0, out1, out2);
    s.row0 = (b - (i > 0 ? n0 : 0) - (i > 1 ? n1 : 0)) * MV_ROWS;
    s.rows = PICK(i, rows0, rows1, rows2);
    return s;
}

// Slot r's matrix (0 or 1) and row; r is a compile-time constant once the loops unroll.
template <bool GLU>
__device__ __forceinline__ int slot_matrix(int r) { return GLU && r >= HALF ? 1 : 0; }
template <bool GLU>
__device__ __forceinline__ size_t slot_row(const Slots& s, int r) {
    int row = s.row0 + (GLU ? r % HALF : r);
    return (size_t)(row < s.rows ? row : s.rows - 1);
}

// Block b (32 weights: 16 code bytes, a scale and for Q4_1 an offset) of each slot's row, every
// load issued before any is used. A thread's first block is loaded before wait_prior_kernels
// (common.cuh): those loads are in flight while the kernel before finishes.
template <bool GLU, bool OFFSETS>
__device__ __forceinline__ void load_q4_block(const Slots& s, int cols, int b, uint4 (&c)[MV_ROWS], u16 (&h)[MV_ROWS],
                                              u16 (&o)[MV_ROWS]) {
#pragma unroll
    for (int r = 0; r < MV_ROWS; r++) {
        size_t row = slot_row<GLU>(s, r);
        c[r] = weights((const uint4*)((const u8*)s.w[slot_matrix<GLU>(r)] + row * (cols / 2)) + b);
        h[r] = weights(s.d[slot_matrix<GLU>(r)] + row * (cols / QK) + b);
        if (OFFSETS) o[r] = weights(s.m[slot_matrix<GLU>(r)] + row * (cols / QK) + b);
    }
}

// A Q4 launch's rounds: thread t takes blocks t, t + blockDim.x, ... of its rows, and
// round(b, codes, scales, offsets) uses each. The first round's weights are loaded before
// wait_prior_kernels, the first round written out apart from the loop so that its arrays are as
// short-lived as the loop's (one loop with the load hoisted kept them live across it: 120 to 216
// bytes of spills on sm_75 to sm_90, where there were none).
template <bool GLU, bool OFFSETS, class Round>
__device__ __forceinline__ void q4_rounds(const Slots& s, int cols, Round round) {
    int nb = cols / QK, b = threadIdx.x;
    if (b < nb) {
        uint4 c[MV_ROWS];
        u16 h[MV_ROWS], o[MV_ROWS];
        load_q4_block<GLU, OFFSETS>(s, cols, b, c, h, o);
        wait_prior_kernels();
        round(b, c, h, o);
        b += blockDim.x;
    } else {
        wait_prior_kernels();
    }
    for (; b < nb; b += blockDim.x) {
        uint4 c[MV_ROWS];
        u16 h[MV_ROWS], o[MV_ROWS];
        load_q4_block<GLU, OFFSETS>(s, cols, b, c, h, o);
        round(b, c, h, o);
    }
}

// What a plain launch does with its sums (GLU launches always store silu(gate) * up):
#define STORE 0     // out[row] = sum
#define ADD 1       // out[row] += sum: a layer's o and down products go straight into the residual
                    // stream, rounded once, as a separate add was, without its launch
#define ADD_NORM 2  // ADD, then the launch's last block: norm_out = rmsnorm(out) * norm_w
#define GLU_GELU 1  // a glu launch's epilogue: GeLU's tanh form (Gemma's GeGLU) in place of SiLU

#define TAIL_LOADS 4

// out[i0 + j stride] for j < TAIL_LOADS (0 past n), from L2, every load issued at once
__device__ __forceinline__ void tail_loads(const float* out, int i0, int stride, int n, float4 (&v)[TAIL_LOADS]) {
#pragma unroll
    for (int j = 0; j < TAIL_LOADS; j++) v[j] = i0 + j * stride < n ? load_l2_4(out + i0 + j * stride) : float4{};
}

// The norm that follows a residual add, by the launch's last block once every block has added its
// rows (a count in *done, reset for the next launch): norm_out[0..n) = out * inv_rms * w, as
// norm.cu's rmsnorm computes it, without that launch (twice a layer; docs/perf/code_figures.md).
// n must be a multiple of 4, as rmsnorm's. Each pass over out keeps
// TAIL_LOADS float4 loads in flight a thread. Its presence costs the W4A16 loop 32 instructions
// a round (938, not 906, by sass_mix.py: ptxas then recomputes the slots' clamped rows each
// round), a cost taken because that loop's issue bound stays above memory speed. Every thread of
// the block must call it.
__device__ __forceinline__ void norm_tail(const float* out, int n, const float* w, float eps, float* norm_out,
                                          int* done) {
    __shared__ int last;
    __shared__ float scratch[32];
    __threadfence();  // this block's rows are visible device-wide before it is counted
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(done, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    int stride = 4 * blockDim.x;
    float4 v[TAIL_LOADS];
    float ss = 0.f;
#pragma unroll 1
    for (int i0 = 4 * threadIdx.x; i0 < n; i0 += TAIL_LOADS * stride) {
        tail_loads(out, i0, stride, n, v);
#pragma unroll
        for (int j = 0; j < TAIL_LOADS; j++)
            ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
    }
    float inv = 1.f / sqrtf(block_sum(ss, scratch) / (float)n + eps);
#pragma unroll 1
    for (int i0 = 4 * threadIdx.x; i0 < n; i0 += TAIL_LOADS * stride) {
        tail_loads(out, i0, stride, n, v);
#pragma unroll
        for (int j = 0; j < TAIL_LOADS; j++) {
            int i = i0 + j * stride;
            if (i < n) {
                float4 g = *(const float4*)(w + i), o;
                o.x = v[j].x * inv * g.x;
                o.y = v[j].y * inv * g.y;
                o.z = v[j].z * inv * g.z;
                o.w = v[j].w * inv * g.w;
                *(float4*)(norm_out + i) = o;
            }
        }
    }
    if (threadIdx.x == 0) *done = 0;
}

// The block's MV_ROWS partial sums -> its outputs (mode: STORE, or ADD and ADD_NORM's add); every
// thread of the block must call it. GLU: out[row] = silu(gate) * up, as silu_mul (elementwise.cu)
// computes it.
template <bool GLU>
__device__ __forceinline__ void store_slots(float (&acc)[MV_ROWS], const Slots& s, int mode) {
    __shared__ float part[MV_MAX_THREADS / 32][MV_ROWS];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5, t = threadIdx.x;
#pragma unroll
    for (int r = 0; r < MV_ROWS; r++) {
        float v = warp_sum(acc[r]);
        if (lane == 0) part[warp][r] = v;
    }
    __syncthreads();
    if (t < (GLU ? HALF : MV_ROWS) && s.row0 + t < s.rows) {
        float v = 0.f, u = 0.f;
        for (int w = 0; w < warps; w++) v += part[w][t];
        float* o = s.out + s.row0 + t;
        if (GLU) {
            for (int w = 0; w < warps; w++) u += part[w][t + HALF];
            *o = (mode == GLU_GELU ? gelu_tanh(v) : v / (1.f + expf(-v))) * u;
        } else {
            *o = mode == STORE ? v : *o + v;
        }
    }
}

#define ALL_MATRICES w0, d0, out0, rows0, w1, d1, out1, rows1, w2, d2, out2, rows2

// W4A16. A Q4_1 block (OFFSETS) is sum_j (d q_j + m) x_j = d sum_j (q_j - 8) x_j + (m + 8 d) sx,
// sx the block's sum of x: the same code dot as Q4_0's, and one more product a row, with sx
// shared by the block's rows. Taking the dot about 8 keeps its terms as small as Q4_0's, and
// m + 8 d, the weight of code 8, is near 0 where the weights are centred (m, their minimum, near
// -7.5 d), so the added term is small too: f32 rounding stays where Q4_0's is.
template <bool GLU, bool OFFSETS>
__device__ __forceinline__ void q4_w4a16(MATRICES, const u16* m0, const u16* m1, const u16* m2,
                                         const float* __restrict__ x, int cols, int mode) {
    Slots s = block_slots<GLU>(ALL_MATRICES, m0, m1, m2);
    float acc[MV_ROWS] = {};
    q4_rounds<GLU, OFFSETS>(s, cols, [&](int b, const uint4 (&c)[MV_ROWS], const u16 (&h)[MV_ROWS],
                                         const u16 (&o)[MV_ROWS]) {
        float4 xb[8];
        float sx = 0.f;
#pragma unroll
        for (int k = 0; k < 8; k++) {  // x / 16^s for the nibble each element meets (q4_block_dot)
            float even = k < 4 ? 1.f : 1.f / 16.f, odd = even / 256.f;  // elements 16.. are high nibbles
            xb[k] = ((const float4*)(x + b * QK))[k];
            if (OFFSETS) sx += (xb[k].x + xb[k].y) + (xb[k].z + xb[k].w);
            xb[k].x *= even, xb[k].y *= odd, xb[k].z *= even, xb[k].w *= odd;
        }
#pragma unroll
        for (int r = 0; r < MV_ROWS; r++) {
            float d = h2f(h[r]);
            acc[r] += d * q4_block_dot(c[r], xb);
            if (OFFSETS) acc[r] += fmaf(8.f, d, h2f(o[r])) * sx;
        }
    });
    store_slots<GLU>(acc, s, mode);
}

// W4A8's activation codes for one 32-group, in the thread that uses them: d = max|x| / 127, codes
// round-half-away(x / d) in -127..127, four to a word (elements 0..15 in lo, 16..31 in hi), and
// their sum; step for step quantize_lane's arithmetic (below), so the same codes. Quantising here
// instead of in a launch of its own saves W4A8 layers four launches a token (a W4A8 matvec reads
// x as f32, as W4A16 does).
__device__ __forceinline__ void quantize_group(const float4 (&x)[8], int4& lo, int4& hi, float& d, int& sum) {
    float amax = 0.f;
#pragma unroll
    for (int k = 0; k < 8; k++)
        amax = fmaxf(amax, fmaxf(fmaxf(fabsf(x[k].x), fabsf(x[k].y)), fmaxf(fabsf(x[k].z), fabsf(x[k].w))));
    d = amax / 127.f;
    float inv = d > 0.f ? 1.f / d : 0.f;
    unsigned words[8];
    sum = 0;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        float v[4] = {x[k].x, x[k].y, x[k].z, x[k].w};
        unsigned w = 0;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int q = (int)fminf(fmaxf(roundf(v[e] * inv), -127.f), 127.f);
            sum += q;
            w |= (unsigned)(q & 0xff) << (8 * e);
        }
        words[k] = w;
    }
    lo = int4{(int)words[0], (int)words[1], (int)words[2], (int)words[3]};
    hi = int4{(int)words[4], (int)words[5], (int)words[6], (int)words[7]};
}

// W4A8: per block d_w * d_x * (sum q_w q_x - 8 sum q_x). The -8 of every weight code is applied
// once per block through the activation code sum (deferred bias correction), so dp4a runs on the
// raw 0..15 codes, which fit a signed byte. The integer part is exact. Q4_1 (OFFSETS): d_w d_x
// sum q_w q_x + m_w (d_x sum q_x), ref's two products, the offset applied through the same sum.
template <bool GLU, bool OFFSETS>
__device__ __forceinline__ void q4_w4a8(MATRICES, const u16* m0, const u16* m1, const u16* m2,
                                        const float* __restrict__ x, int cols, int mode) {
    Slots s = block_slots<GLU>(ALL_MATRICES, m0, m1, m2);
    float acc[MV_ROWS] = {};
    q4_rounds<GLU, OFFSETS>(s, cols, [&](int b, const uint4 (&c)[MV_ROWS], const u16 (&h)[MV_ROWS],
                                         const u16 (&o)[MV_ROWS]) {
        float4 xb[8];
#pragma unroll
        for (int k = 0; k < 8; k++) xb[k] = ((const float4*)(x + b * QK))[k];
        int4 x0, x1;  // codes of elements 0..15, 16..31
        float dx;
        int xsum;
        quantize_group(xb, x0, x1, dx, xsum);
        int bias = OFFSETS ? 0 : 8 * xsum;
        float xoff = dx * (float)xsum;  // Q4_1's offsets meet d_x sum q_x
#pragma unroll
        for (int r = 0; r < MV_ROWS; r++) {
            int dot = 0;
            dot = __dp4a((int)(c[r].x & 0x0F0F0F0Fu), x0.x, dot);
            dot = __dp4a((int)(c[r].y & 0x0F0F0F0Fu), x0.y, dot);
            dot = __dp4a((int)(c[r].z & 0x0F0F0F0Fu), x0.z, dot);
            dot = __dp4a((int)(c[r].w & 0x0F0F0F0Fu), x0.w, dot);
            dot = __dp4a((int)((c[r].x >> 4) & 0x0F0F0F0Fu), x1.x, dot);
            dot = __dp4a((int)((c[r].y >> 4) & 0x0F0F0F0Fu), x1.y, dot);
            dot = __dp4a((int)((c[r].z >> 4) & 0x0F0F0F0Fu), x1.z, dot);
            dot = __dp4a((int)((c[r].w >> 4) & 0x0F0F0F0Fu), x1.w, dot);
            acc[r] += (h2f(h[r]) * dx) * (float)(dot - bias);
            if (OFFSETS) acc[r] += h2f(o[r]) * xoff;
        }
    });
    store_slots<GLU>(acc, s, mode);
}

// Exact variants: f16/bf16 weights as stored, 8 per 16-byte load; cols must be a multiple of 8.
template <bool GLU>
__device__ __forceinline__ void exact(MATRICES, int bf16, const float* __restrict__ x, int cols, int mode) {
    Slots s = block_slots<GLU>(ALL_MATRICES, nullptr, nullptr, nullptr);
    float acc[MV_ROWS] = {};
    for (int c = threadIdx.x; c < cols / 8; c += blockDim.x) {
        uint4 p[MV_ROWS];
#pragma unroll
        for (int r = 0; r < MV_ROWS; r++)
            p[r] = ((const uint4*)((const u16*)s.w[slot_matrix<GLU>(r)] + slot_row<GLU>(s, r) * cols))[c];
        float4 a = ((const float4*)x)[2 * c], b = ((const float4*)x)[2 * c + 1];
#pragma unroll
        for (int r = 0; r < MV_ROWS; r++)
            acc[r] += exact2f(p[r].x & 0xffff, bf16) * a.x + exact2f(p[r].x >> 16, bf16) * a.y
                    + exact2f(p[r].y & 0xffff, bf16) * a.z + exact2f(p[r].y >> 16, bf16) * a.w
                    + exact2f(p[r].z & 0xffff, bf16) * b.x + exact2f(p[r].z >> 16, bf16) * b.y
                    + exact2f(p[r].w & 0xffff, bf16) * b.z + exact2f(p[r].w >> 16, bf16) * b.w;
    }
    store_slots<GLU>(acc, s, mode);
}

// Each body has two entry points with the same parameters: matvec_* (plain) and glu_* (the
// epilogue unused); Q4_1's (*_q4_1_*) take its offset planes m0..m2 last. Their parameters are
// spelled out, not MATRICES: tests/cuda_emu and kernels.declared_kernels read them.
extern "C" __global__ void __launch_bounds__(MV_MAX_THREADS, MV_MIN_BLOCKS) matvec_q4_w4a16(
    const void* w0, const u16* d0, float* out0, int rows0, const void* w1, const u16* d1, float* out1, int rows1,
    const void* w2, const u16* d2, float* out2, int rows2,
    const float* __restrict__ x, int cols, int epilogue,
    const float* norm_w, float* norm_out, float eps, int* done) {
    q4_w4a16<false, false>(ALL_MATRICES, nullptr, nullptr, nullptr, x, cols, epilogue);
    if (epilogue == ADD_NORM) norm_tail(out0, rows0, norm_w, eps, norm_out, done);  // one matrix
}
extern "C" __global__ void __launch_bounds__(MV_MAX_THREADS, MV_MIN_BLOCKS) glu_q4_w4a16(
    const void* w0, const u16* d0, float* out0, int rows0, const void* w1, const u16* d1, float* out1, int rows1,
    const void* w2, const u16* d2, float* out2, int rows2,
    const float* __restrict__ x, int cols, int epilogue,
    const float* norm_w, float* norm_out, float eps, int* done) {
    q4_w4a16<true, false>(ALL_MATRICES, nullptr, nullptr, nullptr, x, cols, epilogue);  // STORE or GLU_GELU
}
extern "C" __global__ void __launch_bounds__(MV_MAX_THREADS, MV_MIN_BLOCKS) matvec_q4_1_w4a16(
    const void* w0, const u16* d0, float* out0, int rows0, const void* w1, const u16* d1, float* out1, int rows1,
    const void* w2, const u16* d2, float* out2, int rows2,
    const float* __restrict__ x, int cols, int epilogue,
    const float* norm_w, float* norm_out, float eps, int* done,
    const u16* m0, const u16* m1, const u16* m2) {
    q4_w4a16<false, true>(ALL_MATRICES, m0, m1, m2, x, cols, epilogue);
    if (epilogue == ADD_NORM) norm_tail(out0, rows0, norm_w, eps, norm_out, done);  // one matrix
}
extern "C" __global__ void __launch_bounds__(MV_MAX_THREADS, MV_MIN_BLOCKS) glu_q4_1_w4a16(
    const void* w0, const u16* d0, float* out0, int rows0, const void* w1, const u16* d1, float* out1, int rows1,
    const void* w2, const u16* d2, float* out2, int rows2,
    const float* __restrict__ x, int cols, int epilogue,
    const float* norm_w, float* norm_out, float eps, int* done,
    const u16* m0, const u16* m1, const u16* m2) {
    q4_w4a16<true, true>(ALL_MATRICES, m0, m1, m2, x, cols, epilogue);  // STORE or GLU_GELU
}
extern "C" __global__ void __launch_bounds__(MV_MAX_THREADS, MV_W4A8_MIN_BLOCKS) matvec_q4_w4a8(
    const void* w0, const u16* d0, float* out0, int rows0, const void* w1, const u16* d1, float* out1, int rows1,
    const void* w2, const u16* d2, float* out2, int rows2,
    const float* __restrict__ x, int cols, int epilogue,
    const float* norm_w, float* norm_out, float eps, int* done) {
    q4_w4a8<false, false>(ALL_MATRICES, nullptr, nullptr, nullptr, x, cols, epilogue);
    if (epilogue == ADD_NORM) norm_tail(out0, rows0, norm_w, eps, norm_out, done);  // one matrix
}
extern "C" __global__ void __launch_bounds__(MV_MAX_THREADS, MV_MIN_BLOCKS) glu_q4_w4a8(
    const void* w0, const u16* d0, float* out0, int rows0, const void* w1, const u16* d1, float* out1, int rows1,
    const void* w2, const u16* d2, float* out2, int rows2,
    const float* __restrict__ x, int cols, int epilogue,
    const float* norm_w, float* norm_out, float eps, int* done) {
    q4_w4a8<true, false>(ALL_MATRICES, nullptr, nullptr, nullptr, x, cols, epilogue);  // STORE or GLU_GELU
}
extern "C" __global__ void __launch_bounds__(MV_MAX_THREADS, MV_W4A8_MIN_BLOCKS) matvec_q4_1_w4a8(
    const void* w0, const u16* d0, float* out0, int rows0, const void* w1, const u16* d1, float* out1, int rows1,
    const void* w2, const u16* d2, float* out2, int rows2,
    const float* __restrict__ x, int cols, int epilogue,
    const float* norm_w, float* norm_out, float eps, int* done,
    const u16* m0, const u16* m1, const u16* m2) {
    q4_w4a8<false, true>(ALL_MATRICES, m0, m1, m2, x, cols, epilogue);
    if (epilogue == ADD_NORM) norm_tail(out0, rows0, norm_w, eps, norm_out, done);  // one matrix
}
extern "C" __global__ void __launch_bounds__(MV_MAX_THREADS, MV_MIN_BLOCKS) glu_q4_1_w4a8(
    const void* w0, const u16* d0, float* out0, int rows0, const void* w1, const u16* d1, float* out1, int rows1,
    const void* w2, const u16* d2, float* out2, int rows2,
    const float* __restrict__ x, int cols, int epilogue,
    const float* norm_w, float* norm_out, float eps, int* done,
    const u16* m0, const u16* m1, const u16* m2) {
    q4_w4a8<true, true>(ALL_MATRICES, m0, m1, m2, x, cols, epilogue);  // STORE or GLU_GELU
}
extern "C" __global__ void matvec_exact(
    const void* w0, const u16* d0, float* out0, int rows0, const void* w1, const u16* d1, float* out1, int rows1,
    const void* w2, const u16* d2, float* out2, int rows2,
    int bf16, const float* __restrict__ x, int cols, int epilogue,
    const float* norm_w, float* norm_out, float eps, int* done) {
    wait_prior_kernels();
    exact<false>(ALL_MATRICES, bf16, x, cols, epilogue);
    if (epilogue == ADD_NORM) norm_tail(out0, rows0, norm_w, eps, norm_out, done);  // one matrix
}
extern "C" __global__ void glu_exact(
    const void* w0, const u16* d0, float* out0, int rows0, const void* w1, const u16* d1, float* out1, int rows1,
    const void* w2, const u16* d2, float* out2, int rows2,
    int bf16, const float* __restrict__ x, int cols, int epilogue,
    const float* norm_w, float* norm_out, float eps, int* done) {
    wait_prior_kernels();
    exact<true>(ALL_MATRICES, bf16, x, cols, epilogue);  // STORE or GLU_GELU
}

// Q8_0 (the Q4 variants' token table, read here as the lm_head): codes int8 [rows, cols], one f16
// scale per 32 (weight d q); plain launches only. A thread takes a block's 32 code bytes of each
// of its rows in two 16-byte loads, all issued first, as the Q4 kernels do. W8A16: sum q x with
// each code converted to float; W8A8 (A8): x quantised per group as W4A8 does, then dp4a on
// signed codes with no bias to correct, d_w d_x times the exact integer dot. x is quantised before
// the codes are loaded: with the loads first, ptxas kept x's 32 floats live beside the 64 code
// registers and, bounded, spilled 224 bytes (sm_90); now 8 on sm_75 and sm_90, none elsewhere
// (NVRTC 13.5). Their speeds: docs/perf/code_figures.md.
template <bool A8>
__device__ __forceinline__ void q8_0(MATRICES, const float* __restrict__ x, int cols, int mode) {
    Slots s = block_slots<false>(ALL_MATRICES, nullptr, nullptr, nullptr);
    int nb = cols / QK;
    float acc[MV_ROWS] = {};
    for (int b = threadIdx.x; b < nb; b += blockDim.x) {
        float4 xb[8];
#pragma unroll
        for (int k = 0; k < 8; k++) xb[k] = ((const float4*)(x + b * QK))[k];
        int4 x0, x1;  // W8A8: codes of elements 0..15, 16..31
        float dx;
        int xsum;
        if (A8) quantize_group(xb, x0, x1, dx, xsum);
        uint4 c[MV_ROWS][2];
        u16 h[MV_ROWS];
#pragma unroll
        for (int r = 0; r < MV_ROWS; r++) {
            size_t row = slot_row<false>(s, r);
            const uint4* codes = (const uint4*)((const u8*)s.w[0] + row * cols) + 2 * b;
            c[r][0] = codes[0];
            c[r][1] = codes[1];
            h[r] = s.d[0][row * (cols / QK) + b];
        }
#pragma unroll
        for (int r = 0; r < MV_ROWS; r++) {
            if (A8) {
                int dot = 0;
                dot = __dp4a((int)c[r][0].x, x0.x, dot);
                dot = __dp4a((int)c[r][0].y, x0.y, dot);
                dot = __dp4a((int)c[r][0].z, x0.z, dot);
                dot = __dp4a((int)c[r][0].w, x0.w, dot);
                dot = __dp4a((int)c[r][1].x, x1.x, dot);
                dot = __dp4a((int)c[r][1].y, x1.y, dot);
                dot = __dp4a((int)c[r][1].z, x1.z, dot);
                dot = __dp4a((int)c[r][1].w, x1.w, dot);
                acc[r] += (h2f(h[r]) * dx) * (float)dot;
            } else {
                unsigned words[8] = {c[r][0].x, c[r][0].y, c[r][0].z, c[r][0].w,
                                     c[r][1].x, c[r][1].y, c[r][1].z, c[r][1].w};  // word k: elements 4k..4k+3
                float t = 0.f;
#pragma unroll
                for (int k = 0; k < 8; k++) {
                    t = fmaf((float)(signed char)(words[k] & 0xffu), xb[k].x, t);
                    t = fmaf((float)(signed char)((words[k] >> 8) & 0xffu), xb[k].y, t);
                    t = fmaf((float)(signed char)((words[k] >> 16) & 0xffu), xb[k].z, t);
                    t = fmaf((float)(signed char)(words[k] >> 24), xb[k].w, t);
                }
                acc[r] += h2f(h[r]) * t;
            }
        }
    }
    store_slots<false>(acc, s, mode);
}

extern "C" __global__ void __launch_bounds__(MV_MAX_THREADS, MV_MIN_BLOCKS) matvec_q8_0_w8a16(
    const void* w0, const u16* d0, float* out0, int rows0, const void* w1, const u16* d1, float* out1, int rows1,
    const void* w2, const u16* d2, float* out2, int rows2,
    const float* __restrict__ x, int cols, int epilogue,
    const float* norm_w, float* norm_out, float eps, int* done) {
    wait_prior_kernels();
    q8_0<false>(ALL_MATRICES, x, cols, epilogue);
    if (epilogue == ADD_NORM) norm_tail(out0, rows0, norm_w, eps, norm_out, done);  // one matrix
}
extern "C" __global__ void __launch_bounds__(MV_MAX_THREADS, MV_MIN_BLOCKS) matvec_q8_0_w8a8(
    const void* w0, const u16* d0, float* out0, int rows0, const void* w1, const u16* d1, float* out1, int rows1,
    const void* w2, const u16* d2, float* out2, int rows2,
    const float* __restrict__ x, int cols, int epilogue,
    const float* norm_w, float* norm_out, float eps, int* done) {
    wait_prior_kernels();
    q8_0<true>(ALL_MATRICES, x, cols, epilogue);
    if (epilogue == ADD_NORM) norm_tail(out0, rows0, norm_w, eps, norm_out, done);  // one matrix
}

// One 32-group per warp: scale d = max|x| / 127, codes round-half-away(x / d) in -127..127,
// exactly as the NumPy reference does (IEEE division; no fast math).
__device__ __forceinline__ int quantize_lane(float v, float* d_out) {
    float d = warp_max(fabsf(v)) / 127.f;
    float inv = d > 0.f ? 1.f / d : 0.f;
    *d_out = d;
    return (int)fminf(fmaxf(roundf(v * inv), -127.f), 127.f);
}

// Prefill's W4A8: rows of x quantised per 32-group and scaled back, in f16 (a GEMM over them
// gives the integer kernel's products, up to the f16 rounding of q d: 2^-11 relative). n = all
// elements, a multiple of 32.
extern "C" __global__ void fake_quantize_q8(const float* x, u16* out, long long n) {
    wait_prior_kernels();
    long long g = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (g < n / QK) {
        float d;
        int q = quantize_lane(x[g * QK + lane], &d);
        out[g * QK + lane] = f2h((float)q * d);
    }
}
