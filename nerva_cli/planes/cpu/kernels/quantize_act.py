"""The activations' quantisation: Q8 and Q16 codes per 32-group (with their sums where a Q4 kernel
needs them) for the integer matvecs, and prefill's fake-quantised rows for its W4A8 GEMM."""

from __future__ import annotations

import numpy as np
from numba import njit

from nerva_cli.planes.cpu.kernels.numba_setup import F32


# The activation quantiser's arithmetic, shared by decode (codes) and prefill (codes times scale).
# No fast-math but no-NaN/no-inf: every step stays a correctly rounded IEEE op, so the codes equal
# ref's, and the flags let LLVM vectorise the max and the branch-free rounding
# (docs/perf/code_figures.md).
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
    _quantize_q16(x, xq, xd, None)


@njit(cache=True, nogil=True, fastmath=_Q8_MATH)
def _quantize_q16(x, xq, xd, xs):
    """quantize_act_q16, and where xs is not None each group's code sum into it (W4A16's integer
    kernel corrects Q4_0's -8 and adds Q4_1's offsets through it, as W4A8 does with Q8's)."""
    for b in range(xd.shape[0]):
        g = x[32 * b: 32 * b + 32]
        d, inv = _group_scale(g, _Q16_TOP)
        total = 0
        for j in range(32):
            q = np.int32(_group_code(g[j], inv, _Q16_TOP))
            xq[32 * b + j] = q
            total += q
        xd[b] = d
        if xs is not None:
            xs[b] = total


@njit(cache=True, nogil=True, fastmath=_Q8_MATH)
def fake_quantize_q8(x, out):
    # Prefill's W4A8: rows quantised per 32-group as quantize_act_q8 does, then scaled back, so
    # a GEMM over them gives decode's integer products. On one thread: a parallel version saved
    # little and cost the first long prompt more compiling (docs/perf/code_figures.md).
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            g = x[r, 32 * b: 32 * b + 32]
            d, inv = _group_scale(g, _Q8_TOP)
            for j in range(32):
                out[r, 32 * b + j] = _group_code(g[j], inv, _Q8_TOP) * d
