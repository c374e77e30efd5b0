"""Decode attention: its score and value steps in IR (vectors of _ATT_LANES floats, packs of
query heads of one kv head), the kernel over splits of the positions with an online softmax,
and its geometry for the target."""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from nerva_cli.planes.cpu.kernels.glu import _exp_nonpositive
from nerva_cli.planes.cpu.kernels.ir_helpers import (
    _F32, _I8, _I16, _I32, _I64, _Operands, _broadcast, _c_arrays, _fmuladd, _intp, _lanes, _load, _maxnum,
    _planes_at, _prefetch, _splat, _stack_f32, _vec)
from nerva_cli.planes.cpu.kernels.numba_setup import F32, _FAST, _threads
from nerva_cli.planes.cpu.kernels.target import _AVX512F
from nerva_cli.planes.ref import ATT_SPLIT_MIN


def _cache_operand(a):
    """A cache array as the kernels take it: f16 as its uint16 bits (numba has no float16)."""
    return a.view(np.uint16) if a.dtype == np.float16 else a


_ATT_CHUNK = ATT_SPLIT_MIN  # positions a chunk of scores covers; a split takes whole chunks
_ATT_SPLIT_BYTES = 256 << 10  # K and V bytes a split of positions covers, at most

# Decode attention's inner loops are IR in vectors of _ATT_LANES floats. A score step takes
# _ATT_BLOCK positions for a pack of up to _ATT_PACK query heads of one kv head: each K element is
# widened once for the pack, the pack x block accumulators (24 in AVX-512's 32 registers, 12 in
# AVX2's 16) stay in registers, and a block's sums are reduced together (_lane_sums; a sum at a
# time took 8 shuffles and adds a position). A value step takes _ATT_VALUE_CHUNKS vectors of a V
# row while a row has them (then one), each weight broadcast once for them all (faster than one
# vector a step: docs/perf/code_figures.md), and as many positions, up
# to _ATT_UNROLL, as make 8 accumulators, so the multiply-adds into one sum do not wait on each
# other.
_ATT_UNROLL = 4
_ATT_VALUE_CHUNKS = 4


def attention_geometry(avx512: bool) -> dict:
    """The decode attention's register geometry for a target with or without AVX-512 (module
    globals, read when the kernel compiles; tests and scripts/cpu_attention_bench.py set the
    other one to build it on this host). Without AVX-512, packs of 3 against 2 (SmolLM2's
    3-head groups widened K once, not twice) were faster at every context length tried
    (docs/perf/code_figures.md)."""
    lanes, block, pack = (16, 8, 3) if avx512 else (8, 4, 3)
    return {"_ATT_LANES": lanes, "_ATT_BLOCK": block, "_ATT_PACK": pack,
            "_ATT_SCORES": pack * _ATT_CHUNK}  # a pack's scores for one chunk: the stack buffer's floats


_geometry = attention_geometry(_AVX512F)
_ATT_LANES, _ATT_BLOCK, _ATT_PACK = _geometry["_ATT_LANES"], _geometry["_ATT_BLOCK"], _geometry["_ATT_PACK"]
_ATT_SCORES = _geometry["_ATT_SCORES"]
# The scores ask the cache for the K rows _ATT_AHEAD_BYTES of rows further on, and for the V rows
# they score (the values read them next). The distance is about the best of those tried with
# caches larger than L3, and the V rows' prefetch paid too (docs/perf/code_figures.md).
_ATT_AHEAD_BYTES = 16 << 10
# Both into L2 (prefetcht2), not L1 as the matvecs' (t0): a pass reads a kv head's 128 bytes of
# each 384-byte row, a stride the hardware prefetchers do not follow, and prefetches into L1 held
# the misses to L1's few fill buffers. The matvecs' row streams, by contrast, lose with t2
# (docs/perf/code_figures.md).
_ATT_PREFETCH_LOCALITY = 1


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
    """One sequence: k_cache, v_cache the layer's whole cache [ctx, kv_heads, head_dim], of which
    n_ctx rows count; part: attention_decode_partials(ctx, heads, head_dim) floats, the splits'
    partials; softcap > 0 caps the scaled scores (ref.capped). attention_decode_rows for one row
    (its views and index arrays made here: the engine's hot path calls that directly)."""
    one = np.zeros(1, dtype=np.int64)
    attention_decode_rows(q[None], k_cache[None], v_cache[None], one, one, np.full(1, n_ctx, np.int64), out[None],
                          part[None], softcap)


def attention_decode_rows(q, k_all, v_all, slots, firsts, n_ctx, out, part, softcap=0.0):
    """B sequences' decode attention in one call: row b's query q[b] [heads, head_dim] over
    n_ctx[b] rows of sequence slot slots[b]'s cache from row firsts[b] (k_all, v_all [slots, ctx,
    kv_heads, head_dim]) into out[b]; part [>= B, ...] a row's attention_decode_partials each.
    Each row's result is what it gets alone, bit for bit: its splits are the same (they depend
    on its own length and the threads) and each is computed and merged by the same code."""
    attention_kernel(q.shape[1], k_all.shape[2])(q, _cache_operand(k_all), _cache_operand(v_all), slots, firsts,
                                                 n_ctx, out, part, _threads[0], F32(softcap))


