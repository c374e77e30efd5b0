"""The CPU backend: ref's kernel contract compiled with numba and threaded (ARCHITECTURE section 7).

Kernels compile on first use and are cached on disk (`cache=True`). They release the GIL
(`nogil`), so the pager's reader thread issues its disk reads while they compute. Decode kernels allocate
nothing; the tiny ones (a few hundred elements, ~300 calls a token) run on one thread because a
parallel region costs more than their work (CPU-NOTES); the matvecs and decode attention run in
parallel. Threads: `set_threads`.

The Q4 matvecs' inner loops are LLVM IR built here, not in a module of their own: numba's disk
cache keys each function on its own file's timestamp, so IR edited in another file would leave
stale machine code behind.

Fast-math: `_FAST` allows reassociation (so reductions vectorise) and FMA contraction, but not
the no-NaN/no-inf assumptions, so inf and NaN still propagate as IEEE says.
"""

from __future__ import annotations

import os
import sys

if "NUMBA_CACHE_DIR" not in os.environ:
    home = os.path.expanduser(os.environ.get("NERVA_HOME") or "~/.nerva")
    os.environ["NUMBA_CACHE_DIR"] = os.path.join(home, "numba-cache")
    if "numba" in sys.modules:  # numba reads its environment once, when first imported
        sys.modules["numba"].core.config.reload_config()

import numba  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import binding as llvm, ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from nerva_cli.planes.cpu.compile_aside import compile_aside, compile_only  # noqa: E402, F401  (Engine.warm_up's)
from nerva_cli.planes.ref import ATT_SPLIT_MIN, SHORT_PREFILL_MOST, attention_prefill_work  # noqa: E402  (every backend's sizes)


def _refresh_without_optional_imports(target_context) -> None:
    """Loads numba's typing and lowering registries, in numba's order, with two of their imports
    failing fast: they serve nothing here. Its NumPy support probes for scipy's BLAS by importing
    scipy.linalg: 0.13 s where scipy is installed (as on this project's 2-core EPYC machines).
    Its cffi support makes a cffi.FFI(), which imports pycparser: 0.03 s where cffi is installed
    (it was on a Zen 4 EPYC of that kind). No kernel here uses either: their GEMMs call NumPy's
    OpenBLAS through an address of their own (_sgemm), and nothing compiled calls a cffi
    function. numba's own np.dot still imports scipy.linalg when one compiles; numba's cffi
    support stays off in this process (it looks for cffi once), while cffi itself imports as
    before."""
    hidden = [name for name in ("scipy.linalg", "cffi") if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # `import scipy.linalg...` raises ImportError at once
    try:
        target_context.refresh()
    finally:
        for name in hidden:
            del sys.modules[name]


def _load_numba_registries_only_to_compile() -> None:
    """numba loads its registries before it loads a function from its disk cache, though cached
    machine code needs only numba's runtime (NRT, whose symbols it links against). Here a cache
    load initialises the runtime alone, and the registries load at the first miss, which numba
    compiles next; a function without a disk cache compiles as before (numba's compiler loads
    them itself, optional imports included). A warm run leaves 62 of numba's modules unimported
    (cached code's environments still import a dozen, numba.np.arrayobj's among them): `nerva
    run smollm2-135m -p "Say hi" -n 8` on the 2-core Zen 4 EPYC, eight runs each, alternating,
    medians 0.96 -> 0.90 s (q4_1), 1.07 -> 0.99 s (f16)."""
    try:
        from numba.core.caching import Cache
        from numba.core.cpu import CPUContext
        from numba.core.runtime import rtsys

        load_with_registries = Cache.load_overload
        Cache._load_overload, Cache._guard_against_spurious_io_errors  # noqa: B018  (what the patch calls)
    except (ImportError, AttributeError):  # numba moved them: the registries load now, as numba would
        from numba.core.registry import cpu_target

        _refresh_without_optional_imports(cpu_target.target_context)
        return
    registries_loaded = []

    def load_overload(self, sig, target_context):
        if registries_loaded or not isinstance(target_context, CPUContext):  # rtsys is the CPU's runtime
            return load_with_registries(self, sig, target_context)
        rtsys.initialize(target_context)
        found = None
        with self._guard_against_spurious_io_errors():
            found = self._load_overload(sig, target_context)
        if found is None:
            _refresh_without_optional_imports(target_context)
            registries_loaded.append(True)
        return found

    Cache.load_overload = load_overload


_load_numba_registries_only_to_compile()


def _serialise_numba_cache_saves() -> None:
    """numba adds a compiled overload to its disk cache by reading the function's index, adding
    the entry and writing the index back, with nothing held between: two nerva processes
    compiling one function for different types at once (a first run of two variants side by
    side) lose one entry, which a later run compiles again, or, where their writes interleave
    unluckily, map one entry to the other's code. A lock on the cache directory for the length of
    each save keeps them in turn (a test makes the window wide and sees both entries kept)."""
    try:
        import fcntl
        from numba.core.caching import IndexDataCacheFile
    except ImportError:  # not POSIX, or numba moved it: saves as numba makes them
        return
    save = IndexDataCacheFile.save

    def save_in_turn(self, key, data):
        try:
            lock = open(os.path.join(os.path.dirname(self._index_path), ".nerva-save.lock"), "a")
        except OSError:  # numba raises what a save raises on POSIX: never let the lock be why
            return save(self, key, data)
        with lock:  # closing it releases the lock
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
            except OSError:  # a filesystem without locks (some NFS): saves as numba makes them
                pass
            return save(self, key, data)

    IndexDataCacheFile.save = save_in_turn


_serialise_numba_cache_saves()

F32 = np.float32
_FAST = {"reassoc", "contract"}


def set_threads(n: int) -> None:
    """Threads for the parallel kernels, 1..the cores numba saw at start."""
    most = numba.config.NUMBA_NUM_THREADS
    if not 1 <= n <= most:
        raise ValueError(f"threads must be between 1 and {most}, got {n}")
    numba.set_num_threads(n)
    _threads[0] = n


_threads = [numba.get_num_threads()]  # set_threads's, kept here: numba's getter takes 0.7 us a call


# -- helpers -------------------------------------------------------------------------------

@intrinsic
def _half_to_f32(typingctx, bits):
    """IEEE half bits (uint16) -> float32 by LLVM's fpext: one vcvtph2ps with F16C, exact for
    every input (subnormals, inf, NaN). Measured 25% faster on the Q4 matvecs than decoding the
    bits in numba code, whose branches sit in the per-block path; tests check all 65536 inputs."""
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@njit(cache=True, inline="always")
def _row_group(g, rows):
    # Rows 4g..4g+3, the ones past the end repeated (they recompute and rewrite the last row,
    # with the same value): no tail loop.
    r0 = 4 * g
    r1 = r0 + 1 if r0 + 1 < rows else r0
    r2 = r0 + 2 if r0 + 2 < rows else r1
    r3 = r0 + 3 if r0 + 3 < rows else r2
    return r0, r1, r2, r3


# -- norms, rope, activation ----------------------------------------------------------------

@njit(cache=True, nogil=True, fastmath=_FAST)
def rmsnorm(x, w, eps, out):
    n = w.shape[0]
    x2, out2 = x.reshape(-1, n), out.reshape(-1, n)  # reshaped here: ~0.3 us less than in Python
    for t in range(x2.shape[0]):
        ss = F32(0)
        for i in range(n):
            ss += x2[t, i] * x2[t, i]
        inv = F32(1) / np.sqrt(ss / F32(n) + F32(eps))
        for i in range(n):
            out2[t, i] = x2[t, i] * inv * w[i]


@njit(cache=True, nogil=True, fastmath=_FAST)
def add_rmsnorm(x, residual, w, eps, out):
    n = w.shape[0]
    x2, res2, out2 = x.reshape(-1, n), residual.reshape(-1, n), out.reshape(-1, n)
    for t in range(x2.shape[0]):
        ss = F32(0)
        for i in range(n):
            r = res2[t, i] + x2[t, i]
            res2[t, i] = r
            ss += r * r
        inv = F32(1) / np.sqrt(ss / F32(n) + F32(eps))
        for i in range(n):
            out2[t, i] = res2[t, i] * inv * w[i]


@njit(cache=True, nogil=True, fastmath=_FAST)
def add_rows(x, b):
    # NumPy's broadcasting `x += b` takes a 32 KB buffer a call (its ufunc buffer); this none.
    n = b.shape[0]
    x2 = x.reshape(-1, n)
    for t in range(x2.shape[0]):
        for i in range(n):
            x2[t, i] += b[i]


@njit(cache=True, nogil=True, fastmath=_FAST)
def rope(x, pos, cos, sin):
    half = cos.shape[1]
    x3 = x.reshape(pos.shape[0], -1, 2 * half)
    for t in range(x3.shape[0]):
        p = pos[t]
        for h in range(x3.shape[1]):
            for i in range(half):
                x1 = x3[t, h, i]
                x2 = x3[t, h, i + half]
                c = cos[p, i]
                s = sin[p, i]
                x3[t, h, i] = x1 * c - x2 * s
                x3[t, h, i + half] = x2 * c + x1 * s




# -- Q4_0 / Q4_1 matvecs --------------------------------------------------------------------
#
# The inner loops are LLVM vector IR (numba intrinsics): numba types integer arithmetic as int64
# and keeps no SIMD register across loop iterations. W4A16 takes four rows a call through every
# block and keeps a <16 x float> accumulator per row, its lanes summed once, at the end, or with
# AVX-512F a row a call that looks its weights up (_w4a16_row), or with AVX512-BF16 a row a call
# in bf16 dot products (_w4a16_bf16_row); W4A8 takes a row a call (see
# "integer-dot matvecs" below). Against the numba kernels before them (the first IR kernels, four
# rows a call), all of SmolLM2-135M's q4_0 matvecs on one thread of the 2-core EPYC: W4A8 2.1x
# (4.3 -> 9.2 GB/s), W4A16 1.8x (3.8 -> 6.9).
#
# m is None for Q4_0 (w = d (q - 8)) and the Q4_1 offsets (w = d q + m) otherwise; the IR is
# built for one case or the other, so Q4_0 pays nothing for Q4_1.
#
# GB/s figures of the kernels as they stand: scripts/cpu_matvec_bench.py (--dram for a matrix
# read from DRAM, --lowering avx2 for the kernels a host without AVX-512 runs); the figures of
# kernels since replaced were taken with their commits.

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()


def _host_has(feature: str) -> bool:
    """Whether numba compiles for a target with this LLVM feature (avx2, avx512bw, ...)."""
    if numba.config.CPU_NAME is None:  # numba compiles for this machine
        return bool(llvm.get_host_cpu_features().get(feature))
    return f"+{feature}" in (numba.config.CPU_FEATURES or "")


_AVX2 = _host_has("avx2")
_AVX512F = _host_has("avx512f")
_AVX512BW = _host_has("avx512bw")
_AVX512VNNI = _AVX512BW and _host_has("avx512vnni")
_AVX512BF16 = _AVX512BW and _host_has("avx512bf16")


def _vec(elt, n):
    return ir.VectorType(elt, n)


def _splat(elt, n, value):
    return ir.Constant(_vec(elt, n), [ir.Constant(elt, value)] * n)


def _lanes(indices):
    return ir.Constant(_vec(_I32, len(indices)), [ir.Constant(_I32, i) for i in indices])


def _load(builder, base, offset, ty):
    """A ty at byte offset of base (i8*), no alignment assumed."""
    return builder.load(builder.bitcast(builder.gep(base, [offset]), ty.as_pointer()), align=1)


def _broadcast(builder, scalar, n=8):
    v = builder.insert_element(ir.Constant(_vec(scalar.type, n), ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, _lanes([0] * n))


def _maxnum(builder, a, b):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type] * 2),
                                        f"llvm.maxnum.v{a.type.count}f32")
    return builder.call(fn, [a, b])


def _fmuladd(builder, a, b, c):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type] * 3),
                                        f"llvm.fmuladd.v{a.type.count}f32")
    return builder.call(fn, [a, b, c])


