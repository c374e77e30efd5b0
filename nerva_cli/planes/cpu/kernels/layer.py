"""A resident layer's decode step in a few calls (decode_layer_halves): the attention half's
inputs and the MLP half compiled as kernels of their own."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from nerva_cli.planes.cpu.kernels.decode_attention import _cache_operand, attention_kernel
from nerva_cli.planes.cpu.kernels.exact import _exact_bits, _matvec_exact
from nerva_cli.planes.cpu.kernels.glu import gelu_mul, silu_mul
from nerva_cli.planes.cpu.kernels.ir_helpers import _I16
from nerva_cli.planes.cpu.kernels.norms import add_rmsnorm, add_rows, rmsnorm, rope
from nerva_cli.planes.cpu.kernels.numba_setup import F32, _threads
from nerva_cli.planes.cpu.kernels.q4 import _bits, _pair_scratch, _w4a16_kernel
from nerva_cli.planes.cpu.kernels.q4_w4a8 import _LANES_FROM, _lane_rows, _w4a8, _w4a8_batch
from nerva_cli.planes.cpu.kernels.quantize_act import quantize_act_q8


# -- a decode layer in a few calls ----------------------------------------------------------------
#
# A Q4 or exact layer's decode step as the engine's kernel-by-kernel layer runs it, in four calls
# made from arguments bound once (decode_layer_halves): norm to the cache rows, the attention,
# the o projection, and the MLP half. The kernels are the backend's own, called in the same order
# on the same buffers, so the logits are the same to the bit (tests/test_engine.py). What goes is
# the Python between the kernels, about 16 calls a layer, which cost more than the kernels' own
# time would suggest. The attention kernel stays a call of its own: compiled into a caller, a
# kernel's IR is linked in and built again, seconds more of a first run for no clear gain.
# Figures: docs/perf/code_figures.md.

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
def _layer_matvec(w, qs, d, m, x, xq, x_pairs, xd, xs, xq16, w4a8, quantize, out):
    """A matvec of the compiled halves, as the engine's _matvec picks it: an exact matrix (w its
    stored bits, _exact_bits; qs, d, m None), whatever the layer's precision (a Q4 variant keeps
    a matrix f16 where its rows are not whole blocks), or Q4 planes (w None), W4A8 (x quantised
    into xq, xd, xs first where `quantize`: the second and third of a slot's q, k, v reuse the
    codes) or W4A16 (where its kernel takes Q16 codes, into xq16, xd, xs likewise). numba drops
    an `is None` branch only where the argument is None, so each case tests the argument that is
    None in the other: the exact kernel is never typed with Q4 codes, nor the Q4 ones with none
    (an overload picking the case cost 0.2-0.5 s more of a Q4 first run's compiling)."""
    if qs is None:
        if w is not None:
            _matvec_exact(w, x, out)
    elif w4a8:
        n = x.shape[0]
        if quantize:
            quantize_act_q8(x, xq[:n], xd[:n // 32], xs[:n // 32])
        _w4a8(qs, d, m, xq[:n], x_pairs, xd[:n // 32], xs[:n // 32], out)
    else:
        _w4a16_kernel(qs, d, m, x, xq16, xd, xs, quantize, out)


@njit(cache=True, nogil=True)
def _attention_inputs(x, norm, eps, xn, xq, x_pairs, xd, xs, xq16, w4a8, q_w, q_qs, q_d, q_m, k_w, k_qs, k_d, k_m,
                      v_w, v_qs, v_d, v_m, qkv_bias, q_norm, k_norm, qkv, heads, kv_heads, pos, cos, sin, k_cache,
                      v_cache, base):
    """Norm, QKV, bias, q/k norms, RoPE, and this position's K and V rows into the cache (row
    pos - base: a sliding-window layer's cache starts at position base). q_* is a resident
    layer's fused q/k/v matrix, the k_* and v_* None; a staging slot's q, k and v are apart (its
    file's layout), each into its part of qkv."""
    rmsnorm(x, norm, eps, xn)
    dim = k_cache.shape[2]
    qd, kvd = heads * dim, kv_heads * dim
    if k_qs is None and k_w is None:
        _layer_matvec(q_w, q_qs, q_d, q_m, xn, xq, x_pairs, xd, xs, xq16, w4a8, True, qkv)
    else:
        _layer_matvec(q_w, q_qs, q_d, q_m, xn, xq, x_pairs, xd, xs, xq16, w4a8, True, qkv[:qd])
        _layer_matvec(k_w, k_qs, k_d, k_m, xn, xq, x_pairs, xd, xs, xq16, w4a8, False, qkv[qd:qd + kvd])
        _layer_matvec(v_w, v_qs, v_d, v_m, xn, xq, x_pairs, xd, xs, xq16, w4a8, False, qkv[qd + kvd:])
    if qkv_bias is not None:
        add_rows(qkv, qkv_bias)
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
def _mlp(o, x, norm, eps, xn, xq, x_pairs, xd, xs, xq16, w4a8, gate_w, gate_qs, gate_d, gate_m, up_w, up_qs, up_d, up_m,
         gate_up, act, down_w, down_qs, down_d, down_m, down, gelu, post_norm):
    """Residual add and norm, gate/up (a resident layer's fused matrix as gate_*, up_* None; a
    staging slot's two apart), SiLU (GeLU: gelu) * up, down, its norm (post_norm, where not
    None) and the residual add."""
    add_rmsnorm(o, x, norm, eps, xn)
    if up_qs is None and up_w is None:
        _layer_matvec(gate_w, gate_qs, gate_d, gate_m, xn, xq, x_pairs, xd, xs, xq16, w4a8, True, gate_up)
    else:
        f = act.shape[0]
        _layer_matvec(gate_w, gate_qs, gate_d, gate_m, xn, xq, x_pairs, xd, xs, xq16, w4a8, True, gate_up[:f])
        _layer_matvec(up_w, up_qs, up_d, up_m, xn, xq, x_pairs, xd, xs, xq16, w4a8, False, gate_up[f:])
    if gelu:
        gelu_mul(gate_up, act)
    else:
        silu_mul(gate_up, act)
    _layer_matvec(down_w, down_qs, down_d, down_m, act, xq, x_pairs, xd, xs, xq16, w4a8, True, down)
    if post_norm is not None:
        rmsnorm(down, post_norm, eps, down)
    for i in range(x.shape[0]):
        x[i] += down[i]


def decode_layer_halves(layer, spec, a, cfg, base=None):
    """For a layer of Q4 or exact matrices, or both (a Q4 variant's matrices kept f16 for their
    width, each run by its own kernel), over the arena `a`, resident (fused qkv and
    gate/up) or a staging slot's (q, k, v and gate, up apart, as layer.index says now):
    (attention(n_ctx), mlp()), the two halves of its decode step, n_ctx counting this token's
    position, with the layer's RoPE tables, window, score cap and GLU (its LayerSpec), the cache's
    first row holding position base[0] (None: 0); mlp None for a mixture of experts' layer (its
    MLP is the engine's, experts.MixtureMLP); None for any other layer. The arguments are made
    here, once: a slot's halves for each layer it may hold."""
    m = layer.mats  # resident: qkv, o, gate_up, down; a slot's: q, k, v, o, gate, up, down
    if layer.precision not in ("exact", "w4a8", "w4a16") or any(lin.w is None and lin.qs is None for lin in m.values()):
        return None

    def planes(lin):
        if lin.w is not None:
            return _exact_bits(lin.w), None, None, None
        return None, lin.qs, _bits(lin.d), _bits(lin.m)

    w4a8 = layer.precision == "w4a8"
    k_cache, v_cache = _cache_operand(a.k_cache[layer.index]), _cache_operand(a.v_cache[layer.index])
    k_all, v_all = _cache_operand(a.k_all[layer.index]), _cache_operand(a.v_all[layer.index])  # attention's
    x_pairs = _pair_scratch(a.xq.shape[0])
    nothing = (None, None, None, None)
    qkv = (*planes(m["qkv"]), *nothing, *nothing) if "qkv" in m else \
        (*planes(m["q"]), *planes(m["k"]), *planes(m["v"]))
    moe = getattr(layer, "moe", None) is not None
    gate_up = () if moe else \
        (*planes(m["gate_up"]), *nothing) if "gate_up" in m else (*planes(m["gate"]), *planes(m["up"]))
    inputs = (a.x, layer.attn_norm, cfg.rms_eps, a.xn, a.xq, x_pairs, a.xd, a.xs, a.xq16, w4a8, *qkv,
              layer.qkv_bias, layer.q_norm, layer.k_norm, a.qkv, cfg.num_heads, cfg.num_kv_heads, a.pos,
              spec.cos, spec.sin, k_cache, v_cache, _NO_BASE if base is None else base)
    attend = attention_kernel(cfg.num_heads, cfg.num_kv_heads)
    o = (*planes(m["o"]), a.attn_flat, a.xq, x_pairs, a.xd, a.xs, a.xq16, w4a8, True, a.o)
    mlp = None if moe else (a.o, a.x, layer.mlp_norm, cfg.rms_eps, a.xn, a.xq, x_pairs, a.xd, a.xs, a.xq16, w4a8,
                            *gate_up, a.gate_up, a.act, *planes(m["down"]), a.down, spec.gelu, layer.post_mlp_norm)
    post_norm, softcap, window, slot = layer.post_attn_norm, F32(spec.softcap), spec.window, a.slot
    slots, firsts, counts = a.att_one

    def attention(n_ctx):
        _attention_inputs(*inputs)
        rows = n_ctx if base is None else n_ctx - base[0]
        first = rows - window if 0 < window < rows else 0  # where a window has moved on
        slots[0], firsts[0], counts[0] = slot, first, rows - first
        attend(a.q_rows, k_all, v_all, slots, firsts, counts, a.attn_rows, a.att_part, _threads[0], softcap)
        _layer_matvec(*o)
        if post_norm is not None:
            rmsnorm(a.o, post_norm, cfg.rms_eps, a.o)

    return attention, None if moe else (lambda: _mlp(*mlp))


_NO_BASE = np.zeros(1, dtype=np.int64)  # a full-context cache's: row r holds position r


# -- a batched decode step's layer in a few calls -----------------------------------------------
#
# What batch_decode's layer runs kernel by kernel for B rows (each row in its own sequence slot),
# in three calls: the attention's inputs (norm, QKV, RoPE, each row's K and V into its slot's
# cache), the o projection, and the MLP half. The same kernels on the same buffers in the same
# order, so every row stays its decode()'s bit for bit (tests/test_batch_decode.py); what goes
# is some 600 Python calls a step at B = 4. The attention is one more call, all rows in it.

@njit(cache=True, nogil=True)
def _rows_matmul(w, qs, d, m, x, codes, scales, sums, pairs, w4a8, out):
    """out [B, rows] = the matrix times each row of x [B, cols], as a batched step's _rows_dense
    runs it: W4A8 in the batch kernel on the rows' Q8 codes (quantised here into the fronts of
    the flat code buffers, where pw.take lays them), exact a matvec a row. W4A16 layers do not
    come here (batch_layer_planes): their batch kernel is _rows_dense's."""
    B, n = x.shape
    if qs is None:
        if w is not None:
            for b in range(B):
                _matvec_exact(w, x[b], out[b])
    elif w4a8:
        g = B * n // 32
        quantize_act_q8(x.reshape(-1), codes[:B * n], scales[:g], sums[:g])
        _w4a8_batch(qs, d, m, codes[:B * n].reshape(B, n), pairs[:B * n].reshape(B, n),
                    scales[:g].reshape(B, n // 32), sums[:g].reshape(B, n // 32), out)
    else:
        raise ValueError("_rows_matmul: a W4A16 layer's batched step is batch_decode's _rows_dense")


@njit(cache=True, nogil=True)
def _flat_cache_row(cache, p, flat, start):
    """_cache_row of the rows [heads, dim] held flat in flat[start:]."""
    heads, dim = cache.shape[1], cache.shape[2]
    if cache.itemsize == 2:
        for h in range(heads):
            for i in range(dim):
                cache[p, h, i] = _f32_to_half_bits(flat[start + h * dim + i])
    else:
        for h in range(heads):
            for i in range(dim):
                cache[p, h, i] = flat[start + h * dim + i]


@njit(cache=True, nogil=True)
def _batch_attention_inputs(x, norm, eps, xn, codes, scales, sums, pairs, w4a8, qkv_w, qkv_qs, qkv_d, qkv_m,
                            qkv_bias, q_norm, k_norm, qkv, q, k, pos, cos, sin, k_all, v_all, slots, bases, ring):
    """Norm, QKV, bias, q/k norms, RoPE for the rows of x, and row b's K and V into sequence slot
    slots[b]'s cache (k_all [slots, rows, kv_heads, dim]) at row pos[b] (minus the slot's base
    where `ring`: a sliding-window layer's cache)."""
    B = x.shape[0]
    rmsnorm(x, norm, eps, xn)
    _rows_matmul(qkv_w, qkv_qs, qkv_d, qkv_m, xn, codes, scales, sums, pairs, w4a8, qkv)
    if qkv_bias is not None:
        add_rows(qkv, qkv_bias)
    qd, kvd = q.shape[1] * q.shape[2], k.shape[1] * k.shape[2]
    qf, kf = q.reshape(B, qd), k.reshape(B, kvd)
    for b in range(B):
        for i in range(qd):
            qf[b, i] = qkv[b, i]
        for i in range(kvd):
            kf[b, i] = qkv[b, qd + i]
    if q_norm is not None:
        rmsnorm(q, q_norm, eps, q)
        rmsnorm(k, k_norm, eps, k)
    rope(q, pos, cos, sin)
    rope(k, pos, cos, sin)
    for b in range(B):
        s = slots[b]
        row = pos[b] - bases[s] if ring else pos[b]
        _cache_row(k_all[s], row, k[b])
        _flat_cache_row(v_all[s], row, qkv[b], qd + kvd)


@njit(cache=True, nogil=True)
def _batch_o(attn, o_w, o_qs, o_d, o_m, codes, scales, sums, pairs, w4a8, out, post_norm, eps):
    _rows_matmul(o_w, o_qs, o_d, o_m, attn, codes, scales, sums, pairs, w4a8, out)
    if post_norm is not None:
        rmsnorm(out, post_norm, eps, out)


@njit(cache=True, nogil=True)
def _batch_mlp(o, x, norm, eps, xn, codes, scales, sums, pairs, w4a8, gu_w, gu_qs, gu_d, gu_m, gate_up, act,
               down_w, down_qs, down_d, down_m, gelu, post_norm):
    """The residual add and norm, gate/up, the GLU, down (into o), its norm and the residual add,
    for the rows of x."""
    add_rmsnorm(o, x, norm, eps, xn)
    _rows_matmul(gu_w, gu_qs, gu_d, gu_m, xn, codes, scales, sums, pairs, w4a8, gate_up)
    if gelu:
        gelu_mul(gate_up, act)
    else:
        silu_mul(gate_up, act)
    _rows_matmul(down_w, down_qs, down_d, down_m, act, codes, scales, sums, pairs, w4a8, o)
    if post_norm is not None:
        rmsnorm(o, post_norm, eps, o)
    for b in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[b, i] += o[b, i]


def batch_layer_planes(layer):
    """For a resident layer (fused qkv and gate/up) of Q4 or exact matrices at W4A8 or exact: its
    matrices as _batch_attention_inputs, _batch_o and _batch_mlp take them ((w, qs, d, m) for
    qkv, o, gate_up and down), or None where its batched step stays kernel by kernel: a staging
    slot's layer, or W4A16, whose own batch kernel (matmul_q4_w4a16) reads the weights once for
    every row."""
    m = layer.mats
    if "qkv" not in m or "gate_up" not in m or layer.precision not in ("exact", "w4a8"):
        return None
    if any(lin.w is None and lin.qs is None for lin in m.values()):
        return None

    def planes(lin):
        if lin.w is not None:
            return _exact_bits(lin.w), None, None, None
        return None, lin.qs, _bits(lin.d), _bits(lin.m)

    return planes(m["qkv"]), planes(m["o"]), planes(m["gate_up"]), planes(m["down"])


def batch_rows_fused(rows: int) -> bool:
    """Whether a batched step of `rows` rows takes the W4A8 batch kernel (_rows_matmul's): below
    _LANES_FROM rows, or where there is no rows-in-lanes GEMM (which takes more: AVX2, AVX-512BW)."""
    return not (_lane_rows() and rows >= _LANES_FROM)
