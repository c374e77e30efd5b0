"""Prefill's GEMMs (weights dequantised or widened in slices, multiplied by NumPy's OpenBLAS on
numba's threads), and how long a prompt chunk takes the batch kernels instead."""

from __future__ import annotations

import os
import sys

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from nerva_cli.planes.cpu.kernels.exact import _exact_bits, _widen_exact
from nerva_cli.planes.cpu.kernels.ir_helpers import _F32, _I32, _I64
from nerva_cli.planes.cpu.kernels.numba_setup import F32, _threads
from nerva_cli.planes.cpu.kernels.q4 import _bits
from nerva_cli.planes.cpu.kernels.q4_float import _dequantize_q4
from nerva_cli.planes.cpu.kernels.q8 import _dequantize_q8
from nerva_cli.planes.cpu.kernels.q4_w4a8 import _lane_rows
from nerva_cli.planes.cpu.kernels.target import _AVX512F
from nerva_cli.planes.ref import SHORT_PREFILL_MOST


# Prefill's GEMMs: OpenBLAS's sgemm called from numba's threads, each thread dequantising (or
# widening) a slice of weight rows into its own scratch and multiplying it while it is in cache.
# OpenBLAS's own thread pool stays at one thread, so numba's pool is the only one on the cores:
# OpenBLAS's workers spin-waited after each GEMM on the cores numba's threads wanted, which kept
# prefill's other kernels serial (a parallel one between GEMMs ran many times slower:
# docs/perf/code_figures.md).

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
# re-reading x; 64 rows were faster on every wide matrix tried, 128 no faster again
# (docs/perf/code_figures.md). Matrices up to 3072 columns keep their 768 KB slices.
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


def short_prefill_rows(precision: str) -> int:
    """The longest prompt chunk at `precision` that prefill sends through the batch kernels
    (matmul_q4_w4a8, matmul_q4_w4a16, matmul_exact) rather than dequantise + BLAS GEMM, at the
    threads set: the GEMM pays a fixed cost of dequantising whatever the chunk, then less a token
    than the batch kernels, and two threads hardly speed a short GEMM where they halve a batch
    kernel's time. The crossing points per thread, measured on SmolLM2 (docs/perf/code_figures.md):
    W4A8 32 tokens (16 compiled for AVX2), W4A16 16 (8 on Q16 codes, without AVX-512F), exact 12,
    up to SHORT_PREFILL_MOST; W4A16's bf16 dots (AVX512-BF16) are no faster in a batch than its
    tables, so the same threshold.
    W4A8 on AVX2 or AVX-512BW has no bound: matmul_q4_w4a8's rows-in-lanes kernel is faster
    than the GEMM at every length (see q4_w4a8._LANE_ACTS), so every W4A8 chunk takes it."""
    if precision == "w4a8" and _lane_rows():
        return sys.maxsize
    per_thread = {"w4a8": 16, "w4a16": 16 if _AVX512F else 8, "exact": 12}.get(precision, 0)
    return min(per_thread * _threads[0], SHORT_PREFILL_MOST)


def batch_matches_matvec(matrix: str, precision: str) -> bool:
    """Whether the batch kernel for a `matrix` ("q4", "q8" or "exact") at `precision` gives each
    activation's output row bit for bit as its matvec does, so that a batched decode step may
    take it (else it runs a matvec a row, reading the weights once a row): the integer ones
    (W4A8, W4A16 on Q16 codes without AVX-512F, Q8_0's W8A8 and W8A16) by construction
    (_integer_row), W4A16's row tables and bf16 dots (AVX-512F) as they share the matvec's
    code; the exact one never (its four activations' sums vectorise apart from the matvec's)."""
    return matrix != "exact"
