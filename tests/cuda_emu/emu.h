// CUDA C on the CPU, for tests on machines without a GPU: force-included (g++ -include) before a
// kernel source, which then builds as plain C++20. A launch runs the grid's blocks one after
// another on the calling thread, in grid order and in reverse grid order by turns (CUDA promises
// no order, so a block that counts on another block of its launch having run first meets the
// other order every second launch). The threads of a block are fibers (one small stack each,
// with a guard page), switched cooperatively: a thread runs until it reaches __syncthreads, a
// warp shuffle or __syncwarp, or returns, and then another runnable thread of the block runs.
//
// Barriers are real barriers: no thread passes one before every thread it waits for has
// arrived. Between barriers nothing interleaves, and the order is chosen to break kernels that
// lack one: a thread runs its whole phase before the next starts it (so one that reads a slot
// another thread has yet to write gets the stale value), the direction alternates from phase
// to phase, and the most recently released threads run first (a LIFO), so a warp whose lanes
// all pass a shuffle runs on ahead, through its later shuffles, to its next __syncthreads
// while other warps have not started (so shared memory rewritten before other warps read it
// shows too). A block that can no longer progress (threads returned, or wait at another
// barrier, while others wait) ends the launch with an error naming the block; a thread that
// spins waiting for another thread or block without a barrier never yields, and hangs.
// Memory is checked as compute-sanitizer's memcheck would on a GPU: the library is built with
// gcc's ThreadSanitizer instrumentation, which calls the __tsan_* hooks below before every load
// and store that is not of a private local (statics included, which AddressSanitizer's skips
// when it can see they are in bounds), and with -fsanitize=alignment, which calls the __ubsan_*
// one before every typed access through a misaligned pointer (on a GPU, an N-byte load needs
// an N-aligned address; on x86 a misaligned vector load just works). Inside a launch a thread
// may touch its own stack, the library's statics (__shared__ memory among them) and the arrays
// its launch was passed, each within its extent; anything else, or a misaligned access, ends
// the launch with an error naming the access, the nearest argument and the code's address
// (cuda_emu turns that into a source line). The emulator's own code below is left unchecked
// (EMU_RUNTIME).
// Shared memory is also checked for races, as compute-sanitizer's racecheck would: two accesses
// to a byte by different threads, one of them a write (atomics aside), need a __syncthreads
// between them, or a warp shuffle or __syncwarp when both threads are of one warp. Blocks run
// their threads in phases, so such a race often gives the right values here and the wrong ones
// on a GPU; the check names both accesses instead. So is global memory between the blocks of a
// launch, which run one after another here and at once on a GPU: a block may read or overwrite
// a byte another block of the launch wrote only as the last-block pattern orders it, the
// writing thread's __threadfence after its write and an atomic of its block after that fence,
// then an atomic of the reading block before its access, each step after the one before in
// its thread or behind a __syncthreads (so the order the emulation ran them in does not count).
// A launch made as a programmatic dependent (EmuModule's dependent_launches, as the cuda backend
// launches kernels/*.cu on sm_90) may, before its thread calls common.cuh's wait_prior_kernels,
// read only through weights(): a store, an atomic or another read of a launch's array there
// ends the launch with an error (before_wait below).
// __CUDACC__ stays undefined on purpose: kernels/common.cuh then takes its host branch
// (_Float16 half conversions instead of inline PTX).
#pragma once
#include <atomic>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <link.h>
#include <math.h>
#include <string_view>
#include <sys/mman.h>
#include <type_traits>
#include <unistd.h>
#include <utility>
// x86-64 switches fibers in a few instructions of its own; elsewhere (or with -DEMU_UCONTEXT, to
// test that path) ucontext's swapcontext, which makes a system call per switch.
#if defined(__x86_64__) && !defined(EMU_UCONTEXT)
#define EMU_ASM_SWITCH 1
#else
#define EMU_ASM_SWITCH 0
#include <ucontext.h>
#endif

// The emulator's own code: not instrumented, so its bookkeeping (the fibers' table, the launch's
// argument block) is not taken for the kernel's accesses.
#define EMU_RUNTIME __attribute__((no_sanitize_thread, no_sanitize("alignment")))

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

// Plain globals: one OS thread runs a launch, and a switch to a fiber sets its threadIdx.
inline uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

#ifndef EMU_STACK_KIB
#define EMU_STACK_KIB 128  // per CUDA thread; overflowing it hits a guard page (SIGSEGV)
#endif

