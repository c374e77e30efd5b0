// CUDA C on the CPU, for tests on machines without a GPU: force-included (g++ -include) before a
// kernel source, which then builds as plain C++20. A launch runs the grid's blocks one after
// another; the threads of a block are real std::threads, so __syncthreads and warp shuffles
// are barriers and races show up as they would on a GPU rather than being serialised away.
// __CUDACC__ stays undefined on purpose: kernels/common.cuh then takes its host branch
// (_Float16 half conversions instead of inline PTX).
#pragma once
#include <atomic>
#include <barrier>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <math.h>
#include <memory>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

// Each kernel source is its own shared library (as each is its own module on the GPU), so
// __device__ needs no `inline` to avoid clashes, and must not get one: `__device__ inline`
// would become a duplicate `inline`. g++ knows __restrict__ itself.
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
// Blocks run one at a time, so one static is exactly the running block's shared memory.
#define __shared__ static
#define warpSize 32

struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(8) int2 { int x, y; };
struct alignas(8) float2 { float x, y; };

inline thread_local uint3 threadIdx, blockIdx;
inline thread_local dim3 blockDim, gridDim;

namespace emu {
struct Warp {
    std::barrier<> bar{32};
    uint64_t slot[32];  // each lane's value in the current shuffle
};
struct Launch {  // what one launch's threads share
    explicit Launch(unsigned n) : block(n), warps(new Warp[n / 32]) {}
    std::barrier<> block;
    std::unique_ptr<Warp[]> warps;
};
inline thread_local Launch* launch_ = nullptr;
inline thread_local unsigned tid_ = 0;  // linear thread index in the block; lane = tid_ % 32

template <class T> T shuffle(T v, unsigned src) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
    Warp& w = launch_->warps[tid_ / 32];
    std::memcpy(&w.slot[tid_ % 32], &v, sizeof v);
    w.bar.arrive_and_wait();  // every lane has published
    std::memcpy(&v, &w.slot[src], sizeof v);
    w.bar.arrive_and_wait();  // every lane has read before any publishes the next value
    return v;
}

// Function pointer types hold the parameters with top-level const dropped, which is what
// the Python side parsed: kind (p pointer, i signed, u unsigned/bool, f float) and size.
template <class T> constexpr bool param_is(const char* c) {
    char k = std::is_pointer_v<T> ? 'p' : std::is_floating_point_v<T> ? 'f' : std::is_signed_v<T> ? 'i' : 'u';
    return c[0] == k && c[1] - '0' == int(sizeof(T));
}
template <class... A> constexpr bool signature_is(void (*)(A...), std::string_view s) {
    int i = 0;
    return s.size() == 2 * sizeof...(A) && (param_is<A>(s.data() + 2 * i++) && ...);
}

template <class... A, size_t... I> void call(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*static_cast<A*>(args[I])...);
}

template <class... A> void launch(void (*f)(A...), dim3 grid, dim3 block, void** args) {
    const unsigned n = block.x * block.y * block.z;
    assert(n > 0 && n % 32 == 0 && n <= 1024);  // the Python side says why first; this is a backstop
    Launch L(n);
    std::vector<std::jthread> threads;  // declared after L: they join before L goes away
    threads.reserve(n);
    for (unsigned t = 0; t < n; t++)
        threads.emplace_back([&, t] {
            launch_ = &L;
            tid_ = t;
            threadIdx = {t % block.x, t / block.x % block.y, t / (block.x * block.y)};
            blockDim = block;
            gridDim = grid;
            for (unsigned z = 0; z < grid.z; z++)
                for (unsigned y = 0; y < grid.y; y++)
                    for (unsigned x = 0; x < grid.x; x++) {
                        blockIdx = {x, y, z};
                        call(f, args, std::index_sequence_for<A...>{});
                        L.block.arrive_and_wait();  // the next block reuses the shared statics
                    }
        });
}
}  // namespace emu

inline void __syncthreads() { emu::launch_->block.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::launch_->warps[emu::tid_ / 32].bar.arrive_and_wait(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// Shuffles with CUDA's width rules: a lane reads within its width-wide segment, and one whose
// source would fall outside it (down past the end, xor into a later segment) keeps its value.
template <class T> T __shfl_sync(unsigned, T v, int src, int width = 32) {
    unsigned lane = emu::tid_ % 32;
    return emu::shuffle(v, (lane & ~(width - 1)) + (src & (width - 1)));
}
template <class T> T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
    unsigned lane = emu::tid_ % 32, src = lane ^ mask;
    return emu::shuffle(v, src < (lane & ~(width - 1)) + width ? src : lane);
}
template <class T> T __shfl_down_sync(unsigned, T v, unsigned d, int width = 32) {
    unsigned lane = emu::tid_ % 32;
    return emu::shuffle(v, (lane & (width - 1)) + d < unsigned(width) ? lane + d : lane);
}
template <class T> T __shfl_up_sync(unsigned, T v, unsigned d, int width = 32) {
    unsigned lane = emu::tid_ % 32;
    return emu::shuffle(v, (lane & (width - 1)) >= d ? lane - d : lane);
}

// Both overloads, as CUDA has them: an unsigned call must not get signed bytes silently.
// Sums wrap as on the GPU: unsigned arithmetic, as signed overflow would be undefined in C++.
inline int __dp4a(int a, int b, int c) {
    unsigned r = c;
    for (int i = 0; i < 32; i += 8) r += unsigned(int(int8_t(a >> i)) * int(int8_t(b >> i)));
    return int(r);
}
inline unsigned __dp4a(unsigned a, unsigned b, unsigned c) {
    for (int i = 0; i < 32; i += 8) c += ((a >> i) & 0xff) * ((b >> i) & 0xff);
    return c;
}

template <class To, class From> To emu_bits(From v) { To r; std::memcpy(&r, &v, sizeof r); return r; }
inline float __uint_as_float(unsigned u) { return emu_bits<float>(u); }
inline float __int_as_float(int i) { return emu_bits<float>(i); }
inline unsigned __float_as_uint(float f) { return emu_bits<unsigned>(f); }
inline int __float_as_int(float f) { return emu_bits<int>(f); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
inline int __float2int_rn(float x) { return int(nearbyintf(x)); }  // ties to even, as rn says
template <class T> T __ldg(const T* p) { return *p; }
template <class A, class B> auto min(A a, B b) { return b < a ? b : a; }
template <class A, class B> auto max(A a, B b) { return a < b ? b : a; }

// Non-template overloads, as CUDA's, so atomicAdd(float_ptr, 1.0) converts instead of failing.
#define EMU_ATOMIC(T) \
    inline T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); } \
    inline T atomicExch(T* p, T v) { return std::atomic_ref<T>(*p).exchange(v); }
#define EMU_ATOMIC_INT(T) EMU_ATOMIC(T) \
    inline T atomicMax(T* p, T v) { std::atomic_ref<T> r(*p); T o = r.load(); \
                                    while (o < v && !r.compare_exchange_weak(o, v)) {} return o; } \
    inline T atomicMin(T* p, T v) { std::atomic_ref<T> r(*p); T o = r.load(); \
                                    while (v < o && !r.compare_exchange_weak(o, v)) {} return o; }
EMU_ATOMIC_INT(int)
EMU_ATOMIC_INT(unsigned)
EMU_ATOMIC_INT(unsigned long long)
EMU_ATOMIC(float)
EMU_ATOMIC(double)
