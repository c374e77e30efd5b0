"""The CPU emulator of CUDA C (tests/cuda_emu) on a small kernel source of its own: shared memory
and barriers (counting ones too), warp shuffles, dp4a, 2-D grids, the host half branch, and the
argument checks that stand in for CuPy's silent scalar conversions; barriers that separate
phases, deadlocks reported rather than hung on, blocks run in both orders, and the memory checks
(accesses outside the launch's arrays, misaligned vector loads, shared-memory races, global
memory shared between blocks without the last-block pattern). Each test prints its seed."""

from __future__ import annotations

import re

import numpy as np
import pytest

from cuda_emu import EmuBuildError, EmuKernelError, EmuModule

# common.cuh sits in its own directory, not beside the .cu, so only -I can find it
COMMON = r"""
#pragma once
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#error "the emulator must take the kernels' host branch"
#endif
#define FULL 0xffffffffu
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}
inline float h2f(unsigned short h) { _Float16 v; __builtin_memcpy(&v, &h, 2); return (float)v; }
"""

SOURCE = r"""
#include "common.cuh"

// per-block sums through shared memory; their total through atomicAdd. The last thread reads
// s[0], which the next block's thread 0 overwrites: blocks must not overlap.
extern "C" __global__ void block_sum(const float* __restrict__ x, float* partial, float* total, int n) {
    __shared__ float s[1024];
    int t = threadIdx.x, i = blockIdx.x * blockDim.x + t;
    s[t] = i < n ? x[i] : 0.f;
    __syncthreads();
    for (int h = blockDim.x / 2; h > 0; h >>= 1) {
        if (t < h) s[t] += s[t + h];
        __syncthreads();
    }
    if (t == blockDim.x - 1) {
        partial[blockIdx.x] = s[0];
        atomicAdd(total, s[0]);
    }
}

extern "C" __global__ void warp_ops(const float* x, float* sums, const int* v, int* down, int* bcast,
                                    int* xr) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    float s = warp_sum(x[i]);
    if ((threadIdx.x & 31) == 0) sums[i / 32] = s;
    down[i] = __shfl_down_sync(FULL, v[i], 3);
    bcast[i] = __shfl_sync(FULL, v[i], 5);
    xr[i] = __shfl_xor_sync(FULL, v[i], 6);
}

extern "C" __global__ void dp4a(const int* a, const int* b, const int* c, int* out, unsigned* out_u, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = __dp4a(a[i], b[i], c[i]);
        out_u[i] = __dp4a((unsigned)a[i], (unsigned)b[i], (unsigned)c[i]);
    }
}

// Each thread reads its neighbour's slot: right only with the barrier between write and read.
// The slots: in shared memory, or in global memory (slots) when global is set.
extern "C" __global__ void neighbour(int* out, int* slots, int base, int sync, int global) {
    __shared__ int s[256];
    int t = threadIdx.x, *slot = global ? slots : s;
    slot[t] = base + t;
    if (sync) __syncthreads();
    out[t] = slot[(t + 1) % blockDim.x];
}

// Lanes swap slots through shared memory, ordered by __syncwarp (sync set) or not at all; then
// every thread counts itself in with a shared atomic, which races with nothing.
extern "C" __global__ void warp_exchange(int* out, int* count, int sync) {
    __shared__ int s[1024];
    __shared__ int n;
    int t = threadIdx.x;
    if (t == 0) n = 0;
    s[t] = 3 * t;
    if (sync) __syncwarp();
    out[t] = s[t ^ 1];
    __syncthreads();
    atomicAdd(&n, 1);
    __syncthreads();
    if (t == 0) *count = n;
}

// `returns` threads leave early; the rest wait at __syncthreads (mode 0) or shuffle (mode 1).
extern "C" __global__ void early_exit(int* out, int returns, int mode) {
    int t = threadIdx.x;
    if (t < returns) return;
    if (mode == 0) __syncthreads();
    else out[blockIdx.x * blockDim.x + t] = __shfl_xor_sync(FULL, t, 1);
}

// Block sums without (first_sync 0) the barrier that keeps a warp from rewriting scratch while
// other warps still read the previous call's values from it. Any thread that gets another sum says so.
__device__ float bsum(float v, float* scratch, int first_sync) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    if (first_sync) __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_sum(lane < warps ? scratch[lane] : 0.f);
}

extern "C" __global__ void repeated_sums(float* out, int rounds, int first_sync) {
    __shared__ float scratch[32];
    for (int r = 0; r < rounds; r++) {
        float s = bsum((float)(r + 1), scratch, first_sync);
        if (threadIdx.x == 0 || s != out[r]) out[r] = s;
    }
}

extern "C" __global__ void half_warp_shuffle(int* out) {
    if (threadIdx.x < 16) out[threadIdx.x] = __shfl_xor_sync(0xffffu, (int)threadIdx.x, 1);
}

// A large local array lives on the emulated thread's own stack.
extern "C" __global__ void big_local(int* out) {
    int a[8192];
    for (int i = 0; i < 8192; i++) a[i] = i * (int)threadIdx.x;
    __syncthreads();
    int s = 0;
    for (int i = 0; i < 8192; i += 97) s += a[i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

/* a 2-D grid of 2-D blocks; the parameters span lines */
extern "C" __global__ void affine2d(const float* x, float* out, float a,
                                    int rows, int cols) {
    int c = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y * blockDim.y + threadIdx.y;
    if (r < rows && c < cols) out[r * cols + c] = a * x[r * cols + c] + (float)r;
}

// __syncthreads_count in back-to-back rounds: round r counts the threads with t % (r + 2) == 0.
extern "C" __global__ void barrier_counts(int* out, int rounds) {
    for (int r = 0; r < rounds; r++) {
        int c = __syncthreads_count(threadIdx.x % (r + 2) == 0);
        out[r * blockDim.x + threadIdx.x] = c;
    }
}

// The order the blocks ran in: order[k] = linear index of the k-th block to run.
extern "C" __global__ void block_order(int* order, int* count) {
    if (threadIdx.x == 0) order[atomicAdd(count, 1)] = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}

// out[i] = x[i + shift] for every thread's i; with store set, out[i + shift] = x[i] instead.
extern "C" __global__ void shifted_copy(const float* x, float* out, int shift, int store) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (store) out[i + shift] = x[i];
    else out[i] = x[i + shift];
}

// The same as float4s: out's i-th float4 from x + shift floats, whose 16-byte words are aligned
// only when shift is a multiple of 4.
extern "C" __global__ void shifted_copy4(const float* x, float* out, int shift) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    ((float4*)out)[i] = ((const float4*)(x + shift))[i];
}

// Each block's sum into partial[block]; the last block to count itself in adds them into *total.
// mode 0: thread 0 sums, fences and counts; 1: without the fence; 2: without the count (the
// grid's last block adds them, which on a GPU may run first); 3: thread 1 sums and fences, and
// thread 0 counts behind a __syncthreads; 4: the same without the __syncthreads.
extern "C" __global__ void last_block_sum(const float* x, float* partial, int* done, float* total, int mode) {
    __shared__ int last;
    if (threadIdx.x == (mode >= 3 ? 1u : 0u)) {
        float a = 0.f;
        for (unsigned i = 0; i < blockDim.x; i++) a += x[blockIdx.x * blockDim.x + i];
        partial[blockIdx.x] = a;
        if (mode != 1) __threadfence();
    }
    if (mode == 3) __syncthreads();
    if (threadIdx.x == 0) last = mode == 2 ? blockIdx.x == gridDim.x - 1 : atomicAdd(done, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (last && threadIdx.x == 0) {
        float a = 0.f;
        for (unsigned b = 0; b < gridDim.x; b++) a += partial[b];
        *total = a;
        *done = 0;
    }
}

extern "C" __global__ void __launch_bounds__(64, 2) bounded(int* out) { out[threadIdx.x] = threadIdx.x; }

extern "C" __global__ void half_to_float(const unsigned short* h, float* out, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = h2f(h[i]);
}
"""