namespace emu {
// Switches stacks: saves the callee-saved registers and the stack pointer in *save, resumes
// `to`. In assembly the compiler cannot see into, so every call is an ordinary call that may
// clobber what the ABI lets a call clobber (no interprocedural register assumptions). The
// floating-point control words (MXCSR, x87) are not switched: kernels do not change them.
#if EMU_ASM_SWITCH
extern "C" void emu_ctx_switch(void** save, void* to);
asm(R"(
    .pushsection .text
    .p2align 4
    .hidden emu_ctx_switch
    .type emu_ctx_switch, @function
emu_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_ctx_switch, .-emu_ctx_switch
    .popsection
)");
#endif

enum State : unsigned char { READY, AT_SYNCTHREADS, AT_WARP, EXITED };

struct Fiber {
#if EMU_ASM_SWITCH
    void* sp;
#else
    ucontext_t uc;
#endif
    char* stack;  // its lowest usable byte; the guard page lies below
    uint3 idx;
    unsigned tid;  // linear index in the block; lane = tid % 32
    State state;
    bool waited;  // has called wait_prior_kernels (common.cuh)
};

struct Warp {
    unsigned arrived, gen;
    unsigned waiting[32];
    uint64_t slot[2][32];  // the shuffle of generation g uses slot[g & 1]: see shuffle()
};

struct Sched {
    Fiber* fibers = nullptr;
    unsigned capacity = 0;  // fibers with a stack
    unsigned n = 0;         // threads in the running block
    unsigned* ready = nullptr;  // runnable fibers: a stack, the last pushed runs next
    unsigned nready = 0;
    unsigned* at_sync = nullptr;  // arrived at __syncthreads, in order
    unsigned sync_arrived = 0, exited = 0;
    unsigned sync_count = 0, sync_result = 0;  // __syncthreads_count's sum so far, and the last total
    unsigned launches = 0;  // odd ones run their blocks in reverse
    Warp warps[32];
    Fiber* cur = nullptr;
#if EMU_ASM_SWITCH
    void* main_sp = nullptr;
#else
    ucontext_t main_uc;
#endif
    void (*body)(void*) = nullptr;  // runs the kernel for the current thread
    void* body_arg = nullptr;
    char error[512];
    bool failed = false;
    // Memory checks: on while a kernel thread runs. The launch's pointer arguments' extents
    // [lo, hi) a parameter (0, 0 for a scalar), and the library's own loaded image.
    bool checking = false;
    bool dependent = false;        // the launch is a programmatic dependent: wait_prior_kernels checked
    bool reading_weights = false;  // inside common.cuh's weights()
    const unsigned long long* extents = nullptr;
    unsigned nparams = 0;
    uintptr_t image_lo = 0, image_hi = 0, image_base = 0;
    // Shared-memory races: the library's writable image (its __shared__ statics, and the
    // emulator's own state, which no checked code writes), a Byte of history each. A phase is a
    // block's stretch between barriers, numbered across blocks and launches, so history from an
    // earlier phase is simply stale and nothing needs clearing.
    uintptr_t shared_lo = 0, shared_hi = 0;
    struct Byte* history = nullptr;
    unsigned long long phase = 0;
    // Global memory between blocks: the bytes this launch wrote, by open addressing on the
    // address (an entry of an earlier launch is free), and the running block's written bytes,
    // fences and atomics, numbered by seq.
    struct Written* written = nullptr;
    size_t written_cap = 0, written_count = 0;
    uintptr_t* block_writes = nullptr;
    size_t block_writes_n = 0, block_writes_cap = 0;
    unsigned launch_id = 0, block_id = 0, atomic_thread = 0;
    unsigned long long seq = 0, atomic_seq = 0, atomic_phase = 0;  // atomic_*: the running block's last atomic
    unsigned long long fence_seq[1024], fence_phase[1024];  // each thread's last __threadfence in the block
};
// A byte of global memory the launch wrote: by which block and thread, at what seq and phase,
// from code at pc; published once its block ended with a fence after the write and an atomic
// after that (after: see after()).
struct Written {
    uintptr_t addr;
    unsigned long long seq, phase;
    unsigned launch, block, pc;
    unsigned short thread;
    bool published;
};
// The last write to a byte of shared memory and the reads since, in phase wphase / rphase: by
// thread writer / reader (MANY: several) at warp generation wgen / rgen (the readers' latest),
// from code at wpc / rpc (offsets in the library). rwarp: the readers' one warp, or MANY.
constexpr unsigned short MANY = 0xffff;
struct Byte {
    unsigned long long wphase, rphase;
    unsigned wpc, rpc, wgen, rgen;
    unsigned short writer, reader, rwarp;
};
inline Sched S;

EMU_RUNTIME inline void push(unsigned f) { S.ready[S.nready++] = f; }

EMU_RUNTIME inline void resume(Fiber* from, Fiber* to) {
    S.cur = to;
    threadIdx = to->idx;
#if EMU_ASM_SWITCH
    emu_ctx_switch(&from->sp, to->sp);
#else
    swapcontext(&from->uc, &to->uc);
#endif
}

EMU_RUNTIME inline void to_main(Fiber* from) {
#if EMU_ASM_SWITCH
    emu_ctx_switch(&from->sp, S.main_sp);
#else
    swapcontext(&from->uc, &S.main_uc);
#endif
}

// Ends the launch from inside a fiber: never resumed, as the next launch starts every fiber afresh.
[[noreturn]] EMU_RUNTIME inline void fail(Fiber* me) {
    S.failed = true;
    to_main(me);
    __builtin_unreachable();
}

[[noreturn]] EMU_RUNTIME __attribute__((noinline)) inline void deadlock(Fiber* me) {
    unsigned warp_waiting = 0;
    for (unsigned i = 0; i < S.n; i++) warp_waiting += S.fibers[i].state == AT_WARP;
    int len = snprintf(S.error, sizeof S.error,
                       "deadlock in block (%u,%u,%u) of %u threads: %u wait at __syncthreads, %u at a warp "
                       "shuffle/__syncwarp, %u returned",
                       blockIdx.x, blockIdx.y, blockIdx.z, S.n, S.sync_arrived, warp_waiting, S.exited);
    for (unsigned w = 0; w < S.n / 32 && len < int(sizeof S.error) - 64; w++) {
        unsigned counts[4] = {};
        for (unsigned l = 0; l < 32; l++) counts[S.fibers[w * 32 + l].state]++;
        if (counts[AT_WARP] || (counts[AT_SYNCTHREADS] && counts[EXITED]))
            len += snprintf(S.error + len, sizeof S.error - len, "; warp %u: %u at __syncthreads, %u at warp, %u returned",
                            w, counts[AT_SYNCTHREADS], counts[AT_WARP], counts[EXITED]);
    }
    fail(me);
}

[[noreturn]] EMU_RUNTIME __attribute__((noinline)) inline void partial_mask(const char* what, unsigned mask) {
    snprintf(S.error, sizeof S.error, "%s with mask 0x%08x in block (%u,%u,%u), thread (%u,%u,%u): the emulator "
             "only has whole-warp (0xffffffff) shuffles and __syncwarp", what, mask, blockIdx.x, blockIdx.y,
             blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z);
    fail(S.cur);
}

// `me` has stopped (waits or returned): run the next runnable fiber, or end the block.
EMU_RUNTIME inline void next(Fiber* me) {
    if (S.nready) {
        resume(me, &S.fibers[S.ready[--S.nready]]);  // whoever resumes `me` has set S.cur and threadIdx
    } else if (S.exited == S.n) {
        to_main(me);
    } else {
        deadlock(me);
    }
}

[[noreturn]] EMU_RUNTIME inline void fiber_main() {
    S.body(S.body_arg);
    Fiber* me = S.cur;
    me->state = EXITED;
    S.exited++;
    next(me);
    std::abort();  // a returned fiber is never resumed
}

// Returns how many threads of the block arrived with a nonzero pred. The total stays readable
// until the next barrier completes, which needs every thread, each of which reads it first.
EMU_RUNTIME inline unsigned syncthreads(int pred = 0) {
    Fiber* me = S.cur;
    S.sync_count += pred != 0;
    if (++S.sync_arrived == S.n) {  // the last to arrive releases the others and goes on
        for (unsigned i = 0; i < S.n - 1; i++) {
            S.fibers[S.at_sync[i]].state = READY;
            push(S.at_sync[i]);
        }
        S.sync_arrived = 0;
        S.phase++;
        S.sync_result = S.sync_count;
        S.sync_count = 0;
        return S.sync_result;
    }
    S.at_sync[S.sync_arrived - 1] = me->tid;
    me->state = AT_SYNCTHREADS;
    next(me);
    return S.sync_result;
}

// Returns the generation it waited in: a shuffle reads slot[gen & 1]. Lanes released by the
// last arrival read after it, possibly after it has gone on to the next shuffle, which writes
// the other slot; the one after that cannot start until they have all arrived at it.
EMU_RUNTIME inline unsigned warp_sync() {
    Fiber* me = S.cur;
    Warp& w = S.warps[me->tid / 32];
    unsigned gen = w.gen;
    if (++w.arrived == 32) {
        for (unsigned i = 0; i < 31; i++) {
            S.fibers[w.waiting[i]].state = READY;
            push(w.waiting[i]);
        }
        w.arrived = 0;
        w.gen++;
        return gen;
    }
    w.waiting[w.arrived - 1] = me->tid;
    me->state = AT_WARP;
    next(me);
    return gen;
}

template <class T> EMU_RUNTIME T shuffle(T v, unsigned src) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
    unsigned tid = S.cur->tid;
    Warp& w = S.warps[tid / 32];
    std::memcpy(&w.slot[w.gen & 1][tid % 32], &v, sizeof v);
    unsigned gen = warp_sync();  // every lane has published
    std::memcpy(&v, &w.slot[gen & 1][src], sizeof v);
    return v;
}

