"""Q4 rows against integer activations: W4A8 (Q8 codes) in integer dots (integer_dots), a row at a
time for decode and short prompts, and with AVX2 or AVX-512BW rows in lanes for a prompt's GEMM;
and W4A16 on Q16 codes, the same row walk, on hosts without AVX-512F."""

from __future__ import annotations

from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from nerva_cli.planes.cpu.kernels.integer_dots import _codes, _dot_s8_s16, _dot_u4_s8, _dot_u4_s8_pair, _integer_row
from nerva_cli.planes.cpu.kernels.ir_helpers import (
    _F32, _I8, _I16, _I32, _I64, _Operands, _broadcast, _c_arrays, _fmuladd, _intp, _load, _planes_at, _splat, _vec)
from nerva_cli.planes.cpu.kernels.q4_float import _dot_operands
from nerva_cli.planes.cpu.kernels.quantize_act import _quantize_q16, quantize_act_q8
from nerva_cli.planes.cpu.kernels.target import _AVX2, _AVX512BW, _AVX512VNNI


def _w4a8_codegen(acts):
    """Rows . activations for Q4 rows and Q8 activations x = xd xq (block code sums xs; x_pairs,
    the codes in _pair_order, for the 512-bit pair dots): one activation (1-D operands) or `acts`
    rows t0.. of 2-D ones. Per block, as ref: the integer dot of the codes with xq (exact in
    int32), minus 8 xs for Q4_0, times d_w d_x, plus m_w d_x xs for Q4_1. With int16 xq (Q16
    codes: W4A16's kernel, _w4a16_q16) the same, the dots vpmaddwd's (_dot_s8_s16), no pair
    dots (x_pairs unread)."""
    def codegen(context, builder, sig, args):
        a, q_row, d_row, m_row, (xq, x_pairs, xd, xs) = _dot_operands(context, builder, sig, args, 7, acts)
        q4_1 = m_row is not None
        q16 = sig.args[3].dtype == types.int16

        def block_dot(b, t):
            if q16:
                x = _load(builder, xq[t], builder.mul(b, ir.Constant(_I64, 64)), _vec(_I16, 32))
                return _dot_s8_s16(builder, _codes(builder, q_row, b), x)
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

        pair_dot = None if q16 else (lambda b, t: _dot_u4_s8_pair(builder, q_row, x_pairs[t], b))
        dots = _integer_row(builder, a.cols(1), q_row, 16, block_dot, block_terms, pair_dot, acts)
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


# A mixture's decode step: the chosen experts' rows of a layer's stacked gate/up (or down) matrices
# in one parallel region, each row _w4a8_row's as a matvec of that expert alone gives it; a region
# an expert cost a thread wake-up each, which at OLMoE's size was as much as the rows' work.
@njit(cache=True, nogil=True, parallel=True)
def _experts_rows(qs, d, m, experts, xq, x_pairs, xd, xs, out):
    """out[j, r] = row experts[j] * R + r of the stacked rows (R = out.shape[1]) times activation
    a's codes, a = 0 where xq has one row (gate/up's input, every expert's), else j."""
    k, rows = out.shape
    shared = xq.shape[0] == 1
    for i in prange(k * rows):
        j = i // rows
        r = i - j * rows
        a = 0 if shared else j
        out[j, r] = _w4a8_row(qs, d, m, xq[a], x_pairs[a], xd[a], xs[a], experts[j] * rows + r)


@njit(cache=True, nogil=True)
def _w4a8_experts(qs, d, m, experts, x, xq, x_pairs, xd, xs, out):
    """_experts_rows on the Q8 codes of x's rows, quantised into xq, xd, xs first."""
    for a in range(x.shape[0]):
        quantize_act_q8(x[a], xq[a], xd[a], xs[a])
        if _AVX512BW:
            _pair_order(xq[a], x_pairs[a])
    _experts_rows(qs, d, m, experts, xq, x_pairs, xd, xs, out)


@njit(cache=True, nogil=True)
def _w4a16_q16_experts(qs, d, m, experts, x, xq16, xd, xs, out):
    """_experts_rows on the Q16 codes of x's rows (W4A16 without AVX-512F), as _w4a16_q16's."""
    for a in range(x.shape[0]):
        _quantize_q16(x[a], xq16[a], xd[a], xs[a])
    _experts_rows(qs, d, m, experts, xq16, xq16, xd, xs, out)