def write_sources(root, common=COMMON, source=SOURCE):
    (root / "inc").mkdir(parents=True, exist_ok=True)
    (root / "src").mkdir(exist_ok=True)
    (root / "inc" / "common.cuh").write_text(common)
    (root / "src" / "harness.cu").write_text(source)
    return [root / "src" / "harness.cu"], root / "inc"


@pytest.fixture(scope="module")
def mod(tmp_path_factory):
    root = tmp_path_factory.mktemp("emu")
    sources, inc = write_sources(root)
    return EmuModule(sources, inc, root / "cache")


def cdiv(a, b):
    return -(-a // b)


@pytest.mark.parametrize("threads", [256, 1024])
def test_block_reduction(mod, rng, threads):
    n = 7 * threads + 100  # a ragged last block
    x = rng.uniform(0.5, 1.5, n).astype(np.float32)  # positive: no cancellation, so rtol means something
    partial = np.full(cdiv(n, threads), np.nan, np.float32)
    total = np.zeros(1, np.float32)
    mod.get_function("block_sum")(cdiv(n, threads), threads, (x, partial, total, np.int32(n)))
    want = np.add.reduceat(x.astype(np.float64), np.arange(0, n, threads))
    np.testing.assert_allclose(partial, want, rtol=1e-5)
    np.testing.assert_allclose(total[0], want.sum(), rtol=1e-5)


def test_warp_shuffles(mod, rng):
    blocks, threads = 3, 64
    n = blocks * threads
    x = rng.standard_normal(n, dtype=np.float32)
    v = rng.integers(-2**31, 2**31, n, dtype=np.int32)
    sums, down, bcast, xr = np.full(n // 32, np.nan, np.float32), *(np.zeros(n, np.int32) for _ in range(3))
    mod.get_function("warp_ops")((blocks,), (threads,), (x, sums, v, down, bcast, xr))
    w = x.reshape(-1, 32).astype(np.float64)
    np.testing.assert_allclose(sums, w.sum(1), rtol=0, atol=1e-5 * np.abs(w).sum(1).max())
    lane = np.arange(n) % 32
    np.testing.assert_array_equal(down, np.where(lane + 3 < 32, np.roll(v, -3), v))  # the last 3 keep theirs
    np.testing.assert_array_equal(bcast, np.repeat(v.reshape(-1, 32)[:, 5], 32))
    np.testing.assert_array_equal(xr, v[np.arange(n) ^ 6])  # a sum cannot tell xor from a rotation


def test_dp4a(mod, rng):
    n = 300
    a8, b8 = (rng.integers(-128, 128, (n, 4), dtype=np.int8) for _ in range(2))
    c = rng.integers(-2**31, 2**31, n, dtype=np.int32)  # the full range: sums wrap as on the GPU
    out, out_u = np.zeros(n, np.int32), np.zeros(n, np.uint32)
    a, b = a8.view(np.int32).ravel(), b8.view(np.int32).ravel()
    mod.get_function("dp4a")(cdiv(n, 128), 128, (a, b, c, out, out_u, np.int32(n)))
    signed = (a8.astype(np.int64) * b8).sum(1) + c
    np.testing.assert_array_equal(out, ((signed + 2**31) % 2**32 - 2**31).astype(np.int32))
    unsigned = (a8.view(np.uint8).astype(np.int64) * b8.view(np.uint8)).sum(1) + c.view(np.uint32)
    np.testing.assert_array_equal(out_u, (unsigned % 2**32).astype(np.uint32))


def test_2d_grid(mod, rng):
    rows, cols = 37, 100
    x = rng.standard_normal((rows, cols), dtype=np.float32)
    out = np.full_like(x, np.nan)
    a = np.float32(rng.uniform(-2, 2))
    mod.get_function("affine2d")((cdiv(cols, 32), cdiv(rows, 4)), (32, 4),
                                 (x, out, a, np.int32(rows), np.int32(cols)))
    np.testing.assert_array_equal(out, a * x + np.arange(rows, dtype=np.float32)[:, None])


@pytest.mark.parametrize("threads", [64, 1024])
def test_syncthreads_count_gives_every_thread_the_round_total(mod, threads):
    """Each thread gets its round's count, though the thread that completes a barrier runs on
    into the next round before the others have read theirs."""
    rounds = 5
    out = np.full(rounds * threads, -1, np.int32)
    mod.get_function("barrier_counts")((1,), (threads,), (out, np.int32(rounds)))
    want = [len(range(0, threads, r + 2)) for r in range(rounds)]
    np.testing.assert_array_equal(out.reshape(rounds, threads), np.repeat(np.array(want)[:, None], threads, 1))


def test_launches_run_their_blocks_forward_and_backward_by_turns(mod):
    """CUDA runs a launch's blocks in no promised order: of two launches in a row, one runs them
    in grid order and the other in reverse, so a block that counts on another having run first
    fails on one of them."""
    orders = []
    for _ in range(2):
        order, count = np.full(24, -1, np.int32), np.zeros(1, np.int32)
        mod.get_function("block_order")((3, 4, 2), (32,), (order, count))
        orders.append(order.tolist())
    assert sorted(orders) == sorted([list(range(24)), list(range(23, -1, -1))])


def test_half_host_branch(mod, rng):
    h = rng.standard_normal(1000).astype(np.float16)
    out = np.zeros(1000, np.float32)
    mod.get_function("half_to_float")(cdiv(1000, 256), 256, (h.view(np.uint16), out, np.int64(1000)))
    np.testing.assert_array_equal(out, h.astype(np.float32))


def test_argument_checks(mod, rng):
    x = rng.standard_normal((4, 64), dtype=np.float32)
    out = np.zeros_like(x)
    f = mod.get_function("affine2d")
    rows, cols = np.int32(4), np.int32(64)
    for bad, index, want in ((4, 3, "int32"), (np.int64(4), 3, "int32")):  # CuPy would pass 64 bits
        with pytest.raises(TypeError, match=rf"affine2d parameter {index} .*{want}"):
            f((2, 1), (32, 4), (x, out, np.float32(1), bad, cols))
    for bad in (1.0, np.float64(1)):  # CuPy would pass a double
        with pytest.raises(TypeError, match=r"affine2d parameter 2 .*float32"):
            f((2, 1), (32, 4), (x, out, bad, rows, cols))
    with pytest.raises(TypeError, match="not C-contiguous"):
        f((2, 1), (32, 4), (x[:, ::2], out, np.float32(1), rows, cols))
    ro = out.copy()
    ro.flags.writeable = False
    with pytest.raises(TypeError, match="read-only"):
        f((2, 1), (32, 4), (x, ro, np.float32(1), rows, cols))
    with pytest.raises(TypeError, match="takes 5 arguments"):
        f((2, 1), (32, 4), (x, out, np.float32(1), rows))
    with pytest.raises(ValueError, match="whole warps"):
        f((2, 1), (16, 3), (x, out, np.float32(1), rows, cols))
    with pytest.raises(KeyError, match="no_such"):
        mod.get_function("no_such")
    bounded = mod.get_function("bounded")
    bounded(1, 64, (np.zeros(64, np.int32),))
    with pytest.raises(EmuKernelError, match=r"block of 96 threads, more than the kernel's __launch_bounds__ \(64\)"):
        bounded(1, 96, (np.zeros(96, np.int32),))
    # a read-only input through a const pointer, and an __array_interface__ object, are fine
    x.flags.writeable = False

    class Wrapped:
        __array_interface__ = out.__array_interface__

    f((2, 1), (32, 4), (x, Wrapped(), np.float32(3), rows, cols))
    np.testing.assert_array_equal(out, 3 * x + np.arange(4, dtype=np.float32)[:, None])


def test_syncthreads_separates_phases(mod, rng):
    f, out, slots = mod.get_function("neighbour"), np.zeros(128, np.int32), np.zeros(128, np.int32)
    for base in rng.integers(0, 1000, 3) * 1000:  # a new base each launch: stale slots show
        f(1, 128, (out, slots, np.int32(base), np.int32(1), np.int32(1)))
        np.testing.assert_array_equal(out, base + (np.arange(128) + 1) % 128)
    # no barrier: a thread reads before its neighbour writes
    f(1, 128, (out, slots, np.int32(base + 7), np.int32(0), np.int32(1)))
    assert (out != base + 7 + (np.arange(128) + 1) % 128).any()


def test_shared_memory_races_are_caught(mod, rng):
    """The same exchange through shared memory, which is checked for races: without the barrier
    the launch fails naming both accesses, before any value could be wrong."""
    f, out, unused = mod.get_function("neighbour"), np.zeros(128, np.int32), np.zeros(128, np.int32)
    f(1, 128, (out, unused, np.int32(5), np.int32(1), np.int32(0)))
    np.testing.assert_array_equal(out, 5 + (np.arange(128) + 1) % 128)
    with pytest.raises(EmuKernelError, match=r"shared-memory race \(write after read\) in block \(0,0,0\) on "
                                             r"neighbour::s, byte 4: thread \(0,0,0\) at harness\.cu:\d+ "
                                             r"\(neighbour\), then thread \(1,0,0\) at harness\.cu:\d+ \(neighbour\)"):
        f(1, 128, (out, unused, np.int32(5), np.int32(0), np.int32(0)))


def test_warp_syncs_and_atomics_order_shared_memory(mod):
    f, out, count = mod.get_function("warp_exchange"), np.zeros(256, np.int32), np.zeros(1, np.int32)
    f(1, 256, (out, count, np.int32(1)))
    np.testing.assert_array_equal(out, 3 * (np.arange(256) ^ 1))
    assert count[0] == 256
    # thread 0 runs on to its read of slot 1 before thread 1 has written it
    with pytest.raises(EmuKernelError, match=r"race \(write after read\) .* on warp_exchange::s, byte 4: thread "
                                             r"\(0,0,0\) at harness\.cu:\d+ \(warp_exchange\), then thread \(1,0,0\)"):
        f(1, 256, (out, count, np.int32(0)))


@pytest.mark.parametrize("mode, returns, waits", [
    (0, 1, "255 wait at __syncthreads"), (0, 255, "1 wait at __syncthreads"),
    (1, 3, "warp 0: 0 at __syncthreads, 29 at warp, 3 returned")])
def test_deadlock_is_reported(mod, mode, returns, waits):
    f, out = mod.get_function("early_exit"), np.zeros(512, np.int32)
    with pytest.raises(EmuKernelError, match=rf"early_exit .*deadlock in block \(0,0,0\).*{waits}"):
        f(1, 256, (out, np.int32(returns), np.int32(mode)))
    f(2, 256, (out, np.int32(0), np.int32(1)))  # the next launch starts afresh
    np.testing.assert_array_equal(out, np.tile(np.arange(256) ^ 1, 2))
    f(2, 256, (out, np.int32(64), np.int32(1)))  # whole warps that return are fine
    f(2, 256, (out, np.int32(256), np.int32(0)))  # and so is a block of which all return


def test_warp_running_ahead_is_caught(mod):
    f, want = mod.get_function("repeated_sums"), 256 * np.arange(1, 5, dtype=np.float32)
    out = np.zeros(4, np.float32)
    f(1, 256, (out, np.int32(4), np.int32(1)))
    np.testing.assert_array_equal(out, want)
    # a fast warp rewrites scratch before the others have read it
    with pytest.raises(EmuKernelError, match=r"shared-memory race .* on repeated_sums::scratch, byte \d+: thread "
                                             r"\(\d+,0,0\) at harness\.cu:\d+ \(bsum\), then thread"):
        f(1, 256, (out, np.int32(4), np.int32(0)))


def test_partial_masks_are_refused(mod):
    with pytest.raises(EmuKernelError, match=r"__shfl_xor_sync with mask 0x0000ffff .*thread \(0,0,0\)"):
        mod.get_function("half_warp_shuffle")(1, 32, (np.zeros(32, np.int32),))


def test_large_local_array(mod):
    out = np.zeros(128, np.int32)
    mod.get_function("big_local")(2, 64, (out,))
    np.testing.assert_array_equal(out, np.arange(0, 8192, 97).sum() * np.tile(np.arange(64), 2))


def test_accesses_outside_the_arrays_are_caught(mod, rng):
    x = rng.standard_normal(128, dtype=np.float32)
    out = np.zeros(128, np.float32)
    f = mod.get_function("shifted_copy")
    f(4, 32, (x, out, np.int32(0), np.int32(0)))
    np.testing.assert_array_equal(out, x)
    read = r"4-byte read of 0x[0-9a-f]+ at harness\.cu:\d+ \(shifted_copy\), block \(\d,0,0\) thread \(\d+,0,0\): out"
    with pytest.raises(EmuKernelError, match=read + r".*nearest: byte \+512 of parameter 0 `const float\* x`"):
        f(4, 32, (x, out, np.int32(1), np.int32(0)))
    with pytest.raises(EmuKernelError, match=read + r".*nearest: byte -4 of parameter 0 `const float\* x`"):
        f(4, 32, (x, out, np.int32(-1), np.int32(0)))
    # only the last thread writes out of bounds, right past the end (nearer than any other array)
    with pytest.raises(EmuKernelError, match=r"4-byte write .*nearest: byte \+512 of parameter 1 `float\* out`"):
        f(4, 32, (x, out, np.int32(1), np.int32(1)))
    # an argument is the array passed, not whatever memory lies beyond it
    with pytest.raises(EmuKernelError, match=r"nearest: byte \+128 of parameter 0 .*an array of 128 bytes"):
        f(2, 32, (x[:32], out, np.int32(0), np.int32(0)))
    f(4, 32, (x, out, np.int32(0), np.int32(1)))  # the next launch is checked afresh, and passes
    np.testing.assert_array_equal(out, x)


def test_misaligned_vector_loads_are_caught(mod, rng):
    x = rng.standard_normal(256, dtype=np.float32)
    out = np.zeros(128, np.float32)
    assert x.ctypes.data % 16 == 0
    f = mod.get_function("shifted_copy4")
    f(1, 32, (x, out, np.int32(4)))
    np.testing.assert_array_equal(out, x[4:132])
    for shift in (1, 2, 3):
        with pytest.raises(EmuKernelError, match=rf"misaligned access at \S*harness\.cu:\d+, block \(0,0,0\) "
                                                 rf"thread \(0,0,0\): 'const struct float4' needs 16-byte alignment, "
                                                 rf"and 0x[0-9a-f]+ is {4 * shift} bytes past a boundary"):
            f(1, 32, (x, out, np.int32(shift)))


def test_blocks_share_global_memory_only_through_a_fence_and_a_count(mod, rng):
    """Blocks run one after another here, so a block that reads another's output gets it
    whatever the order; on a GPU only the last-block pattern (fence, then count, each after the
    step before in its thread or behind a barrier) makes it so."""
    partial, done, total = np.zeros(4, np.float32), np.zeros(1, np.int32), np.zeros(1, np.float32)
    f = mod.get_function("last_block_sum")

    def is_sum(t, x):
        # a block adds its 32 in turn, the last block the 4 partials: 34 roundings, each within
        # eps of the magnitudes so far (a bound relative to the sum itself fails where it cancels)
        return abs(float(t) - x.astype(np.float64).sum()) <= 34 * np.finfo(np.float32).eps * np.abs(x).sum()

    race = (r"global-memory race between blocks \(read after write\): block \(\d,0,0\) thread \((\d),0,0\) at "
            r"harness\.cu:\d+ \(last_block_sum\) wrote a byte that block \(\d,0,0\) thread \(0,0,0\) at "
            r"harness\.cu:\d+ \(last_block_sum\) then reads .*; byte \d+ of parameter 1 `float\* partial`")
    for mode, writer in ((0, None), (3, None), (1, "0"), (4, "1")):
        for _ in range(2):  # both block orders
            x = rng.standard_normal(4 * 32, dtype=np.float32)
            done[0] = 0
            if writer is None:
                f(4, 32, (x, partial, done, total, np.int32(mode)))
                assert is_sum(total[0], x) and done[0] == 0
            else:
                with pytest.raises(EmuKernelError, match=race) as e:
                    f(4, 32, (x, partial, done, total, np.int32(mode)))
                assert re.search(race, str(e.value))[1] == writer
    # No count: where the grid's last block runs first here too (every second launch), it reads
    # the partials before any block of the launch wrote them, which the check does not follow
    # (it knows the writes, not the reads to come): the sum is wrong.
    raised = 0
    for _ in range(2):
        x = rng.standard_normal(4 * 32, dtype=np.float32)
        try:
            f(4, 32, (x, partial, done, total, np.int32(2)))
            assert not is_sum(total[0], x)
        except EmuKernelError as e:
            assert re.search(race, str(e))
            raised += 1
    assert raised == 1


def test_compile_error_carries_gcc_message(tmp_path):
    sources, inc = write_sources(tmp_path, source=SOURCE + "\nextern \"C\" __global__ void bad(int n) { n +; }\n")
    with pytest.raises(EmuBuildError, match=r"harness\.cu.*error"):
        EmuModule(sources, inc, tmp_path / "cache")


def test_build_cached_by_content_and_headers(tmp_path):
    sources, inc = write_sources(tmp_path)
    cache = tmp_path / "cache"
    EmuModule(sources, inc, cache)
    first = {p: p.stat().st_mtime_ns for p in cache.glob("*.so")}
    EmuModule(sources, inc, cache)
    assert {p: p.stat().st_mtime_ns for p in cache.glob("*.so")} == first  # reused, not rebuilt
    write_sources(tmp_path, common=COMMON + "\n// changed\n")  # only the header changes
    EmuModule(sources, inc, cache)
    assert len(list(cache.glob("*.so"))) == 2 and not list(cache.glob("*.tmp")) and not list(cache.glob("*.o"))


DEPENDENT = r"""
#include "common.cuh"

// out = w x, w read before the wait as weights(); mode 1 also stores, mode 2 reads x and mode 3
// counts before it, each of which a programmatic dependent may not do
extern "C" __global__ void weighted(const float* w, const float* x, float* out, int* count, int mode) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    float a = weights(w + i);
    if (mode == 1) out[i] = 0.f;
    if (mode == 2) a += x[i];
    if (mode == 3) atomicAdd(count, 1);
    wait_prior_kernels();
    out[i] = a * x[i];
}
"""


@pytest.mark.parametrize("dependent", [True, False])
def test_programmatic_dependents_touch_only_weights_before_their_wait(tmp_path, rng, dependent):
    """kernels/common.cuh's wait_prior_kernels rule, as the cuda backend's launches need it on a
    GPU that takes programmatic dependent launch: before the wait, weights() reads only."""
    (tmp_path / "weighted.cu").write_text(DEPENDENT)
    from nerva_cli.planes.cuda.nvrtc import KERNEL_DIR

    f = EmuModule([tmp_path / "weighted.cu"], KERNEL_DIR, tmp_path / "cache",
                  dependent_launches=dependent).get_function("weighted")
    w, x = rng.standard_normal(64, dtype=np.float32), rng.standard_normal(64, dtype=np.float32)
    out, count = np.zeros(64, np.float32), np.zeros(1, np.int32)
    f(2, 32, (w, x, out, count, np.int32(0)))
    np.testing.assert_array_equal(out, w * x)
    for mode, what in ((1, r"a store to parameter 2 `float\* out`"), (2, r"a read of parameter 1 `const float\* x`"),
                       (3, r"an atomic on parameter 3 `int\* count`")):
        if dependent:
            with pytest.raises(EmuKernelError, match=what + r" at weighted\.cu:\d+ \(weighted\).* before "
                                                            r"wait_prior_kernels\(\)"):
                f(2, 32, (w, x, out, count, np.int32(mode)))
        else:
            f(2, 32, (w, x, out, count, np.int32(mode)))