EMU_RUNTIME inline unsigned lane() { return S.cur->tid % 32; }

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

template <class... A> struct Call {
    void (*f)(A...);
    void** args;
    template <size_t... I> EMU_RUNTIME void run(std::index_sequence<I...>) { f(*static_cast<A*>(args[I])...); }
    EMU_RUNTIME static void thunk(void* self) { static_cast<Call*>(self)->run(std::index_sequence_for<A...>{}); }
};

// Stacks are made once, at the most threads a launch has asked for, and kept.
EMU_RUNTIME inline bool reserve(unsigned n) {
    if (n <= S.capacity) return true;
    const size_t page = size_t(sysconf(_SC_PAGESIZE)), size = size_t(EMU_STACK_KIB) * 1024;
    auto* fibers = static_cast<Fiber*>(realloc(S.fibers, n * sizeof(Fiber)));
    auto* ready = static_cast<unsigned*>(realloc(S.ready, n * sizeof(unsigned)));
    auto* at_sync = static_cast<unsigned*>(realloc(S.at_sync, n * sizeof(unsigned)));
    if (fibers) S.fibers = fibers;
    if (ready) S.ready = ready;
    if (at_sync) S.at_sync = at_sync;
    if (!fibers || !ready || !at_sync) return false;
    for (unsigned i = S.capacity; i < n; i++) {
        void* m = mmap(nullptr, size + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) return false;
        mprotect(m, page, PROT_NONE);  // the guard page
        S.fibers[i].stack = static_cast<char*>(m) + page;
        S.capacity = i + 1;
    }
    return true;
}