# W4A16 on hosts without AVX-512F: the activation as Q16 codes (int16 per 32-group, quantize_act_q16's
# rounding, at most half of 2^-15 of a group's largest value) in W4A8's row walk, the dots
# vpmaddwd's against the codes widened to 16 bits. The four-row float kernel before it converted
# every code to float and was bound by that (docs/perf/code_figures.md); the integer row also gives
# W4A16 a batch form equal to its matvec bit for bit (_w4a16_q16_batch).
@njit(cache=True, nogil=True, parallel=True)
def _w4a16_q16(qs, d, m, x, xq16, xd, xs, quantize, out):
    """out = the Q4 rows times x at W4A16, on x's Q16 codes in the fronts of xq16, xd, xs: made
    there first where `quantize`, else already x's (q, k and v of one input)."""
    n = x.shape[0]
    codes, scales, sums = xq16[:n], xd[:n // 32], xs[:n // 32]
    if quantize:
        _quantize_q16(x, codes, scales, sums)
    for r in prange(d.shape[0]):
        out[r] = _w4a8_row(qs, d, m, codes, codes, scales, sums, r)


@njit(cache=True, nogil=True)
def _w4a16_q16_batch(qs, d, m, x, xq16, xd, xs, out):
    """out[t] = _w4a16_q16 of row t of x [T, cols], bit for bit: each row's Q16 codes into xq16
    [T, cols], xd and xs [T, cols / 32], then W4A8's batch walk over them (no AVX-512BW where
    this runs, so no pair order is written)."""
    for t in range(x.shape[0]):
        _quantize_q16(x[t], xq16[t], xd[t], xs[t])
    _w4a8_batch(qs, d, m, xq16, xq16, xd, xs, out)


# A short prompt's W4A8 GEMM (and a batched decode step's): each thread's rows against every
# activation, eight of them a row at once (then four, two, one), so a row's codes are read from
# memory and unpacked once a tile.
@njit(cache=True, nogil=True, parallel=True)
def _w4a8_batch(qs, d, m, xq, x_pairs, xd, xs, out):
    acts = xq.shape[0]
    if _AVX512BW:
        for t in range(acts):
            _pair_order(xq[t], x_pairs[t])
    eights = acts - acts % 8
    fours = acts - acts % 4
    twos = acts - acts % 2
    for r in prange(d.shape[0]):
        for t in range(0, eights, 8):
            v = _w4a8_row_batch(qs, d, m, xq, x_pairs, xd, xs, r, t, 8)
            for j in range(8):
                out[t + j, r] = v[j]
        for t in range(eights, fours, 4):
            w = _w4a8_row_batch(qs, d, m, xq, x_pairs, xd, xs, r, t, 4)
            for j in range(4):
                out[t + j, r] = w[j]
        for t in range(fours, twos, 2):
            u = _w4a8_row_batch(qs, d, m, xq, x_pairs, xd, xs, r, t, 2)
            out[t, r], out[t + 1, r] = u[0], u[1]
        for t in range(twos, acts):
            out[t, r] = _w4a8_row_batch(qs, d, m, xq, x_pairs, xd, xs, r, t, 1)[0]


# W4A8 prompt GEMM with a row in each int32 lane (AVX-512BW: 16 rows in a 512-bit register;
# AVX2: 8 in a 256-bit one): a thread copies a tile of rows' codes into lane-wide quads (quad j of
# block b: bytes 4j..4j+3 of each row's block, row after row, so one load holds the tile's four
# code bytes of each row, low nibbles the weights 4j.. and high ones 16 + 4j..), then for
# _LANE_ACTS activations at a time multiplies those rows by four broadcast activation codes: one
# vpdpbusd with VNNI; else vpmaddubsw, whose 16-bit pair sums a block's eight products add up in
# 16 bits (16 products of at most 15 * 128: 30720, no overflow) before one vpmaddwd widens them.
# No horizontal sums, and the rows' codes are unpacked once for eight activations. Each row's
# arithmetic is the decode kernel's (_integer_row) step for step: the same integer dots, the same
# scale products and fused multiply-adds, into the same eight, two and one partial sums (blocks
# j, j + 8, ...; then the pairs; then the last), added in _hsum's order, so every output equals
# matvec_q4_w4a8's bit for bit, for any prompt length. It is about three times as fast as
# dequantise + OpenBLAS sgemm (gemm_q4) at 256 activations on AVX-512. Below _LANES_FROM
# activations the row kernel (_w4a8_batch) is faster: a tile's packing and its eight activations
# cost the same for fewer, and the row kernel takes one activation at a time; the 8-row AVX2 tile
# catches up with it later (docs/perf/code_figures.md).
_LANE_ACTS = 8
_LANES_FROM = 12 if _AVX512BW else 16


def _lane_rows():
    """Rows a lane tile holds at the target: an int32 lane each of a 512-bit register with
    AVX-512BW, of a 256-bit one with AVX2; 0 without AVX2 (no lane kernel: the row kernel)."""
    return 16 if _AVX512BW else (8 if _AVX2 else 0)


@njit(cache=True, nogil=True)
def _pack_lane_rows(qs32, d, m, r0, codes, scales, offsets):
    """Rows r0 .. r0 + lanes - 1 of Q4 planes (qs as uint32 words; rows past the end repeat the
    last) into codes [blocks, 4, lanes] (word j of block b, row after row) and scales, offsets
    [blocks, lanes] (f16 bits; offsets only for Q4_1, m not None)."""
    rows, blocks = d.shape
    for i in range(codes.shape[2]):
        r = min(r0 + i, rows - 1)
        for b in range(blocks):
            for j in range(4):
                codes[b, j, i] = qs32[r, 4 * b + j]
            scales[b, i] = d[r, b]
            if m is not None:
                offsets[b, i] = m[r, b]


@intrinsic
def _w4a8_lane_tile(typingctx, codes, scales, offsets, xq, xd, xs, out, r0, t0):
    """out[t, r0 + i] for the _lane_rows() rows packed by _pack_lane_rows (those below out's row
    count) and the activations t0 .. t0 + _LANE_ACTS - 1 (those below xq's count; the rest read
    the last one's and are not stored): see _LANE_ACTS."""
    lanes, acts_n = _lane_rows(), _LANE_ACTS
    if not (lanes and _c_arrays(codes, scales, offsets, xq, xd, xs) and isinstance(out, types.Array)):
        return None
    q4_1 = not isinstance(offsets, types.NoneType)
    width = 4 * lanes  # bytes of a register: a quad of each row
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
        v_i8, v_i16 = _vec(_I8, width), _vec(_I16, 2 * lanes)
        if _AVX512VNNI:
            dpbusd = cgutils.get_or_insert_function(module, ir.FunctionType(v_i32, [v_i32] * 3),
                                                    "llvm.x86.avx512.vpdpbusd.512")
        else:
            names = ("llvm.x86.avx512.pmaddubs.w.512", "llvm.x86.avx512.pmaddw.d.512") if _AVX512BW else \
                ("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd")
            pmaddubsw = cgutils.get_or_insert_function(module, ir.FunctionType(v_i16, [v_i8] * 2), names[0])
            pmaddwd = cgutils.get_or_insert_function(module, ir.FunctionType(v_i32, [v_i16] * 2), names[1])

        def block(b, sums):
            """Block b's terms added to the activations' partial sums (allocas of <lanes x float>)."""
            x_at = builder.mul(b, ir.Constant(_I64, 32))
            four = ir.Constant(_I64, 4)
            xs_b = [_load(builder, xs_rows[t], builder.mul(b, four), _I32) for t in range(acts_n)]
            if q4_1:
                acc = [_splat(_I32, lanes, 0)] * acts_n
            else:  # Q4_0's -8 sum q_x, which the decode kernel subtracts from the dot: the same integer
                acc = [_broadcast(builder, builder.mul(s, ir.Constant(_I32, -8)), lanes) for s in xs_b]
            pairs = [None] * acts_n  # without VNNI: the block's 16-bit pair sums
            for j in range(4):
                w = _load(builder, codes_p, builder.add(builder.mul(b, ir.Constant(_I64, 4 * width)),
                                                        ir.Constant(_I64, width * j)), v_i8)
                low = builder.and_(w, _splat(_I8, width, 15))
                high = builder.lshr(builder.bitcast(w, v_i16), _splat(_I16, 2 * lanes, 4))
                high = builder.bitcast(builder.and_(high, _splat(_I16, 2 * lanes, 0x0F0F)), v_i8)
                for t in range(acts_n):
                    x_lo, x_hi = (builder.bitcast(_broadcast(builder, _load(
                        builder, x_rows[t], builder.add(x_at, ir.Constant(_I64, half + 4 * j)), _I32), lanes), v_i8)
                        for half in (0, 16))
                    if _AVX512VNNI:
                        acc[t] = builder.call(dpbusd, [builder.call(dpbusd, [acc[t], builder.bitcast(low, v_i32),
                                                                             builder.bitcast(x_lo, v_i32)]),
                                                       builder.bitcast(high, v_i32), builder.bitcast(x_hi, v_i32)])
                        continue
                    both = builder.add(builder.call(pmaddubsw, [low, x_lo]), builder.call(pmaddubsw, [high, x_hi]))
                    pairs[t] = both if pairs[t] is None else builder.add(pairs[t], both)
            if not _AVX512VNNI:
                acc = [builder.add(acc[t], builder.call(pmaddwd, [pairs[t], _splat(_I16, 2 * lanes, 1)]))
                       for t in range(acts_n)]
            # a block's scales (and offsets) are lanes f16s
            at = builder.mul(b, ir.Constant(_I64, 2 * lanes))
            d = builder.fpext(_load(builder, scales_p, at, _vec(ir.HalfType(), lanes)), v_f32)
            m = builder.fpext(_load(builder, offsets_p, at, _vec(ir.HalfType(), lanes)), v_f32) if q4_1 else None
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
        # SmolLM2's first prompt waiting on numba a few times longer (docs/perf/code_figures.md).
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
    rows, acts, workers, lanes = d.shape[0], xq.shape[0], codes.shape[0], codes.shape[3]
    groups = (rows + lanes - 1) // lanes
    for w in prange(workers):
        for g in range(w, groups, workers):
            r0 = g * lanes
            if m is None:
                _pack_lane_rows(qs32, d, None, r0, codes[w], scales[w], None)
                for t0 in range(0, acts, _LANE_ACTS):
                    _w4a8_lane_tile(codes[w], scales[w], None, xq, xd, xs, out, r0, t0)
            else:
                _pack_lane_rows(qs32, d, m, r0, codes[w], scales[w], offsets[w])
                for t0 in range(0, acts, _LANE_ACTS):
                    _w4a8_lane_tile(codes[w], scales[w], offsets[w], xq, xd, xs, out, r0, t0)