@njit(cache=True)
def decode_splits(n_ctx, row_bytes, threads):
    """How many splits of the positions attention_decode runs: a multiple of the threads (so
    they share the work evenly), each covering at most _ATT_SPLIT_BYTES of K and V rows
    (row_bytes a position); never more than one a 64-position chunk. Since a split reads all
    the kv heads of a chunk together, one split a thread measured the same
    (docs/perf/code_figures.md)."""
    by_bytes = (n_ctx * row_bytes + _ATT_SPLIT_BYTES - 1) // _ATT_SPLIT_BYTES
    most = (by_bytes + threads - 1) // threads * threads
    return max(1, min(most, (n_ctx + _ATT_CHUNK - 1) // _ATT_CHUNK))


def _attention_decode_for(big: int, small: int):
    """The decode attention kernel for query-head packs of `big` and `small` heads
    (pack_sizes), their score and value steps compiled for those sizes alone: compiling every
    size up to _ATT_PACK added seconds to a machine's first run (docs/perf/code_figures.md).
    numba caches each
    pair's kernel apart (the closure's values are part of its cache key)."""

    @njit(cache=True, nogil=True, fastmath=_FAST, parallel=True)
    def _attention_decode(q, k_all, v_all, slots, firsts, n_ctx, out, part, threads, softcap):
        # A unit of work is a split of a row's positions (rows in turn, each cut into as many splits
        # as it would be alone: decode_splits of its own length). It runs an online softmax over them in chunks
        # of 64, taking every kv head's query heads in turn on a chunk (in packs of at most
        # _ATT_PACK heads, as even as they divide), so a chunk's K and V rows are read whole while
        # they are in cache: _att_scores writes a pack's scores and their max, each head's max m
        # rescales what it accumulated by exp(m_old - m), its weights exp(s - m) are taken in one
        # vectorised loop, and _att_values adds the weighted V rows. A split accumulates in its
        # `part` rows: per head sum_t exp(s_t - m) v_t, then m and sum_t exp(s_t - m), which the merge
        # rescales to the largest m. The cache is f16 (uint16 bits) or f32, one compiled version each.
        #
        # Against the kernel before (a query head at a time, its K and V rows widened for each head,
        # sums reduced a position at a time) this about halved a layer's attention, and interleaving
        # a split's kv heads beat taking them one after another (docs/perf/code_figures.md). A
        # batched step's rows in one call, not a call a row: one parallel region instead of B.
        rows, heads, dim = q.shape
        kv_heads = k_all.shape[2]
        group = heads // kv_heads
        packs = (group + _ATT_PACK - 1) // _ATT_PACK
        scale = F32(1) / np.sqrt(F32(dim))
        row_bytes = 2 * kv_heads * dim * k_all.itemsize
        most = 1
        for b in range(rows):
            most = max(most, min(decode_splits(n_ctx[b], row_bytes, threads), part.shape[1]))
        for unit in prange(rows * most):
            b, sp = unit // most, unit % most
            splits = min(decode_splits(n_ctx[b], row_bytes, threads), part.shape[1])
            if sp >= splits:
                continue
            per_split = ((n_ctx[b] + splits - 1) // splits + 3) // 4 * 4  # even shares, whole 4-position steps
            lo, hi = sp * per_split, min(n_ctx[b], (sp + 1) * per_split)
            qb, k_cache, v_cache, first = q[b], k_all[slots[b]], v_all[slots[b]], firsts[b]
            acc = part[b, sp]
            s = numba.carray(_stack_f32(_ATT_SCORES), _ATT_SCORES)
            peaks = numba.carray(_stack_f32(_ATT_PACK), _ATT_PACK)
            for h in range(heads):
                for i in range(dim):
                    acc[h, i] = 0
                acc[h, dim], acc[h, dim + 1] = -np.inf, 0
            for c0 in range(lo, hi, _ATT_CHUNK):
                n = min(_ATT_CHUNK, hi - c0)
                for unit_kv in range(kv_heads * packs):
                    kv, pk = unit_kv // packs, unit_kv % packs
                    size = group // packs + (1 if pk < group % packs else 0)
                    h0 = kv * group + pk * (group // packs) + min(pk, group % packs)
                    # the sizes as literals, each compiled with its own registers; big == small is
                    # a constant, so one size compiles one step
                    if big == small or size == big:
                        _att_scores(qb, h0, big, k_cache, v_cache, kv, first + c0, n, scale, s, peaks)
                    else:
                        _att_scores(qb, h0, small, k_cache, v_cache, kv, first + c0, n, scale, s, peaks)
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
                        _att_values(s, big, v_cache, kv, first + c0, n, acc, h0)
                    else:
                        _att_values(s, small, v_cache, kv, first + c0, n, acc, h0)
        for b in range(rows):  # plain loops: an array expression here would be a parfor (a launch) a head
            splits = min(decode_splits(n_ctx[b], row_bytes, threads), part.shape[1])
            parts = part[b]
            for h in range(heads):
                m = parts[0, h, dim]
                for sp in range(1, splits):
                    m = max(m, parts[sp, h, dim])
                total = F32(0)
                acc = out[b, h]
                for i in range(dim):
                    acc[i] = 0
                for sp in range(splits):
                    weight = _exp_nonpositive(parts[sp, h, dim] - m)  # a split that saw no position holds zeros
                    total += weight * parts[sp, h, dim + 1]
                    for i in range(dim):
                        acc[i] += weight * parts[sp, h, i]
                inv = F32(1) / total
                for i in range(dim):
                    acc[i] *= inv

    return _attention_decode


_attention_kernels: dict = {}  # (big, small) -> its kernel, made once


def attention_kernel(heads: int, kv_heads: int):
    """The decode attention kernel for heads query heads over kv_heads kv heads: kernel(q, k_all,
    v_all, slots, firsts, n_ctx, out, part, threads, softcap), attention_decode_rows's arguments,
    caches as _cache_operand gives them."""
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
