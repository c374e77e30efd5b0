"""Every kernel of kernels/*.cu against `ref` on fresh random inputs, launched by the cuda
backend's own launch code (planes/cuda/launch.Kernels): on the CPU emulation of the CUDA sources
always, on a GPU too where one answers (the `gpu` parameter). Each test prints its seed.

Tolerances as in test_kernels.py: float32 sums taken in another order differ by about
sqrt(K) eps times the sum of the terms' magnitudes, so dot products are held per row to
4 sqrt(K) eps * sum |a_i b_i|, elementwise results to a few eps in relative norm. Kernels whose
arithmetic is the reference's, step for step (embeddings, dequantisation, the activation
quantiser, the KV cache's f16 rounding, W4A8's integer sums), are held to exact equality.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nerva_cli.planes import ref
from nerva_cli.planes.cuda.launch import ATT_LONG_CHUNK, RECENT, Kernels, most_prefill_partials, prefill_partials, prefill_splits
from nerva_cli.model.quant import dequantize_q4, dequantize_q8
from nerva_cli.runtime.sampling import Sampler, SamplingOptions
from test_kernels import EPS, act_q8, dequant_f64, dequant_q8_f64, random_q4, random_q8, randn, rel, rope_tables, sum_tol
from test_sampling import between_weights

KINDS = ("q4_0", "q4_1")
# (precision, weight format) pairs of the matvec launches: both Q4 formats at both precisions
MATVEC_CASES = [("w4a16", "q4_0"), ("w4a16", "q4_1"), ("w4a8", "q4_0"), ("w4a8", "q4_1"), ("f16", "f16")]


@pytest.fixture
def k(cuda_device):
    return Kernels(cuda_device)


def up(k, a):
    return k.dev.upload(np.ascontiguousarray(a))


def down(k, a):
    return k.dev.download(a)


def assert_rows_close(got, want, magnitude, terms):
    assert np.all(np.abs(got.astype(np.float64) - want) <= sum_tol(terms) * magnitude + 1e-30)


def q4_matrix(k, rng, rows, cols, kind):
    """A random Q4_0 or Q4_1 matrix -> (its planes on the device, as Kernels takes them), qs, d, m."""
    qs, d, m = random_q4(rng, rows, cols, kind)
    return {"qs": up(k, qs), "d": up(k, d), **({} if m is None else {"m": up(k, m)})}, qs, d, m


def w4a16_want(qs, d, m, x):
    """(W x in float64, the magnitude the kernel's f32 sums are held to): sum_j |w_j x_j| for Q4_0;
    for Q4_1 the two terms matvec.cu sums apart, d (q - 8) x_j and (m + 8 d) x_j, each in size."""
    w = dequant_f64(qs, d, m)
    if m is None:
        return w @ x, np.abs(w) @ np.abs(x)
    mid = np.repeat(m.astype(np.float64) + 8 * d.astype(np.float64), 32, axis=1)
    return w @ x, (np.abs(w - mid) + np.abs(mid)) @ np.abs(x)


def w4a8_want(qs, d, m, act):
    """(ref's W4A8 product, the size its per-block f32 terms are held to: a code product of 127 x
    15 at d_w d_x, plus for Q4_1 a code sum of 127 at m d_x)."""
    want = np.empty(qs.shape[0], np.float32)
    ref.matvec_q4_w4a8(qs, d, m, *act, want)
    scale = np.abs(d.astype(np.float64)) * 15 + (0 if m is None else np.abs(m.astype(np.float64)))
    return want, (scale * act[1] * 127).sum(axis=1) + np.abs(want)


# -- norms and elementwise ---------------------------------------------------------------------
@pytest.mark.parametrize("rows,n", [(1, 64), (5, 96), (3, 576)])
def test_rmsnorm(k, rng, rows, n):
    x, w = randn(rng, rows, n), randn(rng, n)
    want = np.empty_like(x)
    ref.rmsnorm(x, w, 1e-5, want)
    out = up(k, np.zeros_like(x))
    k.rmsnorm(up(k, x), up(k, w), 1e-5, out)
    assert rel(down(k, out), want) < 8 * EPS


def test_rmsnorm_in_place(k, rng):
    x, w = randn(rng, 4, 64), randn(rng, 64)
    want = np.empty_like(x)
    ref.rmsnorm(x, w, 1e-6, want)
    xd = up(k, x)
    k.rmsnorm(xd, up(k, w), 1e-6, xd)
    assert rel(down(k, xd), want) < 8 * EPS


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0", "f16", "bf16"])
def test_embed_rows(k, rng, kind):
    """Bit for bit: a Q4_1 row is d q + m, d q exact in f32 and one rounding after, as ref's."""
    vocab, cols = 50, 96
    tokens = rng.integers(0, vocab, 7).astype(np.int32)
    if kind in KINDS:
        table, qs, d, m = q4_matrix(k, rng, vocab, cols, kind)
        want = dequantize_q4(qs, d, m)[tokens]
    elif kind == "q8_0":
        q8, d = random_q8(rng, vocab, cols)
        table, want = {"q8": up(k, q8), "d": up(k, d)}, dequantize_q8(q8, d)[tokens]
    elif kind == "f16":
        w = randn(rng, vocab, cols).astype(np.float16)
        table, want = {"w": up(k, w)}, w.astype(np.float32)[tokens]
    else:
        w = (randn(rng, vocab, cols).view(np.uint32) >> 16).astype(np.uint16)
        table, want = {"w": up(k, w)}, (w.astype(np.uint32) << 16).view(np.float32)[tokens]
    out = up(k, np.zeros((7, cols), np.float32))
    k.embed(table, up(k, tokens), out)
    np.testing.assert_array_equal(down(k, out), want)


@pytest.mark.parametrize("T,heads,kv_heads,start", [(1, 4, 2, 9), (5, 3, 3, 0), (6, 2, 1, 17)])
def test_rope_kv_store(k, rng, T, heads, kv_heads, start):
    """q rotated in place; k rotated and v stored in f16 at positions start .., nothing else written.
    Rows laid out as prefill's: q, k, v side by side, `stride` floats apart."""
    hd, ctx = 32, 32
    qd, kvd = heads * hd, kv_heads * hd
    stride = qd + 2 * kvd
    rows = randn(rng, T, stride)
    cos, sin = rope_tables(64, hd)
    want_q = rows[:, :qd].reshape(T, heads, hd).copy()
    want_k = rows[:, qd:qd + kvd].reshape(T, kv_heads, hd).copy()
    ref.rope(want_q, np.arange(start, start + T), cos, sin)
    ref.rope(want_k, np.arange(start, start + T), cos, sin)
    flat = up(k, rows).reshape(-1)
    kc, vc = up(k, np.zeros((ctx, kv_heads, hd), np.float16)), up(k, np.zeros((ctx, kv_heads, hd), np.float16))
    k.rope_kv_store(flat, flat[qd:], flat[qd + kvd:], stride, up(k, np.array([start], np.int32)), up(k, cos),
                    up(k, sin), T, heads, kc, vc)
    got = down(k, flat).reshape(T, stride)
    assert rel(got[:, :qd].reshape(T, heads, hd), want_q) < 4 * EPS
    np.testing.assert_array_equal(got[:, qd:], rows[:, qd:])  # k and v rows are read only
    gk, gv = down(k, kc).astype(np.float32), down(k, vc)
    # f16 of a rotation that may differ from NumPy's in its last f32 bit: within one f16 rounding
    assert rel(gk[start:start + T], want_k) < 2.0 ** -11 + 4 * EPS
    np.testing.assert_array_equal(gv[start:start + T], rows[:, qd + kvd:].astype(np.float16).reshape(T, kv_heads, hd))
    for cache in (gk, gv):
        assert not cache[:start].any() and not cache[start + T:].any()


def test_silu_mul_and_add_rows(k, rng):
    T, f = 3, 160
    gu = randn(rng, T, 2 * f) * 4
    want = np.empty((T, f), np.float32)
    ref.silu_mul(gu, want)
    out = up(k, np.zeros((T, f), np.float32))
    k.silu_mul(up(k, gu), out, f, T)
    assert rel(down(k, out), want) < 4 * EPS
    ref.gelu_mul(gu, want)
    k.gelu_mul(up(k, gu), out, f, T)
    assert rel(down(k, out), want) < 4 * EPS  # tanhf and NumPy's tanh: an ulp or two apart
    x = randn(rng, T, 48)
    xd = up(k, x)
    k.scale(xd, 33.9411255)  # Gemma 3 1B's sqrt(1152)
    np.testing.assert_array_equal(down(k, xd), x * np.float32(33.9411255))
    x, b = randn(rng, T, 48), randn(rng, 48)
    xd, want_x = up(k, x), x.copy()
    k.add_rows(xd, up(k, b), T)
    ref.add_rows(want_x, b)
    np.testing.assert_array_equal(down(k, xd), want_x)


# -- matvecs -----------------------------------------------------------------------------------
# 4160 columns: 130 blocks a row, more than a matvec block has threads (two rounds, the second partial)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,cols", [(1, 32), (37, 64), (200, 576), (9, 1536), (5, 4160)])
def test_matvec_w4a16(k, rng, rows, cols, kind):
    mat, qs, d, m = q4_matrix(k, rng, rows, cols, kind)
    x = randn(rng, cols)
    out = up(k, np.zeros(rows, np.float32))
    k.matvec(mat, up(k, x), out, "w4a16")
    assert_rows_close(down(k, out), *w4a16_want(qs, d, m, x), cols)


@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("precision,kind", MATVEC_CASES)
def test_matvecs_share_a_launch(k, rng, precision, kind, add):
    """q, k and v (or gate and up) in one launch: each output is its own matrix's product, and
    no block writes into another's output (each starts poisoned with NaN). With add, each output
    starts as a random residual and ends as residual + product (one more f32 rounding)."""
    cols, x = 576, randn(rng, 576)
    act = act_q8(ref, x)
    mats, outs, wants = [], [], []
    for rows in (37, 9, 200):
        if precision == "f16":
            w = randn(rng, rows, cols).astype(np.float16)
            mats.append({"w": up(k, w)})
            wants.append((w.astype(np.float64) @ x, np.abs(w.astype(np.float64)) @ np.abs(x)))
        else:
            mat, qs, d, m = q4_matrix(k, rng, rows, cols, kind)
            mats.append(mat)
            wants.append(w4a8_want(qs, d, m, act) if precision == "w4a8" else w4a16_want(qs, d, m, x))
        res = randn(rng, rows) if add else np.full(rows, np.nan, np.float32)
        outs.append(up(k, res))
        if add:
            wants[-1] = (res + wants[-1][0], np.abs(res) + wants[-1][1])
    k.matvecs(mats, up(k, x), outs, precision, add)
    for out, (want, scale) in zip(outs, wants):
        assert_rows_close(down(k, out), want, scale, cols // 32 if precision == "w4a8" else cols)


@pytest.mark.parametrize("precision,kind", MATVEC_CASES)
@pytest.mark.parametrize("rows", [36, 200, 1100])  # 36, 1100: a partial last block; 1100: 3 rounds of the tail
def test_matvec_add_then_norm(k, rng, precision, kind, rows):
    """A residual add whose launch's last block then normalises the whole sum (the o and down
    products): x = r + W x to the dot tolerance, xn = rmsnorm(x) * w of the x it wrote within
    8 eps as the rmsnorm test holds it, and the block count back at 0 for the next launch (a
    second launch on the same counter checks that)."""
    cols = 576
    done = up(k, np.zeros(1, np.int32))
    for _ in range(2):
        x, res, w = randn(rng, cols), randn(rng, rows), randn(rng, rows)
        act = act_q8(ref, x)
        if precision == "f16":
            wt = randn(rng, rows, cols).astype(np.float16)
            m, wide = {"w": up(k, wt)}, wt.astype(np.float64)
            want, scale, terms = wide @ x, np.abs(wide) @ np.abs(x), cols
        else:
            m, qs, d, offsets = q4_matrix(k, rng, rows, cols, kind)
            if precision == "w4a8":
                (want, scale), terms = w4a8_want(qs, d, offsets, act), cols // 32
            else:
                (want, scale), terms = w4a16_want(qs, d, offsets, x), cols
        out, xn = up(k, res), up(k, np.full(rows, np.nan, np.float32))
        k.matvec(m, up(k, x), out, precision, add=True, norm=(up(k, w), xn, 0.25, done))
        got = down(k, out)
        assert_rows_close(got, res + want, np.abs(res) + scale, terms)
        want_xn = np.empty((1, rows), np.float32)
        ref.rmsnorm(got.reshape(1, -1), w, 0.25, want_xn)  # an eps large enough to matter to the test
        assert rel(down(k, xn), want_xn[0]) < 8 * EPS
        np.testing.assert_array_equal(down(k, done), 0)


@pytest.mark.parametrize("precision,kind", MATVEC_CASES)
@pytest.mark.parametrize("rows,cols", [(1, 64), (37, 576), (6, 4160)])
def test_glu_is_silu_of_gate_times_up(k, rng, precision, kind, rows, cols):
    """One launch for silu(gate x) * up x, rows of both in each block (a row count that is no
    multiple of a block's 4 gate rows leaves a partial block). Held to the unfused launches
    (matvecs, then silu_mul) within a few ulps, and to ref's products through silu's error
    propagation: |d out| <= 1.1 |d gate| |up| + |silu(gate)| |d up|, each product's error as the
    matvec tests bound it."""
    x = randn(rng, cols)
    act = act_q8(ref, x)
    mats, wants = [], []
    for _ in range(2):  # gate, up
        if precision == "f16":
            w = randn(rng, rows, cols).astype(np.float16)
            mats.append({"w": up(k, w)})
            wide = w.astype(np.float64)
            wants.append((wide @ x, sum_tol(cols) * (np.abs(wide) @ np.abs(x))))
        else:
            mat, qs, d, m = q4_matrix(k, rng, rows, cols, kind)
            mats.append(mat)
            if precision == "w4a8":
                want, scale = w4a8_want(qs, d, m, act)
                wants.append((want.astype(np.float64), sum_tol(cols // 32) * scale))
            else:
                want, magnitude = w4a16_want(qs, d, m, x)
                wants.append((want, sum_tol(cols) * magnitude))
    out = up(k, np.full(rows, np.nan, np.float32))
    k.glu(mats[0], mats[1], up(k, x), out, precision)
    got = down(k, out).astype(np.float64)
    (g, dg), (u, du) = wants
    silu = g / (1 + np.exp(-g))
    assert np.all(np.abs(got - silu * u) <= 1.1 * dg * np.abs(u) + np.abs(silu) * du + 8 * EPS * np.abs(silu * u))
    gate_up, unfused = up(k, np.zeros(2 * rows, np.float32)), up(k, np.zeros(rows, np.float32))
    k.matvecs(mats, up(k, x), [gate_up[:rows], gate_up[rows:]], precision)
    k.silu_mul(gate_up, unfused, rows, 1)
    np.testing.assert_allclose(got, down(k, unfused), rtol=4 * EPS, atol=0)
    # GeGLU (Gemma's): GeLU's tanh form, whose slope is at most 1.13 where silu's is 1.1
    k.glu(mats[0], mats[1], up(k, x), out, precision, gelu=True)
    got = down(k, out).astype(np.float64)
    gelu = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
    assert np.all(np.abs(got - gelu * u) <= 1.2 * dg * np.abs(u) + np.abs(gelu) * du + 8 * EPS * np.abs(gelu * u))
    k.gelu_mul(gate_up, unfused, rows, 1)
    np.testing.assert_allclose(got, down(k, unfused), rtol=4 * EPS, atol=0)


@pytest.mark.parametrize("cols", [32, 96, 1536])
def test_activation_quantiser_is_bit_exact(k, rng, cols):
    """W4A8's activation codes, made inside the matvec: with one-hot rows of unit scale (row r
    keeps element r) each output is d_g * q_r, one f32 product, so every code and scale shows,
    held to ref's quantiser exactly. Prefill's fake quantiser is held to ref's the same way."""
    x = randn(rng, cols) * rng.uniform(0.1, 10)
    if cols > 32:
        x[:32] = 0.0  # an all-zero group: scale 0, codes 0
        x[40] = -1.5 * abs(x[32:64]).max()  # a group whose extreme is negative
    xq, xd, _ = act_q8(ref, x)
    codes = np.full((cols, cols), 8, np.uint8)  # code 8 is weight 0
    codes[np.arange(cols), np.arange(cols)] = 9  # weight +1
    blocks = codes.reshape(cols, cols // 32, 32)  # byte j of a block: element j low, j + 16 high
    qs = (blocks[:, :, :16] | (blocks[:, :, 16:] << 4)).reshape(cols, cols // 2)
    d = np.ones((cols, cols // 32), np.float16)
    out = up(k, np.zeros(cols, np.float32))
    k.matvec({"qs": up(k, qs), "d": up(k, d)}, up(k, x), out, "w4a8")
    np.testing.assert_array_equal(down(k, out), np.repeat(xd, 32) * xq.astype(np.float32))
    fq, want_fq = up(k, np.zeros((1, cols), np.float16)), np.empty((1, cols), np.float32)
    ref.fake_quantize_q8(x.reshape(1, -1), want_fq)
    k.fake_quantize_q8(up(k, x.reshape(1, -1)), fq)  # prefill's GEMM operand: q d rounded to f16
    np.testing.assert_array_equal(down(k, fq), want_fq.astype(np.float16))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,cols", [(1, 32), (37, 64), (200, 576), (11, 4160)])
def test_matvec_w4a8(k, rng, rows, cols, kind):
    mat, qs, d, m = q4_matrix(k, rng, rows, cols, kind)
    x = randn(rng, cols)
    want, scale = w4a8_want(qs, d, m, act_q8(ref, x))
    out = up(k, np.zeros(rows, np.float32))
    k.matvec(mat, up(k, x), out, "w4a8")
    assert_rows_close(down(k, out), want, scale, cols // 32)


@pytest.mark.parametrize("kind", KINDS)
def test_matvec_w4a8_integer_sums_are_exact(k, rng, kind):
    """Unit scales (and Q4_1 offsets of 1): the result is the integer sum itself, which f32 holds
    exactly here. x is integers in -127..127 with a 127 in every group, so its codes are x itself
    at scale 1."""
    rows, cols = 24, 256
    qs = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    d = np.ones((rows, cols // 32), np.float16)
    m = d.copy() if kind == "q4_1" else None
    xq = rng.integers(-127, 128, cols, dtype=np.int8)
    xq[::32] = 127
    xd = np.ones(cols // 32, np.float32)
    xs = xq.reshape(-1, 32).sum(axis=1, dtype=np.int32)
    assert [np.array_equal(a, b) for a, b in zip(act_q8(ref, xq.astype(np.float32)), (xq, xd, xs))] == [True] * 3
    want = np.empty(rows, np.float32)
    ref.matvec_q4_w4a8(qs, d, m, xq, xd, xs, want)
    exact = ref.unpack_q4_codes(qs).reshape(rows, cols).astype(np.int64) + (1 if m is not None else -8)
    np.testing.assert_array_equal(want, exact @ xq.astype(np.int64))
    out = up(k, np.zeros(rows, np.float32))
    planes = {"qs": up(k, qs), "d": up(k, d), **({} if m is None else {"m": up(k, m)})}
    k.matvec(planes, up(k, xq.astype(np.float32)), out, "w4a8")
    np.testing.assert_array_equal(down(k, out), want)


# Q8_0: the Q4 variants' token table as lm_head (SmolLM2's 49152 x 576) and an untied lm_head
@pytest.mark.parametrize("rows,cols", [(1, 32), (37, 64), (200, 576), (5, 4160)])
def test_matvec_q8_0(k, rng, rows, cols):
    q8, d = random_q8(rng, rows, cols)
    mat = {"q8": up(k, q8), "d": up(k, d)}
    x = randn(rng, cols)
    out = up(k, np.zeros(rows, np.float32))
    k.matvec(mat, up(k, x), out, "w4a16")
    w = dequant_q8_f64(q8, d)
    assert_rows_close(down(k, out), w @ x, np.abs(w) @ np.abs(x), cols)
    # W8A8: ref's product, per-block terms held as W4A8's are (a code product of 128 x 127)
    xq, xd, xs = act_q8(ref, x)
    want = np.empty(rows, np.float32)
    ref.matvec_q8_w8a8(q8, d, xq, xd, want)
    k.matvec(mat, up(k, x), out, "w4a8")
    assert_rows_close(down(k, out), want, (np.abs(d.astype(np.float64)) * 128 * xd * 127).sum(axis=1)
                      + np.abs(want), cols // 32)


def test_matvec_q8_0_w8a8_integer_sums_are_exact(k, rng):
    """Unit scales and x of integers with a 127 in every group (its codes are x itself): the
    result is the integer dot of signed codes, -128 among them, which f32 holds exactly here."""
    rows, cols = 24, 256
    q8 = rng.integers(-128, 128, (rows, cols), dtype=np.int8)
    q8[:, 5] = -128
    xq = rng.integers(-127, 128, cols, dtype=np.int8)
    xq[::32] = 127
    out = up(k, np.zeros(rows, np.float32))
    k.matvec({"q8": up(k, q8), "d": up(k, np.ones((rows, cols // 32), np.float16))},
             up(k, xq.astype(np.float32)), out, "w4a8")
    np.testing.assert_array_equal(down(k, out), q8.astype(np.int64) @ xq.astype(np.int64))


def test_dequantize_q8_0_to_half(k, rng):
    """Bit for bit: d q is exact in f32 and rounded once to f16, as NumPy rounds it; a slice of
    rows from inside the matrix, as prefill's lm_head is dequantised."""
    q8, d = random_q8(rng, 40, 192)
    mat = {"q8": up(k, q8), "d": up(k, d)}
    scratch = up(k, np.zeros(40 * 192, np.float16))
    out = k.half_weights({name: plane[2:35] for name, plane in mat.items()}, scratch)
    assert out.shape == (33, 192) and out.dtype == np.float16
    np.testing.assert_array_equal(down(k, out), dequantize_q8(q8[2:35], d[2:35]).astype(np.float16))


@pytest.mark.parametrize("kind", ["f16", "bf16"])
@pytest.mark.parametrize("rows,cols", [(3, 64), (70, 160), (5, 1112)])
def test_matvec_exact(k, rng, kind, rows, cols):
    w32 = randn(rng, rows, cols)
    if kind == "f16":
        w = w32.astype(np.float16)
        wide = w.astype(np.float64)
    else:
        w = (w32.view(np.uint32) >> 16).astype(np.uint16)
        wide = (w.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    x = randn(rng, cols)
    out = up(k, np.zeros(rows, np.float32))
    k.matvec({"w": up(k, w)}, up(k, x), out, "exact")
    assert_rows_close(down(k, out), wide @ x, np.abs(wide) @ np.abs(x), cols)
    # prefill's f16 GEMM operand: f16 weights as stored (no copy), bf16 rounded to f16
    wd, scratch = up(k, w), up(k, np.zeros(rows * cols + 7, np.float16))
    half = k.half_weights({"w": wd}, scratch)
    assert (half is wd) == (kind == "f16")
    np.testing.assert_array_equal(down(k, half).view(np.float16), wide.astype(np.float16))


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_q4_to_half(k, rng, kind):
    """Bit for bit: d (q - 8) is exact in f32 and rounded once to f16, as NumPy rounds it; Q4_1's
    d q + m is rounded once in f32 (d q exact), then to f16, as ref then NumPy do. Scales at f16's
    extremes too (the smallest subnormal, and the largest, whose products leave f16's range), and
    a slice of rows from inside the matrix, as prefill dequantises one."""
    mat, qs, d, m = q4_matrix(k, rng, 40, 192, kind)
    d[3, :3] = [np.float16(2.0 ** -24), np.float16(-65504), np.float16(6.1e-5)]
    mat["d"] = up(k, d)
    scratch = up(k, np.zeros(40 * 192, np.float16))
    out = k.half_weights({name: plane[2:35] for name, plane in mat.items()}, scratch)
    assert out.shape == (33, 192) and out.dtype == np.float16
    with np.errstate(over="ignore"):  # -65504 (q - 8) past f16's range, on purpose: -inf or inf
        want = dequantize_q4(qs[2:35], d[2:35], None if m is None else m[2:35]).astype(np.float16)
    np.testing.assert_array_equal(down(k, out), want)
    assert np.isinf(want).any() and (want[1, :32] != 0).any()


def test_to_half_rounds_to_nearest_even(k, rng):
    """Every f32 -> f16 case: normal, subnormal, ties (an f32 half-way between two f16 values),
    past the range (inf) and the extremes, held to NumPy's conversion (round to nearest even)."""
    x = randn(rng, 3, 160) * np.float32(rng.uniform(0.5, 2))
    x[0, :40] *= np.float32(2.0 ** -18)  # f16 subnormals
    x[1, :8] = [65504, 65519, 65520, -7e4, 2.0 ** -25, 2.0 ** -26, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11]
    out = up(k, np.zeros(x.shape, np.float16))
    k.to_half(up(k, x), out)
    with np.errstate(over="ignore"):  # the values past f16's range, on purpose
        want = x.astype(np.float16)
    np.testing.assert_array_equal(down(k, out), want)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("T,n,k_dim", [(1, 40, 64), (7, 96, 576), (33, 130, 256)])
def test_gemm_t_into_a_column_slice(k, rng, T, n, k_dim, accumulate):
    """Prefill's GEMM, out [T, n] = a @ b.T on f16 operands with f32 sums (accumulate: out += that,
    prefill's residual adds), written into columns lo..lo + n of a wider f32 array with the other
    columns untouched. Tolerance: sums of k f32 products (each exact, being of two f16 values),
    and the old value, in another order, as assert_rows_close; on a GPU cuBLAS may split k, which
    that bound covers too. The GPU run is the check of how cuBLAS reads gemm_t's arguments; the
    emulated run checks only the emulation's NumPy stand-in (the argument mapping is checked in CI
    against fake_cupy's cuBLAS: test_cuda_engine.py)."""
    a, b = randn(rng, T, k_dim).astype(np.float16), randn(rng, n, k_dim).astype(np.float16)
    wide = randn(rng, T, n + 11)
    out = up(k, wide)
    k.dev.gemm_t(up(k, a), up(k, b), out[:, 5:5 + n], accumulate)
    got = down(k, out)
    want = a.astype(np.float64) @ b.astype(np.float64).T
    magnitude = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)).T
    if accumulate:
        want += wide[:, 5:5 + n]
        magnitude += np.abs(wide[:, 5:5 + n])
    assert_rows_close(got[:, 5:5 + n], want, magnitude, k_dim + accumulate)
    np.testing.assert_array_equal(got[:, :5], wide[:, :5])
    np.testing.assert_array_equal(got[:, 5 + n:], wide[:, 5 + n:])


# -- attention ---------------------------------------------------------------------------------
def f16_cache(rng, ctx, kvh, hd):
    return randn(rng, ctx, kvh, hd).astype(np.float16)


# head dims: a lane holds hd / 32 elements, loaded as one word for 64, 128 and 256 (80 and 48:
# lanes with fewer elements, or none). splits (least, most): least until a block would take more
# than ATT_LONG_CHUNK (16) positions, then more, up to most; (4, 2, 64, 40) and (2, 1, 32, 1400)
# grow to 3 of 5 and to all 5 (blocks past them return at once, and the merge takes only those
# that ran). A block takes up to ATT_GROUP (4) query heads of a kv group where a lane holds 2 or 4
# elements of a head, else one: groups of 12 (three sets) and 6 (a set of 4, then one of 2), and
# 5 at hd 96 and 4 at hd 256 (a block a head)
@pytest.mark.parametrize("heads,kvh,hd,n,splits", [(4, 2, 32, 1, (1, 1)), (4, 2, 64, 37, (3, 3)),
                                                   (6, 3, 32, 5, (8, 8)), (2, 1, 256, 70, (2, 2)),
                                                   (8, 8, 128, 130, (4, 4)), (4, 2, 80, 21, (3, 3)),
                                                   (2, 2, 48, 9, (2, 2)), (4, 2, 64, 40, (2, 5)),
                                                   (2, 1, 32, 1400, (1, 5)), (12, 1, 64, 50, (3, 5)),
                                                   (6, 1, 128, 33, (2, 2)), (10, 2, 96, 19, (1, 2)),
                                                   (8, 2, 256, 45, (2, 3))])
def test_attention_decode_split_over_context(k, rng, heads, kvh, hd, n, splits):
    """The new token's q, k and v before RoPE: rotated in the launch, k and v stored in f16 at its
    cache row (no other row written), attention over it and the rows before (GQA, online softmax,
    any number of splits, some empty when n < splits). The last split of each head merges them,
    and leaves the split counts at zero: a second token, a position on, runs on the same
    buffers and attends to the row the first one stored."""
    ctx = max(160, n + 2)
    kc = f16_cache(rng, ctx, kvh, hd)
    vc = f16_cache(rng, ctx, kvh, hd)
    cos, sin = rope_tables(ctx, hd)
    kc_d, vc_d, cos_d, sin_d = up(k, kc), up(k, vc), up(k, cos), up(k, sin)
    out, part = up(k, np.zeros((heads, hd), np.float32)), up(k, np.zeros(heads * splits[1] * (hd + 2), np.float32))
    done = up(k, np.zeros(heads, np.int32))
    for n_ctx in (n, n + 1):
        cur = n_ctx - 1
        q, k_new, v_new = randn(rng, heads, hd), randn(rng, kvh, hd), randn(rng, kvh, hd)
        q_rot, k_rot = q.copy(), k_new.copy()
        ref.rope(q_rot, np.array([cur]), cos, sin)
        ref.rope(k_rot, np.array([cur]), cos, sin)
        vc[cur] = v_new.astype(np.float16)
        pos = up(k, np.array([cur], np.int32))
        k.attention_decode(up(k, q), up(k, k_new), up(k, v_new), cos_d, sin_d, kc_d, vc_d, pos, part, done, out,
                           heads, splits)
        # the kernel's f16 K row may differ from NumPy's in one f16 rounding (its rotation's last f32
        # bit); the attention is held to the row it stored
        got_k = down(k, kc_d)
        assert rel(got_k[cur].astype(np.float32), k_rot) < 2.0 ** -11 + 4 * EPS
        kc[cur] = got_k[cur]
        np.testing.assert_array_equal(got_k, kc)
        np.testing.assert_array_equal(down(k, vc_d), vc)
        want = np.empty((heads, hd), np.float32)
        ref.attention_decode(q_rot, kc.astype(np.float32), vc.astype(np.float32), n_ctx, want)
        assert rel(down(k, out), want) < 64 * EPS
        np.testing.assert_array_equal(down(k, done), 0)
        # the blocks that ran wrote their partials' m (-inf for an empty one); the rest kept 0
        ran = min(max(-(-n_ctx // ATT_LONG_CHUNK), splits[0]), splits[1])
        m = down(k, part).reshape(heads, splits[1], hd + 2)[:, :, 0]
        assert np.all((m != 0).sum(axis=1) == ran)


def test_decode_head_sets_follow_the_kernel():
    """decode_heads_per_block (the grid's head sets) uses attention.cu's ATT_GROUP: a larger
    figure here would hand a block more heads than its accumulators hold."""
    import re

    from nerva_cli.planes.cuda.launch import ATT_GROUP, decode_blocks, decode_heads_per_block

    source = (Path(__file__).resolve().parent.parent / "kernels" / "attention.cu").read_text()
    assert int(re.search(r"#define ATT_GROUP (\d+)", source)[1]) == ATT_GROUP
    assert [decode_heads_per_block(32, 8, 128), decode_blocks(32, 8, 128)] == [4, 8]  # Llama-3-8B
    assert [decode_heads_per_block(9, 3, 64), decode_blocks(9, 3, 64)] == [3, 3]  # SmolLM2-135M
    assert [decode_heads_per_block(8, 4, 256), decode_blocks(8, 4, 256)] == [1, 8]  # Gemma 2 2B
    assert [decode_heads_per_block(12, 1, 64), decode_blocks(12, 1, 64)] == [4, 3]
    assert [decode_heads_per_block(10, 2, 96), decode_blocks(10, 2, 96)] == [1, 10]


def test_head_dims_the_engine_refuses_are_those_attention_misaligns(rng):
    """Every even head dim up to MAX_HEAD_DIM, decoded on the emulation (a misaligned load would
    poison a real GPU's context): those unsupported_shapes accepts run without a memory error
    and match ref; those it refuses (98, 250, ...) would make a misaligned word load, which the
    emulator reports as a GPU would fault."""
    from types import SimpleNamespace

    from cuda_emu import EmuKernelError
    from cuda_emu.device import EmuDevice
    from nerva_cli.planes.cuda.launch import MAX_HEAD_DIM, unsupported_shapes

    k, heads, kvh, n = Kernels(EmuDevice()), 2, 2, 3
    refused = []
    for hd in range(2, MAX_HEAD_DIM + 1, 2):
        cfg = SimpleNamespace(head_dim=hd, hidden_size=64, intermediate_size=128, q_dim=64)
        kc, vc = f16_cache(rng, 4, kvh, hd), f16_cache(rng, 4, kvh, hd)
        cos, sin = rope_tables(4, hd)
        q, k_new, v_new = randn(rng, heads, hd), randn(rng, kvh, hd), randn(rng, kvh, hd)
        out = up(k, np.zeros((heads, hd), np.float32))
        args = (up(k, q), up(k, k_new), up(k, v_new), up(k, cos), up(k, sin), up(k, kc), up(k, vc),
                up(k, np.array([n - 1], np.int32)), up(k, np.zeros(heads * (hd + 2), np.float32)),
                up(k, np.zeros(heads, np.int32)), out, heads, (1, 1))
        if unsupported_shapes(cfg):
            refused.append(hd)
            with pytest.raises(EmuKernelError, match="misaligned"):
                k.attention_decode(*args)
            continue
        k.attention_decode(*args)
        q_rot = q.copy()
        ref.rope(q_rot, np.array([n - 1]), cos, sin)
        want = np.empty((heads, hd), np.float32)  # over the cache the kernel wrote its new row to, as above
        ref.attention_decode(q_rot, down(k, args[5]).astype(np.float32), down(k, args[6]).astype(np.float32), n, want)
        assert rel(down(k, out), want) < 64 * EPS, hd
    assert refused == [h for h in range(98, 129, 4)] + [h for h in range(226, 257, 8) for h in (h, h + 2, h + 4)]
    too_wide = SimpleNamespace(head_dim=MAX_HEAD_DIM + 2, hidden_size=64, intermediate_size=128, q_dim=64)
    assert unsupported_shapes(too_wide) == f"head_dim {MAX_HEAD_DIM + 2}: the cuda attention kernels hold at most 256"
    assert unsupported_shapes(SimpleNamespace(head_dim=98, hidden_size=64, intermediate_size=128, q_dim=64)) == (
        "head_dim 98: the cuda attention kernels need a multiple of 4 for head dims 97 to 128")


# A block takes 32 (query, head) rows of one kv group and 32 positions' K and V at a time: the
# cases cover one and several blocks, a block that ends past the prompt, groups of 1 to 7 heads
# (a group that does not divide 32 splits a query's heads between blocks), several tiles with
# a partial last one, head dims of 1 to 8 elements a lane (70: 3, loaded one at a time), and
# positions split between blocks: evenly, unevenly, and more splits than tiles (empty splits,
# and splits whose rows see no position).
@pytest.mark.parametrize("T,start,heads,kvh,hd,splits", [
    (1, 0, 4, 2, 32, 1), (6, 0, 4, 2, 32, 1), (5, 11, 4, 2, 32, 2),
    (19, 0, 8, 2, 64, 1), (10, 45, 7, 1, 70, 3), (33, 3, 3, 3, 128, 1), (9, 70, 6, 2, 256, 2), (4, 0, 2, 1, 18, 1),
    (7, 200, 4, 2, 64, 5), (3, 20, 4, 1, 32, 4), (40, 90, 4, 2, 128, 3)])
def test_attention_prefill_causal(k, rng, T, start, heads, kvh, hd, splits):
    stride = heads * hd + 2 * kvh * hd
    qrows = randn(rng, T, stride)
    ctx = start + T + 7  # rows past the prompt's, which no query may see
    kc, vc = f16_cache(rng, ctx, kvh, hd), f16_cache(rng, ctx, kvh, hd)
    q = qrows[:, : heads * hd].reshape(T, heads, hd).copy()
    want = np.empty_like(q)
    ref.attention_prefill(q, kc[: start + T].astype(np.float32), vc[: start + T].astype(np.float32), start, want)
    out = up(k, np.zeros((T, heads, hd), np.float32))
    part = up(k, randn(rng, prefill_partials(T, heads, kvh, hd, splits)))  # every partial is written first
    done = up(k, np.zeros(64, np.int32))
    k.attention_prefill(up(k, qrows), stride, up(k, kc), up(k, vc), up(k, np.array([start], np.int32)), out, T, heads,
                        splits, part, done)
    assert rel(down(k, out), want) < 64 * EPS
    assert (down(k, done) == 0).all()  # ready for the next launch


def prefill_error(k, rng, kc, vc, heads, T, start, splits, window=0, softcap=0.0, seen=None):
    """attention_prefill of T random queries at positions start.. over the caches kc, vc (each
    position's row p % rows) against ref over `seen` (K, V of every position, default the caches'
    own rows): the relative error."""
    kvh, hd = kc.shape[1:]
    full_k, full_v = seen or (kc[: start + T], vc[: start + T])
    stride = heads * hd + 2 * kvh * hd
    qrows = randn(rng, T, stride)
    q = qrows[:, : heads * hd].reshape(T, heads, hd).copy()
    want = np.empty_like(q)
    ref.attention_prefill(q, full_k.astype(np.float32), full_v.astype(np.float32), start, want, window=window,
                          softcap=softcap)
    out = up(k, np.zeros((T, heads, hd), np.float32))
    part = up(k, randn(rng, prefill_partials(T, heads, kvh, hd, splits)))  # every partial is written first
    done = up(k, np.zeros(64, np.int32))
    k.attention_prefill(up(k, qrows), stride, up(k, kc), up(k, vc), up(k, np.array([start], np.int32)), out, T,
                        heads, splits, part, done, window, softcap)
    return rel(down(k, out), want)


@pytest.mark.parametrize("window", [1, 8, 37])
def test_attention_windows(k, rng, window):
    """A sliding-window layer's attention (Gemma 3's): decode over the last `window` positions,
    split over them (some splits empty where the window is short), and prefill's queries each
    over the `window` up to their own, with one split and several; both against ref."""
    heads, kvh, hd, ctx = 4, 1, 256, 300
    kc, vc = f16_cache(rng, ctx, kvh, hd), f16_cache(rng, ctx, kvh, hd)
    cos, sin = rope_tables(ctx, hd)
    for n, splits in ((5, (1, 1)), (70, (2, 5)), (299, (3, 8))):
        cur = n - 1
        q, k_new, v_new = randn(rng, heads, hd), randn(rng, kvh, hd), randn(rng, kvh, hd)
        kc_d, vc_d = up(k, kc), up(k, vc)
        out = up(k, np.zeros((heads, hd), np.float32))
        part, done = up(k, np.zeros(heads * splits[1] * (hd + 2), np.float32)), up(k, np.zeros(heads, np.int32))
        k.attention_decode(up(k, q), up(k, k_new), up(k, v_new), up(k, cos), up(k, sin), kc_d, vc_d,
                           up(k, np.array([cur], np.int32)), part, done, out, heads, splits, window)
        q_rot = q.copy()
        ref.rope(q_rot, np.array([cur]), cos, sin)
        first = max(0, n - window)
        kw, vw = down(k, kc_d)[first:n].astype(np.float32), down(k, vc_d)[first:n].astype(np.float32)
        want = np.empty((heads, hd), np.float32)
        ref.attention_decode(q_rot, kw, vw, n - first, want)
        assert rel(down(k, out), want) < 64 * EPS, (n, window)
    for T, start, splits in ((19, 0, 1), (9, 45, 2), (40, 200, 3)):
        assert prefill_error(k, rng, kc, vc, heads, T, start, splits, window) < 64 * EPS, (T, start, window)


def test_attention_over_a_ring_of_cache_rows(k, rng):
    """A sliding-window layer's cache on the GPU holds fewer rows than the context, position p in
    row p % rows (arena.cache_rows): decode over a 24-position window of 299 positions in 40 rows
    (its splits cross the wrap; the new row is stored at 298 % 40 and read back from there), and
    prefill of 19 and 7 queries over 8-position windows in 30 rows (the first tile it reads starts
    below the window, at rows other positions now hold: masked). Against ref over the positions
    themselves, to the bound of the whole-context kernels."""
    heads, kvh, hd = 4, 2, 64
    cos, sin = rope_tables(320, hd)
    n, rows, window = 299, 40, 24
    full_k, full_v = f16_cache(rng, n, kvh, hd), f16_cache(rng, n, kvh, hd)
    ring = np.arange(n - rows, n) % rows  # the rows of the last `rows` positions
    kc, vc = np.zeros((rows, kvh, hd), np.float16), np.zeros((rows, kvh, hd), np.float16)
    kc[ring], vc[ring] = full_k[n - rows:], full_v[n - rows:]
    q, k_new, v_new = randn(rng, heads, hd), randn(rng, kvh, hd), randn(rng, kvh, hd)
    kc_d, vc_d = up(k, kc), up(k, vc)
    out = up(k, np.zeros((heads, hd), np.float32))
    part, done = up(k, np.zeros(heads * 8 * (hd + 2), np.float32)), up(k, np.zeros(heads, np.int32))
    k.attention_decode(up(k, q), up(k, k_new), up(k, v_new), up(k, cos), up(k, sin), kc_d, vc_d,
                       up(k, np.array([n - 1], np.int32)), part, done, out, heads, (3, 8), window)
    q_rot, k_rot = q.copy(), k_new.copy()
    ref.rope(q_rot, np.array([n - 1]), cos, sin)
    ref.rope(k_rot, np.array([n - 1]), cos, sin)
    got_k = down(k, kc_d)
    np.testing.assert_array_equal(got_k[(n - 1) % rows], k_rot.astype(np.float16))
    full_k[n - 1], full_v[n - 1] = k_rot, v_new
    want = np.empty((heads, hd), np.float32)
    ref.attention_decode(q_rot, full_k[n - window:].astype(np.float32), full_v[n - window:].astype(np.float32),
                         window, want)
    assert rel(down(k, out), want) < 64 * EPS
    rows, window = 30, 8
    for T, start, splits in ((19, 45, 1), (7, 70, 2)):
        n = start + T
        full_k, full_v = f16_cache(rng, n, kvh, hd), f16_cache(rng, n, kvh, hd)
        ring = np.arange(n - rows, n) % rows
        kc, vc = np.zeros((rows, kvh, hd), np.float16), np.zeros((rows, kvh, hd), np.float16)
        kc[ring], vc[ring] = full_k[n - rows:], full_v[n - rows:]
        error = prefill_error(k, rng, kc, vc, heads, T, start, splits, window, seen=(full_k, full_v))
        assert error < 64 * EPS, (T, start)


def test_attention_caps_scores(k, rng):
    """Gemma 2's capped scores (softcap tanh(s / softcap) after the scale): a K cache 4x randn's
    makes scores of std about 4 at hd 64 (cap 3: most bent), decode over 70 and 299 positions in
    splits, with and without a window, and prefill in one split and three; against ref's capped
    attention, to the uncapped kernels' bound (tanhf is within a few ulp). And `softcap` on a
    vector of logits, against ref.capped."""
    heads, kvh, hd, ctx, cap = 4, 2, 64, 300, 3.0
    kc, vc = (4 * f16_cache(rng, ctx, kvh, hd)).astype(np.float16), f16_cache(rng, ctx, kvh, hd)
    cos, sin = rope_tables(ctx, hd)
    for n, splits, window in ((70, (2, 5), 0), (299, (3, 8), 0), (299, (3, 8), 37)):
        q, k_new, v_new = randn(rng, heads, hd), 4 * randn(rng, kvh, hd), randn(rng, kvh, hd)
        kc_d, vc_d = up(k, kc), up(k, vc)
        out = up(k, np.zeros((heads, hd), np.float32))
        part, done = up(k, np.zeros(heads * splits[1] * (hd + 2), np.float32)), up(k, np.zeros(heads, np.int32))
        k.attention_decode(up(k, q), up(k, k_new), up(k, v_new), up(k, cos), up(k, sin), kc_d, vc_d,
                           up(k, np.array([n - 1], np.int32)), part, done, out, heads, splits, window, cap)
        q_rot = q.copy()
        ref.rope(q_rot, np.array([n - 1]), cos, sin)
        first = max(0, n - window) if window else 0
        kw, vw = down(k, kc_d)[first:n].astype(np.float32), down(k, vc_d)[first:n].astype(np.float32)
        want, plain = np.empty((heads, hd), np.float32), np.empty((heads, hd), np.float32)
        ref.attention_decode(q_rot, kw, vw, n - first, want, softcap=cap)
        ref.attention_decode(q_rot, kw, vw, n - first, plain)
        assert rel(down(k, out), want) < 64 * EPS < rel(plain, want), (n, window)
    for T, start, splits in ((19, 0, 1), (40, 200, 3)):
        assert prefill_error(k, rng, kc, vc, heads, T, start, splits, softcap=cap) < 64 * EPS, (T, start)
    logits = 20 * randn(rng, 1001)
    got = up(k, logits)
    k.softcap(got, cap)
    assert rel(down(k, got), ref.capped(logits, cap)) < 4 * EPS


def test_prefill_splits_fill_the_gpu_only_when_row_blocks_do_not():
    # Llama-3-8B's heads on an H100: a 512-token pass is 512 row blocks; a 32-token turn is 32,
    # split 9 ways after 4064 tokens, and not after 100 (4 tiles a split at least)
    assert prefill_splits(512, 32, 8, 128, 512, 132) == 1
    assert prefill_splits(32, 32, 8, 128, 4096, 132) == 9
    assert prefill_splits(32, 32, 8, 128, 132, 132) == 1
    floats, counts = most_prefill_partials(32, 8, 128, 132, 512)
    for T in (1, 7, 32, 200, 512):
        splits = prefill_splits(T, 32, 8, 128, 1 << 20, 132)
        assert splits == 1 or prefill_partials(T, 32, 8, 128, splits) <= floats


# -- sampling ----------------------------------------------------------------------------------
def sample_once(k, logits, opts, state=(3, 0, 0, 0), recent=None, advance=True):
    st = up(k, np.array(state, np.int32))
    rc = up(k, np.zeros(RECENT, np.int32) if recent is None else recent)
    lg = up(k, logits)
    k.sample(lg, st, rc, opts, advance)
    return down(k, st), down(k, rc), down(k, lg)


def test_greedy_is_argmax_lowest_index_on_ties(k, rng):
    logits = randn(rng, 1000)
    logits[[17, 400]] = logits.max() + 1.0
    st, rc, _ = sample_once(k, logits, SamplingOptions(temperature=0.0))
    assert st[1] == 17 and rc[0] == 17
    assert list(st[[0, 2, 3]]) == [4, 1, 1]  # moved on one position, one draw, one sampled
    st, _, _ = sample_once(k, logits, SamplingOptions(temperature=0.0), advance=False)
    assert st[0] == 3


@pytest.mark.parametrize("vocab", [40003, 70000])
def test_greedy_over_a_vocab_of_many_load_rounds(k, rng, vocab):
    """A vocab a 1024-thread block reads in several rounds of float4 loads, with a tail of
    single elements when it is no multiple of 4: ties across the whole range still go to the
    lowest index, and a maximum in the last elements is found."""
    logits = randn(rng, vocab)
    top = logits.max() + 1.0
    logits[[vocab - 1, 5000, 36000]] = top  # the tail (for 40003), and two earlier ties
    st, _, _ = sample_once(k, logits, SamplingOptions(temperature=0.0))
    assert st[1] == 5000
    logits[[5000, 36000]] = 0.0
    st, _, _ = sample_once(k, logits, SamplingOptions(temperature=0.0))
    assert st[1] == vocab - 1


def test_sampled_tokens_stay_in_the_candidate_set_of_a_large_vocab(k, rng):
    """Top-k and top-p over 40003 logits (several load rounds a pass, and a tail): every draw is
    in the host sampler's candidate set, and more than one of them is drawn when none dominates."""
    vocab, draws = 40003, 40
    logits = randn(rng, vocab)
    opts = SamplingOptions(temperature=1.0, top_k=6, top_p=0.9, seed=int(rng.integers(1 << 31)))
    top = np.argsort(-logits, kind="stable")[:6]
    p = np.exp(logits[top] - logits[top].max())
    p /= p.sum()
    allowed = set(top[: int(np.searchsorted(np.cumsum(p), 0.9) + 1)].tolist())
    st, rc, lg = up(k, np.zeros(4, np.int32)), up(k, np.zeros(RECENT, np.int32)), up(k, logits)
    seen = set()
    for _ in range(draws):
        k.sample(lg, st, rc, opts, True)
        seen.add(int(down(k, st)[1]))
    assert seen <= allowed
    kept = np.sort(p[: len(allowed)])[::-1] / p[: len(allowed)].sum()
    if kept[0] < 0.5:  # then 40 draws of one token have probability below 2e-12
        assert len(seen) > 1


def test_repetition_penalty_as_the_host_sampler(k, rng):
    vocab = 300
    logits = randn(rng, vocab) * 3
    recent = rng.integers(0, vocab, RECENT).astype(np.int32)  # with repeats, applied once each
    opts = SamplingOptions(temperature=0.0, repeat_penalty=1.3)
    host = Sampler(opts, vocab)
    for t in recent:
        host.remember(int(t))
    want = host.penalised(logits.copy())
    st, _, got = sample_once(k, logits, opts, state=(0, 0, 0, 200), recent=recent)
    np.testing.assert_array_equal(got, want)
    assert st[1] == int(np.argmax(want))


def test_top_k_one_is_greedy(k, rng):
    logits = randn(rng, 500)
    st, _, _ = sample_once(k, logits, SamplingOptions(temperature=1.5, top_k=1, top_p=1.0, seed=7))
    assert st[1] == int(np.argmax(logits))


def test_sampled_frequencies_follow_the_truncated_softmax(k, rng):
    """Temperature, top-k and top-p together: every draw inside the host sampler's candidate set,
    frequencies within 5 standard errors of its probabilities (plus one draw). A NumPy
    multinomial of the same shapes fails that 3 times in 1e5 (4 standard errors: 16 in 1e5)."""
    vocab, draws = 40, 200
    logits = np.sort(randn(rng, vocab) * 2)[::-1].copy()
    rng.shuffle(logits)
    opts = SamplingOptions(temperature=0.8, top_k=8, top_p=0.9, seed=int(rng.integers(1 << 31)))
    top = np.argsort(-logits, kind="stable")[:8]
    p = np.exp((logits[top] - logits[top].max()) / 0.8)
    p /= p.sum()
    keep = int(np.searchsorted(np.cumsum(p), 0.9) + 1)
    allowed, probs = top[:keep], p[:keep] / p[:keep].sum()
    st = up(k, np.zeros(4, np.int32))
    rc, lg = up(k, np.zeros(RECENT, np.int32)), up(k, logits)
    seen = np.zeros(vocab, int)
    for _ in range(draws):
        k.sample(lg, st, rc, opts, True)
        seen[int(down(k, st)[1])] += 1
    assert seen[np.setdiff1d(np.arange(vocab), allowed)].sum() == 0
    freq = seen[allowed] / draws
    assert np.all(np.abs(freq - probs) <= 5 * np.sqrt(probs * (1 - probs) / draws) + 1.0 / draws)


def uniform01(seed: int, counter: int) -> float:
    """sample.cu's uniform01, in 32-bit arithmetic."""
    m = 0xFFFFFFFF
    x = ((seed * 0x9E3779B9) & m) ^ ((counter + 0x7F4A7C15) & m)
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    x ^= x >> 16
    return (x >> 8) / 16777216.0


# case: vocab, top_k, temperature, logit scale, the kept set's size about (top_p midway between two
# running masses; None: top_p 1), whether the kernel draws in value order (candidates sorted in
# shared memory) or in index order (bisection, and temperature alone), and the size min_p keeps
# of that (None: min_p 0)
DRAW_CASES = {
    "top_k": (40003, 40, 0.8, 2.0, 12, True, None),
    "top_k_ties": (5000, 40, 0.8, 2.0, 12, False, None),  # 1500 ties of the largest value: over 1024
    "top_p_only": (3000, 0, 1.5, 2.0, 12, True, None),
    "top_p_wide": (3000, 0, 1.0, 0.05, 2000, False, None),  # nearly flat: the top-p set passes its candidates
    "temperature_only": (3000, 0, 1.5, 2.0, None, False, None),
    "top_k_min_p": (40003, 40, 0.8, 2.0, None, True, 8),
    "top_p_then_min_p": (3000, 0, 1.5, 2.0, 30, True, 10),
    "min_p_only": (3000, 0, 1.5, 2.0, None, False, 25),  # bisection, its cut at min-p's
}


@pytest.mark.parametrize("case", list(DRAW_CASES))
def test_a_draw_is_the_inverse_cdf_of_its_uniform(k, rng, case):
    """Each draw, recomputed on the host from the kernel's own uniform: the token whose range of
    the kept mass holds it, the kept tokens in the order the kernel takes them. Draws whose
    uniform lies within 1e-5 of the total mass of a range boundary are skipped (float32 sums
    there may go either way); the kept set is built so no top-p cut lies that near. With 1500
    equal weights (top_k_ties) the boundaries are 1/1500 apart, so 3% of draws are skipped: 40
    draws skip more than 8 with probability ~1e-5 (24 draws and 20 checked failed in one CI
    run, a chance of ~1e-3)."""
    vocab, top_k, temperature, scale, size, by_value, min_size = DRAW_CASES[case]
    logits = randn(rng, vocab) * scale
    if case == "top_k_ties":
        logits[rng.choice(vocab, 1500, replace=False)] = logits.max() + 1.0
    top_p = 1.0
    if size is not None:  # top_p midway between two running masses of the candidates, away from every cut
        cand, w = ref.sampling_candidates(logits, temperature, top_k, 1.0)
        c = np.cumsum(w) / w.sum()
        j = min(len(c) - 2, size)
        top_p = float(np.float32((c[j] + c[j + 1]) / 2))
    kept, w = ref.sampling_candidates(logits, temperature, top_k, top_p)
    min_p = 0.0 if min_size is None else float(np.float32(between_weights(w, min_size)))  # as the kernel takes it
    kept, w = ref.sampling_candidates(logits, temperature, top_k, top_p, min_p)
    assert min_size is None or len(kept) == min_size
    if not by_value:
        w, kept = w[np.argsort(kept)], np.sort(kept)
    bounds = np.cumsum(w) / w.sum()
    seed = int(rng.integers(1 << 31))
    opts = SamplingOptions(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    st, rc, lg = up(k, np.zeros(4, np.int32)), up(k, np.zeros(RECENT, np.int32)), up(k, logits)
    checked = 0
    for draw in range(40):
        k.sample(lg, st, rc, opts, True)
        u = uniform01(seed, draw)
        if np.min(np.abs(bounds - u)) < 1e-5:
            continue
        assert int(down(k, st)[1]) == kept[np.searchsorted(bounds, u, side="right")], f"draw {draw}"
        checked += 1
    assert checked >= 32