EMU_RUNTIME inline void start(Fiber& f, unsigned i) {
    const size_t size = size_t(EMU_STACK_KIB) * 1024;
    f.waited = false;
    // Stack tops staggered by 64 bytes a thread, so the threads' hot frames do not all fall
    // in the same cache sets (the stacks themselves are page aligned).
    char* top = f.stack + size - (i % 64) * 64;
#if EMU_ASM_SWITCH
    auto* sp = reinterpret_cast<void**>(top);
    *--sp = nullptr;                                           // fiber_main's return address
    *--sp = reinterpret_cast<void*>(&fiber_main);              // where emu_ctx_switch returns to
    for (int r = 0; r < 6; r++) *--sp = nullptr;               // rbp rbx r12 r13 r14 r15
    f.sp = sp;
#else
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = f.stack;
    f.uc.uc_stack.ss_size = size - (i % 64) * 64;
    f.uc.uc_link = nullptr;
    makecontext(&f.uc, reinterpret_cast<void (*)()>(&fiber_main), 0);
#endif
}

// The loaded image (every PT_LOAD segment) of the library holding S: its statics, __shared__
// memory among them, are memory a kernel thread may touch.
EMU_RUNTIME inline int find_image(dl_phdr_info* info, size_t, void*) {
    uintptr_t lo = UINTPTR_MAX, hi = 0, me = reinterpret_cast<uintptr_t>(&S);
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const auto& ph = info->dlpi_phdr[i];
        if (ph.p_type != PT_LOAD) continue;
        uintptr_t a = info->dlpi_addr + ph.p_vaddr;
        lo = a < lo ? a : lo;
        hi = a + ph.p_memsz > hi ? a + ph.p_memsz : hi;
    }
    if (me < lo || me >= hi) return 0;
    S.image_lo = lo, S.image_hi = hi, S.image_base = info->dlpi_addr;
    for (int i = 0; i < info->dlpi_phnum; i++) {  // the writable segment holds the statics
        const auto& ph = info->dlpi_phdr[i];
        uintptr_t a = info->dlpi_addr + ph.p_vaddr;
        if (ph.p_type == PT_LOAD && (ph.p_flags & PF_W) && a <= me && me < a + ph.p_memsz)
            S.shared_lo = a, S.shared_hi = a + ph.p_memsz;
    }
    S.history = static_cast<Byte*>(calloc(S.shared_hi - S.shared_lo, sizeof(Byte)));
    return S.history != nullptr;
}

// Programmatic dependent launch (common.cuh's wait_prior_kernels): before its wait a thread may
// only read weights, through weights(); any other access to a launch's array could meet the
// kernel before still running on a GPU.
[[noreturn]] EMU_RUNTIME __attribute__((noinline)) inline void before_wait(unsigned param, bool write, bool atomic,
                                                                           uintptr_t pc) {
    snprintf(S.error, sizeof S.error, "%s parameter %u [pc +0x%lx], block (%u,%u,%u) thread (%u,%u,%u), before "
             "wait_prior_kernels(): launched as a programmatic dependent, the kernel before may still be running "
             "(only weights() reads may come first)", atomic ? "an atomic on" : write ? "a store to" : "a read of",
             param, (unsigned long)(pc - S.image_base), blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x,
             threadIdx.y, threadIdx.z);
    fail(S.cur);
}

EMU_RUNTIME inline void prior_kernels_waited() { S.cur->waited = true; }
EMU_RUNTIME inline void weights_reading(bool on) { S.reading_weights = on; }

