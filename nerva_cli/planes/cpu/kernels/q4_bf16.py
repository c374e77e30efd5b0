"""W4A16 in bf16 dot products (AVX512-BF16): the activation split into bf16 pairs once a call,
the row intrinsics, and their kernels."""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from nerva_cli.planes.cpu.kernels.ir_helpers import (
    _F32, _I8, _I16, _I32, _I64, _broadcast, _c_arrays, _f32_at, _fmuladd, _half_at, _lanes, _load, _splat,
    _stack_f32, _stack_u16, _vec)
from nerva_cli.planes.cpu.kernels.numba_setup import F32
from nerva_cli.planes.cpu.kernels.q4_float import _dot_operands, _row_results, _scale_groups, _SCALE_SPAN


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
# the float tables its matvecs are faster, from the caches and from DRAM, and so is decode; a
# short prompt's batch tiles gain nothing (their table was shared by four activations already)
# (docs/perf/code_figures.md).
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