def _hsum(builder, v):
    """The lanes' sum in a fixed order (halves, then quarters, and so on)."""
    while v.type.count > 1:
        half = v.type.count // 2
        v = builder.fadd(builder.shuffle_vector(v, v, _lanes(range(half))),
                         builder.shuffle_vector(v, v, _lanes(range(half, 2 * half))))
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _codes(builder, row, b):
    """Block b's 32 codes (0..15) as <32 x i8>: the 16 low nibbles, then the 16 high ones. The
    16 bytes load into both halves (vbroadcasti128, a load), the upper half's int32 lanes shift
    by 4 (vpsrlvd) and one mask takes both halves' nibbles: two vector operations, where taking
    the nibbles apart and joining them took four (vpand, vpsrlw, vpand, vinserti128). On the
    2-core Zen 3 (AVX2), one thread, alternating runs, Q4_0 and Q4_1 W4A8 in cache: 256 x 576
    9.1-9.4 -> 10.0-10.5 GB/s, 1536 x 576 11.8-12.3 -> 13.5-13.7, 576 x 1536 13.2-13.9 ->
    15.0-15.9; `nerva bench` q4_1 mixed decode 94-97 -> 98-102 tok/s, 161-167 -> 169-173 on two
    threads. Hosts with AVX-512BW take this path only for a row's last odd block
    (_dot_u4_s8_pair makes the rest)."""
    v = _load(builder, row, builder.mul(b, ir.Constant(_I64, 16)), _vec(_I8, 16))
    both = builder.bitcast(builder.shuffle_vector(v, v, _lanes(list(range(16)) * 2)), _vec(_I32, 8))
    shifted = builder.lshr(both, ir.Constant(_vec(_I32, 8), [ir.Constant(_I32, 4 * (k // 4)) for k in range(8)]))
    return builder.and_(builder.bitcast(shifted, _vec(_I8, 32)), _splat(_I8, 32, 15))


# The float kernels (W4A16, the Q4 dequantisation; W8A16 too, until it took int16 activations)
# work in <_LANES x float>: one AVX-512 register where the target has them, one AVX2 register
# where it has not. On the 2-core AMD EPYC (Zen 5), against the <8 x float> IR before, Q4_0
# W4A16 matvecs of 3072 and 200000 rows x 576:
# 13.1 -> 22.3 and 13.0 -> 19.4 GB/s on one thread, 25.7 -> 43.3 and 26.0 -> 38.5 on two; Q4_1
# 11.0 -> 16.9 / 16.3. Compiled for AVX2 alone (NUMBA_CPU_NAME=haswell and NUMBA_CPU_FEATURES
# without avx512) the 16 lanes split in two were where 8 were, 12.7-12.9 GB/s against 13.0-13.3.
# On a 2-core AMD EPYC without AVX-512 (Zen 3), <8 x float> and a block's sum as one chain of
# multiply-adds (so one scale multiply-add a row and block, not one a register) against the split
# <16 x float> of two chains each, one thread, alternating runs: Q4_1 W4A16 1536 x 576 and 576 x
# 1536 in cache 6.3-6.5 -> 7.3-7.5 GB/s, Q4_0 6.9-7.1 -> 7.7-8.0; from DRAM (--dram) Q4_1 1536 x
# 576 5.0-5.1 -> 5.8, 131072 x 576 6.5 -> 7.3-7.4; Q8_0 W8A16 131072 x 576 from DRAM 11.6-11.9 ->
# 12.0-12.6, 1536 x 576 in cache 15.6-16.3 -> 15.2-15.6. `nerva bench` q4_1 decode, W4A16 on every
# layer: 62-65 -> 66-68 tok/s on one thread, 109-114 -> 117-120 on two (mixed: within its noise).
# Not kept, on the Zen 3: scales of eight blocks loaded at once and broadcast from that vector
# (as _w4a16_row does), as fast from the caches, 0.75x from DRAM for W8A16; vpshufb in place of
# vpmovzxbd (which llvm-mca -mcpu=znver3 models as three times a shuffle's issue), 3% slower.
_LANES = 16 if _AVX512F else 8


def _codes_i32(builder, row, b):
    """Block b's 32 codes as 32 / _LANES <_LANES x i32>, in the weights' order: the 16 bytes
    widened to int32 straight from memory (vpmovzxbd folds the load: 1.4x faster than nibbles
    split in bytes and widened from a register), in 16 / _LANES pieces, their low nibbles
    (weights 0-15), then their high ones (16-31)."""
    at = builder.mul(b, ir.Constant(_I64, 16))
    words = [builder.zext(_load(builder, row, builder.add(at, ir.Constant(_I64, _LANES * h)), _vec(_I8, _LANES)),
                          _vec(_I32, _LANES)) for h in range(16 // _LANES)]
    return [builder.and_(w, _splat(_I32, _LANES, 15)) for w in words] + \
        [builder.lshr(w, _splat(_I32, _LANES, 4)) for w in words]


def _codes_f32(builder, row, b):
    return [builder.sitofp(v, _vec(_F32, _LANES)) for v in _codes_i32(builder, row, b)]


def _lane_chunks(builder, base, b):
    """Floats 32 b to 32 b + 31 of base (f32) as 32 / _LANES <_LANES x float>: block b's."""
    at = builder.mul(b, ir.Constant(_I64, 32))
    return [_f32_at(builder, base, at, _LANES, _LANES * k) for k in range(32 // _LANES)]


def _tree_sum(builder, vectors):
    while len(vectors) > 1:
        vectors = [builder.fadd(vectors[k], vectors[k + 1]) for k in range(0, len(vectors), 2)]
    return vectors[0]


def _widening_dot(builder, q, x, q_signed=True):
    """32 codes (signed, or 0..15 with q_signed False) times 32 signed activations (int8 or
    int16) as 8 int32 partial sums, in plain IR: each product widened to int32, the four quarters
    added. The integer dots' lowering on a target without AVX2."""
    wide_q = (builder.sext if q_signed else builder.zext)(q, _vec(_I32, 32))
    p = builder.mul(wide_q, builder.sext(x, _vec(_I32, 32)))
    quarters = [builder.shuffle_vector(p, p, _lanes(range(8 * k, 8 * k + 8))) for k in range(4)]
    return builder.add(builder.add(quarters[0], quarters[1]), builder.add(quarters[2], quarters[3]))


def _dot_u4_s8(builder, q, x):
    """Codes (0..15) times int8 activations, as 8 int32 partial sums. With AVX2: vpmaddubsw
    (pairs to int16: at most 2 * 15 * 127, no saturation) then vpmaddwd against ones; else
    plain widening IR, which LLVM lowers on any target. Integer sums: the same result either way."""
    if _AVX2:
        module = builder.module
        pmaddubsw = cgutils.get_or_insert_function(
            module, ir.FunctionType(_vec(_I16, 16), [_vec(_I8, 32)] * 2), "llvm.x86.avx2.pmadd.ub.sw")
        pmaddwd = cgutils.get_or_insert_function(
            module, ir.FunctionType(_vec(_I32, 8), [_vec(_I16, 16)] * 2), "llvm.x86.avx2.pmadd.wd")
        return builder.call(pmaddwd, [builder.call(pmaddubsw, [q, x]), _splat(_I16, 16, 1)])
    return _widening_dot(builder, q, x, q_signed=False)


def _dot_u4_s8_pair(builder, row, x_pairs, b):
    """Blocks b and b+1 (b even) at once in 512-bit registers (AVX-512BW): <16 x i32> whose 128-bit
    quarters hold partial sums of blocks b, b+1, b, b+1. The two blocks' 32 code bytes load into
    both halves of a register (vbroadcasti64x4, a load), the upper half's 16-bit lanes shift by 4
    and one mask takes the low nibbles (weights 0-15) below and the high ones (16-31) above: no
    shuffle, where interleaving the two blocks' nibbles took a vpermt2q a pair. The activation
    meets them in that order, which _pair_order writes once a call (x_pairs). With AVX-512 VNNI
    one vpdpbusd makes the sums; else vpmaddubsw and vpmaddwd, as _dot_u4_s8. Integer sums: the
    same totals either way."""
    v = _load(builder, row, builder.mul(b, ir.Constant(_I64, 16)), _vec(_I8, 32))
    both = builder.bitcast(builder.shuffle_vector(v, v, _lanes(list(range(32)) * 2)), _vec(_I16, 32))
    shifted = builder.lshr(both, ir.Constant(_vec(_I16, 32), [ir.Constant(_I16, 4 * (k // 16)) for k in range(32)]))
    codes = builder.and_(builder.bitcast(shifted, _vec(_I8, 64)), _splat(_I8, 64, 15))
    x = _load(builder, x_pairs, builder.mul(b, ir.Constant(_I64, 32)), _vec(_I8, 64))
    module = builder.module
    if _AVX512VNNI:
        v16 = _vec(_I32, 16)
        dpbusd = cgutils.get_or_insert_function(module, ir.FunctionType(v16, [v16] * 3), "llvm.x86.avx512.vpdpbusd.512")
        return builder.call(dpbusd, [_splat(_I32, 16, 0), builder.bitcast(codes, v16), builder.bitcast(x, v16)])
    pmaddubsw = cgutils.get_or_insert_function(
        module, ir.FunctionType(_vec(_I16, 32), [_vec(_I8, 64)] * 2), "llvm.x86.avx512.pmaddubs.w.512")
    pmaddwd = cgutils.get_or_insert_function(
        module, ir.FunctionType(_vec(_I32, 16), [_vec(_I16, 32)] * 2), "llvm.x86.avx512.pmaddw.d.512")
    return builder.call(pmaddwd, [builder.call(pmaddubsw, [codes, x]), _splat(_I16, 32, 1)])


class _Operands:
    """Pointers into the numba arrays an intrinsic received (rows of a 2-D array by its row stride;
    the kernels' typing admits C-contiguous arrays only, so a row's elements are adjacent). The
    arguments that are not arrays (None, scalars) are None here."""

    def __init__(self, context, builder, types_, values):
        self.builder = builder
        self.arrays = [context.make_array(t)(context, builder, v) if isinstance(t, types.Array) else None
                       for t, v in zip(types_, values)]

    def data(self, i):
        return self.builder.bitcast(self.arrays[i].data, _I8.as_pointer())

    def row(self, i, r):
        stride = self.builder.extract_value(self.arrays[i].strides, 0)
        return self.builder.gep(self.data(i), [self.builder.mul(r, stride)])

    def cols(self, i):
        return self.builder.extract_value(self.arrays[i].shape, 1)

    def weight_rows(self, rows):
        """The given rows of operands 0, 1, 2 (qs, d, m): three lists, the last None for Q4_0."""
        return [None if self.arrays[i] is None else [self.row(i, r) for r in rows] for i in range(3)]

    def prefetch_codes_ahead(self, q_rows, b):
        """Asks the cache for block b (16 bytes of Q4 codes) of the code rows PREFETCH_BYTES
        further on, at least PREFETCH_ROWS (the rows a thread takes next: its row groups are
        consecutive)."""
        builder = self.builder
        stride = builder.extract_value(self.arrays[0].strides, 0)
        rows = builder.udiv(ir.Constant(_I64, PREFETCH_BYTES), stride)
        rows = builder.select(builder.icmp_unsigned("<", rows, ir.Constant(_I64, PREFETCH_ROWS)),
                              ir.Constant(_I64, PREFETCH_ROWS), rows)
        at = builder.add(builder.mul(stride, rows), builder.mul(b, ir.Constant(_I64, 16)))
        for row in q_rows:
            _prefetch(builder, row, at)


_SCALE_SPAN = 16  # blocks whose scales the W4A16 row codegens load as one vector


def _scale_groups(builder, q_row, d_row, m_row, blocks, body):
    """body(b0, d16, m16) for each group of _SCALE_SPAN blocks from b0 of a row, the group's codes
    prefetched PREFETCH_BYTES ahead and its scales (and Q4_1 offsets; else m16 None) loaded as
    one vector each. -> the first block after the groups."""
    span = ir.Constant(_I64, _SCALE_SPAN)
    groups = builder.udiv(blocks, span)
    with cgutils.for_range(builder, groups) as loop:
        b0 = builder.mul(loop.index, span)
        codes_at = builder.mul(b0, ir.Constant(_I64, 16))
        for line in range(0, _SCALE_SPAN * 16, 64):
            _prefetch(builder, q_row, builder.add(codes_at, ir.Constant(_I64, PREFETCH_BYTES + line)))
        d16 = _planes_at(builder, d_row, b0, _SCALE_SPAN, ir.HalfType(), 2)
        m16 = None if m_row is None else _planes_at(builder, m_row, b0, _SCALE_SPAN, ir.HalfType(), 2)
        body(b0, d16, m16)
    return builder.mul(groups, span)


def _dot_operands(context, builder, sig, args, n, acts):
    """A row-dot intrinsic's operands: n arrays (qs, d, m, then the activation's), the row r, and
    for a batch t0. -> (the _Operands, q_row, d_row, m_row (None for Q4_0), and for each activation
    array its pointers: [its data] where it is 1-D (one activation), else rows t0 .. t0 + acts - 1)."""
    a = _Operands(context, builder, sig.args[:n], args[:n])
    r = args[n]
    m_row = None if a.arrays[2] is None else a.row(2, r)
    if sig.args[3].ndim == 1:
        activations = [[a.data(i)] for i in range(3, n)]
    else:
        t0 = context.cast(builder, args[n + 1], sig.args[n + 1], types.intp)
        at = [builder.add(t0, ir.Constant(_I64, t)) for t in range(acts)]
        activations = [[a.row(i, t) for t in at] for i in range(3, n)]
    return a, a.row(0, r), a.row(1, r), m_row, activations


def _prefetch(builder, base, offset, locality=3):
    """A read prefetch of data; locality 3 (prefetcht0) keeps it in every cache level, 1
    (prefetcht2) from L2 outward. Past the matrix's end it asks for nothing harmful: a prefetch
    never faults."""
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0i8")
    builder.call(fn, [builder.gep(base, [offset]), ir.Constant(_I32, 0), ir.Constant(_I32, locality),
                      ir.Constant(_I32, 1)])


# How far ahead the matvecs ask the cache for codes. The hardware prefetcher does not ramp up over
# the short streams a thread walks (rows of a few hundred bytes, SmolLM2's 288 and 768; the float
# kernels take four at a time).
#
# The float kernels prefetch block b of the rows PREFETCH_ROWS further on, or more where rows are
# short: as many as PREFETCH_BYTES spans. On a 2-core Intel Xeon with a 480 MB L3, SmolLM2 q4_1's
# decode matrices (55 MB), without -> 8 rows ahead, the same run: W4A8 (then a four-row kernel too)
# 6.2-12.5 -> 15.3 GB/s on one thread, 21.4-24.6 -> 27.8 on two; W4A16 5.6 -> 9.4 and 15.5 ->
# 18.2; 12 to 24 rows no better than 8. On the Zen 5 EPYC, a 28 MB Q8_0 lm_head (576-byte rows)
# read from DRAM, W8A16: 8 rows 33.5-34.2 GB/s on one thread, 16: 39.0-41.3, 24: 40.7-40.8, 32:
# 37.1-37.7 (the four-row float W8A16 of then; it is an integer kernel now); the four-row W4A16 is
# bound by its conversions there (18 GB/s whatever the distance).
#
# The integer kernels (a row at a time) prefetch PREFETCH_BYTES ahead in the row's codes, which
# runs on into the thread's next rows. On the Zen 5, a 126 MB q4_1 matrix of 1536 columns from
# DRAM, W4A8: no prefetch 22.7 GB/s on one thread, 512 bytes 25.1, 2048 28.4, 4096 31.4, 8192
# 31.9, 16384 31.5; on two 46.1, 48.1, 52.8, 58.4, 59.3, 58.2. Prefetching the scale planes as
# well measured 1-7% slower.
PREFETCH_ROWS = 8
PREFETCH_BYTES = 8192


def _half_at(builder, row, b):
    return builder.fpext(_load(builder, row, builder.mul(b, ir.Constant(_I64, 2)), ir.HalfType()), _F32)


def _f32_at(builder, base, b, lanes=1, first=0):
    ty = _F32 if lanes == 1 else _vec(_F32, lanes)
    index = builder.add(b, ir.Constant(_I64, first))
    return _load(builder, base, builder.mul(index, ir.Constant(_I64, 4)), ty)


def _c_arrays(*arrays):
    return all(isinstance(a, types.NoneType) or (isinstance(a, types.Array) and a.layout == "C")
               for a in arrays)


@intrinsic
def _w4a16_rows(typingctx, qs, d, m, x, r0, r1, r2, r3):
    """(row r0 . x, ..., row r3 . x) for Q4 rows and f32 x (the kernel a host without AVX-512F
    runs). Per block and row, with q the codes: t = sum q x (+ sum -8 x for Q4_0),
    acc += d t (+ m sum x for Q4_1): the -8 or the offset enters through the block's activation
    sum (the deferred bias), computed once for all four rows. t is one chain of multiply-adds
    (the four rows' chains overlap), so a block costs a row one multiply-add by its scale."""
    if not _c_arrays(qs, d, m, x):
        return None
    q4_1 = not isinstance(m, types.NoneType)

    def codegen(context, builder, sig, args):
        a = _Operands(context, builder, sig.args[:4], args[:4])
        q_rows, d_rows, m_rows = a.weight_rows(args[4:])
        x = a.data(3)
        acc = [cgutils.alloca_once_value(builder, _splat(_F32, _LANES, 0.0)) for _ in q_rows]
        with cgutils.for_range(builder, a.cols(1)) as loop:
            b = loop.index
            a.prefetch_codes_ahead(q_rows, b)
            xs = _lane_chunks(builder, x, b)
            x_sum = _tree_sum(builder, xs)
            start = _splat(_F32, _LANES, 0.0) if q4_1 else builder.fmul(x_sum, _splat(_F32, _LANES, -8.0))
            for i in range(4):
                t = start
                for q, xk in zip(_codes_f32(builder, q_rows[i], b), xs):
                    t = _fmuladd(builder, q, xk, t)
                scale = _broadcast(builder, _half_at(builder, d_rows[i], b), _LANES)
                s = _fmuladd(builder, scale, t, builder.load(acc[i]))
                if q4_1:
                    s = _fmuladd(builder, _broadcast(builder, _half_at(builder, m_rows[i], b), _LANES), x_sum, s)
                builder.store(s, acc[i])
        return context.make_tuple(builder, sig.return_type, [_hsum(builder, builder.load(v)) for v in acc])

    return types.UniTuple(types.float32, 4)(qs, d, m, x, r0, r1, r2, r3), codegen


def _w4a16_codegen(acts):
    """Rows . activations for Q4 rows and f32 activations, as _w4a16_row describes: one
    activation (1-D x) or `acts` rows t0.. of a 2-D x, each block's weight table built once for
    them all."""
    def codegen(context, builder, sig, args):
        a, q_row, d_row, m_row, (x,) = _dot_operands(context, builder, sig, args, 4, acts)
        q4_1 = m_row is not None
        v16 = _vec(_F32, 16)
        permps = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16, _vec(_I32, 16)]),
                                                "llvm.x86.avx512.permvar.sf.512")
        codes = ir.Constant(v16, [ir.Constant(_F32, float(k if q4_1 else k - 8)) for k in range(16)])
        acc = [[cgutils.alloca_once_value(builder, _splat(_F32, 16, 0.0)) for _ in range(4)] for _ in x]

        def block(b, parity, dw, mw):
            table = _fmuladd(builder, codes, dw, mw) if q4_1 else builder.fmul(codes, dw)
            words = builder.zext(_load(builder, q_row, builder.mul(b, ir.Constant(_I64, 16)), _vec(_I8, 16)),
                                 _vec(_I32, 16))
            weights = [builder.call(permps, [table, words]),  # the low nibbles: codes 0-15 of the block
                       builder.call(permps, [table, builder.lshr(words, _splat(_I32, 16, 4))])]
            for t, row in enumerate(x):
                xs = [_f32_at(builder, row, builder.mul(b, ir.Constant(_I64, 32)), 16, 16 * k) for k in range(2)]
                for k in range(2):
                    slot = acc[t][2 * parity + k]
                    builder.store(_fmuladd(builder, weights[k], xs[k], builder.load(slot)), slot)

        def group(b0, d16, m16):
            for j in range(_SCALE_SPAN):
                dw = builder.shuffle_vector(d16, d16, _lanes([j] * 16))
                mw = builder.shuffle_vector(m16, m16, _lanes([j] * 16)) if q4_1 else None
                block(builder.add(b0, ir.Constant(_I64, j)), j % 2, dw, mw)

        first = _scale_groups(builder, q_row, d_row, m_row, a.cols(1), group)
        with cgutils.for_range(builder, builder.sub(a.cols(1), first)) as loop:
            b = builder.add(first, loop.index)
            mw = _broadcast(builder, _half_at(builder, m_row, b), 16) if q4_1 else None
            block(b, 0, _broadcast(builder, _half_at(builder, d_row, b), 16), mw)
        return _row_results(context, builder, sig, acc)

    return codegen


def _row_results(context, builder, sig, acc, offsets=None):
    """A W4A16 row codegen's value: each activation's four accumulators (and its offset sums, where
    there are) added, their lanes summed; one float for a 1-D activation (operand 3), else the tuple."""
    sums = []
    for t, slots in enumerate(acc):
        total = builder.fadd(builder.fadd(builder.load(slots[0]), builder.load(slots[1])),
                             builder.fadd(builder.load(slots[2]), builder.load(slots[3])))
        if offsets is not None:
            total = builder.fadd(total, builder.load(offsets[t]))
        sums.append(_hsum(builder, total))
    if sig.args[3].ndim == 1:
        return sums[0]
    return context.make_tuple(builder, sig.return_type, sums)


@intrinsic
def _w4a16_row(typingctx, qs, d, m, x, r):
    """Row r . x for Q4 rows and f32 x, with AVX-512F. Per block, the 16 weights a code can stand
    for, d (q - 8) or d q + m (one fused multiply-add, as a dequantised weight), and each code's
    weight taken from them by vpermps/vpermd, which read only an index's low 4 bits: no mask, no
    int-to-float conversion; acc += w x, over four accumulators (a block's two halves, even and
    odd blocks) so that no multiply-add waits on the one before. A row's scales load 16 blocks at
    a time and are broadcast from that vector; codes are prefetched PREFETCH_BYTES ahead in the
    row stream, as the integer kernels do. Against the four-row _w4a16_rows on the Zen 5, q4_1
    matrices 3072 x 576 in L3 and 131072 x 576 from DRAM: 22.1 -> 22.6 and 19.3 -> 21.7 GB/s on
    one thread, 42.3 -> 41.6 and 37.9 -> 42.3 on two; Q4_0 from DRAM 18.8 -> 23.2 and 38.0 -> 46.4."""
    if not _c_arrays(qs, d, m, x):
        return None
    return types.float32(qs, d, m, x, r), _w4a16_codegen(1)


@intrinsic
def _w4a16_row_batch(typingctx, qs, d, m, x, r, t0, acts):
    """(row r . x_t0, ..., row r . x_{t0 + acts - 1}) for Q4 rows and the rows of a 2-D f32 x, with
    AVX-512F (_w4a16_codegen): each block's weights made once for `acts` (a literal) dots, each
    equal to _w4a16_row's."""
    if not (isinstance(acts, types.IntegerLiteral) and _c_arrays(qs, d, m, x)):
        return None
    n = acts.literal_value
    return types.UniTuple(types.float32, n)(qs, d, m, x, r, t0, acts), _w4a16_codegen(n)


# -- W4A16 in bf16 dot products (AVX512-BF16) -------------------------------------------------
#
# Where the target has AVX512-BF16 (Zen 4 and 5, Sapphire Rapids and later), W4A16 multiplies in
# vdpbf16ps: 32 products a call, summed in pairs into 16 f32 lanes. The codes are exact in bf16
# (their 16 values, q or q - 8, looked up by vpermw); each activation is split once a call into
# hi = bf16(x) and lo = bf16(x - hi), 16 significant bits between them, so every product is
# exact and x's only error is lo's rounding: at most 2^-8 of |x - hi|, itself at most 2^-8 |x|,
# so 2^-16 |x| (2^-17 the most over 10^7 normal samples; an f16 activation carries 2^-11). The
# sums are f32, as the other lowerings'; vdpbf16ps treats bf16 subnormals (|lo| below 1.2e-38)
# as zero. Per pair of blocks: a load of their 32 code bytes widened to words, a
# shift, two vpermw, four vdpbf16ps (hi and lo of each half) and one multiply-add by the blocks'
# scales, where the float tables take two lookups, two multiply-adds and a table a block. Against
# the float tables (`scripts/cpu_matvec_bench.py --lowering avx512` against the host's, the two
# alternating) on the 2-core Zen 4 EPYC, one thread then two, GB/s: Q4_1 from the caches 1536 x
# 576 9.7 -> 13.9 and 18.4 -> 25.5, 576 x 1536 10.0 -> 15.9 and 19.1 -> 28.3, 2048 x 2048 10.4 ->
# 17.1 and 20.5 -> 33.0, 8192 x 2048 10.4 -> 17.4 and 20.8 -> 33.4, 2048 x 8192 (its 32 KB of
# split activation fills L1) 10.6 -> 13.2 and 21.3 -> 26.9; Q4_0 1.2-1.5x; from DRAM (--dram)
# Q4_1 8192 x 2048 9.2-10.0 -> 13.0-14.7 and 20.1 -> 28.5-29.8, 1536 x 576 6.9 -> 8.3 and
# 9.2-10.1 -> 10.0-11.4. `nerva bench smollm2-135m` decode, W4A16 on every layer: 110-112 ->
# 142-145 tok/s on one thread, 174-187 -> 243-255 on two; mixed (3 of 30 layers W4A16) 167-170
# -> 170-176 and 228-253 -> 278-293. A short prompt's batch tiles gain nothing (their table was
# shared by four activations already): 16 prompt tokens at SmolLM2-1.7B's shapes, one thread,
# 15.3-15.6 -> 14.5 tok/s.
#
# The split activation, `words`: for each pair of blocks (2p, 2p + 1), 128 uint16: hi of elements
# 0-15 of both blocks (the low nibbles' weights, as the codes widen), then hi of elements 16-31
# of both, then lo the same way; an odd last block's partner is zeros. `sums` holds each block's
# activation sum, for Q4_1's offsets (m sum x, a block's term of d q x + m x).
_BF16_WORDS_A_PAIR = 128
_BF16_MOST_COLS = 32768  # the widest activation the decode kernel's stack scratch holds (128 KB)
_BF16_STACK_WORDS = 2 * _BF16_MOST_COLS  # literals for the stack buffers
_BF16_STACK_SUMS = _BF16_MOST_COLS // 32


class _BFloat(ir.Type):
    """LLVM's bfloat, which llvmlite's IR builder lacks; only bitcast to and passed on."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


def _dpbf16(builder, acc, a, b):
    """acc (<16 x float>) + the pairwise sums of a * b, 32 bf16 each (given as <32 x i16> bits)."""
    v32 = _vec(_BFloat(), 32)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_vec(_F32, 16), [_vec(_F32, 16), v32, v32]), "llvm.x86.avx512bf16.dpbf16ps.512")
    return builder.call(fn, [acc, builder.bitcast(a, v32), builder.bitcast(b, v32)])


def _bf16_bits(value: float) -> int:
    return int(np.array(value, np.float32).view(np.uint32)) >> 16  # exact for the codes' small integers


@intrinsic
def _as_f32(typingctx, bits):
    """uint32 bits -> the float32 they are."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], _F32)
    return types.float32(types.uint32), codegen


@intrinsic
def _f32_bits(typingctx, value):
    """A float32's bits as uint32."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], _I32)
    return types.uint32(types.float32), codegen


@njit(cache=True, nogil=True, inline="always")
def _bf16_round(bits):
    # a float32's bits to the nearest bf16's (ties to even). A NaN's lo part is NaN (NaN - hi), so
    # NaN carries through; an infinite activation's lo is inf - inf, so it gives NaN, where the
    # float lowerings give inf or NaN (NaN wherever its row has a zero weight)
    return (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


@njit(cache=True, nogil=True)
def _bf16_split(x, words, sums):
    """x [cols] -> words (the pair layout above, (blocks + 1) // 2 * 128 of them) and sums [blocks]."""
    blocks = x.shape[0] // 32
    bits = x.view(np.uint32)
    for p in range((blocks + 1) // 2):
        base = _BF16_WORDS_A_PAIR * p
        for k in range(2):
            b = 2 * p + k
            for half in range(2):
                at = base + 32 * half + 16 * k
                for j in range(16):
                    hi = lo = np.uint32(0)
                    if b < blocks:
                        i = 32 * b + 16 * half + j
                        hi = _bf16_round(bits[i])
                        lo = _bf16_round(_f32_bits(x[i] - _as_f32(hi << np.uint32(16))))
                    words[at + j] = hi
                    words[at + 64 + j] = lo
    for b in range(blocks):
        total = F32(0)
        for j in range(32):
            total += x[32 * b + j]
        sums[b] = total


def _w4a16_bf16_codegen(acts):
    """Rows . activations for Q4 rows and split activations (words, sums: 1-D for one activation,
    or `acts` rows from t0 of 2-D ones); each block's weights made once for them all."""
    def codegen(context, builder, sig, args):
        a, q_row, d_row, m_row, (words, sums) = _dot_operands(context, builder, sig, args, 5, acts)
        q4_1 = m_row is not None
        v32w, v16f = _vec(_I16, 32), _vec(_F32, 16)
        permw = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v32w, [v32w, v32w]),
                                               "llvm.x86.avx512.permvar.hi.512")
        # vpermw reads an index's low 5 bits; a low nibble's word is its whole byte, so bit 4 (the
        # high nibble's lowest) may be set: the 16 values twice, and no mask
        table = ir.Constant(v32w, [ir.Constant(_I16, _bf16_bits((i & 15) - (0 if q4_1 else 8))) for i in range(32)])
        acc = [[cgutils.alloca_once_value(builder, _splat(_F32, 16, 0.0)) for _ in range(4)] for _ in words]
        offsets = [cgutils.alloca_once_value(builder, _splat(_F32, 16, 0.0)) for _ in words] if q4_1 else None

        def pair(b, one_block, scales, slot):
            """Blocks b and b + 1 (b alone where one_block) into accumulator `slot`, the two blocks'
            scales in lanes 0-7 and 8-15 of `scales`."""
            if one_block:  # 16 code bytes; the partner's words are zeros, as its activations are
                raw = _load(builder, q_row, builder.mul(b, ir.Constant(_I64, 16)), _vec(_I8, 16))
                zeros = ir.Constant(_vec(_I8, 16), [ir.Constant(_I8, 0)] * 16)
                raw = builder.shuffle_vector(raw, zeros, _lanes(range(32)))
            else:
                raw = _load(builder, q_row, builder.mul(b, ir.Constant(_I64, 16)), _vec(_I8, 32))
            codes = builder.zext(raw, v32w)
            low = builder.call(permw, [table, codes])
            high = builder.call(permw, [table, builder.lshr(codes, _splat(_I16, 32, 4))])
            at = builder.mul(builder.udiv(b, ir.Constant(_I64, 2)), ir.Constant(_I64, 2 * _BF16_WORDS_A_PAIR))
            for t, base in enumerate(words):
                x = [_load(builder, base, builder.add(at, ir.Constant(_I64, 64 * k)), v32w) for k in range(4)]
                dots = _dpbf16(builder, _splat(_F32, 16, 0.0), low, x[0])
                dots = _dpbf16(builder, dots, low, x[2])
                dots = _dpbf16(builder, dots, high, x[1])
                dots = _dpbf16(builder, dots, high, x[3])
                builder.store(_fmuladd(builder, dots, scales, builder.load(acc[t][slot])), acc[t][slot])

        def group(b0, d16, m16):
            if q4_1:
                for t, base in enumerate(sums):
                    s16 = _load(builder, base, builder.mul(b0, ir.Constant(_I64, 4)), v16f)
                    builder.store(_fmuladd(builder, m16, s16, builder.load(offsets[t])), offsets[t])
            for j in range(0, _SCALE_SPAN, 2):
                scales = builder.shuffle_vector(d16, d16, _lanes([j] * 8 + [j + 1] * 8))
                pair(builder.add(b0, ir.Constant(_I64, j)), False, scales, (j // 2) % 4)

        blocks = a.cols(1)
        first = _scale_groups(builder, q_row, d_row, m_row, blocks, group)
        left = builder.sub(blocks, first)
        zero16 = ir.Constant(_vec(_F32, 16), [ir.Constant(_F32, 0.0)] * 16)

        def tail_offsets(b):
            if q4_1:
                mb = _broadcast(builder, _half_at(builder, m_row, b), 16)
                for t, base in enumerate(sums):
                    sb = _broadcast(builder, _f32_at(builder, base, b), 16)
                    # one lane carries it (the others add zeros), so the lanes' sum takes it once
                    term = builder.shuffle_vector(builder.fmul(mb, sb), zero16, _lanes([0] + [16] * 15))
                    builder.store(builder.fadd(builder.load(offsets[t]), term), offsets[t])

        with cgutils.for_range(builder, builder.udiv(left, ir.Constant(_I64, 2))) as loop:
            b = builder.add(first, builder.mul(loop.index, ir.Constant(_I64, 2)))
            b1 = builder.add(b, ir.Constant(_I64, 1))
            db, db1 = (_broadcast(builder, _half_at(builder, d_row, k), 16) for k in (b, b1))
            pair(b, False, builder.shuffle_vector(db, db1, _lanes([0] * 8 + [16] * 8)), 0)
            tail_offsets(b)
            tail_offsets(b1)
        odd = builder.icmp_unsigned("!=", builder.urem(left, ir.Constant(_I64, 2)), ir.Constant(_I64, 0))
        with builder.if_then(odd):
            b = builder.sub(blocks, ir.Constant(_I64, 1))
            pair(b, True, _broadcast(builder, _half_at(builder, d_row, b), 16), 1)
            tail_offsets(b)
        return _row_results(context, builder, sig, acc, offsets)

    return codegen


@intrinsic
def _w4a16_bf16_row(typingctx, qs, d, m, words, sums, r):
    """Row r . x for Q4 rows and x split by _bf16_split (words, sums), with AVX512-BF16."""
    if not _c_arrays(qs, d, m, words, sums):
        return None
    return types.float32(qs, d, m, words, sums, r), _w4a16_bf16_codegen(1)


@intrinsic
def _w4a16_bf16_row_batch(typingctx, qs, d, m, words, sums, r, t0, acts):
    """(row r . x_t0, ..., row r . x_{t0 + acts - 1}) for the rows of 2-D split activations: the
    codes loaded and looked up once for `acts` (a literal) dots, each equal to _w4a16_bf16_row's."""
    if not (isinstance(acts, types.IntegerLiteral) and _c_arrays(qs, d, m, words, sums)):
        return None
    n = acts.literal_value
    return types.UniTuple(types.float32, n)(qs, d, m, words, sums, r, t0, acts), _w4a16_bf16_codegen(n)


@intrinsic
def _stack_u16(typingctx, n):
    """A uint16[n] on the calling function's stack (n a literal), as _stack_f32."""
    if not isinstance(n, types.IntegerLiteral):
        return None

    def codegen(context, builder, sig, args):
        ptr = cgutils.alloca_once(builder, _I16, size=n.literal_value)
        ptr.align = 64
        return ptr
    return types.CPointer(types.uint16)(n), codegen


# -- integer-dot matvecs (W4A8, W8A8): a row at a time ----------------------------------------
#
# A thread walks its rows one by one, so it reads its share of each plane front to back. Per group
# of eight blocks a row makes eight <8 x i32> integer dots and reduces them together into one
# <8 x i32>, lane j block j's dot; the block scales then come as vectors straight from the planes
# (<8 x half> of d and m, <8 x float> of the activation's scales), and each row keeps an
# <8 x float> accumulator. The rows' last blocks, fewer than eight, go two and then one at a time.
# Against the four-row groups before (scales gathered a half at a time), on the 2-core AMD EPYC
# (Zen 5), SmolLM2's q4_1 matrices 3072 x 576 and 3072 x 1536, without prefetching: W4A8 22.4 ->
# 26.4 and 23.3 -> 32.4 GB/s on one thread, 43.4 -> 50.4 and 45.0 -> 62.1 on two. With the
# prefetch (PREFETCH_BYTES), `nerva bench smollm2-135m` decode: 188-190 -> 220-228 tok/s on one
# thread, 288-299 -> 321-328 on two.
#
# Where the target has AVX-512BW, W4A8 makes its dots two blocks at a time in 512-bit registers
# (_dot_u4_s8_pair), with VNNI's vpdpbusd where there is one. Against the 256-bit dots, on the
# Zen 5, q4_1 3072 x 576 and 1024 x 1536: 26.8 -> 34.8 and 30.8 -> 43.3 GB/s on one thread, 41.9 ->
# 61.3 and 53.4 -> 72.2 on two (1.21-1.34x without vpdpbusd); decode 188-192 -> 249-257 tok/s on
# one thread and 283-288 -> 360-366 on two, against the four-row kernel.
#
# The pair dot then interleaved the two blocks' nibbles with a vpermt2q, a cross-lane shuffle, per
# row and pair; now the activation comes in that order instead, made once a call (_pair_order),
# and the codes take a broadcast load, a shift and a mask. On the 2-core Zen 4 EPYC (AVX-512 and
# VNNI at half width), one thread, in cache, alternating with the shuffle: q4_1 3072 x 576
# 17.6-18.3 -> 21.0-21.1 GB/s, 576 x 1536 20.6-20.9 -> 22.9-23.0, 960 x 576 17.4-17.9 -> 19.6;
# 131072 x 576 (47 MB, from DRAM) 13.0-13.6 -> 17.6-17.7; q4_0 likewise (12.8-18.5 -> 14.7-20.4).
# `nerva bench` decode moved less than this shared machine's drift between runs: w4a8 on one
# thread, best token rates 115-144 -> 135-151 tok/s, medians 112-137 -> 123-134.
_GROUP = 8


def _pairs(builder, a, b):
    """vphaddd's pattern on two <8 x i32>: adjacent lanes summed, a's and b's interleaved by 128 bits."""
    even = builder.shuffle_vector(a, b, _lanes([0, 2, 8, 10, 4, 6, 12, 14]))
    odd = builder.shuffle_vector(a, b, _lanes([1, 3, 9, 11, 5, 7, 13, 15]))
    return builder.add(even, odd)


def _fold(builder, v, first, second):
    return builder.add(builder.shuffle_vector(v, v, _lanes(first)), builder.shuffle_vector(v, v, _lanes(second)))


def _pair_totals(builder, pairs):
    """Four block pairs' <16 x i32> partial sums (_dot_u4_s8_pair) -> <8 x i32>, lane j block j's
    total: vphaddd's pattern twice leaves quarters of blocks 0 2 4 6, 1 3 5 7, 0 2 4 6, 1 3 5 7;
    the halves added and one vpermd put them in order."""
    def adjacent(a, b):  # vphaddd on zmm: lanes summed in pairs, a's and b's interleaved by 128 bits
        order = [i + k for i in range(0, 16, 4) for k in (0, 2, 16, 18)]
        return builder.add(builder.shuffle_vector(a, b, _lanes(order)),
                           builder.shuffle_vector(a, b, _lanes([i + 1 for i in order])))
    t = adjacent(adjacent(pairs[0], pairs[1]), adjacent(pairs[2], pairs[3]))
    half = _fold(builder, t, range(8), range(8, 16))
    return builder.shuffle_vector(half, half, _lanes([0, 4, 1, 5, 2, 6, 3, 7]))


def _pair_total(builder, v):
    """One block pair's <16 x i32> (_dot_u4_s8_pair) -> <2 x i32>, its two blocks' totals."""
    v = _fold(builder, v, range(8), range(8, 16))  # block b in lanes 0-3, b+1 in 4-7
    v = _fold(builder, v, [0, 1, 4, 5], [2, 3, 6, 7])
    return _fold(builder, v, [0, 2], [1, 3])


def _block_totals(builder, dots):
    """1, 2 or 8 blocks' <8 x i32> partial sums -> <n x i32>, lane j block j's total."""
    if len(dots) == 8:
        p = [_pairs(builder, dots[i], dots[i + 1]) for i in range(0, 8, 2)]
        lo, hi = _pairs(builder, p[0], p[1]), _pairs(builder, p[2], p[3])  # blocks 0-3 twice, 4-7 twice
        return builder.add(builder.shuffle_vector(lo, hi, _lanes([0, 1, 2, 3, 8, 9, 10, 11])),
                           builder.shuffle_vector(lo, hi, _lanes([4, 5, 6, 7, 12, 13, 14, 15])))
    if len(dots) == 2:
        v = _fold(builder, _pairs(builder, dots[0], dots[1]), range(4), range(4, 8))  # 0 0 1 1
        return _fold(builder, v, [0, 2], [1, 3])
    v = dots[0]
    for n in (4, 2, 1):
        v = _fold(builder, v, range(n), range(n, 2 * n))
    return v


def _planes_at(builder, base, b, n, elt, size):
    """n consecutive elements of a scale plane from block b, as a vector (floats widened from f16)."""
    v = _load(builder, base, builder.mul(b, ir.Constant(_I64, size)), _vec(elt, n))
    return builder.fpext(v, _vec(_F32, n)) if isinstance(elt, ir.HalfType) else v


def _integer_row(builder, n_blocks, code_row, code_bytes, block_dot, block_terms, pair_dot=None, acts=1):
    """A row's dot products with `acts` activations, its blocks in groups of eight, then pairs,
    then one: a group's block_dot(b, t) partials (or pair_dot(b, t)'s, two blocks a call, where
    the target has AVX-512BW) are reduced to a lane per block, and block_terms(b, n, totals, acc,
    t) folds them into activation t's accumulator of that group size. Returns the accumulators'
    f32 sums, one an activation. Each activation's arithmetic is the same whatever `acts` is (so
    a batch's dots equal one-at-a-time ones bit for bit); the row's codes are loaded once for
    them all: LLVM merges the identical loads and unpacking of the acts copies (with VNNI at 576
    columns, four activations take one's 7 vbroadcasti64x4 and 28 vpdpbusd to its 7:
    test_w4a8_row_batch_loads_a_rows_codes_once)."""
    wide = _AVX512BW and pair_dot is not None

    def totals(b, n, t):
        at = [builder.add(b, ir.Constant(_I64, j)) for j in range(n)]
        if wide and n == _GROUP:
            return _pair_totals(builder, [pair_dot(at[j], t) for j in range(0, n, 2)])
        if wide and n == 2:
            return _pair_total(builder, pair_dot(b, t))
        return _block_totals(builder, [block_dot(bj, t) for bj in at])

    one = ir.Constant(_I64, 1)
    groups = builder.lshr(n_blocks, ir.Constant(_I64, 3))
    tail = builder.sub(n_blocks, builder.shl(groups, ir.Constant(_I64, 3)))
    spans = [(_GROUP, ir.Constant(_I64, 0), groups),
             (2, builder.shl(groups, ir.Constant(_I64, 3)), builder.lshr(tail, one)),
             (1, builder.sub(n_blocks, builder.and_(tail, one)), builder.and_(tail, one))]
    total = [ir.Constant(_F32, 0.0)] * acts
    for n, first, count in spans:
        acc = [cgutils.alloca_once_value(builder, _splat(_F32, n, 0.0)) for _ in range(acts)]
        with cgutils.for_range(builder, count) as loop:
            b = builder.add(first, builder.mul(loop.index, ir.Constant(_I64, n)))
            if n == _GROUP:
                codes_at = builder.mul(b, ir.Constant(_I64, code_bytes))
                for line in range(0, _GROUP * code_bytes, 64):
                    _prefetch(builder, code_row, builder.add(codes_at, ir.Constant(_I64, PREFETCH_BYTES + line)))
            for t in range(acts):
                builder.store(block_terms(b, n, totals(b, n, t), builder.load(acc[t]), t), acc[t])
        total = [builder.fadd(total[t], _hsum(builder, builder.load(acc[t]))) for t in range(acts)]
    return total


def _w4a8_codegen(acts):
    """Rows . activations for Q4 rows and Q8 activations x = xd xq (block code sums xs; x_pairs,
    the codes in _pair_order, for the 512-bit pair dots): one activation (1-D operands) or `acts`
    rows t0.. of 2-D ones. Per block, as ref: the integer dot of the codes with xq (exact in
    int32), minus 8 xs for Q4_0, times d_w d_x, plus m_w d_x xs for Q4_1."""
    def codegen(context, builder, sig, args):
        a, q_row, d_row, m_row, (xq, x_pairs, xd, xs) = _dot_operands(context, builder, sig, args, 7, acts)
        q4_1 = m_row is not None

        def block_dot(b, t):
            x = _load(builder, xq[t], builder.mul(b, ir.Constant(_I64, 32)), _vec(_I8, 32))
            return _dot_u4_s8(builder, _codes(builder, q_row, b), x)

        def block_terms(b, n, dots, acc, t):
            sums = _planes_at(builder, xs[t], b, n, _I32, 4)
            if not q4_1:
                dots = builder.sub(dots, builder.shl(sums, _splat(_I32, n, 3)))
            dx = _planes_at(builder, xd[t], b, n, _F32, 4)
            scale = builder.fmul(_planes_at(builder, d_row, b, n, ir.HalfType(), 2), dx)
            acc = _fmuladd(builder, scale, builder.sitofp(dots, _vec(_F32, n)), acc)
            if q4_1:
                offset_x = builder.fmul(dx, builder.sitofp(sums, _vec(_F32, n)))
                acc = _fmuladd(builder, _planes_at(builder, m_row, b, n, ir.HalfType(), 2), offset_x, acc)
            return acc

        dots = _integer_row(builder, a.cols(1), q_row, 16, block_dot, block_terms,
                            lambda b, t: _dot_u4_s8_pair(builder, q_row, x_pairs[t], b), acts)
        if sig.args[3].ndim == 1:
            return dots[0]
        return context.make_tuple(builder, sig.return_type, dots)

    return codegen


@intrinsic
def _w4a8_row(typingctx, qs, d, m, xq, x_pairs, xd, xs, r):
    """Row r . x for Q4 rows and the Q8 activation x (_w4a8_codegen)."""
    if not _c_arrays(qs, d, m, xq, x_pairs, xd, xs):
        return None
    return types.float32(qs, d, m, xq, x_pairs, xd, xs, r), _w4a8_codegen(1)


@intrinsic
def _w4a8_row_batch(typingctx, qs, d, m, xq, x_pairs, xd, xs, r, t0, acts):
    """(row r . x_t0, ..., row r . x_{t0 + acts - 1}) for Q4 rows and the Q8 activations x_t, the
    rows of 2-D xq, x_pairs, xd, xs (_w4a8_codegen): the codes loaded once for `acts` (a literal)
    dots, each equal to _w4a8_row's."""
    if not (isinstance(acts, types.IntegerLiteral) and _c_arrays(qs, d, m, xq, x_pairs, xd, xs)):
        return None
    n = acts.literal_value
    return types.UniTuple(types.float32, n)(qs, d, m, xq, x_pairs, xd, xs, r, t0, acts), _w4a8_codegen(n)


@njit(cache=True, nogil=True, parallel=True)
def _w4a16(qs, d, m, x, out):
    rows = d.shape[0]
    for g in prange((rows + 3) // 4):
        r0, r1, r2, r3 = _row_group(g, rows)
        out[r0], out[r1], out[r2], out[r3] = _w4a16_rows(qs, d, m, x, r0, r1, r2, r3)


@njit(cache=True, nogil=True, parallel=True)
def _w4a16_by_row(qs, d, m, x, out):
    for r in prange(d.shape[0]):
        out[r] = _w4a16_row(qs, d, m, x, r)


def _bits(a):
    """An f16 plane as the uint16 view the kernels decode (numba has no float16); None stays."""
    return None if a is None else a.view(np.uint16)


@njit(cache=True, nogil=True, parallel=True)
def _w4a16_bf16(qs, d, m, x, out):
    # The split activation lives on this call's stack, so decode allocates nothing; an activation
    # wider than it holds (wider than any model's so far) takes a heap buffer a call instead,
    # where a second kernel for it (the float tables) cost every first run 0.6 s of compiling.
    if x.shape[0] > _BF16_MOST_COLS:
        blocks = x.shape[0] // 32
        words = np.empty((blocks + 1) // 2 * _BF16_WORDS_A_PAIR, np.uint16)
        sums = np.empty(blocks, np.float32)
    else:
        words = numba.carray(_stack_u16(_BF16_STACK_WORDS), _BF16_STACK_WORDS)
        sums = numba.carray(_stack_f32(_BF16_STACK_SUMS), _BF16_STACK_SUMS)
    _bf16_split(x, words, sums)
    for r in prange(d.shape[0]):
        out[r] = _w4a16_bf16_row(qs, d, m, words, sums, r)


# a global, so compiled callers type one of the three
_w4a16_kernel = _w4a16_bf16 if _AVX512BF16 else (_w4a16_by_row if _AVX512F else _w4a16)


def matvec_q4_w4a16(qs, d, m, x, out):
    _w4a16_kernel(qs, d.view(np.uint16), _bits(m), x, out)


@njit(cache=True, nogil=True, parallel=True)
def _w4a16_batch(qs, d, m, x, out):
    # A short prompt's W4A16 GEMM, as _w4a8_batch: four activations a row at once (four
    # accumulators each, as _w4a16_row keeps: sixteen of the 32 registers), then one.
    acts = x.shape[0]
    fours = acts - acts % 4
    for r in prange(d.shape[0]):
        for t in range(0, fours, 4):
            v = _w4a16_row_batch(qs, d, m, x, r, t, 4)
            for j in range(4):
                out[t + j, r] = v[j]
        for t in range(fours, acts):
            out[t, r] = _w4a16_row_batch(qs, d, m, x, r, t, 1)[0]


@njit(cache=True, nogil=True, parallel=True)
def _w4a16_bf16_batch(qs, d, m, x, words, sums, out):
    # _w4a16_batch's tiles for the bf16 dots: each activation split once, then four a row at once
    # (four accumulators and an offset sum each: twenty of the 32 registers), then one.
    acts = x.shape[0]
    for t in range(acts):
        _bf16_split(x[t], words[t], sums[t])
    fours = acts - acts % 4
    for r in prange(d.shape[0]):
        for t in range(0, fours, 4):
            v = _w4a16_bf16_row_batch(qs, d, m, words, sums, r, t, 4)
            for j in range(4):
                out[t + j, r] = v[j]
        for t in range(fours, acts):
            out[t, r] = _w4a16_bf16_row_batch(qs, d, m, words, sums, r, t, 1)[0]


_bf16_scratch = [np.empty(0, np.uint16), np.empty(0, np.float32)]  # the batch's split activations


def matmul_q4_w4a16(qs, d, m, x, out):
    """out[t] = matvec_q4_w4a16 of activation t, the rows of x [T, cols], bit for bit; out [T, rows]
    may be a column slice of a wider array. It compiles only where AVX-512F runs _w4a16_row's
    tables (or AVX512-BF16 its dots): elsewhere short_prefill_rows keeps prefill off it."""
    if not _AVX512BF16:  # as the matvec picks its kernel
        _w4a16_batch(qs, d.view(np.uint16), _bits(m), x, out)
        return
    acts, cols = x.shape
    blocks = cols // 32
    width = (blocks + 1) // 2 * _BF16_WORDS_A_PAIR
    if _bf16_scratch[0].shape[0] < acts * width or _bf16_scratch[1].shape[0] < acts * blocks:
        _bf16_scratch[0] = np.empty(max(acts * width, _bf16_scratch[0].shape[0]), np.uint16)
        _bf16_scratch[1] = np.empty(max(acts * blocks, _bf16_scratch[1].shape[0]), np.float32)
    words = _bf16_scratch[0][:acts * width].reshape(acts, width)
    sums = _bf16_scratch[1][:acts * blocks].reshape(acts, blocks)
    _w4a16_bf16_batch(qs, d.view(np.uint16), _bits(m), x, words, sums, out)


def short_prefill_rows(precision: str) -> int:
    """The longest prompt chunk at `precision` that prefill sends through the batch kernels
    (matmul_q4_w4a8, matmul_q4_w4a16, matmul_exact) rather than dequantise + BLAS GEMM, at the
    threads set: the GEMM pays some 50 ms of dequantising whatever the chunk, then less a token
    than the batch kernels, and two threads hardly speed a short GEMM where they halve a batch
    kernel's time.
    SmolLM2 q4_1 prefill on the 2-core Zen 4 EPYC (best of alternating runs), GEMM against batch
    kernel, one thread then two:
    - W4A8 (512-bit dots): 32 tokens 87 / 78 and 94 / 47 ms, 48 tokens 106 / 123 and 119 / 72,
      64 tokens 129 / 168 and 137 / 99: about 2.4 ms a token and thread;
    - W4A8 compiled for Zen 3 (NUMBA_CPU_NAME=znver3, AVX2 features, OPENBLAS_CORETYPE=Zen), on
      the same machine: 16 tokens 56 / 50 and 68 / 32, 24 tokens 62 / 68 and 80 / 42, 32 tokens
      75 / 104 and 89 / 59, 48 tokens 91 / 147 and 109 / 111: about 3.1 ms a token and thread;
    - W4A16 (AVX-512F tables; none without): 8 tokens 67 / 35 and 67 / 21, 16 tokens 81 / 75 and
      78 / 45, 31 tokens 97 / 154 and 98 / 90: its multiply-adds take 16 weights where vpdpbusd
      takes 64, about 4.8 ms a token. Its bf16 dots (AVX512-BF16) take 32, but four a pair of
      blocks and activation, where the tables' four activations shared a table: a batch measured
      a little slower than the tables (see the bf16 section), so the same threshold.
    - exact (matmul_exact, f16 weights widened in registers; the GEMM widens them into prefill's
      scratch): 4 tokens 56 / 28 and 61 / 16, 8 tokens 61 / 48 and 65 / 26, 16 tokens 68 / 88 and
      75 / 46, 24 tokens 76 / 125 and 82-160 / 65-71, 32 tokens 85 / 161 and 93-176 / 86-90 ms
      (SmolLM2 f16, Engine.prefill alone, best of nine; the two-thread GEMM swings from run to
      run, OpenBLAS's worker meeting numba's spinning one): about 5 ms a token and thread.
    So per thread 32, 16, 16 and 12 tokens, up to SHORT_PREFILL_MOST.
    Measured again once the GEMMs ran on numba's threads (0088c53; batch / GEMM, two threads, a
    slow spell of the machine): W4A8 32 tokens 61 / 118, 64 tokens 112 / 167; W4A16 16 tokens
    54 / 66, 32 tokens 112 / 110; exact 16 tokens 60 / 83, 32 tokens 103 / 100: the same.
    W4A8 on AVX-512BW has no bound: matmul_q4_w4a8's rows-in-lanes kernel is faster than the
    GEMM at every length (see _LANE_ROWS), so every W4A8 chunk takes it."""
    if precision == "w4a8" and _AVX512BW:
        return sys.maxsize
    per_thread = {"w4a8": 16, "w4a16": 16 if _AVX512F else 0, "exact": 12}.get(precision, 0)
    return min(per_thread * _threads[0], SHORT_PREFILL_MOST)


# The activation quantiser's arithmetic, shared by decode (codes) and prefill (codes times scale).
# No fast-math but no-NaN/no-inf: every step stays a correctly rounded IEEE op, so the codes equal
# ref's, and the flags let LLVM vectorise the max and the branch-free rounding (1.3 -> 0.9 us a
# 576-wide call, 2.9 -> 1.7 at 1536, numba's dispatch included).
_Q8_MATH = {"nnan", "ninf"}


@njit(cache=True, nogil=True, inline="always", fastmath=_Q8_MATH)
def _group_scale(g, top):
    """A 32-group's scale d = max |g| / top and its inverse (0 for an all-zero group)."""
    amax = F32(0)
    for j in range(32):
        a = abs(g[j])
        amax = a if a > amax else amax
    d = amax / top
    return d, (F32(1) / d if d > 0 else F32(0))


@njit(cache=True, nogil=True, inline="always", fastmath=_Q8_MATH)
def _group_code(v, inv, top):
    """round-half-away(v * inv) (C's roundf, as llama.cpp's quantisers), clamped to -top..top."""
    s = v * inv
    t = np.trunc(s)
    t += np.copysign(F32(1), s) if abs(s - t) >= F32(0.5) else F32(0)
    return min(max(t, -top), top)


_Q8_TOP, _Q16_TOP = F32(127), F32(32767)


@njit(cache=True, nogil=True, fastmath=_Q8_MATH)
def quantize_act_q8(x, xq, xd, xs):
    for b in range(xd.shape[0]):
        g = x[32 * b: 32 * b + 32]
        d, inv = _group_scale(g, _Q8_TOP)
        total = 0
        for j in range(32):
            q = np.int32(_group_code(g[j], inv, _Q8_TOP))
            xq[32 * b + j] = q
            total += q
        xd[b] = d
        xs[b] = total


@njit(cache=True, nogil=True, fastmath=_Q8_MATH)
def quantize_act_q16(x, xq, xd):
    for b in range(xd.shape[0]):
        g = x[32 * b: 32 * b + 32]
        d, inv = _group_scale(g, _Q16_TOP)
        for j in range(32):
            xq[32 * b + j] = np.int16(_group_code(g[j], inv, _Q16_TOP))
        xd[b] = d


@njit(cache=True, nogil=True, fastmath=_Q8_MATH)
def fake_quantize_q8(x, out):
    # Prefill's W4A8: rows quantised per 32-group as quantize_act_q8 does, then scaled back, so
    # a GEMM over them gives decode's integer products. On one thread: a parallel version saved
    # 6 of a 256-token prompt's 390 ms on two (SmolLM2 q4_1, the 2-core Zen 4 EPYC) and cost the
    # first long prompt 0.6 s more of compiling.
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            g = x[r, 32 * b: 32 * b + 32]
            d, inv = _group_scale(g, _Q8_TOP)
            for j in range(32):
                out[r, 32 * b + j] = _group_code(g[j], inv, _Q8_TOP) * d


@njit(cache=True, nogil=True)
def _pair_order(xq, x_pairs):
    """xq's codes for the pair dots: in each 64 bytes (blocks 2p and 2p+1) the middle 16-byte
    quarters swapped, so the two blocks' first halves come first, then their second halves; a
    last odd block (no pair: it takes the one-block dot) is left out."""
    for p in range(xq.shape[0] // 64):
        for j in range(16):
            at = 64 * p + j
            x_pairs[at] = xq[at]
            x_pairs[at + 16] = xq[at + 32]
            x_pairs[at + 32] = xq[at + 16]
            x_pairs[at + 48] = xq[at + 48]


@njit(cache=True, nogil=True, parallel=True)
def _w4a8(qs, d, m, xq, x_pairs, xd, xs, out):
    if _AVX512BW:  # only the pair dots read it
        _pair_order(xq, x_pairs)
    for r in prange(d.shape[0]):
        out[r] = _w4a8_row(qs, d, m, xq, x_pairs, xd, xs, r)


_x_pairs = [np.empty(0, np.int8)]  # the pair-ordered activation of the wrapper's calls


def _pair_scratch(cols):
    """A buffer for cols activation codes in _pair_order, made again only when a wider one is
    needed: a decode step allocates nothing."""
    if _x_pairs[0].shape[0] < cols:
        _x_pairs[0] = np.empty(cols, np.int8)
    return _x_pairs[0]


def matvec_q4_w4a8(qs, d, m, xq, xd, xs, out):
    _w4a8(qs, d.view(np.uint16), _bits(m), xq, _pair_scratch(xq.shape[0]), xd, xs, out)


# A short prompt's W4A8 GEMM: each thread's rows against every activation, eight of them a row at
# once (then four, then one), so a row's codes are read from memory and unpacked once a tile.
@njit(cache=True, nogil=True, parallel=True)
def _w4a8_batch(qs, d, m, xq, x_pairs, xd, xs, out):
    acts = xq.shape[0]
    if _AVX512BW:
        for t in range(acts):
            _pair_order(xq[t], x_pairs[t])
    eights = acts - acts % 8
    fours = acts - acts % 4
    for r in prange(d.shape[0]):
        for t in range(0, eights, 8):
            v = _w4a8_row_batch(qs, d, m, xq, x_pairs, xd, xs, r, t, 8)
            for j in range(8):
                out[t + j, r] = v[j]
        for t in range(eights, fours, 4):
            w = _w4a8_row_batch(qs, d, m, xq, x_pairs, xd, xs, r, t, 4)
            for j in range(4):
                out[t + j, r] = w[j]
        for t in range(fours, acts):
            out[t, r] = _w4a8_row_batch(qs, d, m, xq, x_pairs, xd, xs, r, t, 1)[0]


# W4A8 prompt GEMM with a row in each int32 lane (AVX-512BW): a thread copies 16 rows' codes into
# _LANE_ROWS-wide quads (quad j of block b: bytes 4j..4j+3 of each row's block, row after row, so
# one 64-byte load holds 16 rows' four code bytes, low nibbles the weights 4j.. and high ones
# 16 + 4j..), then for _LANE_ACTS activations at a time one vpdpbusd (vpmaddubsw + vpmaddwd
# without VNNI) multiplies those 16 rows by four broadcast activation codes: no horizontal sums,
# and the rows' codes are unpacked once for eight activations. Each row's arithmetic is the
# decode kernel's (_integer_row) step for step: the same integer dots, the same scale products
# and fused multiply-adds, into the same eight, two and one partial sums (blocks j, j + 8, ...;
# then the pairs; then the last), added in _hsum's order, so every output equals
# matvec_q4_w4a8's bit for bit, for any prompt length. Against dequantise + OpenBLAS sgemm
# (gemm_q4) on the 2-core Zen 4 EPYC, q4_1, 256 activations, two threads, best of seven:
# 3072 x 576 1.74 ms against 5.15, 576 x 1536 0.83 against 2.47, 4096 x 4096 16.3 against 53.4
# (the row kernel 4.59, 2.10, 48.8). Below _LANES_FROM activations the row kernel
# (_w4a8_batch) is faster: a tile's packing and its eight activations cost the same for fewer,
# and the row kernel takes one activation at a time. Best of nine, q4_1, lanes / row kernel in
# us, two threads: 3072 x 576 at 1, 8, 12 and 16 activations 241 / 29, 145 / 134, 205 / 216,
# 200 / 251; 576 x 1536 62 / 15, 71 / 60, 101 / 92, 103 / 113 (one thread: 3072 x 576 at 12
# 353 / 394, 576 x 1536 159 / 161, at 16 355 / 488 and 160 / 210).
_LANE_ROWS = 16
_LANE_ACTS = 8
_LANES_FROM = 12


@njit(cache=True, nogil=True)
def _pack_lane_rows(qs32, d, m, r0, codes, scales, offsets):
    """Rows r0 .. r0 + 15 of Q4 planes (qs as uint32 words; rows past the end repeat the last)
    into codes [blocks, 4, 16] (word j of block b, row after row) and scales, offsets [blocks, 16]
    (f16 bits; offsets only for Q4_1, m not None)."""
    rows, blocks = d.shape
    for i in range(_LANE_ROWS):
        r = min(r0 + i, rows - 1)
        for b in range(blocks):
            for j in range(4):
                codes[b, j, i] = qs32[r, 4 * b + j]
            scales[b, i] = d[r, b]
            if m is not None:
                offsets[b, i] = m[r, b]


@intrinsic
def _w4a8_lane_tile(typingctx, codes, scales, offsets, xq, xd, xs, out, r0, t0):
    """out[t, r0 + i] for the _LANE_ROWS rows packed by _pack_lane_rows (those below out's row
    count) and the activations t0 .. t0 + _LANE_ACTS - 1 (those below xq's count; the rest read
    the last one's and are not stored): see _LANE_ROWS."""
    if not (_c_arrays(codes, scales, offsets, xq, xd, xs) and isinstance(out, types.Array)):
        return None
    q4_1 = not isinstance(offsets, types.NoneType)
    lanes, acts_n = _LANE_ROWS, _LANE_ACTS
    v_i32, v_f32 = _vec(_I32, lanes), _vec(_F32, lanes)

    def codegen(context, builder, sig, args):
        a = _Operands(context, builder, sig.args[:7], args[:7])
        r0_, t0_ = _intp(context, builder, sig, args, 7), _intp(context, builder, sig, args, 8)
        one = ir.Constant(_I64, 1)
        acts = builder.extract_value(a.arrays[3].shape, 0)
        rows = builder.extract_value(a.arrays[6].shape, 1)
        blocks = builder.extract_value(a.arrays[1].shape, 0)
        last = builder.sub(acts, one)
        ts = [builder.add(t0_, ir.Constant(_I64, t)) for t in range(acts_n)]
        at = [builder.select(builder.icmp_signed("<", t, acts), t, last) for t in ts]
        x_rows, xd_rows, xs_rows = ([a.row(i, t) for t in at] for i in (3, 4, 5))
        codes_p, scales_p = a.data(0), a.data(1)
        offsets_p = a.data(2) if q4_1 else None
        module = builder.module
        if _AVX512VNNI:
            dpbusd = cgutils.get_or_insert_function(module, ir.FunctionType(v_i32, [v_i32] * 3),
                                                    "llvm.x86.avx512.vpdpbusd.512")

            def dot(acc, w, x):
                return builder.call(dpbusd, [acc, w, x])
        else:
            pmaddubsw = cgutils.get_or_insert_function(
                module, ir.FunctionType(_vec(_I16, 32), [_vec(_I8, 64)] * 2), "llvm.x86.avx512.pmaddubs.w.512")
            pmaddwd = cgutils.get_or_insert_function(
                module, ir.FunctionType(v_i32, [_vec(_I16, 32)] * 2), "llvm.x86.avx512.pmaddw.d.512")

            def dot(acc, w, x):
                pairs = builder.call(pmaddubsw, [builder.bitcast(w, _vec(_I8, 64)), builder.bitcast(x, _vec(_I8, 64))])
                return builder.add(acc, builder.call(pmaddwd, [pairs, _splat(_I16, 32, 1)]))

        def block(b, sums):
            """Block b's terms added to the activations' partial sums (allocas of <16 x float>)."""
            x_at = builder.mul(b, ir.Constant(_I64, 32))
            four = ir.Constant(_I64, 4)
            xs_b = [_load(builder, xs_rows[t], builder.mul(b, four), _I32) for t in range(acts_n)]
            if q4_1:
                acc = [_splat(_I32, lanes, 0)] * acts_n
            else:  # Q4_0's -8 sum q_x, which the decode kernel subtracts from the dot: the same integer
                acc = [_broadcast(builder, builder.mul(s, ir.Constant(_I32, -8)), lanes) for s in xs_b]
            for j in range(4):
                w = _load(builder, codes_p, builder.add(builder.mul(b, ir.Constant(_I64, 256)),
                                                        ir.Constant(_I64, 64 * j)), _vec(_I8, 64))
                low = builder.bitcast(builder.and_(w, _splat(_I8, 64, 15)), v_i32)
                high = builder.lshr(builder.bitcast(w, _vec(_I16, 32)), _splat(_I16, 32, 4))
                high = builder.bitcast(builder.and_(high, _splat(_I16, 32, 0x0F0F)), v_i32)
                for t in range(acts_n):
                    x_lo = _broadcast(builder, _load(builder, x_rows[t], builder.add(x_at, ir.Constant(_I64, 4 * j)),
                                                     _I32), lanes)
                    x_hi = _broadcast(builder, _load(builder, x_rows[t],
                                                     builder.add(x_at, ir.Constant(_I64, 16 + 4 * j)), _I32), lanes)
                    acc[t] = dot(dot(acc[t], low, x_lo), high, x_hi)
            # a block's 16 scales (and offsets) are 32 bytes, as its activation codes are
            d = builder.fpext(_load(builder, scales_p, x_at, _vec(ir.HalfType(), lanes)), v_f32)
            m = builder.fpext(_load(builder, offsets_p, x_at, _vec(ir.HalfType(), lanes)), v_f32) if q4_1 else None
            for t in range(acts_n):
                dx = _load(builder, xd_rows[t], builder.mul(b, four), _F32)
                scale = builder.fmul(d, _broadcast(builder, dx, lanes))
                v = _fmuladd(builder, scale, builder.sitofp(acc[t], v_f32), builder.load(sums[t]))
                if q4_1:
                    offset_x = builder.fmul(dx, builder.sitofp(xs_b[t], _F32))
                    v = _fmuladd(builder, m, _broadcast(builder, offset_x, lanes), v)
                builder.store(v, sums[t])

        # _integer_row's spans, as 11 classes of blocks each summed apart: j < 8, the groups of
        # eight's lane j (blocks j, j + 8, ...); 8 and 9, the pairs' lanes; 10, the last block.
        # One loop over the classes, so the block's code is generated once: as 11 copies it kept
        # SmolLM2's first prompt waiting 4.5 s for numba on the 2-core Zen 4 EPYC, as one 1.4-1.9.
        c8, c2 = ir.Constant(_I64, 8), ir.Constant(_I64, 2)
        groups = builder.lshr(blocks, ir.Constant(_I64, 3))
        tail = builder.sub(blocks, builder.shl(groups, ir.Constant(_I64, 3)))
        pair0, pairs, odd = builder.shl(groups, ir.Constant(_I64, 3)), builder.lshr(tail, one), builder.and_(tail, one)
        parts = cgutils.alloca_once(builder, v_f32, size=11 * acts_n)
        with cgutils.for_range(builder, ir.Constant(_I64, 11)) as classes:
            c = classes.index
            in_groups, in_pairs = builder.icmp_signed("<", c, c8), builder.icmp_signed("<", c, ir.Constant(_I64, 10))
            first = builder.select(in_groups, c, builder.select(in_pairs, builder.add(pair0, builder.sub(c, c8)),
                                                                builder.sub(blocks, odd)))
            step = builder.select(in_groups, c8, c2)
            count = builder.select(in_groups, groups, builder.select(in_pairs, pairs, odd))
            sums = [cgutils.alloca_once_value(builder, _splat(_F32, lanes, 0.0)) for _ in range(acts_n)]  # zeroed here
            with cgutils.for_range(builder, count) as loop:
                block(builder.add(first, builder.mul(loop.index, step)), sums)
            for t in range(acts_n):
                at = builder.add(builder.mul(c, ir.Constant(_I64, acts_n)), ir.Constant(_I64, t))
                builder.store(builder.load(sums[t]), builder.gep(parts, [at]))

        def part(c, t):
            return builder.load(builder.gep(parts, [ir.Constant(_I64, c * acts_n + t)]))

        valid = builder.sub(rows, r0_)
        mask = builder.icmp_signed("<", ir.Constant(_vec(_I64, lanes), [ir.Constant(_I64, i) for i in range(lanes)]),
                                   _broadcast(builder, valid, lanes))
        store = cgutils.get_or_insert_function(
            module, ir.FunctionType(ir.VoidType(), [v_f32, v_f32.as_pointer(), _I32, mask.type]),
            f"llvm.masked.store.v{lanes}f32.p0v{lanes}f32")
        for t in range(acts_n):
            e = [part(c, t) for c in range(8)]
            hsum8 = builder.fadd(builder.fadd(builder.fadd(e[0], e[4]), builder.fadd(e[2], e[6])),
                                 builder.fadd(builder.fadd(e[1], e[5]), builder.fadd(e[3], e[7])))
            total = builder.fadd(_splat(_F32, lanes, 0.0), hsum8)
            total = builder.fadd(total, builder.fadd(part(8, t), part(9, t)))
            total = builder.fadd(total, part(10, t))
            with builder.if_then(builder.icmp_signed("<", ts[t], acts)):
                ptr = builder.gep(a.row(6, ts[t]), [builder.mul(r0_, ir.Constant(_I64, 4))])
                builder.call(store, [total, builder.bitcast(ptr, v_f32.as_pointer()), ir.Constant(_I32, 4), mask])
        return context.get_dummy_value()

    return types.void(codes, scales, offsets, xq, xd, xs, out, r0, t0), codegen


@njit(cache=True, nogil=True, parallel=True)
def _w4a8_lanes(qs32, d, m, xq, xd, xs, out, codes, scales, offsets):
    rows, acts, workers = d.shape[0], xq.shape[0], codes.shape[0]
    groups = (rows + _LANE_ROWS - 1) // _LANE_ROWS
    for w in prange(workers):
        for g in range(w, groups, workers):
            r0 = g * _LANE_ROWS
            if m is None:
                _pack_lane_rows(qs32, d, None, r0, codes[w], scales[w], None)
                for t0 in range(0, acts, _LANE_ACTS):
                    _w4a8_lane_tile(codes[w], scales[w], None, xq, xd, xs, out, r0, t0)
            else:
                _pack_lane_rows(qs32, d, m, r0, codes[w], scales[w], offsets[w])
                for t0 in range(0, acts, _LANE_ACTS):
                    _w4a8_lane_tile(codes[w], scales[w], offsets[w], xq, xd, xs, out, r0, t0)


_lane_buffers = [np.empty(0, np.uint32), np.empty(0, np.uint16)]  # _w4a8_lanes's packed rows, a worker each


def _lane_scratch(workers, blocks):
    """(codes [workers, blocks, 4, 16] uint32, scales and offsets [workers, blocks, 16] uint16),
    over buffers made again only when a wider matrix needs more."""
    words, halves = workers * blocks * 4 * _LANE_ROWS, 2 * workers * blocks * _LANE_ROWS
    if _lane_buffers[0].size < words:
        _lane_buffers[0] = np.empty(words, np.uint32)
    if _lane_buffers[1].size < halves:
        _lane_buffers[1] = np.empty(halves, np.uint16)
    planes = _lane_buffers[1][:halves].reshape(2, workers, blocks, _LANE_ROWS)
    return _lane_buffers[0][:words].reshape(workers, blocks, 4, _LANE_ROWS), planes[0], planes[1]


def matmul_q4_w4a8(qs, d, m, xq, xd, xs, out):
    """out[t] = matvec_q4_w4a8 of activation t, the rows of xq [T, cols] and xd, xs [T, cols / 32],
    bit for bit; out [T, rows] may be a column slice of a wider array. With AVX-512BW and at
    least _LANES_FROM activations, rows in lanes (_LANE_ROWS); else each row
    against eight activations at a time (and four, and one)."""
    if _AVX512BW and xq.shape[0] >= _LANES_FROM:
        rows, blocks = d.shape
        workers = max(1, min(_threads[0], (rows + _LANE_ROWS - 1) // _LANE_ROWS))
        codes, scales, offsets = _lane_scratch(workers, blocks)
        _w4a8_lanes(qs.view(np.uint32), d.view(np.uint16), _bits(m), xq, xd, xs, out, codes, scales, offsets)
        return
    acts, cols = xq.shape
    x_pairs = _pair_scratch(acts * cols)[:acts * cols].reshape(acts, cols)
    _w4a8_batch(qs, d.view(np.uint16), _bits(m), xq, x_pairs, xd, xs, out)


@njit(cache=True, nogil=True)
def _dequantize_q4(qs, d, m, out):
    # Serial: prefill's GEMMs call it from each of their threads for a slice of rows (_gemm_q4).
    for r in range(d.shape[0]):
        _dequantize_q4_row(qs, d, m, out, r)


@intrinsic
def _dequantize_q4_row(typingctx, qs, d, m, out, r):
    """Row r of Q4 planes into out's row r in f32, as ref computes it: d (q - 8), or d q + m (a
    multiply, then an add: no FMA, so the same bits). In IR, a block's 32 values a vector of
    _LANES at a time: numba's loop stayed scalar (its stores might alias the codes it reads),
    32 vmulss a block. 1536 x 576, the output in cache, AMD EPYC (Zen 5): Q4_0 0.224 -> 0.033
    ms, Q4_1 0.232 -> 0.041."""
    if not _c_arrays(qs, d, m, out):
        return None
    q4_1 = not isinstance(m, types.NoneType)

    def codegen(context, builder, sig, args):
        a = _Operands(context, builder, sig.args[:4], args[:4])
        r = args[4]
        q_row, d_row, o_row = a.row(0, r), a.row(1, r), a.row(3, r)
        m_row = a.row(2, r) if q4_1 else None
        vt = _vec(_F32, _LANES)
        with cgutils.for_range(builder, a.cols(1)) as loop:
            b = loop.index
            codes = _codes_f32(builder, q_row, b)
            if not q4_1:  # q - 8 of a small integer: exact in f32, as ref's int subtraction
                codes = [builder.fsub(c, _splat(_F32, _LANES, 8.0)) for c in codes]
            scale = _broadcast(builder, _half_at(builder, d_row, b), _LANES)
            offset = _broadcast(builder, _half_at(builder, m_row, b), _LANES) if q4_1 else None
            for k, c in enumerate(codes):
                v = builder.fmul(scale, c)
                if q4_1:
                    v = builder.fadd(v, offset)
                at = builder.add(builder.mul(b, ir.Constant(_I64, 128)), ir.Constant(_I64, 4 * _LANES * k))
                builder.store(v, builder.bitcast(builder.gep(o_row, [at]), vt.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(qs, d, m, out, r), codegen


def dequantize_q4(qs, d, m, out):
    _dequantize_q4(qs, d.view(np.uint16), _bits(m), out)


@njit(cache=True, nogil=True)
def _embed_q4(qs, d, m, token, out):
    row = out.reshape(1, -1)
    if m is None:
        _dequantize_q4(qs[token:token + 1], d[token:token + 1], None, row)
    else:
        _dequantize_q4(qs[token:token + 1], d[token:token + 1], m[token:token + 1], row)


def embed_q4(qs, d, m, token, out):
    _embed_q4(qs, d.view(np.uint16), _bits(m), token, out)


# -- Q8_0 matvecs (the Q4 variants' token table as lm_head) -----------------------------------
#
# Both integer kernels, a row a call, as W4A8: W8A8 against the Q8 activation, W8A16 against a Q16
# one (int16 codes per 32-group, quantize_act_q16), whose rounding (2^-16 of a group's largest
# value) moved SmolLM2's perplexity over 999 decoded tokens from 19.10500 to 19.10502. W8A16 was a
# four-row float kernel before, bound by converting every code to float.

def _dot_s8_s8(builder, q, x):
    """Signed codes times int8 activations, as 8 int32 partial sums. With AVX2, vpmaddubsw takes
    an unsigned operand: |q| (at most 128) against x with q's sign moved onto it (vpsignb), pairs
    at most 2 * 128 * 127, no saturation; else plain widening IR. The same integers either way."""
    if _AVX2:
        module = builder.module
        v32 = _vec(_I8, 32)
        psign = cgutils.get_or_insert_function(module, ir.FunctionType(v32, [v32, v32]), "llvm.x86.avx2.psign.b")
        pmaddubsw = cgutils.get_or_insert_function(
            module, ir.FunctionType(_vec(_I16, 16), [v32] * 2), "llvm.x86.avx2.pmadd.ub.sw")
        pmaddwd = cgutils.get_or_insert_function(
            module, ir.FunctionType(_vec(_I32, 8), [_vec(_I16, 16)] * 2), "llvm.x86.avx2.pmadd.wd")
        negative = builder.icmp_signed("<", q, _splat(_I8, 32, 0))
        magnitude = builder.select(negative, builder.sub(_splat(_I8, 32, 0), q), q)
        pairs = builder.call(pmaddubsw, [magnitude, builder.call(psign, [x, q])])
        return builder.call(pmaddwd, [pairs, _splat(_I16, 16, 1)])
    return _widening_dot(builder, q, x)


def _dot_s8_s16(builder, q, x):
    """32 signed codes times 32 int16 activations, as 8 int32 partial sums: codes widened to
    int16 (vpmovsxbw), then vpmaddwd pairs (at most 2 * 128 * 32767, no overflow); without AVX2,
    plain widening IR. The same integers either way."""
    if _AVX2:
        pmaddwd = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_vec(_I32, 8), [_vec(_I16, 16)] * 2), "llvm.x86.avx2.pmadd.wd")
        wide = builder.sext(q, _vec(_I16, 32))

        def half(v, k):
            return builder.shuffle_vector(v, v, _lanes(range(16 * k, 16 * k + 16)))
        return builder.add(builder.call(pmaddwd, [half(wide, 0), half(x, 0)]),
                           builder.call(pmaddwd, [half(wide, 1), half(x, 1)]))
    return _widening_dot(builder, q, x)


def _q8_row_codegen(dot, code_bytes):
    """A Q8_0 row's dot with an integer activation x = xd xq (codes of code_bytes each): per
    block, dot(weight codes, activation codes) as 8 int32 partials, reduced exactly, times
    d_w d_x."""
    def codegen(context, builder, sig, args):
        a = _Operands(context, builder, sig.args[:4], args[:4])
        q_row, d_row = a.row(0, args[4]), a.row(1, args[4])
        xq, xd = a.data(2), a.data(3)
        x_type = _vec(ir.IntType(8 * code_bytes), 32)

        def block_dot(b, _t):
            at = builder.mul(b, ir.Constant(_I64, 32))
            x = _load(builder, xq, builder.mul(at, ir.Constant(_I64, code_bytes)), x_type)
            return dot(builder, _load(builder, q_row, at, _vec(_I8, 32)), x)

        def block_terms(b, n, dots, acc, _t):
            dw = _planes_at(builder, d_row, b, n, ir.HalfType(), 2)
            scale = builder.fmul(dw, _planes_at(builder, xd, b, n, _F32, 4))
            return _fmuladd(builder, scale, builder.sitofp(dots, _vec(_F32, n)), acc)

        return _integer_row(builder, a.cols(1), q_row, 32, block_dot, block_terms)[0]

    return codegen


@intrinsic
def _w8a16_row(typingctx, q8, d, xq, xd, r):
    """Row r . x for Q8_0 rows and the Q16 activation x = xd xq: per block, the integer dot
    (exact in int32: 32 products of at most 128 * 32767) times d_w d_x, as ref. The four-row
    float kernel it replaced was bound by its conversions (a vpmovsxbd and a vcvtdq2ps every 8
    weights): SmolLM2's 49152 x 576 token table from DRAM (scripts/cpu_matvec_bench.py --dram,
    Zen 3, alternating) took 2.92-3.09 ms on one thread and 1.57-1.71 on two, this 1.77-1.96 and
    0.98-1.02, as W8A8."""
    if not _c_arrays(q8, d, xq, xd):
        return None
    return types.float32(q8, d, xq, xd, r), _q8_row_codegen(_dot_s8_s16, 2)


@intrinsic
def _w8a8_row(typingctx, q8, d, xq, xd, r):
    """Row r . x for Q8_0 rows and the Q8 activation x = xd xq: per block, the integer dot (exact
    in int32) times d_w d_x, as ref."""
    if not _c_arrays(q8, d, xq, xd):
        return None
    return types.float32(q8, d, xq, xd, r), _q8_row_codegen(_dot_s8_s8, 1)


@njit(cache=True, nogil=True, parallel=True)
def _w8a16(q8, d, xq, xd, out):
    for r in prange(d.shape[0]):
        out[r] = _w8a16_row(q8, d, xq, xd, r)


@njit(cache=True, nogil=True, parallel=True)
def _w8a8(q8, d, xq, xd, out):
    for r in prange(d.shape[0]):
        out[r] = _w8a8_row(q8, d, xq, xd, r)


def matvec_q8_w8a16(q8, d, xq, xd, out):
    _w8a16(q8, d.view(np.uint16), xq, xd, out)


def matvec_q8_w8a8(q8, d, xq, xd, out):
    _w8a8(q8, d.view(np.uint16), xq, xd, out)


@njit(cache=True, nogil=True)
def _dequantize_q8(q8, d, out):
    # Serial, as _dequantize_q4 and for its reason.
    rows, nb = d.shape
    for r in range(rows):
        for b in range(nb):
            s = _half_to_f32(d[r, b])
            for j in range(32):
                out[r, 32 * b + j] = s * F32(q8[r, 32 * b + j])


def dequantize_q8(q8, d, out):
    _dequantize_q8(q8, d.view(np.uint16), out)


@njit(cache=True, nogil=True)
def _embed_q8(q8, d, token, out):
    _dequantize_q8(q8[token:token + 1], d[token:token + 1], out.reshape(1, -1))


def embed_q8(q8, d, token, out):
    _embed_q8(q8, d.view(np.uint16), token, out)


# -- exact variants' matrices, as stored ----------------------------------------------------
# f16 (IEEE half) or bf16 (the store keeps its bits as uint16), widened to f32 in registers as
# they are read: half the bytes a decode step streams of a matrix held in f32, and half the RAM.
# SmolLM2 f16 on the 2-core Zen 4 EPYC (`nerva bench smollm2-135m:f16 --gen-tokens 32`,
# alternating with the f32 matrices before): decode 55 -> 95 tok/s, peak RSS 785 -> 477 MB.

@intrinsic
def _exact_to_f32(typingctx, bits):
    """A stored weight -> float32, exactly: int16 bits are an IEEE half (fpext: vcvtph2ps),
    uint16 bits a bf16 (a float32's upper half). The integer type tells the two apart, so one
    kernel body serves both formats (_exact_bits gives f16 matrices the int16 view)."""
    if bits == types.int16:
        def codegen(context, builder, sig, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), _F32)
    elif bits == types.uint16:
        def codegen(context, builder, sig, args):
            return builder.bitcast(builder.shl(builder.zext(args[0], _I32), ir.Constant(_I32, 16)), _F32)
    else:
        return None
    return types.float32(bits), codegen


def _exact_bits(w):
    return w.view(np.int16) if w.dtype == np.float16 else w


@njit(cache=True, nogil=True, fastmath=_FAST, parallel=True)
def _matvec_exact(w, x, out):
    # numba's threads, not BLAS's: decode calls this between other kernels' parallel regions, and
    # OpenBLAS's sgemv waiting on its worker while numba's OpenMP worker spins on the other core
    # held SmolLM2 f16's decode to 7.4 tok/s on the 2-core Zen 4 EPYC (a NumPy dot of 1536x576:
    # 31 us alone, 8.3 ms right after a numba parallel loop). A kernel of its own, not
    # _matmul_exact's one-activation case: all of SmolLM2 f16's matrices from DRAM took 8-19%
    # longer that way on one thread, 7-13% on two.
    for r in prange(w.shape[0]):
        row = w[r]
        acc = F32(0)
        for c in range(row.shape[0]):
            acc += _exact_to_f32(row[c]) * x[c]
        out[r] = acc


@njit(cache=True, nogil=True, fastmath=_FAST, parallel=True)
def _matmul_exact(w, x, out):
    # four activations a pass share each weight's load and widening
    acts, cols = x.shape
    for r in prange(w.shape[0]):
        t = 0
        while t + 4 <= acts:
            a0 = a1 = a2 = a3 = F32(0)
            for c in range(cols):
                v = _exact_to_f32(w[r, c])
                a0 += v * x[t, c]
                a1 += v * x[t + 1, c]
                a2 += v * x[t + 2, c]
                a3 += v * x[t + 3, c]
            out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = a0, a1, a2, a3
            t += 4
        while t < acts:
            acc = F32(0)
            for c in range(cols):
                acc += _exact_to_f32(w[r, c]) * x[t, c]
            out[t, r] = acc
            t += 1


def matvec_exact(w, x, out):
    """out = w @ x, w an exact variant's matrix as stored: float16, or uint16 holding bf16 bits."""
    _matvec_exact(_exact_bits(w), x, out)


def matmul_exact(w, x, out):
    """out[t] = w @ x[t] for the rows of x [T, cols] (a short prompt chunk: short_prefill_rows);
    out [T, rows] may be a column slice of a wider array."""
    _matmul_exact(_exact_bits(w), x, out)


@njit(cache=True, nogil=True)
def _widen_exact(w, out):
    # Serial, as _dequantize_q4 and for its reason.
    for r in range(w.shape[0]):
        for c in range(w.shape[1]):
            out[r, c] = _exact_to_f32(w[r, c])


def widen_exact(w, out):
    """out f32 [rows, cols] = w, an exact variant's matrix as stored (prefill's GEMM operand)."""
    _widen_exact(_exact_bits(w), out)


def embed_exact(table, token, out):
    """out = row `token` of an exact variant's table as stored."""
    widen_exact(table[token:token + 1], out.reshape(1, -1))


# Prefill's GEMMs: OpenBLAS's sgemm called from numba's threads, each thread dequantising (or
# widening) a slice of weight rows into its own scratch and multiplying it while it is in cache.
# OpenBLAS's own thread pool stays at one thread, so numba's pool is the only one on the cores:
# OpenBLAS's workers spin-waited after each GEMM on the cores numba's threads wanted, which kept
# prefill's other kernels serial (a parallel one between GEMMs took 8 ms where it took 0.06 alone).

def _numpy_sgemm() -> int:
    """The address of cblas_sgemm (64-bit integers) in the OpenBLAS that NumPy's wheels ship, its
    own threads set to one; 0 where NumPy has another BLAS (prefill then takes NumPy's matmul)."""
    import ctypes
    import glob

    base = os.path.dirname(np.__file__)
    for path in sorted(glob.glob(base + ".libs/*openblas*") + glob.glob(os.path.join(base, ".dylibs", "*openblas*"))):
        try:
            lib = ctypes.CDLL(path)  # NumPy's import loaded it: this is the same library
        except OSError:
            continue
        for prefix in ("scipy_", ""):
            sgemm = getattr(lib, f"{prefix}cblas_sgemm64_", None)
            set_threads = getattr(lib, f"{prefix}openblas_set_num_threads64_", None)
            if sgemm is not None and set_threads is not None:
                set_threads.argtypes = [ctypes.c_int64]
                set_threads(1)
                return ctypes.cast(sgemm, ctypes.c_void_p).value or 0
    return 0


_SGEMM = _numpy_sgemm()
_CBLAS_ROW_MAJOR, _CBLAS_NO_TRANS, _CBLAS_TRANS = 101, 111, 112


@intrinsic
def _sgemm(typingctx, sgemm, trans_b, m, n, k, a, a_at, lda, b, b_at, ldb, c, c_at, ldc):
    """C = A B^T (trans_b) or A B, by the cblas_sgemm (64-bit integers) at address sgemm, on the
    calling thread, row-major: A [m, k] from element a_at of array a with rows lda elements
    apart, B [n, k] (or [k, n]) from b's element b_at, C [m, n] from c's element c_at. Offsets
    and strides, not views: the kernels that call it compile without numba's reshape and slice
    machinery (SmolLM2's first run spent 4.8 s compiling attention_prefill with views). The
    address is an argument, not a constant, so numba caches the code."""
    ints = (sgemm, m, n, k, a_at, lda, b_at, ldb, c_at, ldc)
    if not (all(isinstance(t, types.Integer) for t in ints) and isinstance(trans_b, types.Boolean)
            and all(isinstance(t, types.Array) and t.dtype == types.float32 for t in (a, b, c))):
        return None

    def codegen(context, builder, sig, args):
        f32p = _F32.as_pointer()
        fnty = ir.FunctionType(ir.VoidType(),
                               [_I32] * 3 + [_I64] * 3 + [_F32, f32p, _I64, f32p, _I64, _F32, f32p, _I64])
        fn = builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.int64), fnty.as_pointer())

        def i64(i):
            return context.cast(builder, args[i], sig.args[i], types.int64)

        def at(array, offset):
            data = context.make_array(sig.args[array])(context, builder, args[array]).data
            return builder.gep(builder.bitcast(data, f32p), [i64(offset)])

        trans = builder.select(args[1], ir.Constant(_I32, _CBLAS_TRANS), ir.Constant(_I32, _CBLAS_NO_TRANS))
        builder.call(fn, [ir.Constant(_I32, _CBLAS_ROW_MAJOR), ir.Constant(_I32, _CBLAS_NO_TRANS), trans,
                          i64(2), i64(3), i64(4), ir.Constant(_F32, 1.0), at(5, 6), i64(7),
                          at(8, 9), i64(10), ir.Constant(_F32, 0.0), at(11, 12), i64(13)])
        return context.get_dummy_value()

    return types.none(sgemm, trans_b, m, n, k, a, a_at, lda, b, b_at, ldb, c, c_at, ldc), codegen


@njit(cache=True, nogil=True, parallel=True)
def _gemm_q4(sgemm, qs, d, m, x, out, col, scratch):
    rows, workers, each = d.shape[0], scratch.shape[0], scratch.shape[1]
    for t in prange(workers):
        for r0 in range(t * each, rows, workers * each):
            r1 = min(rows, r0 + each)
            w = scratch[t, :r1 - r0]
            if m is None:
                _dequantize_q4(qs[r0:r1], d[r0:r1], None, w)
            else:
                _dequantize_q4(qs[r0:r1], d[r0:r1], m[r0:r1], w)
            _sgemm(sgemm, True, x.shape[0], r1 - r0, x.shape[1], x, 0, x.shape[1], w, 0, w.shape[1],
                   out, col + r0, out.shape[1])


@njit(cache=True, nogil=True, parallel=True)
def _gemm_q8(sgemm, q8, d, x, out, col, scratch):
    rows, workers, each = d.shape[0], scratch.shape[0], scratch.shape[1]
    for t in prange(workers):
        for r0 in range(t * each, rows, workers * each):
            r1 = min(rows, r0 + each)
            w = scratch[t, :r1 - r0]
            _dequantize_q8(q8[r0:r1], d[r0:r1], w)
            _sgemm(sgemm, True, x.shape[0], r1 - r0, x.shape[1], x, 0, x.shape[1], w, 0, w.shape[1],
                   out, col + r0, out.shape[1])


@njit(cache=True, nogil=True, parallel=True)
def _gemm_exact(sgemm, e, x, out, col, scratch):
    rows, workers, each = e.shape[0], scratch.shape[0], scratch.shape[1]
    for t in prange(workers):
        for r0 in range(t * each, rows, workers * each):
            r1 = min(rows, r0 + each)
            w = scratch[t, :r1 - r0]
            _widen_exact(e[r0:r1], w)
            _sgemm(sgemm, True, x.shape[0], r1 - r0, x.shape[1], x, 0, x.shape[1], w, 0, w.shape[1],
                   out, col + r0, out.shape[1])


GEMM_SLICE_BYTES = 768 << 10  # a thread's slice of f32 weight rows at most, but for GEMM_MIN_ROWS
# Fewest rows a slice takes where the scratch holds them: each slice's GEMM packs all of x again,
# so a wide matrix cut into 768 KB slices (8 to 18 rows at 9216 to 16384 columns) spent its time
# re-reading x. Q4_0, 250 tokens, two threads, a 2-core Zen 3 (scripts/cpu_gemm_slices.py, best
# of three): 2048x16384 533 -> 153 ms, 2304x9216 189 -> 99, 2048x8192 128 -> 80; at 48 tokens
# 69 -> 33, 30 -> 22, 24 -> 16 (one thread 80 -> 64, 42 -> 32, 39 -> 33, where 128 rows were
# slower again: 79, 43, 33). Matrices up to 3072 columns keep their 768 KB slices.
GEMM_MIN_ROWS = 64


def _gemm_slices(cols, scratch, align):
    """scratch as [workers, rows, cols]: a slice of weight rows for each thread that runs (as many
    as it holds a row for), at most GEMM_SLICE_BYTES (or GEMM_MIN_ROWS rows) or the scratch's
    share. The slices' height
    divides `align`, and where it can, `align` rows make a whole number of slices for each thread
    (SmolLM2's o, 576 rows of 576: 4 slices of 144, where 3 of 192 left a thread idle a third of
    the time). OpenBLAS's bits depend on a GEMM's shape (a column's sums differ between 7 and 64
    rows of weights), so a stack of matrices whose heights `align` divides (q, k and v; gate and
    up) makes the same GEMMs multiplied apart as fused: paging changes no bit."""
    workers = max(1, min(_threads[0], scratch.size // cols))
    most = max(1, min(max(GEMM_SLICE_BYTES // (4 * cols), GEMM_MIN_ROWS), scratch.size // (workers * cols), align))
    heights = [h for h in range(most, 0, -1) if align % h == 0]
    each = next((h for h in heights if align // h % workers == 0), heights[0])
    return scratch[: workers * each * cols].reshape(workers, each, cols)


def _gemm(kernel, widen, planes, cols, x, out, col, scratch, align):
    rows = planes[0].shape[0]
    if x.shape[1] != cols or not (out.flags.c_contiguous and out.dtype == F32 and out.shape[0] == x.shape[0]
                                  and col + rows <= out.shape[1]):
        raise ValueError(f"gemm: x must be [T, {cols}] and out a C-contiguous f32 [T, >= {col + rows}] (a "
                         f"column range of it is written), got x {x.shape}, out {out.dtype} {out.shape}")
    x = np.ascontiguousarray(x, dtype=F32)
    slices = _gemm_slices(x.shape[1], scratch, align)
    if _SGEMM:
        kernel(_SGEMM, *planes, x, out, col, slices)
        return
    w = slices[0]  # NumPy has another BLAS: its GEMM, slice by slice, threaded as it threads
    for r0 in range(0, rows, w.shape[0]):
        r1 = min(rows, r0 + w.shape[0])
        widen(*[None if p is None else p[r0:r1] for p in planes], w[:r1 - r0])
        np.matmul(x, w[:r1 - r0].T, out=out[:, col + r0:col + r1])


def gemm_q4(qs, d, m, x, out, col, scratch, align):
    """out[:, col:col + rows] = x [T, cols] times the Q4 matrix's transpose (out [T, >= col +
    rows]), dequantised into scratch (f32, at least a row of it) in slices of rows that divide
    `align`, each multiplied by a GEMM of its own."""
    _gemm(_gemm_q4, _dequantize_q4, (qs, d.view(np.uint16), _bits(m)), 2 * qs.shape[1], x, out, col, scratch, align)


def gemm_q8(q8, d, x, out, col, scratch, align):
    """gemm_q4 for a Q8_0 matrix."""
    _gemm(_gemm_q8, _dequantize_q8, (q8, d.view(np.uint16)), q8.shape[1], x, out, col, scratch, align)


def gemm_exact(w, x, out, col, scratch, align):
    """gemm_q4 for an exact variant's matrix as stored."""
    _gemm(_gemm_exact, _widen_exact, (_exact_bits(w),), w.shape[1], x, out, col, scratch, align)


# -- attention ------------------------------------------------------------------------------

@intrinsic
def _pow2(typingctx, n):
    """2^n for an integral float32 n in -126..127, written straight into the exponent bits (plain
    IR, so a loop around it still vectorises)."""
    def codegen(context, builder, sig, args):
        i = builder.fptosi(args[0], _I32)
        biased = builder.add(i, ir.Constant(_I32, 127))
        return builder.bitcast(builder.shl(biased, ir.Constant(_I32, 23)), _F32)
    return types.float32(types.float32), codegen


@intrinsic
def _stack_f32(typingctx, n):
    """A float32[n] on the calling function's stack (n a literal), for numba.carray: scratch that
    is not a heap allocation, so decode stays allocation-free."""
    if not isinstance(n, types.IntegerLiteral):
        return None

    def codegen(context, builder, sig, args):
        ptr = cgutils.alloca_once(builder, _F32, size=n.literal_value)
        ptr.align = 64  # a cache line: vector loads and stores never straddle two
        return ptr
    return types.CPointer(types.float32)(n), codegen


def _cache_operand(a):
    """A cache array as the kernels take it: f16 as its uint16 bits (numba has no float16)."""
    return a.view(np.uint16) if a.dtype == np.float16 else a


@njit(cache=True, fastmath=_FAST, inline="always")
def _exp_nonpositive(x):
    # exp(x) for x <= 0 (NaN stays NaN): 2^n e^r with r = x - n ln2 in [-ln2/2, ln2/2] and e^r
    # by its Taylor series to r^7, within 1 eps (relative) of float64's exp on [-87, 0] (tested;
    # 0.62 eps at worst, measured). No call to libm, so loops over it vectorise; below -87 it
    # gives exp(-87), 1.6e-38.
    x = x if not x < F32(-87) else F32(-87)
    n = np.floor(x * F32(1.4426950408889634) + F32(0.5))
    r = (x - n * F32(0.693359375)) + n * F32(2.12194440e-4)  # ln2 in two parts: n times the first is exact
    p = ((((((F32(1 / 5040) * r + F32(1 / 720)) * r + F32(1 / 120)) * r + F32(1 / 24)) * r
            + F32(1 / 6)) * r + F32(0.5)) * r + F32(1)) * r + F32(1)
    return p * _pow2(n)


@njit(cache=True, nogil=True, fastmath=_FAST, error_model="numpy")
def silu_mul(gate_up, out):
    # silu(g) = g sigmoid(g), the sigmoid from e = exp(-|g|) <= 1: 1 / (1 + e) for g >= 0 and
    # e / (1 + e) below, so the one exp takes a non-positive argument and the loop vectorises
    # (_exp_nonpositive; libm's exp kept it scalar, and so did numba's zero-divisor check, which
    # error_model="numpy" drops: 1 + e >= 1). 1536 elements: 7.1 -> 1.3 us. Rows of the fused
    # gate/up output are read in place: prefill copied the halves out first. On one thread in
    # prefill too: a parallel version saved 3 of a 256-token prompt's 390 ms on two (SmolLM2,
    # the 2-core Zen 4 EPYC) and cost a first run 1 s more of compiling.
    _glu(gate_up, out, F32(1), F32(0))


_GELU_C1 = F32(2 * np.sqrt(2 / np.pi))  # 0.5 (1 + tanh(u)) is sigmoid(2u)
_GELU_C3 = F32(2 * np.sqrt(2 / np.pi) * 0.044715)


@njit(cache=True, nogil=True, fastmath=_FAST, error_model="numpy")
def gelu_mul(gate_up, out):
    # GeGLU, GeLU's tanh form as g sigmoid(2 sqrt(2 / pi) (g + 0.044715 g^3)): silu_mul's
    # vectorising sigmoid on another argument
    _glu(gate_up, out, _GELU_C1, _GELU_C3)


@njit(cache=True, fastmath=_FAST, inline="always", error_model="numpy")
def _glu(gate_up, out, c1, c3):
    # out = g sigmoid(g (c1 + c3 g^2)) up, the sigmoid from e = exp(-|a|) <= 1: 1 / (1 + e) for
    # a >= 0, e / (1 + e) below; inlined where c1 and c3 are constants, which fold (silu: 1, 0)
    f = out.shape[-1]
    gu, o2 = gate_up.reshape(-1, 2 * f), out.reshape(-1, f)
    for t in range(o2.shape[0]):
        for i in range(f):
            g = gu[t, i]
            a = g * (c1 + c3 * g * g)
            e = _exp_nonpositive(-abs(a))
            o2[t, i] = g * ((F32(1) if a >= 0 else e) / (F32(1) + e)) * gu[t, f + i]


_ATT_CHUNK = ATT_SPLIT_MIN  # positions a chunk of scores covers; a split takes whole chunks
_ATT_SPLIT_BYTES = 256 << 10  # K and V bytes a split of positions covers, at most

# Decode attention's inner loops are IR in vectors of _ATT_LANES floats. A score step takes
# _ATT_BLOCK positions for a pack of up to _ATT_PACK query heads of one kv head: each K element is
# widened once for the pack, the pack x block accumulators (24 in AVX-512's 32 registers, 12 in
# AVX2's 16) stay in registers, and a block's sums are reduced together (_lane_sums; a sum at a
# time took 8 shuffles and adds a position). A value step takes _ATT_VALUE_CHUNKS vectors of a V
# row while a row has them (then one), each weight broadcast once for them all (one vector a step:
# SmolLM2's shape, 900 positions in L2, 24.0 against 21.3 us a layer), and as many positions, up
# to _ATT_UNROLL, as make 8 accumulators, so the multiply-adds into one sum do not wait on each
# other.
_ATT_UNROLL = 4
_ATT_VALUE_CHUNKS = 4


def attention_geometry(avx512: bool) -> dict:
    """The decode attention's register geometry for a target with or without AVX-512 (module
    globals, read when the kernel compiles; tests and scripts/cpu_attention_bench.py set the
    other one to build it on this host). Without AVX-512, packs of 3 against 2 (SmolLM2's
    3-head groups widened K once, not twice) on the 2-core Zen 3, 30 layers' caches, one and two
    threads: 64 positions 9.3 / 9.6 -> 7.5 / 7.8 us a layer, 260 25.3 / 17.1 -> 18.6 / 13.7, 900
    78 / 44 -> 56 / 33, 1800 164 / 88 -> 141 / 66."""
    lanes, block, pack = (16, 8, 3) if avx512 else (8, 4, 3)
    return {"_ATT_LANES": lanes, "_ATT_BLOCK": block, "_ATT_PACK": pack,
            "_ATT_SCORES": pack * _ATT_CHUNK}  # a pack's scores for one chunk: the stack buffer's floats


_geometry = attention_geometry(_AVX512F)
_ATT_LANES, _ATT_BLOCK, _ATT_PACK = _geometry["_ATT_LANES"], _geometry["_ATT_BLOCK"], _geometry["_ATT_PACK"]
_ATT_SCORES = _geometry["_ATT_SCORES"]
# The scores ask the cache for the K rows _ATT_AHEAD_BYTES of rows further on, and for the V rows
# they score (the values read them next). SmolLM2's shape, 30 layers' caches at 1800 positions (41
# MB, more than L3), one thread: K 16 rows (6 KB) ahead 66.9 us a layer, 32 rows 62.5, 48 54.7,
# 64 54.6, 96 56.6, 128 59.7; by bytes, 12, 16, 20 and 24 KB: 60.2, 56.5, 56.1, 58.1. Before a
# split interleaved its kv heads: no prefetch 98, and 88 without the V rows where 65 with them.
_ATT_AHEAD_BYTES = 16 << 10
# Both into L2 (prefetcht2), not L1 as the matvecs' (t0): a pass reads a kv head's 128 bytes of
# each 384-byte row, a stride the hardware prefetchers do not follow, and prefetches into L1 held
# the misses to L1's few fill buffers. 30 layers' caches at 1800 positions on the 2-core Zen 4
# EPYC, one and two threads, us a layer (scripts/cpu_attention_bench.py, alternating, two rounds):
# K and V into L1 200-212 and 96-118, K into L2 130-149 and 67-103, V into L2 154-165 and 81-83,
# both 114-130 and 61-71; at 4000 positions 437 and 247 -> 251 and 174; 300 positions (in cache)
# 16.9 and 10.2 -> 14.3 and 12.3. The matvecs' row streams, by contrast, lose with t2: W4A8 from
# DRAM 131072 x 576 16.1-18.3 -> 12.0 GB/s on one thread.
_ATT_PREFETCH_LOCALITY = 1


def _intp(context, builder, sig, args, i):
    return context.cast(builder, args[i], sig.args[i], types.intp)


def _masked_load(builder, ptr, ty, mask):
    """A vector of ty at ptr where mask holds, zeros elsewhere; the masked-off lanes are not read
    (a row's last chunk never touches the memory past the row)."""
    elt, size = ("i16", 2) if ty.element == _I16 else ("f32", 4)
    name = f"llvm.masked.load.v{ty.count}{elt}.p0v{ty.count}{elt}"
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty.as_pointer(), _I32, mask.type, ty]),
                                        name)
    zero = ir.Constant(ty, [ir.Constant(ty.element, 0)] * ty.count)
    return builder.call(fn, [builder.bitcast(ptr, ty.as_pointer()), ir.Constant(_I32, size), mask, zero])


def _store_floats(builder, v, base, c, mask=None):
    """_floats_at's inverse for float32: v to elements c L .. of base, only where mask holds."""
    ptr = builder.bitcast(builder.gep(base, [builder.mul(c, ir.Constant(_I64, 4 * _ATT_LANES))]), v.type.as_pointer())
    if mask is None:
        builder.store(v, ptr, align=4)
        return
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [v.type, v.type.as_pointer(), _I32, mask.type]),
        f"llvm.masked.store.v{v.type.count}f32.p0v{v.type.count}f32")
    builder.call(fn, [v, ptr, ir.Constant(_I32, 4), mask])


def _floats_at(builder, base, c, elt, mask=None):
    """Elements c L .. c L + L - 1 (L = _ATT_LANES) from base (i8*) as <L x float>: f16 bits
    (elt i16) widened, or float32; only the lanes where mask holds when there is one."""
    size = 2 if elt == _I16 else 4
    if mask is None:
        return _planes_at(builder, base, builder.mul(c, ir.Constant(_I64, _ATT_LANES)), _ATT_LANES,
                          ir.HalfType() if elt == _I16 else _F32, size)
    ptr = builder.gep(base, [builder.mul(c, ir.Constant(_I64, _ATT_LANES * size))])
    v = _masked_load(builder, ptr, _vec(elt, _ATT_LANES), mask)
    return builder.fpext(builder.bitcast(v, _vec(ir.HalfType(), _ATT_LANES)), _vec(_F32, _ATT_LANES)) \
        if elt == _I16 else v


def _lane_sums(builder, vectors):
    """4 or 8 <L x float> (L 8 or 16) -> <n x float>, lane i the sum of vector i's lanes. Two
    rounds interleave pairs of vectors within each 128-bit quarter (unpcklps/unpckhps, then the
    same by float pairs) and add, leaving each quarter of a vector 4 vectors' partial sums; then
    quarters are added across (vshuff32x4's moves), all of them cheaper than full permutes."""
    width, n = vectors[0].type.count, len(vectors)
    assert n in (4, 8) and width in (8, 16) and n <= width, (n, width)
    for pair in (1, 2):
        lo, hi = [], []
        for q in range(0, width, 4):
            for first, half in ((0, lo), (2, hi)):
                a, b = q + first, width + q + first
                half += [a, b, a + 1, b + 1] if pair == 1 else [a, a + 1, b, b + 1]
        vectors = [builder.fadd(builder.shuffle_vector(a, b, _lanes(lo)), builder.shuffle_vector(a, b, _lanes(hi)))
                   for a, b in zip(vectors[::2], vectors[1::2])]
    v = vectors[0]
    if len(vectors) == 2:  # quarters 0-1 of both, then 2-3 of both: each group's sums in two quarters
        a, b = vectors
        v = builder.fadd(builder.shuffle_vector(a, b, _lanes([*range(8), *range(width, width + 8)])),
                         builder.shuffle_vector(a, b, _lanes([*range(8, 16), *range(width + 8, width + 16)])))
    while v.type.count > n:  # adjacent quarters added
        quarters = v.type.count // 4
        first = [q * 4 + i for q in range(0, quarters, 2) for i in range(4)]
        v = builder.fadd(builder.shuffle_vector(v, v, _lanes(first)),
                         builder.shuffle_vector(v, v, _lanes([i + 4 for i in first])))
    return v


class _CacheHead:
    """One kv head's rows of a [ctx, kv_heads, head_dim] cache (f16 bits or float32, C order)."""

    def __init__(self, context, builder, ty, value, kv):
        arr = context.make_array(ty)(context, builder, value)
        self.builder = builder
        self.stride = builder.extract_value(arr.strides, 0)
        data = builder.bitcast(arr.data, _I8.as_pointer())
        self.base = builder.gep(data, [builder.mul(kv, builder.extract_value(arr.strides, 1))])
        self.dim = builder.extract_value(arr.shape, 2)
        self.elt = _I16 if ty.dtype == types.uint16 else _F32

    def row(self, r):
        return self.builder.gep(self.base, [self.builder.mul(r, self.stride)])

    def chunks(self, body, together=1):
        """body(first, count, mask) over a row's chunks of _ATT_LANES elements: `together` whole
        ones a call while they last, then one a call, then the last, partial one with mask set to
        the lanes still inside the row (mask None for whole chunks)."""
        builder = self.builder
        lanes = ir.Constant(_I64, _ATT_LANES)
        full = builder.udiv(self.dim, lanes)
        rest = builder.sub(self.dim, builder.mul(full, lanes))
        groups = builder.udiv(full, ir.Constant(_I64, together))
        with cgutils.for_range(builder, groups) as loop:
            body(builder.mul(loop.index, ir.Constant(_I64, together)), together, None)
        if together > 1:
            grouped = builder.mul(groups, ir.Constant(_I64, together))
            with cgutils.for_range(builder, builder.sub(full, grouped)) as loop:
                body(builder.add(grouped, loop.index), 1, None)
        with builder.if_then(builder.icmp_unsigned("!=", rest, ir.Constant(_I64, 0)), likely=False):
            splat = _broadcast(builder, builder.trunc(rest, _I32), _ATT_LANES)
            body(full, 1, builder.icmp_signed("<", _lanes(range(_ATT_LANES)), splat))


@intrinsic
def _att_scores(typingctx, q, h0, pack, k_cache, v_cache, kv, c0, n, scale, s, peaks):
    """s[j * _ATT_CHUNK + t] = scale q[h0 + j] . K[c0 + t, kv] for the pack's heads j < pack and
    positions t < n (s's lanes from n to the block's end get the last position's score again),
    and peaks[j] the largest of head j's. v_cache is only prefetched: its rows t < n."""
    if not (isinstance(pack, types.IntegerLiteral) and _c_arrays(q, k_cache, v_cache, s, peaks)):
        return None
    heads = pack.literal_value

    def codegen(context, builder, sig, args):
        h0, kv, c0, n = (_intp(context, builder, sig, args, i) for i in (1, 5, 6, 7))
        a = _Operands(context, builder, sig.args, args)
        q_rows = [a.row(0, builder.add(h0, ir.Constant(_I64, j))) for j in range(heads)]
        cache = _CacheHead(context, builder, sig.args[3], args[3], kv)
        values = _CacheHead(context, builder, sig.args[4], args[4], kv)
        s_data = a.data(9)
        scale = _broadcast(builder, args[8], _ATT_BLOCK)
        chunk_bytes = ir.Constant(_I64, _ATT_LANES * (2 if cache.elt == _I16 else 4))
        one = ir.Constant(_I64, 1)
        rows_ahead = builder.udiv(ir.Constant(_I64, _ATT_AHEAD_BYTES), cache.stride)
        rows_ahead = builder.select(builder.icmp_unsigned("<", rows_ahead, one), one, rows_ahead)
        ahead = builder.mul(rows_ahead, cache.stride)
        acc = [[cgutils.alloca_once(builder, _vec(_F32, _ATT_LANES)) for _ in range(_ATT_BLOCK)] for _ in range(heads)]
        highest = [cgutils.alloca_once_value(builder, _splat(_F32, _ATT_BLOCK, float("-inf"))) for _ in range(heads)]
        last = builder.sub(builder.add(c0, n), ir.Constant(_I64, 1))
        blocks = builder.udiv(builder.add(n, ir.Constant(_I64, _ATT_BLOCK - 1)), ir.Constant(_I64, _ATT_BLOCK))
        with cgutils.for_range(builder, blocks) as block:
            t = builder.mul(block.index, ir.Constant(_I64, _ATT_BLOCK))
            rows, v_rows = [], []
            for p in range(_ATT_BLOCK):  # positions past the last read the last one's row again
                r = builder.add(builder.add(c0, t), ir.Constant(_I64, p))
                r = builder.select(builder.icmp_signed("<=", r, last), r, last)
                rows.append(cache.row(r))
                v_rows.append(values.row(r))
            for cell in (cell for row in acc for cell in row):
                builder.store(_splat(_F32, _ATT_LANES, 0.0), cell)

            def step(c, _count, mask):  # one chunk a call
                qv = [_floats_at(builder, row, c, _F32, mask) for row in q_rows]
                at = builder.mul(c, chunk_bytes)
                for p in range(_ATT_BLOCK):
                    _prefetch(builder, rows[p], builder.add(at, ahead), _ATT_PREFETCH_LOCALITY)
                    _prefetch(builder, v_rows[p], at, _ATT_PREFETCH_LOCALITY)
                    k = _floats_at(builder, rows[p], c, cache.elt, mask)
                    for j in range(heads):
                        builder.store(_fmuladd(builder, qv[j], k, builder.load(acc[j][p])), acc[j][p])

            cache.chunks(step)
            for j in range(heads):
                sums = builder.fmul(_lane_sums(builder, [builder.load(cell) for cell in acc[j]]), scale)
                builder.store(_maxnum(builder, builder.load(highest[j]), sums), highest[j])
                at = builder.add(t, ir.Constant(_I64, j * _ATT_CHUNK))
                builder.store(sums, builder.bitcast(builder.gep(s_data, [builder.mul(at, ir.Constant(_I64, 4))]),
                                                    sums.type.as_pointer()), align=4)
        for j in range(heads):
            v = builder.load(highest[j])
            while v.type.count > 1:
                half = v.type.count // 2
                v = _maxnum(builder, builder.shuffle_vector(v, v, _lanes(range(half))),
                            builder.shuffle_vector(v, v, _lanes(range(half, 2 * half))))
            builder.store(builder.extract_element(v, ir.Constant(_I32, 0)),
                          builder.bitcast(builder.gep(a.data(10), [ir.Constant(_I64, 4 * j)]), _F32.as_pointer()))
        return context.get_dummy_value()

    return types.none(q, h0, pack, k_cache, v_cache, kv, c0, n, scale, s, peaks), codegen


@intrinsic
def _att_values(typingctx, s, pack, v_cache, kv, c0, n, acc, h0):
    """acc[h0 + j, i] += sum over t < n of s[j * _ATT_CHUNK + t] V[c0 + t, kv, i], for the pack's
    heads j < pack and i < head_dim; acc's rows may run on past head_dim (they are `part`'s)."""
    if not (isinstance(pack, types.IntegerLiteral) and _c_arrays(s, v_cache, acc)):
        return None
    heads = pack.literal_value

    def codegen(context, builder, sig, args):
        kv, c0, n, h0 = (_intp(context, builder, sig, args, i) for i in (3, 4, 5, 7))
        cache = _CacheHead(context, builder, sig.args[2], args[2], kv)
        a = _Operands(context, builder, sig.args, args)
        s_data = a.data(0)
        vt = _vec(_F32, _ATT_LANES)
        at = [a.row(6, builder.add(h0, ir.Constant(_I64, j))) for j in range(heads)]

        def weight(j, t):
            return _broadcast(builder, _load(builder, s_data, builder.mul(
                builder.add(t, ir.Constant(_I64, j * _ATT_CHUNK)), ir.Constant(_I64, 4)), _F32), _ATT_LANES)

        def chunks(first, count, mask):
            # count chunks of a row from chunk `first` (mask: the last one's lanes), with enough
            # positions a step that at least 8 accumulators take turns
            unroll = min(_ATT_UNROLL, -(-8 // (count * heads)))
            cs = [builder.add(first, ir.Constant(_I64, k)) for k in range(count)]
            sums = [[[cgutils.alloca_once(builder, vt) for _ in range(unroll)] for _ in range(count)]
                    for _ in range(heads)]
            for j in range(heads):
                for k in range(count):
                    builder.store(_floats_at(builder, at[j], cs[k], _F32, mask), sums[j][k][0])
                    for u in range(1, unroll):
                        builder.store(_splat(_F32, _ATT_LANES, 0.0), sums[j][k][u])

            def position(t, u):
                row = cache.row(builder.add(c0, t))
                w = [weight(j, t) for j in range(heads)]
                for k in range(count):
                    v = _floats_at(builder, row, cs[k], cache.elt, mask)
                    for j in range(heads):
                        builder.store(_fmuladd(builder, w[j], v, builder.load(sums[j][k][u])), sums[j][k][u])

            steps = builder.udiv(n, ir.Constant(_I64, unroll))
            done = builder.mul(steps, ir.Constant(_I64, unroll))
            with cgutils.for_range(builder, steps) as step:
                t0 = builder.mul(step.index, ir.Constant(_I64, unroll))
                for u in range(unroll):
                    position(builder.add(t0, ir.Constant(_I64, u)), u)
            with cgutils.for_range(builder, builder.sub(n, done)) as tail:
                position(builder.add(done, tail.index), 0)
            for j in range(heads):
                for k in range(count):
                    total = builder.load(sums[j][k][0])
                    for u in range(1, unroll):
                        total = builder.fadd(total, builder.load(sums[j][k][u]))
                    _store_floats(builder, total, at[j], cs[k], mask)

        cache.chunks(chunks, _ATT_VALUE_CHUNKS)
        return context.get_dummy_value()

    return types.none(s, pack, v_cache, kv, c0, n, acc, h0), codegen


def attention_decode(q, k_cache, v_cache, n_ctx, out, part, softcap=0.0):
    """k_cache, v_cache: the layer's whole cache [ctx, kv_heads, head_dim], of which n_ctx rows
    count; part: attention_decode_partials(ctx, heads, head_dim) floats, the splits' partials;
    softcap > 0 caps the scaled scores (ref.capped)."""
    attention_kernel(q.shape[0], k_cache.shape[1])(q, _cache_operand(k_cache), _cache_operand(v_cache), n_ctx, out,
                                                   part, _threads[0], F32(softcap))


@njit(cache=True)
def decode_splits(n_ctx, row_bytes, threads):
    """How many splits of the positions attention_decode runs: a multiple of the threads (so
    they share the work evenly), each covering at most _ATT_SPLIT_BYTES of K and V rows
    (row_bytes a position); never more than one a 64-position chunk. Since a split reads all
    the kv heads of a chunk together, one split a thread measured the same (SmolLM2's shape,
    1800 positions: 53.8 against 55.6 us a layer on one thread, 32.1 against 31.9 on two)."""
    by_bytes = (n_ctx * row_bytes + _ATT_SPLIT_BYTES - 1) // _ATT_SPLIT_BYTES
    most = (by_bytes + threads - 1) // threads * threads
    return max(1, min(most, (n_ctx + _ATT_CHUNK - 1) // _ATT_CHUNK))


def _attention_decode_for(big: int, small: int):
    """The decode attention kernel for query-head packs of `big` and `small` heads
    (pack_sizes), their score and value steps compiled for those sizes alone: compiling every
    size up to _ATT_PACK took 5.1 s of a machine's first run where SmolLM2's one size takes 3.0-3.2
    (the 2-core Zen 4 EPYC; its first `nerva run` 16.3-16.5 -> 13.7-14.9 s). numba caches each
    pair's kernel apart (the closure's values are part of its cache key)."""

    @njit(cache=True, nogil=True, fastmath=_FAST, parallel=True)
    def _attention_decode(q, k_cache, v_cache, n_ctx, out, part, threads, softcap):
        # A unit of work is a split of the positions. It runs an online softmax over them in chunks
        # of 64, taking every kv head's query heads in turn on a chunk (in packs of at most
        # _ATT_PACK heads, as even as they divide), so a chunk's K and V rows are read whole while
        # they are in cache: _att_scores writes a pack's scores and their max, each head's max m
        # rescales what it accumulated by exp(m_old - m), its weights exp(s - m) are taken in one
        # vectorised loop, and _att_values adds the weighted V rows. A split accumulates in its
        # `part` rows: per head sum_t exp(s_t - m) v_t, then m and sum_t exp(s_t - m), which the merge
        # rescales to the largest m. The cache is f16 (uint16 bits) or f32, one compiled version each.
        #
        # Against the kernel before (a query head at a time, its K and V rows widened for each head,
        # sums reduced a position at a time), on the 2-core AMD EPYC, scripts/cpu_attention_bench.py,
        # the two alternating over two rounds (SmolLM2's shape: 9 heads, 3 kv heads, 64 dims, f16; 30
        # layers' caches): 1800 positions 111-113 -> 53-58 us a layer on one thread and 60-61 -> 30-34
        # on two, 300 positions 15.5-16.7 -> 8.5-8.6 and 12.1-12.4 -> 6.7-7.3; one cache of 900
        # positions (in L2) 38.5-40.0 -> 19.8-20.3. Compiled for AVX2 alone (NUMBA_CPU_NAME=haswell,
        # before the value steps took 4 vectors) 147 -> 99 and 77 -> 51 at 1800, 17.4 -> 15.8 and
        # 12.2 -> 11.8 at 300. Taking a split's kv heads one after another instead, each reading its
        # 128 bytes of every 384-byte row, measured 64-67 us at 1800 on one thread where interleaving
        # them measured 55, the same session.
        heads, dim = q.shape
        kv_heads = k_cache.shape[1]
        group = heads // kv_heads
        packs = (group + _ATT_PACK - 1) // _ATT_PACK
        scale = F32(1) / np.sqrt(F32(dim))
        splits = min(decode_splits(n_ctx, 2 * kv_heads * dim * k_cache.itemsize, threads), part.shape[0])
        per_split = ((n_ctx + splits - 1) // splits + 3) // 4 * 4  # even shares, whole 4-position steps
        for sp in prange(splits):
            lo, hi = sp * per_split, min(n_ctx, (sp + 1) * per_split)
            acc = part[sp]
            s = numba.carray(_stack_f32(_ATT_SCORES), _ATT_SCORES)
            peaks = numba.carray(_stack_f32(_ATT_PACK), _ATT_PACK)
            for h in range(heads):
                for i in range(dim):
                    acc[h, i] = 0
                acc[h, dim], acc[h, dim + 1] = -np.inf, 0
            for c0 in range(lo, hi, _ATT_CHUNK):
                n = min(_ATT_CHUNK, hi - c0)
                for unit in range(kv_heads * packs):
                    kv, pk = unit // packs, unit % packs
                    size = group // packs + (1 if pk < group % packs else 0)
                    h0 = kv * group + pk * (group // packs) + min(pk, group % packs)
                    # the sizes as literals, each compiled with its own registers; big == small is
                    # a constant, so one size compiles one step
                    if big == small or size == big:
                        _att_scores(q, h0, big, k_cache, v_cache, kv, c0, n, scale, s, peaks)
                    else:
                        _att_scores(q, h0, small, k_cache, v_cache, kv, c0, n, scale, s, peaks)
                    if softcap > 0:  # Gemma 2's: tanh keeps the order, so a peak caps to its capped scores' peak
                        for j in range(size):
                            for u in range(n):
                                s[j * _ATT_CHUNK + u] = softcap * np.tanh(s[j * _ATT_CHUNK + u] / softcap)
                            peaks[j] = softcap * np.tanh(peaks[j] / softcap)
                    for j in range(size):
                        h, sj = h0 + j, j * _ATT_CHUNK
                        m = acc[h, dim]
                        chunk_max = max(m, peaks[j])
                        if m > F32(-np.inf):
                            alpha = _exp_nonpositive(m - chunk_max)
                            acc[h, dim + 1] *= alpha
                            for i in range(dim):
                                acc[h, i] *= alpha
                        acc[h, dim] = chunk_max
                        weights = F32(0)
                        for u in range(n):
                            e = _exp_nonpositive(s[sj + u] - chunk_max)
                            s[sj + u] = e
                            weights += e
                        acc[h, dim + 1] += weights
                    if big == small or size == big:
                        _att_values(s, big, v_cache, kv, c0, n, acc, h0)
                    else:
                        _att_values(s, small, v_cache, kv, c0, n, acc, h0)
        for h in range(heads):  # plain loops: an array expression here would be a parfor (a launch) a head
            m = part[0, h, dim]
            for sp in range(1, splits):
                m = max(m, part[sp, h, dim])
            total = F32(0)
            acc = out[h]
            for i in range(dim):
                acc[i] = 0
            for sp in range(splits):
                weight = _exp_nonpositive(part[sp, h, dim] - m)  # a split that saw no position holds zeros
                total += weight * part[sp, h, dim + 1]
                for i in range(dim):
                    acc[i] += weight * part[sp, h, i]
            inv = F32(1) / total
            for i in range(dim):
                acc[i] *= inv

    return _attention_decode


_attention_kernels: dict = {}  # (big, small) -> its kernel, made once


def attention_kernel(heads: int, kv_heads: int):
    """The decode attention kernel for heads query heads over kv_heads kv heads:
    kernel(q, k_cache, v_cache, n_ctx, out, part, threads), caches as _cache_operand gives them."""
    sizes = pack_sizes(heads, kv_heads)
    kernel = _attention_kernels.get(sizes)
    if kernel is None:
        kernel = _attention_kernels[sizes] = _attention_decode_for(*sizes)
    return kernel


def pack_sizes(heads: int, kv_heads: int) -> tuple[int, int]:
    """The sizes a kv head's query heads split into: packs of at most _ATT_PACK, as even as they
    divide (SmolLM2's groups of 3: 3 and 3; groups of 7: 3 and 2)."""
    group = heads // kv_heads
    packs = (group + _ATT_PACK - 1) // _ATT_PACK
    return (group + packs - 1) // packs, group // packs


# -- a decode layer in a few calls ----------------------------------------------------------------
#
# A resident Q4 or exact layer's decode step as the engine's _decode_layer runs it kernel by
# kernel, in four calls made from arguments bound once (decode_layer_halves): norm to the cache
# rows, the attention, the o projection, and the MLP half. The kernels are the ones above, called
# in the same order on the same buffers, so the logits are the same to the bit
# (tests/test_engine.py).
# What goes is the Python between the kernels: about 16 calls a layer, each a method lookup, a
# numba dispatch with its argument checks and a wrapper's f16 views, and NumPy's cache writes and
# residual add. A wrapper around each backend call put that Python at 1.4-1.5 ms of a SmolLM2
# q4_1 token on the 2-core Zen 3 EPYC (11.5 ms on one thread, 7.4 on two), more than the same
# lines cost with the kernels stubbed out (0.57 ms): between kernels that stream 3 MB a layer,
# the interpreter's own code and objects come from DRAM too.
#
# `nerva bench smollm2-135m:q4_1`, alternating with the commit before (Zen 3, 256 + 128 tokens):
# 92.4-97.3 -> 98.7-104.2 tok/s on one thread, 160-165 -> 174-182 on two; after 1800 prompt
# tokens 66.9-68.6 -> 68.1-71.2 and 108-112 -> 116-123. The attention kernel stays a call of its
# own: compiled into a caller, a kernel's IR is linked in and built again, 5 s for the attention's
# on this machine, where the matvecs' add about 3 s to the first decode on a fresh cache (`nerva
# run`'s first answer with a fresh NERVA_HOME: 20.4-20.7 -> 23.6-23.7 s). Two calls, the first
# linking the attention and the o projection in, measured 170-193 tok/s on two threads in a run of
# its own: no clear gain for the 5 s.

@intrinsic
def _f32_to_half_bits(typingctx, value):
    """float32 -> IEEE half bits (uint16) by LLVM's fptrunc, rounding to nearest even as NumPy's
    astype(float16) does (vcvtps2ph with F16C)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), _I16)
    return types.uint16(types.float32), codegen


@njit(cache=True, nogil=True)
def _cache_row(cache, p, rows):
    # the f16 cache holds uint16 bits (numba has no float16); both branches compile for either
    # cache, the one that runs is the cache's
    if cache.itemsize == 2:
        for h in range(rows.shape[0]):
            for i in range(rows.shape[1]):
                cache[p, h, i] = _f32_to_half_bits(rows[h, i])
    else:
        for h in range(rows.shape[0]):
            for i in range(rows.shape[1]):
                cache[p, h, i] = rows[h, i]


@njit(cache=True, nogil=True)
def _layer_matvec(w, qs, d, m, x, xq, x_pairs, xd, xs, w4a8, out):
    """A matvec of the compiled halves, as the engine's _matvec picks it: an exact matrix (w its
    stored bits, _exact_bits; qs, d, m None), or Q4 planes (w None), W4A8 (x quantised into xq,
    xd, xs first) or W4A16. numba drops an `is None` branch only where the argument is None, so
    each case tests the argument that is None in the other: the exact kernel is never typed with
    Q4 codes, nor the Q4 ones with none (an overload picking the case cost 0.2-0.5 s more of a
    Q4 first run's compiling)."""
    if qs is None:
        if w is not None:
            _matvec_exact(w, x, out)
    elif w4a8:
        n = x.shape[0]
        quantize_act_q8(x, xq[:n], xd[:n // 32], xs[:n // 32])
        _w4a8(qs, d, m, xq[:n], x_pairs, xd[:n // 32], xs[:n // 32], out)
    else:
        _w4a16_kernel(qs, d, m, x, out)


@njit(cache=True, nogil=True)
def _attention_inputs(x, norm, eps, xn, xq, x_pairs, xd, xs, w4a8, qkv_w, qkv_qs, qkv_d, qkv_m, qkv_bias, q_norm,
                      k_norm, qkv, heads, kv_heads, pos, cos, sin, k_cache, v_cache, base):
    """Norm, QKV, bias, q/k norms, RoPE, and this position's K and V rows into the cache (row
    pos - base: a sliding-window layer's cache starts at position base)."""
    rmsnorm(x, norm, eps, xn)
    _layer_matvec(qkv_w, qkv_qs, qkv_d, qkv_m, xn, xq, x_pairs, xd, xs, w4a8, qkv)
    if qkv_bias is not None:
        add_rows(qkv, qkv_bias)
    dim = k_cache.shape[2]
    q = qkv[:heads * dim].reshape(heads, dim)
    k = qkv[heads * dim:(heads + kv_heads) * dim].reshape(kv_heads, dim)
    v = qkv[(heads + kv_heads) * dim:].reshape(kv_heads, dim)
    if q_norm is not None:
        rmsnorm(q, q_norm, eps, q)
        rmsnorm(k, k_norm, eps, k)
    rope(q, pos, cos, sin)
    rope(k, pos, cos, sin)
    _cache_row(k_cache, pos[0] - base[0], k)
    _cache_row(v_cache, pos[0] - base[0], v)


@njit(cache=True, nogil=True)
def _mlp(o, x, norm, eps, xn, xq, x_pairs, xd, xs, w4a8, gate_up_w, gate_up_qs, gate_up_d, gate_up_m, gate_up, act,
         down_w, down_qs, down_d, down_m, down, gelu, post_norm):
    """Residual add and norm, gate/up, SiLU (GeLU: gelu) * up, down, its norm (post_norm, where
    not None) and the residual add."""
    add_rmsnorm(o, x, norm, eps, xn)
    _layer_matvec(gate_up_w, gate_up_qs, gate_up_d, gate_up_m, xn, xq, x_pairs, xd, xs, w4a8, gate_up)
    if gelu:
        gelu_mul(gate_up, act)
    else:
        silu_mul(gate_up, act)
    _layer_matvec(down_w, down_qs, down_d, down_m, act, xq, x_pairs, xd, xs, w4a8, down)
    if post_norm is not None:
        rmsnorm(down, post_norm, eps, down)
    for i in range(x.shape[0]):
        x[i] += down[i]


def warm_marker(kinds: str):
    """A file in numba's cache directory that stands for "a decode step with kernels of these
    kinds (Engine.kernel_kinds) has run since this file last changed, so their code is on disk".
    compiled_before looks at one kernel; another variant, precision mix or a paged layer calls
    others, which compiled in the middle of a first answer (a paged SmolLM2's first run here:
    2.7 s to its first token, 5 tok/s after, against 0.15 s and 26 the next time)."""
    import hashlib
    from pathlib import Path

    source = os.stat(__file__)
    stamp = f"{kinds}|{source.st_mtime_ns}|{source.st_size}|{numba.__version__}"
    root = numba.config.CACHE_DIR or os.path.join(os.path.dirname(__file__), "__pycache__")  # numba's default
    return Path(root) / "nerva-warmed" / hashlib.sha1(stamp.encode()).hexdigest()[:20]


def compiled_before(decodes: bool = True) -> bool:
    """Whether the disk cache holds compiled code for this source and the kernels a run needs:
    numba's index for `add_rmsnorm`, which only a decode compiles (of any layer: compiled halves
    or kernel by kernel), standing for all of them, or for `_attention_prefill` when the run only
    prefills (`-n 1`). False on a machine's first run, when compiling them takes a while
    (SmolLM2 on the 2-core Zen 4 EPYC, the run's wall time: 5.5 s for a prefill's, 8 s more for a
    decode's)."""
    kernel = add_rmsnorm if decodes else _attention_prefill
    try:
        return bool(kernel._cache._cache_file._load_index())
    except Exception:  # numba internals: should they change, say nothing rather than fail a run
        return True


def decode_layer_halves(layer, a, cfg, cos, sin, window=0, base=None):
    """For a resident Q4 layer (fused qkv and gate/up, W4A8 or W4A16) or exact one over the arena
    `a`: (attention(n_ctx), mlp()), the two halves of its decode step, n_ctx counting this
    token's position, attention over the last `window` positions where that is not 0, the cache's
    first row holding position base[0] (None: 0); None for any other layer. The arguments are made
    here, once."""
    m = layer.mats  # a resident layer's: qkv, o, gate_up, down
    if layer.precision == "exact" and all(m[n].w is not None for n in m):
        planes = lambda lin: (_exact_bits(lin.w), None, None, None)  # noqa: E731
    elif layer.precision in ("w4a8", "w4a16") and all(m[n].qs is not None for n in m):
        planes = lambda lin: (None, lin.qs, _bits(lin.d), _bits(lin.m))  # noqa: E731
    else:
        return None
    w4a8 = layer.precision == "w4a8"
    k_cache, v_cache = _cache_operand(a.k_cache[layer.index]), _cache_operand(a.v_cache[layer.index])
    x_pairs = _pair_scratch(a.xq.shape[0])
    inputs = (a.x, layer.attn_norm, cfg.rms_eps, a.xn, a.xq, x_pairs, a.xd, a.xs, w4a8, *planes(m["qkv"]),
              layer.qkv_bias, layer.q_norm, layer.k_norm, a.qkv, cfg.num_heads, cfg.num_kv_heads, a.pos,
              cos, sin, k_cache, v_cache, _NO_BASE if base is None else base)
    attend = attention_kernel(cfg.num_heads, cfg.num_kv_heads)
    o = (*planes(m["o"]), a.attn_flat, a.xq, x_pairs, a.xd, a.xs, w4a8, a.o)
    mlp = (a.o, a.x, layer.mlp_norm, cfg.rms_eps, a.xn, a.xq, x_pairs, a.xd, a.xs, w4a8, *planes(m["gate_up"]),
           a.gate_up, a.act, *planes(m["down"]), a.down, cfg.activation == "gelu_tanh", layer.post_mlp_norm)
    post_norm, softcap = layer.post_attn_norm, F32(cfg.attn_softcap or 0)

    def attention(n_ctx):
        _attention_inputs(*inputs)
        rows = n_ctx if base is None else n_ctx - base[0]
        if 0 < window < rows:  # a view per call only where a window has moved on
            attend(a.q, k_cache[rows - window:], v_cache[rows - window:], window, a.attn, a.att_part, _threads[0],
                   softcap)
        else:
            attend(a.q, k_cache, v_cache, rows, a.attn, a.att_part, _threads[0], softcap)
        _layer_matvec(*o)
        if post_norm is not None:
            rmsnorm(a.o, post_norm, cfg.rms_eps, a.o)

    return attention, lambda: _mlp(*mlp)


_NO_BASE = np.zeros(1, dtype=np.int64)  # a full-context cache's: row r holds position r

ATT_PREFILL_ROWS = 64  # queries of one kv head's group a job of attention_prefill takes, at most


def attention_prefill(q, k, v, start, out, work, window=0, softcap=0.0):
    # Jobs of up to ATT_PREFILL_ROWS queries of one kv head's group, on numba's threads, each in
    # its own part of `work`: the group's queries copied together, one GEMM for their scores
    # against the positions the job's last query sees (causal: the first jobs read the fewest),
    # each row's visible scores turned into weights exp(s - max) and the rest zeroed, a second
    # GEMM for the weighted values, divided by the weights' totals on the way into `out`
    # (head_dim multiplies a row where normalising the weights took n). An f16 cache is widened
    # for BLAS into `work` first (a copy a layer a chunk: prefill only).
    T, heads, dim = q.shape
    n, kv_heads = start + T, k.shape[1]
    group = heads // kv_heads
    need = attention_prefill_work(T, n, heads, kv_heads, dim)
    if work.size < need:
        raise ValueError(f"attention_prefill: work holds {work.size} floats, {need} needed")
    if not _SGEMM:  # NumPy has another BLAS
        from nerva_cli.planes import ref

        ref.attention_prefill(q, k[:n], v[:n], start, out, window=window, softcap=softcap)
        return
    k, v = k[:n], v[:n]  # a longer cache holds no positions this chunk sees
    if k.dtype != F32:
        wide = work[group * T * (n + 2 * dim + 1):]
        k_f32, v_f32 = wide[: n * kv_heads * dim].reshape(k.shape), wide[n * kv_heads * dim: 2 * n * kv_heads * dim]
        # vcvtph2ps in a vectorised loop: 1792 positions of SmolLM2's K and V (0.7M values) in
        # 0.05 ms through widen_exact, where NumPy's astype took 1.1
        widen_exact(k.reshape(n, -1), k_f32.reshape(n, -1))
        widen_exact(v.reshape(n, -1), v_f32.reshape(n, -1))
        k, v = k_f32, v_f32.reshape(v.shape)
    rows = max(1, min(ATT_PREFILL_ROWS, T // _threads[0]))  # a job for every thread, even for a short chunk
    workers = min(_threads[0], kv_heads * -(-T // rows), T // rows)  # their parts within the work's bound
    _attention_prefill(_SGEMM, np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v), start,
                       out, work, rows, workers, F32(1.0 / np.sqrt(dim)), window, F32(softcap))


@njit(cache=True, nogil=True, parallel=True, fastmath=_FAST)
def _attention_prefill(sgemm, q, k, v, start, out, work, rows, workers, scale, window, softcap):
    # Job j is query block j // kv_heads of kv head j % kv_heads; a worker takes every workers-th
    # job, so the costly last blocks spread over the threads. A worker's part of work holds the
    # group's queries [group * rows, dim], their scores [group * rows, seen], weighted values
    # [group * rows, dim] and weight totals (workers * rows <= T: attention_prefill_work's bound).
    T, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    blocks = (T + rows - 1) // rows
    part = group * rows * (start + T + 2 * dim + 1)
    for w in prange(workers):
        for job in range(w, blocks * kv_heads, workers):
            g, t0 = job % kv_heads, job // kv_heads * rows
            nb = min(T, t0 + rows) - t0
            seen, R = start + t0 + nb, group * nb
            qg = w * part
            s = qg + R * dim
            pv = s + R * seen
            inv = pv + R * dim
            for j in range(group):
                for i in range(nb):
                    for c in range(dim):
                        work[qg + (j * nb + i) * dim + c] = q[t0 + i, g * group + j, c]
            _sgemm(sgemm, True, R, seen, dim, work, qg, dim, k, g * dim, kv_heads * dim, work, s, seen)
            for r in range(R):
                row, at = s + r * seen, start + t0 + r % nb
                first = max(0, at + 1 - window) if window > 0 else 0  # a sliding window's first position
                for c in range(first):
                    work[row + c] = 0
                if softcap > 0:  # Gemma 2's capped scores, already scaled for _causal_weights
                    for c in range(first, at + 1):
                        work[row + c] = softcap * np.tanh(work[row + c] * scale / softcap)
                    work[inv + r] = F32(1) / _causal_weights(work[row + first:row + seen], at + 1 - first, F32(1))
                else:
                    work[inv + r] = F32(1) / _causal_weights(work[row + first:row + seen], at + 1 - first, scale)
            _sgemm(sgemm, False, R, dim, seen, work, s, seen, v, g * dim, kv_heads * dim, work, pv, dim)
            for j in range(group):
                for i in range(nb):
                    wt = work[inv + j * nb + i]
                    for c in range(dim):
                        out[t0 + i, g * group + j, c] = work[pv + (j * nb + i) * dim + c] * wt


@njit(cache=True, nogil=True, fastmath=_FAST)
def _causal_weights(row, seen, scale):
    # The first `seen` scores of a query's row become exp(scale (s - max)), the rest (the future)
    # 0; -> their sum. The max is taken in 8 running maxima (one was a chain of dependent
    # vmaxss; SmolLM2's last chunk of an 1800-token prompt, [3, 256, 1792], 0.90 -> 0.48 ms with
    # the scaling moved into the exp). A sliding window's row starts at its first position (the
    # caller zeroes those before): a start argument here cost SmolLM2's 250-token chunk 2.5x.
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = F32(-np.inf)
    j = 0
    while j + 8 <= seen:
        m0, m1, m2, m3 = max(m0, row[j]), max(m1, row[j + 1]), max(m2, row[j + 2]), max(m3, row[j + 3])
        m4, m5, m6, m7 = max(m4, row[j + 4]), max(m5, row[j + 5]), max(m6, row[j + 6]), max(m7, row[j + 7])
        j += 8
    for i in range(j, seen):
        m0 = max(m0, row[i])
    m = max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))
    total = F32(0)
    for j in range(seen):
        row[j] = _exp_nonpositive(scale * (row[j] - m))
        total += row[j]
    for j in range(seen, row.shape[0]):
        row[j] = 0
    return total


# -- host sampling --------------------------------------------------------------------------
# Not kernels of the contract: sampling.Sampler calls these on whatever host holds the logits.
# They write only into the buffers they are given, so a sampled decode step allocates nothing.

@njit(cache=True, nogil=True)
def penalise(logits, recent, n_recent, penalty, seen, out):
    """out = logits with llama.cpp's repetition penalty applied once per distinct token of
    recent[:n_recent]: positive logits divided by it, negative multiplied, in float32 as the
    cuda sampler does. `seen` (one flag a token) is all False before and after."""
    p = F32(penalty)
    for i in range(logits.shape[0]):
        out[i] = logits[i]
    for i in range(n_recent):
        t = recent[i]
        if not seen[t]:
            seen[t] = True
            v = out[t]
            out[t] = v / p if v > 0 else v * p
    for i in range(n_recent):
        seen[recent[i]] = False


@njit(cache=True, nogil=True, inline="always")
def _sift_min(heap, n, i):
    while True:
        low, left = i, 2 * i + 1
        if left < n and heap[left] < heap[low]:
            low = left
        if left + 1 < n and heap[left + 1] < heap[low]:
            low = left + 1
        if low == i:
            return
        heap[i], heap[low] = heap[low], heap[i]
        i = low


@njit(cache=True, nogil=True, inline="always")
def _sift_best(logits, cand, n, i):
    """Max-heap order on cand: the larger logit first, on a tie the lower token."""
    while True:
        best, left = i, 2 * i + 1
        for c in (left, left + 1):
            if c < n:
                a, b = cand[c], cand[best]
                if logits[a] > logits[b] or (logits[a] == logits[b] and a < b):
                    best = c
        if best == i:
            return
        cand[i], cand[best] = cand[best], cand[i]
        i = best


@njit(cache=True, nogil=True)
def sample_logits(logits, temperature, top_k, top_p, min_p, u, cand, scratch):
    """Draws one token by the rule of ref.sampling_candidates with the uniform u in [0, 1).
    cand (int32) and scratch (float64) hold at least a vocabulary each.

    The k-th largest logit comes from a k-entry min-heap in one pass; the top-p cut pops a
    max-heap of the candidates only until the kept weight is reached, so neither sorts the
    vocabulary (top_k 0 with top_p < 1 builds that heap over all of it)."""
    vocab = logits.shape[0]
    kth = -np.inf
    if 0 < top_k < vocab:
        for i in range(top_k):
            scratch[i] = logits[i]
        for i in range(top_k // 2 - 1, -1, -1):
            _sift_min(scratch, top_k, i)
        for i in range(top_k, vocab):
            if logits[i] > scratch[0]:
                scratch[0] = logits[i]
                _sift_min(scratch, top_k, 0)
        kth = scratch[0]
    n = 0
    best = -np.inf
    for i in range(vocab):
        if logits[i] >= kth:
            cand[n] = i
            n += 1
            best = max(best, np.float64(logits[i]))
    total = 0.0
    for j in range(n):
        scratch[j] = np.exp((np.float64(logits[cand[j]]) - best) / temperature)
        total += scratch[j]
    if top_p >= 1.0:  # no top-p cut: draw in token order among those reaching min_p, nothing to sort
        kept = 0.0
        for j in range(n):
            if scratch[j] >= min_p:
                kept += scratch[j]
        target, run, last = u * kept, 0.0, cand[0]
        for j in range(n):
            if scratch[j] >= min_p:
                run += scratch[j]
                last = cand[j]
                if run > target:
                    return last
        return last
    for i in range(n // 2 - 1, -1, -1):
        _sift_best(logits, cand, n, i)
    want, kept, end, cut = top_p * total, 0.0, n, np.nan
    while end > 0:  # pop the best to cand[end - 1] until the kept weight reaches top_p
        top = cand[0]
        if not np.isnan(cut) and logits[top] != cut:
            break
        weight = np.exp((np.float64(logits[top]) - best) / temperature)
        if weight < min_p:  # the rest are below min_p too
            break
        end -= 1
        cand[0], cand[end] = cand[end], top
        _sift_best(logits, cand, end, 0)
        kept += weight
        if np.isnan(cut) and kept >= want:
            cut = logits[top]  # ties of the last kept logit stay as well
    target, run = u * kept, 0.0
    for j in range(n - 1, end - 1, -1):
        run += np.exp((np.float64(logits[cand[j]]) - best) / temperature)
        if run > target:
            return cand[j]
    return cand[end]