[[noreturn]] EMU_RUNTIME __attribute__((noinline)) inline void bad_access(uintptr_t a, size_t n, bool write,
                                                                          uintptr_t pc) {
    int len = snprintf(S.error, sizeof S.error, "%zu-byte %s of 0x%lx [pc +0x%lx], block (%u,%u,%u) thread (%u,%u,%u): "
                       "outside its stack, shared memory and the launch's arrays", n, write ? "write" : "read",
                       (unsigned long)a, (unsigned long)(pc - S.image_base), blockIdx.x, blockIdx.y, blockIdx.z,
                       threadIdx.x, threadIdx.y, threadIdx.z);
    int near = -1;
    uintptr_t gap = UINTPTR_MAX;
    for (unsigned i = 0; i < S.nparams; i++) {
        uintptr_t lo = S.extents[2 * i], hi = S.extents[2 * i + 1];
        if (!lo) continue;  // a scalar
        uintptr_t d = a >= hi ? a - hi : a + n <= lo ? lo - (a + n) : 0;
        if (d < gap) gap = d, near = int(i);
    }
    if (near >= 0) {
        uintptr_t lo = S.extents[2 * near], hi = S.extents[2 * near + 1];
        snprintf(S.error + len, sizeof S.error - len, "; nearest: byte %+ld of parameter %d, an array of %lu bytes",
                 (long)(a - lo), near, (unsigned long)(hi - lo));
    }
    fail(S.cur);
}

// "what (x,y,z)" for the linear index i of a block (dims: gridDim) or a thread (blockDim).
struct Named { char text[32]; };
EMU_RUNTIME inline Named named(const char* what, unsigned i, dim3 dims) {
    Named n;
    snprintf(n.text, sizeof n.text, "%s (%u,%u,%u)", what, i % dims.x, i / dims.x % dims.y, i / (dims.x * dims.y));
    return n;
}

[[noreturn]] EMU_RUNTIME __attribute__((noinline)) inline void race(const char* kind, uintptr_t a, unsigned me,
                                                                    unsigned pc, unsigned other, unsigned other_pc) {
    Named first = other == MANY ? Named{"several threads"} : named("thread", other, blockDim);
    Named second = named("thread", me, blockDim);
    snprintf(S.error, sizeof S.error, "shared-memory race (%s) in block (%u,%u,%u) on [data +0x%lx]: %s [pc +0x%x], "
             "then %s [pc +0x%x], with no barrier between", kind, blockIdx.x, blockIdx.y, blockIdx.z,
             (unsigned long)(a - S.image_base), first.text, other_pc, second.text, pc);
    fail(S.cur);
}

// Threads t and u's accesses in one phase, u's now and t's at warp generation gen: ordered when
// one thread made both, or a warp sync of their one warp came between.
EMU_RUNTIME inline bool ordered(unsigned t, unsigned gen, unsigned u) {
    return t == u || (t / 32 == u / 32 && S.warps[u / 32].gen > gen);
}

EMU_RUNTIME inline void race_check(uintptr_t a, size_t n, bool write, unsigned pc) {
    const unsigned t = S.cur->tid, w = t / 32, gen = S.warps[w].gen;
    for (Byte* b = S.history + (a - S.shared_lo); b < S.history + (a + n - S.shared_lo); b++) {
        if (b->wphase == S.phase && !ordered(b->writer, b->wgen, t))
            race(write ? "write after write" : "read after write", a, t, pc, b->writer, b->wpc);
        if (write) {
            if (b->rphase == S.phase && b->reader != t &&
                (b->reader == MANY ? b->rwarp != w || gen <= b->rgen : !ordered(b->reader, b->rgen, t)))
                race("write after read", a, t, pc, b->reader, b->rpc);
            b->wphase = S.phase, b->writer = t, b->wgen = gen, b->wpc = pc;
            b->rphase = 0;  // later writes are ordered against this one, which was against the reads
        } else if (b->rphase != S.phase) {
            b->rphase = S.phase, b->reader = t, b->rgen = gen, b->rwarp = w, b->rpc = pc;
        } else if (b->reader != t) {
            b->reader = MANY, b->rgen = gen > b->rgen ? gen : b->rgen, b->rpc = pc;
            if (b->rwarp != w) b->rwarp = MANY;
        }
    }
}

EMU_RUNTIME inline size_t slot_of(uintptr_t a, size_t cap) { return (a * 0x9E3779B97F4A7C15ull >> 20) & (cap - 1); }

