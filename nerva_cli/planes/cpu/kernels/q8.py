"""Q8_0 matrices (the Q4 variants' token table as lm_head): W8A8 and W8A16 matvecs and their batch
forms, the dequantisation and token lookup."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from nerva_cli.planes.cpu.kernels.integer_dots import _dot_s8_s8, _dot_s8_s16, _integer_row
from nerva_cli.planes.cpu.kernels.ir_helpers import (
    _F32, _I8, _I64, _Operands, _c_arrays, _fmuladd, _half_to_f32, _load, _planes_at, _vec)
from nerva_cli.planes.cpu.kernels.numba_setup import F32


# -- Q8_0 matvecs (the Q4 variants' token table as lm_head) -----------------------------------
#
# Both integer kernels, a row a call, as W4A8: W8A8 against the Q8 activation, W8A16 against a Q16
# one (int16 codes per 32-group, quantize_act_q16), whose rounding (2^-16 of a group's largest
# value) moved SmolLM2's perplexity over 999 decoded tokens from 19.10500 to 19.10502. W8A16 was a
# four-row float kernel before, bound by converting every code to float.


def _q8_row_codegen(dot, code_bytes, acts=1):
    """A Q8_0 row's dot with an integer activation x = xd xq (codes of code_bytes each): per
    block, dot(weight codes, activation codes) as 8 int32 partials, reduced exactly, times
    d_w d_x. One activation (1-D xq, xd), or `acts` rows t0.. of 2-D ones, each with the one
    activation's arithmetic (_integer_row), the row's codes loaded once for them all."""
    def codegen(context, builder, sig, args):
        a = _Operands(context, builder, sig.args[:4], args[:4])
        q_row, d_row = a.row(0, args[4]), a.row(1, args[4])
        if sig.args[2].ndim == 1:
            xq, xd = [a.data(2)], [a.data(3)]
        else:
            t0 = context.cast(builder, args[5], sig.args[5], types.intp)
            at = [builder.add(t0, ir.Constant(_I64, t)) for t in range(acts)]
            xq, xd = [a.row(2, t) for t in at], [a.row(3, t) for t in at]
        x_type = _vec(ir.IntType(8 * code_bytes), 32)

        def block_dot(b, t):
            at = builder.mul(b, ir.Constant(_I64, 32))
            x = _load(builder, xq[t], builder.mul(at, ir.Constant(_I64, code_bytes)), x_type)
            return dot(builder, _load(builder, q_row, at, _vec(_I8, 32)), x)

        def block_terms(b, n, dots, acc, t):
            dw = _planes_at(builder, d_row, b, n, ir.HalfType(), 2)
            scale = builder.fmul(dw, _planes_at(builder, xd[t], b, n, _F32, 4))
            return _fmuladd(builder, scale, builder.sitofp(dots, _vec(_F32, n)), acc)

        dots = _integer_row(builder, a.cols(1), q_row, 32, block_dot, block_terms, acts=acts)
        if sig.args[2].ndim == 1:
            return dots[0]
        return context.make_tuple(builder, sig.return_type, dots)

    return codegen


@intrinsic
def _w8a16_row(typingctx, q8, d, xq, xd, r):
    """Row r . x for Q8_0 rows and the Q16 activation x = xd xq: per block, the integer dot
    (exact in int32: 32 products of at most 128 * 32767) times d_w d_x, as ref. The four-row
    float kernel it replaced was bound by its conversions (a vpmovsxbd and a vcvtdq2ps every 8
    weights); this integer dot is faster, as fast as W8A8 (docs/perf/code_figures.md)."""
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


@intrinsic
def _w8a16_row_batch(typingctx, q8, d, xq, xd, r, t0, acts):
    """(row r . x_t0, ..., row r . x_{t0 + acts - 1}) for the Q16 activations x_t, the rows of
    2-D xq and xd: each equal to _w8a16_row's, the row's codes loaded once for `acts` (a literal)."""
    if not (isinstance(acts, types.IntegerLiteral) and _c_arrays(q8, d, xq, xd)):
        return None
    n = acts.literal_value
    return types.UniTuple(types.float32, n)(q8, d, xq, xd, r, t0, acts), _q8_row_codegen(_dot_s8_s16, 2, n)


@intrinsic
def _w8a8_row_batch(typingctx, q8, d, xq, xd, r, t0, acts):
    """_w8a16_row_batch for Q8 activations (_w8a8_row's dots)."""
    if not (isinstance(acts, types.IntegerLiteral) and _c_arrays(q8, d, xq, xd)):
        return None
    n = acts.literal_value
    return types.UniTuple(types.float32, n)(q8, d, xq, xd, r, t0, acts), _q8_row_codegen(_dot_s8_s8, 1, n)


@njit(cache=True, nogil=True, parallel=True)
def _w8a16(q8, d, xq, xd, out):
    for r in prange(d.shape[0]):
        out[r] = _w8a16_row(q8, d, xq, xd, r)


@njit(cache=True, nogil=True, parallel=True)
def _w8a8(q8, d, xq, xd, out):
    for r in prange(d.shape[0]):
        out[r] = _w8a8_row(q8, d, xq, xd, r)


# A batched decode step's lm_head over a Q8_0 table: each thread's rows against every activation,
# eight at a time (then four, then one), as _w4a8_batch, so a row's codes are read from memory once
# for the batch; every output equals the matvec's bit for bit.
@njit(cache=True, nogil=True, parallel=True)
def _w8a16_batch(q8, d, xq, xd, out):
    acts = xq.shape[0]
    eights, fours = acts - acts % 8, acts - acts % 4
    for r in prange(d.shape[0]):
        for t in range(0, eights, 8):
            v = _w8a16_row_batch(q8, d, xq, xd, r, t, 8)
            for j in range(8):
                out[t + j, r] = v[j]
        for t in range(eights, fours, 4):
            w = _w8a16_row_batch(q8, d, xq, xd, r, t, 4)
            for j in range(4):
                out[t + j, r] = w[j]
        for t in range(fours, acts):
            out[t, r] = _w8a16_row_batch(q8, d, xq, xd, r, t, 1)[0]


@njit(cache=True, nogil=True, parallel=True)
def _w8a8_batch(q8, d, xq, xd, out):
    acts = xq.shape[0]
    eights, fours = acts - acts % 8, acts - acts % 4
    for r in prange(d.shape[0]):
        for t in range(0, eights, 8):
            v = _w8a8_row_batch(q8, d, xq, xd, r, t, 8)
            for j in range(8):
                out[t + j, r] = v[j]
        for t in range(eights, fours, 4):
            w = _w8a8_row_batch(q8, d, xq, xd, r, t, 4)
            for j in range(4):
                out[t + j, r] = w[j]
        for t in range(fours, acts):
            out[t, r] = _w8a8_row_batch(q8, d, xq, xd, r, t, 1)[0]


def matvec_q8_w8a16(q8, d, xq, xd, out):
    _w8a16(q8, d.view(np.uint16), xq, xd, out)


def matvec_q8_w8a8(q8, d, xq, xd, out):
    _w8a8(q8, d.view(np.uint16), xq, xd, out)


def matmul_q8_w8a16(q8, d, xq, xd, out):
    """out[t] = matvec_q8_w8a16 of activation t, the rows of xq [T, cols] (int16) and xd
    [T, cols / 32], bit for bit; out [T, rows] may be a column slice of a wider array."""
    _w8a16_batch(q8, d.view(np.uint16), xq, xd, out)


def matmul_q8_w8a8(q8, d, xq, xd, out):
    """matmul_q8_w8a16 for Q8 activations (int8 xq)."""
    _w8a8_batch(q8, d.view(np.uint16), xq, xd, out)


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
