"""The integer-dot matvecs' IR, shared by W4A8 (q4_w4a8) and Q8_0's W8A8 and W8A16 (q8): the
dots of a block's codes with integer activation codes in each lowering (VNNI, AVX-512BW, AVX2,
plain IR), their reduction to a lane a block, and a row's walk over its blocks (_integer_row)."""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

from nerva_cli.planes.cpu.kernels.ir_helpers import (
    PREFETCH_BYTES, _F32, _I8, _I16, _I32, _I64, _hsum, _lanes, _load, _prefetch, _splat, _vec)
from nerva_cli.planes.cpu.kernels.target import _AVX2, _AVX512BW, _AVX512VNNI


# -- integer-dot matvecs (W4A8, W8A8): a row at a time ----------------------------------------
#
# A thread walks its rows one by one, so it reads its share of each plane front to back. Per group
# of eight blocks a row makes eight <8 x i32> integer dots and reduces them together into one
# <8 x i32>, lane j block j's dot; the block scales then come as vectors straight from the planes
# (<8 x half> of d and m, <8 x float> of the activation's scales), and each row keeps an
# <8 x float> accumulator. The rows' last blocks, fewer than eight, go two and then one at a time.
# This beat the four-row groups before (scales gathered a half at a time), and the prefetch
# (PREFETCH_BYTES) added to it (docs/perf/code_figures.md).
#
# Where the target has AVX-512BW, W4A8 makes its dots two blocks at a time in 512-bit registers
# (_dot_u4_s8_pair), with VNNI's vpdpbusd where there is one, faster than the 256-bit dots, and
# still without vpdpbusd (docs/perf/code_figures.md).
#
# The pair dot then interleaved the two blocks' nibbles with a vpermt2q, a cross-lane shuffle, per
# row and pair; now the activation comes in that order instead, made once a call (_pair_order),
# and the codes take a broadcast load, a shift and a mask: faster in the matvecs, less than run
# to run noise in decode (docs/perf/code_figures.md).
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


def _codes(builder, row, b):
    """Block b's 32 codes (0..15) as <32 x i8>: the 16 low nibbles, then the 16 high ones. The
    16 bytes load into both halves (vbroadcasti128, a load), the upper half's int32 lanes shift
    by 4 (vpsrlvd) and one mask takes both halves' nibbles: two vector operations, where taking
    the nibbles apart and joining them took four (vpand, vpsrlw, vpand, vinserti128), faster on
    AVX2 (docs/perf/code_figures.md). Hosts with AVX-512BW take this path only for a row's last
    odd block
    (_dot_u4_s8_pair makes the rest)."""
    v = _load(builder, row, builder.mul(b, ir.Constant(_I64, 16)), _vec(_I8, 16))
    both = builder.bitcast(builder.shuffle_vector(v, v, _lanes(list(range(16)) * 2)), _vec(_I32, 8))
    shifted = builder.lshr(both, ir.Constant(_vec(_I32, 8), [ir.Constant(_I32, 4 * (k // 4)) for k in range(8)]))
    return builder.and_(builder.bitcast(shifted, _vec(_I8, 32)), _splat(_I8, 32, 15))


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
