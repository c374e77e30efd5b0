"""Q4 codes as floats: W4A16's row intrinsic with AVX-512F (a row a call that looks its weights up
in a table) and its kernels, and the Q4 dequantisation, in vectors of _LANES floats. Without
AVX-512F, W4A16 runs on integer codes (q4_w4a8._w4a16_q16)."""

from __future__ import annotations

from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from nerva_cli.planes.cpu.kernels.ir_helpers import (
    PREFETCH_BYTES, _F32, _I8, _I32, _I64, _Operands, _broadcast, _c_arrays, _f32_at, _fmuladd, _half_at, _hsum,
    _lanes, _load, _planes_at, _prefetch, _splat, _vec)
from nerva_cli.planes.cpu.kernels.target import _AVX512F


# The float kernels (W4A16 with AVX-512F, the Q4 dequantisation; W8A16 and W4A16 elsewhere too,
# until they took int16 activations) work in <_LANES x float>: one AVX-512 register where the
# target has them, one AVX2 register where it has not: 16 lanes beat the <8 x float> IR before
# where AVX-512 is (docs/perf/code_figures.md).
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
    row stream, as the integer kernels do. As fast as the four-row float kernel before it from
    L3, faster from DRAM (docs/perf/code_figures.md)."""
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
def _w4a16_by_row(qs, d, m, x, out):
    for r in prange(d.shape[0]):
        out[r] = _w4a16_row(qs, d, m, x, r)


@intrinsic
def _dequantize_q4_row(typingctx, qs, d, m, out, r):
    """Row r of Q4 planes into out's row r in f32, as ref computes it: d (q - 8), or d q + m (a
    multiply, then an add: no FMA, so the same bits). In IR, a block's 32 values a vector of
    _LANES at a time: numba's loop stayed scalar (its stores might alias the codes it reads),
    32 vmulss a block; the IR is several times faster (docs/perf/code_figures.md)."""
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


@njit(cache=True, nogil=True)
def _dequantize_q4(qs, d, m, out):
    # Serial: prefill's GEMMs call it from each of their threads for a slice of rows (_gemm_q4).
    for r in range(d.shape[0]):
        _dequantize_q4_row(qs, d, m, out, r)
