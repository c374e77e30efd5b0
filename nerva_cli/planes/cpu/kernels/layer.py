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
from nerva_cli.planes.cpu.kernels.q4_w4a8 import _w4a8
from nerva_cli.planes.cpu.kernels.quantize_act import quantize_act_q8


# -- a decode layer in a few calls ----------------------------------------------------------------
#
# A resident Q4 or exact layer's decode step as the engine's _decode_layer runs it kernel by
# kernel, in four calls made from arguments bound once (decode_layer_halves): norm to the cache
# rows, the attention, the o projection, and the MLP half. The kernels are the backend's own,
# called in the same order on the same buffers, so the logits are the same to the bit
# (tests/test_engine.py).
# What goes is the Python between the kernels: about 16 calls a layer, each a method lookup, a
# numba dispatch with its argument checks and a wrapper's f16 views, and NumPy's cache writes and
# residual add. A wrapper around each backend call put that Python at 1.4-1.5 ms of a SmolLM2
# q4_1 token on the 2-core Zen 3 EPYC (11.5 ms on one thread, 7.4 on two), more than the same
# lines cost with the kernels stubbed out (0.57 ms): between kernels that stream 3 MB a layer,
# the interpreter's own code and objects come from DRAM too.
#
# `nerva bench smollm2-135m:q4_1`, alternating with the commit before (Zen 3, 256 + 128 tokens):
# 92.4-97.3 -> 98.7-104.2 tok/s on one thread, 160-165 -> 174-182 on two; after 1800 prompt
# tokens 66.9-68.6 -> 68.1-71.2 and 108-112 -> 116-123. The attention kernel stays a call of its
# own: compiled into a caller, a kernel's IR is linked in and built again, 5 s for the attention's
# on this machine, where the matvecs' add about 3 s to the first decode on a fresh cache (`nerva
# run`'s first answer with a fresh NERVA_HOME: 20.4-20.7 -> 23.6-23.7 s). Two calls, the first
# linking the attention and the o projection in, measured 170-193 tok/s on two threads in a run of
# its own: no clear gain for the 5 s.

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
def _layer_matvec(w, qs, d, m, x, xq, x_pairs, xd, xs, w4a8, out):
    """A matvec of the compiled halves, as the engine's _matvec picks it: an exact matrix (w its
    stored bits, _exact_bits; qs, d, m None), or Q4 planes (w None), W4A8 (x quantised into xq,
    xd, xs first) or W4A16. numba drops an `is None` branch only where the argument is None, so
    each case tests the argument that is None in the other: the exact kernel is never typed with
    Q4 codes, nor the Q4 ones with none (an overload picking the case cost 0.2-0.5 s more of a
    Q4 first run's compiling)."""
    if qs is None:
        if w is not None:
            _matvec_exact(w, x, out)
    elif w4a8:
        n = x.shape[0]
        quantize_act_q8(x, xq[:n], xd[:n // 32], xs[:n // 32])
        _w4a8(qs, d, m, xq[:n], x_pairs, xd[:n // 32], xs[:n // 32], out)
    else:
        _w4a16_kernel(qs, d, m, x, out)


@njit(cache=True, nogil=True)
def _attention_inputs(x, norm, eps, xn, xq, x_pairs, xd, xs, w4a8, qkv_w, qkv_qs, qkv_d, qkv_m, qkv_bias, q_norm,
                      k_norm, qkv, heads, kv_heads, pos, cos, sin, k_cache, v_cache, base):
    """Norm, QKV, bias, q/k norms, RoPE, and this position's K and V rows into the cache (row
    pos - base: a sliding-window layer's cache starts at position base)."""
    rmsnorm(x, norm, eps, xn)
    _layer_matvec(qkv_w, qkv_qs, qkv_d, qkv_m, xn, xq, x_pairs, xd, xs, w4a8, qkv)
    if qkv_bias is not None:
        add_rows(qkv, qkv_bias)
    dim = k_cache.shape[2]
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
def _mlp(o, x, norm, eps, xn, xq, x_pairs, xd, xs, w4a8, gate_up_w, gate_up_qs, gate_up_d, gate_up_m, gate_up, act,
         down_w, down_qs, down_d, down_m, down, gelu, post_norm):
    """Residual add and norm, gate/up, SiLU (GeLU: gelu) * up, down, its norm (post_norm, where
    not None) and the residual add."""
    add_rmsnorm(o, x, norm, eps, xn)
    _layer_matvec(gate_up_w, gate_up_qs, gate_up_d, gate_up_m, xn, xq, x_pairs, xd, xs, w4a8, gate_up)
    if gelu:
        gelu_mul(gate_up, act)
    else:
        silu_mul(gate_up, act)
    _layer_matvec(down_w, down_qs, down_d, down_m, act, xq, x_pairs, xd, xs, w4a8, down)
    if post_norm is not None:
        rmsnorm(down, post_norm, eps, down)
    for i in range(x.shape[0]):
        x[i] += down[i]


def decode_layer_halves(layer, a, cfg, cos, sin, window=0, base=None):
    """For a resident Q4 layer (fused qkv and gate/up, W4A8 or W4A16) or exact one over the arena
    `a`: (attention(n_ctx), mlp()), the two halves of its decode step, n_ctx counting this
    token's position, attention over the last `window` positions where that is not 0, the cache's
    first row holding position base[0] (None: 0); None for any other layer. The arguments are made
    here, once."""
    m = layer.mats  # a resident layer's: qkv, o, gate_up, down
    if layer.precision == "exact" and all(m[n].w is not None for n in m):
        planes = lambda lin: (_exact_bits(lin.w), None, None, None)  # noqa: E731
    elif layer.precision in ("w4a8", "w4a16") and all(m[n].qs is not None for n in m):
        planes = lambda lin: (None, lin.qs, _bits(lin.d), _bits(lin.m))  # noqa: E731
    else:
        return None
    w4a8 = layer.precision == "w4a8"
    k_cache, v_cache = _cache_operand(a.k_cache[layer.index]), _cache_operand(a.v_cache[layer.index])
    x_pairs = _pair_scratch(a.xq.shape[0])
    inputs = (a.x, layer.attn_norm, cfg.rms_eps, a.xn, a.xq, x_pairs, a.xd, a.xs, w4a8, *planes(m["qkv"]),
              layer.qkv_bias, layer.q_norm, layer.k_norm, a.qkv, cfg.num_heads, cfg.num_kv_heads, a.pos,
              cos, sin, k_cache, v_cache, _NO_BASE if base is None else base)
    attend = attention_kernel(cfg.num_heads, cfg.num_kv_heads)
    o = (*planes(m["o"]), a.attn_flat, a.xq, x_pairs, a.xd, a.xs, w4a8, a.o)
    mlp = (a.o, a.x, layer.mlp_norm, cfg.rms_eps, a.xn, a.xq, x_pairs, a.xd, a.xs, w4a8, *planes(m["gate_up"]),
           a.gate_up, a.act, *planes(m["down"]), a.down, cfg.activation == "gelu_tanh", layer.post_mlp_norm)
    post_norm, softcap = layer.post_attn_norm, F32(cfg.attn_softcap or 0)

    def attention(n_ctx):
        _attention_inputs(*inputs)
        rows = n_ctx if base is None else n_ctx - base[0]
        if 0 < window < rows:  # a view per call only where a window has moved on
            attend(a.q, k_cache[rows - window:], v_cache[rows - window:], window, a.attn, a.att_part, _threads[0],
                   softcap)
        else:
            attend(a.q, k_cache, v_cache, rows, a.attn, a.att_part, _threads[0], softcap)
        _layer_matvec(*o)
        if post_norm is not None:
            rmsnorm(a.o, post_norm, cfg.rms_eps, a.o)

    return attention, lambda: _mlp(*mlp)


_NO_BASE = np.zeros(1, dtype=np.int64)  # a full-context cache's: row r holds position r