// The entry for byte a in this launch: found, or (insert) made, else null.
EMU_RUNTIME inline Written* written_at(uintptr_t a, bool insert) {
    if (insert && 2 * (S.written_count + 1) > S.written_cap) {  // grow, keeping this launch's entries
        size_t cap = S.written_cap ? 2 * S.written_cap : 4096;
        auto* table = static_cast<Written*>(calloc(cap, sizeof(Written)));
        if (!table) abort();
        for (size_t i = 0; i < S.written_cap; i++) {
            const Written& e = S.written[i];
            if (e.launch != S.launch_id) continue;
            size_t j = slot_of(e.addr, cap);
            while (table[j].launch == S.launch_id) j = (j + 1) & (cap - 1);
            table[j] = e;
        }
        free(S.written);
        S.written = table;
        S.written_cap = cap;
    }
    if (!S.written_cap) return nullptr;
    for (size_t j = slot_of(a, S.written_cap);; j = (j + 1) & (S.written_cap - 1)) {
        Written& e = S.written[j];
        if (e.launch != S.launch_id) {
            if (!insert) return nullptr;
            S.written_count++;
            e = Written{a, 0, 0, S.launch_id, 0, 0, 0, false};
            return &e;
        }
        if (e.addr == a) return &e;
    }
}

[[noreturn]] EMU_RUNTIME __attribute__((noinline)) inline void global_race(const char* kind, uintptr_t a,
                                                                           const Written& w, unsigned pc) {
    int len = snprintf(S.error, sizeof S.error, "global-memory race between blocks (%s): %s %s [pc +0x%x] wrote a "
                       "byte that %s %s [pc +0x%x] then %s in the same launch, not ordered by a fence and atomics "
                       "(the last-block pattern)", kind, named("block", w.block, gridDim).text,
                       named("thread", w.thread, blockDim).text, w.pc, named("block", S.block_id, gridDim).text,
                       named("thread", S.cur->tid, blockDim).text, pc, kind[0] == 'r' ? "reads" : "overwrites");
    for (unsigned i = 0; i < S.nparams; i++)
        if (a >= S.extents[2 * i] && a < S.extents[2 * i + 1]) {
            snprintf(S.error + len, sizeof S.error - len, "; byte %lu of parameter %u",
                     (unsigned long)(a - S.extents[2 * i]), i);
            break;
        }
    fail(S.cur);
}

// Step b of thread u comes after step a of thread t (seq and phase of each; seq 0: never made):
// in t's program order, or behind a __syncthreads.
EMU_RUNTIME inline bool after(unsigned long long a_seq, unsigned long long a_phase, unsigned t,
                              unsigned long long b_seq, unsigned long long b_phase, unsigned u) {
    return a_seq && b_seq && (t == u ? b_seq > a_seq : b_phase > a_phase);
}

// An access to the launch's global memory: a byte another block wrote may be read or written
// only once that block published it and this thread comes after an atomic of its own block.
EMU_RUNTIME inline void global_check(uintptr_t a, size_t n, bool write, unsigned pc) {
    if (!write && !S.written_count) return;  // the launch has written nothing yet
    const unsigned me = S.cur->tid;
    const bool acquired = after(S.atomic_seq, S.atomic_phase, S.atomic_thread, S.seq + 1, S.phase, me);
    for (uintptr_t x = a; x < a + n; x++) {
        Written* w = written_at(x, write);
        if (!w) continue;
        if (w->seq && w->block != S.block_id && !(w->published && acquired))
            global_race(write ? "write after write" : "read after write", x, *w, pc);
        if (!write) continue;
        *w = Written{x, ++S.seq, S.phase, S.launch_id, S.block_id, pc, (unsigned short)me, false};
        if (S.block_writes_n == S.block_writes_cap) {
            S.block_writes_cap = S.block_writes_cap ? 2 * S.block_writes_cap : 4096;
            S.block_writes = static_cast<uintptr_t*>(realloc(S.block_writes, S.block_writes_cap * sizeof(uintptr_t)));
            if (!S.block_writes) abort();
        }
        S.block_writes[S.block_writes_n++] = x;
    }
}

// The running block has ended: which of its writes it published.
EMU_RUNTIME inline void publish_block() {
    for (size_t i = 0; i < S.block_writes_n; i++) {
        Written* w = written_at(S.block_writes[i], false);
        if (w && w->block == S.block_id) {
            unsigned t = w->thread;
            unsigned long long fence = S.fence_seq[t], phase = S.fence_phase[t];
            w->published = after(w->seq, w->phase, t, fence, phase, t) &&
                           after(fence, phase, t, S.atomic_seq, S.atomic_phase, S.atomic_thread);
        }
    }
    S.block_writes_n = 0;
}

// Called before each load or store of a kernel thread (the __tsan_* hooks below); atomic: an
// atomic operation, which races with nothing.
EMU_RUNTIME inline void check(uintptr_t a, size_t n, bool write, uintptr_t pc, bool atomic = false) {
    if (!S.checking) return;
    uintptr_t stack = reinterpret_cast<uintptr_t>(S.cur->stack);
    if (a >= stack && a + n <= stack + size_t(EMU_STACK_KIB) * 1024) return;
    if (a >= S.shared_lo && a + n <= S.shared_hi) {
        if (!atomic) race_check(a, n, write, unsigned(pc - S.image_base));
        return;
    }
    if (a >= S.image_lo && a + n <= S.image_hi) return;
    for (unsigned i = 0; i < S.nparams; i++)
        if (a >= S.extents[2 * i] && a + n <= S.extents[2 * i + 1]) {
            if (S.dependent && !S.cur->waited && (write || atomic || !S.reading_weights))
                before_wait(i, write, atomic, pc);
            if (atomic)
                S.atomic_seq = ++S.seq, S.atomic_phase = S.phase, S.atomic_thread = S.cur->tid;
            else
                global_check(a, n, write, unsigned(pc - S.image_base));
            return;
        }
    bad_access(a, n, write, pc);
}

