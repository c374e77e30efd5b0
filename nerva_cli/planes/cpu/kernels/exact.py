"""The exact variants' matrices (f16, or bf16 bits) as stored, widened to f32 in registers:
matvec, short prompts' matmul, widening and token lookup."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from nerva_cli.planes.cpu.kernels.ir_helpers import _F32, _I32
from nerva_cli.planes.cpu.kernels.numba_setup import F32, _FAST


# -- exact variants' matrices, as stored ----------------------------------------------------
# f16 (IEEE half) or bf16 (the store keeps its bits as uint16), widened to f32 in registers as
# they are read: half the bytes a decode step streams of a matrix held in f32, and half the RAM.
# Decode ran markedly faster, in less memory, than with the f32 matrices before
# (docs/perf/code_figures.md).

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
    # slowed SmolLM2 f16's decode several times over (docs/perf/code_figures.md). A kernel of its
    # own, not _matmul_exact's one-activation case: that way took longer on every matrix.
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