// Runs the launch; returns null, or what went wrong. extents: [lo, hi) of each parameter's
// array (0, 0 for a scalar), the memory the launch may touch besides its stacks and statics;
// most: the kernel's __launch_bounds__ (a larger block is a launch error on a GPU); dependent:
// launched as a programmatic dependent (before_wait says what that forbids).
template <class... A>
EMU_RUNTIME const char* launch(void (*f)(A...), dim3 grid, dim3 block, void** args, const unsigned long long* extents,
                               unsigned most, bool dependent) {
    const unsigned n = block.x * block.y * block.z;
    if (!(n > 0 && n % 32 == 0 && n <= 1024)) return "the emulator needs whole warps, at most 1024 threads";
    if (n > most) {
        snprintf(S.error, sizeof S.error, "a block of %u threads, more than the kernel's __launch_bounds__ (%u): a "
                 "launch error on a GPU", n, most);
        return S.error;
    }
    if (!reserve(n)) return "cannot allocate the emulated threads' stacks";
    if (!S.image_hi && !dl_iterate_phdr(find_image, nullptr)) return "cannot find the emulator library's own image";
    S.extents = extents;
    S.nparams = sizeof...(A);
    S.dependent = dependent;
    Call<A...> call{f, args};
    S.body = &Call<A...>::thunk;
    S.body_arg = &call;
    S.n = n;
    S.failed = false;
    blockDim = block;
    gridDim = grid;
    const bool reverse = S.launches++ & 1;
    const unsigned blocks = grid.x * grid.y * grid.z;
    S.launch_id++;  // every entry of the written table is now free
    S.written_count = 0;
    for (unsigned b = 0; b < blocks; b++) {
        const unsigned i = reverse ? blocks - 1 - b : b;
        blockIdx = {i % grid.x, i / grid.x % grid.y, i / (grid.x * grid.y)};
        S.block_id = i, S.atomic_seq = 0, S.block_writes_n = 0;
        memset(S.fence_seq, 0, n * sizeof *S.fence_seq);
        for (unsigned t = 0; t < n; t++) {
            Fiber& fb = S.fibers[t];
            fb.idx = {t % block.x, t / block.x % block.y, t / (block.x * block.y)};
            fb.tid = t;
            fb.state = READY;
            start(fb, t);
            S.ready[t] = n - 1 - t;  // thread 0 runs first (below), then 1, 2, ...
        }
        S.nready = n - 1;
        S.phase++;
        S.sync_arrived = S.exited = S.sync_count = 0;
        for (unsigned w = 0; w < n / 32; w++) S.warps[w].arrived = S.warps[w].gen = 0;
        S.cur = &S.fibers[0];
        threadIdx = S.fibers[0].idx;
        S.checking = true;
#if EMU_ASM_SWITCH
        emu_ctx_switch(&S.main_sp, S.fibers[0].sp);
#else
        swapcontext(&S.main_uc, &S.fibers[0].uc);
#endif
        S.checking = false;
        if (S.failed) return S.error;
        publish_block();
    }
    return nullptr;
}
}  // namespace emu

// The hooks gcc's -fsanitize=thread calls (with tsan-instrument-func-entry-exit=0, loads, stores
// and the ranges of block copies), and the one -fsanitize=alignment calls on a misaligned typed
// access. Defined here, hidden, so the library needs no sanitizer runtime: TSan's own would
// take every access for a data race between the emulated threads, which share one OS thread.
#define EMU_CALLER reinterpret_cast<uintptr_t>(__builtin_return_address(0))
#define EMU_ACCESS_HOOK(name, n, write) \
    extern "C" EMU_RUNTIME void __tsan_##name(void* a) { \
        emu::check(reinterpret_cast<uintptr_t>(a), n, write, EMU_CALLER); }
#define EMU_ACCESS_HOOKS(n) \
    EMU_ACCESS_HOOK(read##n, n, false) EMU_ACCESS_HOOK(write##n, n, true) \
    EMU_ACCESS_HOOK(unaligned_read##n, n, false) EMU_ACCESS_HOOK(unaligned_write##n, n, true)
EMU_ACCESS_HOOK(read1, 1, false)
EMU_ACCESS_HOOK(write1, 1, true)
EMU_ACCESS_HOOKS(2)
EMU_ACCESS_HOOKS(4)
EMU_ACCESS_HOOKS(8)
EMU_ACCESS_HOOKS(16)
#undef EMU_ACCESS_HOOKS
#undef EMU_ACCESS_HOOK
extern "C" EMU_RUNTIME void __tsan_read_range(void* a, size_t n) {
    emu::check(reinterpret_cast<uintptr_t>(a), n, false, EMU_CALLER);
}
extern "C" EMU_RUNTIME void __tsan_write_range(void* a, size_t n) {
    emu::check(reinterpret_cast<uintptr_t>(a), n, true, EMU_CALLER);
}
extern "C" EMU_RUNTIME void __tsan_init() {}

namespace emu {
// gcc's descriptions of a typed access (compiler-rt's TypeMismatchData and TypeDescriptor).
struct SourceLocation { const char* file; unsigned line, column; };
struct TypeDescriptor { unsigned short kind, info; char name[1]; };
struct TypeMismatch { SourceLocation loc; const TypeDescriptor* type; unsigned char log_alignment, check_kind; };
}  // namespace emu

extern "C" EMU_RUNTIME void __ubsan_handle_type_mismatch_v1(emu::TypeMismatch* d, uintptr_t p) {
    if (!emu::S.checking) return;
    unsigned align = 1u << d->log_alignment;
    snprintf(emu::S.error, sizeof emu::S.error, "misaligned access at %s:%u, block (%u,%u,%u) thread (%u,%u,%u): "
             "%s needs %u-byte alignment, and 0x%lx is %lu bytes past a boundary (a fault on a GPU)", d->loc.file,
             d->loc.line, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z, d->type->name,
             align, (unsigned long)p, (unsigned long)(p % align));
    emu::fail(emu::S.cur);
}

inline void __syncthreads() { emu::syncthreads(); }
inline int __syncthreads_count(int pred) { return (int)emu::syncthreads(pred); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    if (mask != 0xffffffffu) emu::partial_mask("__syncwarp", mask);
    emu::warp_sync();
}
EMU_RUNTIME inline void __threadfence() {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (emu::S.checking) {
        unsigned t = emu::S.cur->tid;
        emu::S.fence_seq[t] = ++emu::S.seq, emu::S.fence_phase[t] = emu::S.phase;
    }
}

// Shuffles with CUDA's width rules: a lane reads within its width-wide segment, and one whose
// source would fall outside it (down past the end, xor into a later segment) keeps its value.
#define EMU_FULL(name) if (mask != 0xffffffffu) emu::partial_mask(name, mask)
template <class T> T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    EMU_FULL("__shfl_sync");
    unsigned lane = emu::lane();
    return emu::shuffle(v, (lane & ~(width - 1)) + (src & (width - 1)));
}
template <class T> T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    EMU_FULL("__shfl_xor_sync");
    unsigned lane = emu::lane(), src = lane ^ lane_mask;
    return emu::shuffle(v, src < (lane & ~(width - 1)) + width ? src : lane);
}
template <class T> T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
    EMU_FULL("__shfl_down_sync");
    unsigned lane = emu::lane();
    return emu::shuffle(v, (lane & (width - 1)) + d < unsigned(width) ? lane + d : lane);
}
template <class T> T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
    EMU_FULL("__shfl_up_sync");
    unsigned lane = emu::lane();
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
// The threads of a launch share one OS thread, but atomics stay atomic: host code may not.
// Checked as atomics (within the launch's memory, never a race): the compare-and-swap loop
// below is the emulator's own code, which gcc's builtins keep uninstrumented where
// std::atomic_ref's inline members would be instrumented as plain accesses.
namespace emu {
template <class T, class F>
EMU_RUNTIME __attribute__((noinline)) T atomic_apply(T* p, F f, uintptr_t pc) {
    check(reinterpret_cast<uintptr_t>(p), sizeof *p, true, pc, true);
    T old, next;
    __atomic_load(p, &old, __ATOMIC_SEQ_CST);
    do next = f(old);
    while (!__atomic_compare_exchange(p, &old, &next, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
    return old;
}
}  // namespace emu
#define EMU_ATOMIC_OP(name, T, update) \
    EMU_RUNTIME __attribute__((noinline)) inline T name(T* p, T v) { \
        return emu::atomic_apply(p, [v](T o) -> T { return update; }, EMU_CALLER); }
#define EMU_ATOMIC(T) EMU_ATOMIC_OP(atomicAdd, T, o + v) EMU_ATOMIC_OP(atomicExch, T, v)
#define EMU_ATOMIC_INT(T) \
    EMU_ATOMIC(T) EMU_ATOMIC_OP(atomicMax, T, o < v ? v : o) EMU_ATOMIC_OP(atomicMin, T, v < o ? v : o)
EMU_ATOMIC_INT(int)
EMU_ATOMIC_INT(unsigned)
EMU_ATOMIC_INT(unsigned long long)
EMU_ATOMIC(float)
EMU_ATOMIC(double)
