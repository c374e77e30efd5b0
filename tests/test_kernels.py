"""Every `cpu` kernel against `ref` on fresh random inputs, and `ref` against independent float64
formulas where that is cheap. Each test prints its seed; pytest shows it when the test fails.

Tolerances derive from float32's eps (1.2e-7). Two float32 sums of K terms taken in different
orders differ by about sqrt(K) eps times the sum of the terms' magnitudes, so dot products are
held per row to 4 sqrt(K) eps * sum_i |a_i b_i| (not to the result: a row whose terms cancel
to near zero would fail that through no fault), and elementwise kernels to a few eps in
relative norm ||a - b|| / ||b||. Both hold with a wide margin, yet any real indexing or scaling error gives
errors of order 1.
"""

from __future__ import annotations

import os
import re

import numba
import numpy as np
import pytest

from nerva_cli.planes import get_backend, ref  # cpu at import: its numba cache dir is fixed then

from nerva_cli.planes.cpu import kernels as cpu
from nerva_cli.planes.cpu.kernels import (  # the kernels' modules: the names and settings the contract does not expose
    decode_attention as cpu_decode_attention, prefill_attention as cpu_prefill_attention, exact as cpu_exact,
    gemm as cpu_gemm, glu as cpu_glu, integer_dots as cpu_integer_dots, ir_helpers as cpu_ir_helpers,
    numba_setup as cpu_numba_setup, q4 as cpu_q4, q4_bf16 as cpu_q4_bf16, q4_float as cpu_q4_float,
    q4_w4a8 as cpu_q4_w4a8, q8 as cpu_q8, quantize_act as cpu_quantize_act, target as cpu_target)

EPS = float(np.finfo(np.float32).eps)
ROWS = (1, 3, 5, 37, 1536)
COLS = (32, 64, 352, 576, 1536)  # 352: 11 blocks, a group of 8, a pair and a single


def sum_tol(k: int) -> float:
    return 4 * np.sqrt(k) * EPS


def assert_dots_close(got, want, magnitude, k, extra=0.0):
    """Per row |got - want| <= (4 sqrt(k) eps + extra) * magnitude, magnitude = sum_i |a_i b_i|:
    extra for an operand rounded before the products (relative, at most extra)."""
    assert np.all(np.abs(got.astype(np.float64) - want) <= (sum_tol(k) + extra) * magnitude)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def randn(rng, *shape):
    return rng.standard_normal(shape, dtype=np.float32)


KINDS = ("q4_0", "q4_1")


def random_q4(rng, rows, cols, kind="q4_0"):
    """Uniform random codes and signed scales of realistic size (llama.cpp's Q4_0 d can be
    negative) -> (qs, d, m); for Q4_1 offsets m around a block minimum (-8 d, with spread),
    else m None."""
    qs = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    d = (rng.uniform(0.002, 0.05, (rows, cols // 32)) * rng.choice([-1, 1], (rows, cols // 32)))
    m = (d * rng.uniform(-10, 2, d.shape)).astype(np.float16) if kind == "q4_1" else None
    return qs, d.astype(np.float16), m


def dequant_f64(qs, d, m=None):
    """Q4_0 (d (q - 8)) or Q4_1 (d q + m) decoded element by element from the layout's
    definition, independent of quant.py."""
    cols = qs.shape[1] * 2
    k = np.arange(cols)
    b, j = k // 32, k % 32
    byte = qs[:, b * 16 + j % 16].astype(np.int64)
    code = np.where(j < 16, byte & 15, byte >> 4)
    if m is None:
        return (code - 8) * d.astype(np.float64)[:, b]
    return code * d.astype(np.float64)[:, b] + m.astype(np.float64)[:, b]


def act_q8(backend, x):
    n = x.shape[0] // 32
    xq, xd, xs = np.empty(x.shape[0], np.int8), np.empty(n, np.float32), np.empty(n, np.int32)
    backend.quantize_act_q8(x, xq, xd, xs)
    return xq, xd, xs


def act_q16(backend, x):
    xq, xd = np.empty(x.shape[0], np.int16), np.empty(x.shape[0] // 32, np.float32)
    backend.quantize_act_q16(x, xq, xd)
    return xq, xd


def rope_tables(max_pos, head_dim):
    inv = 1.0 / 10000 ** (np.arange(0, head_dim, 2) / head_dim)
    ang = np.arange(max_pos)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


# -- backend selection and threads ------------------------------------------------------------

def test_get_backend():
    assert get_backend("ref") is ref and get_backend("cpu") is cpu
    with pytest.raises(ValueError, match="cpu, ref"):
        get_backend("cuda-please")


@pytest.mark.parametrize("module", ("scipy.linalg", "cffi"))
def test_cpu_backend_leaves_optional_imports_out_and_numba_working(tmp_path, module):
    """cpu loads numba's registries with scipy.linalg and cffi hidden (0.13 s and 0.03 s a run).
    numba's own np.dot, compiled later, must still find scipy's BLAS, and cffi must still import.
    In a fresh interpreter: this one may have imported both already."""
    import subprocess
    import sys

    pytest.importorskip("scipy.linalg.cython_blas" if module == "scipy.linalg" else module,
                        reason=f"{module} is not installed: nothing to leave out")
    script = tmp_path / "probe.py"
    script.write_text(f"""
import sys
import numpy as np
from numba import njit
from nerva_cli.planes.cpu import kernels as cpu
rng = np.random.default_rng()
x = rng.standard_normal((48, 3), dtype=np.float32)
cpu.rmsnorm(x, rng.standard_normal(3, dtype=np.float32), 1e-6, np.empty_like(x))
assert "{module}" not in sys.modules, "cpu's first kernel call imported {module}"
a, b = rng.standard_normal((5, 7)), rng.standard_normal((7, 4))
product = njit(lambda a, b: np.dot(a, b))(a, b)
assert np.allclose(product, a @ b, rtol=1e-12), "numba's np.dot"
if "{module}" == "scipy.linalg":
    assert "scipy.linalg" in sys.modules
else:
    import cffi
    assert cffi.FFI().sizeof("int") == 4
print("ok")
""")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_cpu_backend_loads_cached_kernels_without_numba_registries(tmp_path):
    """A run on a warm numba cache loads its kernels without numba's typing and lowering
    registries (0.2 s of its start); a cold one loads them at its first miss, to compile. Both
    processes' kernels (a serial one, a parallel one) must agree with ref. A module only the
    registries import tells whether they loaded; a private cache directory makes the first
    process cold and the second warm. Tolerances: f32 sums of 64 terms in another order."""
    import subprocess
    import sys

    script = tmp_path / "probe.py"
    script.write_text("""
import sys
import numpy as np
from nerva_cli.planes import ref
from nerva_cli.planes.cpu import kernels as cpu
rng = np.random.default_rng()
x = rng.standard_normal((3, 64), dtype=np.float32)
w = rng.standard_normal(64, dtype=np.float32)
got, want = np.empty_like(x), np.empty_like(x)
cpu.rmsnorm(x, w, 1e-6, got)
ref.rmsnorm(x, w, 1e-6, want)
assert np.allclose(got, want, rtol=1e-5, atol=1e-6), "rmsnorm"
m = rng.standard_normal((96, 64)).astype(np.float16)
got, want = np.empty(96, np.float32), np.empty(96, np.float32)
cpu.matvec_exact(m, x[0], got)
ref.matvec_exact(m, x[0], want)
assert np.allclose(got, want, rtol=1e-4, atol=1e-4), "matvec_exact"
print("numba.np.polynomial.polynomial_core" in sys.modules)
""")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba-cache"))
    registries = []
    for _ in range(2):
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
        assert run.returncode == 0, run.stderr[-2000:]
        registries.append(run.stdout.strip())
    assert registries == ["True", "False"]


def test_set_threads_rejects_out_of_range():
    with pytest.raises(ValueError):
        cpu.set_threads(0)


# -- f16 scales -------------------------------------------------------------------------------

def test_half_decoder_all_bit_patterns():
    from numba import njit

    @njit
    def decode_all(bits, out):
        for i in range(bits.shape[0]):
            out[i] = cpu_ir_helpers._half_to_f32(bits[i])

    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    got = np.empty(65536, np.float32)
    decode_all(bits, got)
    want = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))  # signed zeros too


# -- norms, rope, activation --------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(64,), (576,), (5, 576), (3, 1536), (2, 9, 64)])
def test_rmsnorm(rng, shape):
    x, w = randn(rng, *shape), randn(rng, shape[-1])
    want, got = np.empty_like(x), np.empty_like(x)
    ref.rmsnorm(x, w, 1e-5, want)
    cpu.rmsnorm(x, w, 1e-5, got)
    # the sum of squares is the only reduction; the rest is a few roundings per element
    assert rel(got, want) < sum_tol(shape[-1])
    x64 = x.astype(np.float64)
    ind = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-5) * w
    assert rel(want, ind) < sum_tol(shape[-1])
    cpu.rmsnorm(x, w, 1e-5, x)  # in place (q/k norms do this)
    assert np.array_equal(x, got)


@pytest.mark.parametrize("shape", [(576,), (4, 576), (2, 1536)])
def test_add_rmsnorm(rng, shape):
    x, res, w = randn(rng, *shape), randn(rng, *shape), randn(rng, shape[-1])
    res_ref, res_cpu = res.copy(), res.copy()
    want, got = np.empty_like(x), np.empty_like(x)
    ref.add_rmsnorm(x, res_ref, w, 1e-6, want)
    cpu.add_rmsnorm(x, res_cpu, w, 1e-6, got)
    assert np.array_equal(res_cpu, res + x)  # one IEEE add per element: exact
    assert np.array_equal(res_ref, res + x)
    assert rel(got, want) < sum_tol(shape[-1])


@pytest.mark.parametrize("shape", [(960,), (37, 160)])
def test_add_rows(rng, shape):
    x, b = randn(rng, *shape), randn(rng, shape[-1])
    want, got = x.copy(), x.copy()
    ref.add_rows(want, b)
    cpu.add_rows(got, b)
    assert np.array_equal(got, want) and np.array_equal(want, x + b)  # one IEEE add per element: exact


@pytest.mark.parametrize("T,heads,head_dim", [(1, 9, 64), (1, 3, 64), (5, 4, 32), (37, 2, 128)])
def test_rope(rng, T, heads, head_dim):
    cos, sin = rope_tables(600, head_dim)
    pos = rng.integers(0, 600, T).astype(np.int64)
    x = randn(rng, T, heads, head_dim)
    want, got = x.copy(), x.copy()
    ref.rope(want, pos, cos, sin)
    cpu.rope(got, pos, cos, sin)
    # per element x1 c - x2 s: two products and a sum, a few eps of ||x|| (a rotation keeps it)
    assert rel(got, want) < 8 * EPS
    half = head_dim // 2
    c, s = cos[pos][:, None].astype(np.float64), sin[pos][:, None].astype(np.float64)
    x1, x2 = x[..., :half].astype(np.float64), x[..., half:]
    assert rel(want, np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)) < 8 * EPS
    flat = x.reshape(T, -1).copy()  # the same rotation through a [T, heads * head_dim] view
    cpu.rope(flat, pos.astype(np.int32), cos, sin)
    assert np.array_equal(flat.reshape(x.shape), got)


@pytest.mark.parametrize("shape", [(37,), (1536,), (5, 576)])
def test_silu_mul(rng, shape):
    """gate and up as the fused projection leaves them: each row's gate, then its up."""
    gate, up = 4 * randn(rng, *shape), randn(rng, *shape)
    gate.flat[0] = -100.0  # exp(100) overflows float32: silu must give (nearly) -0, not NaN
    gate_up = np.concatenate([gate, up], axis=-1)
    want, got = np.empty_like(gate), np.empty_like(gate)
    ref.silu_mul(gate_up, want)
    cpu.silu_mul(gate_up, got)
    # elementwise; exp implementations (libm vs NumPy's SIMD) differ by an ulp or two
    assert rel(got, want) < 8 * EPS
    g64 = gate.astype(np.float64)
    assert rel(want, g64 / (1 + np.exp(-g64)) * up) < 8 * EPS


@pytest.mark.parametrize("shape", [(37,), (6912,), (5, 576)])
def test_gelu_mul(rng, shape):
    """GeGLU as Gemma's gelu_pytorch_tanh, against its tanh formula in float64. cpu computes
    0.5 (1 + tanh(u)) as sigmoid(2u) with its own exp, ref through NumPy's tanh: each within a few
    ulps of it (8 eps on the vector, as silu_mul)."""
    gate, up = 4 * randn(rng, *shape), randn(rng, *shape)
    gate.flat[0], gate.flat[-1] = -100.0, 60.0  # the cube overflows the exp's range both ways: 0 and g
    gate_up = np.concatenate([gate, up], axis=-1)
    want, got = np.empty_like(gate), np.empty_like(gate)
    ref.gelu_mul(gate_up, want)
    cpu.gelu_mul(gate_up, got)
    assert np.isfinite(got).all()
    assert rel(got, want) < 8 * EPS
    g64 = gate.astype(np.float64)
    exact = 0.5 * g64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64 ** 3))) * up
    assert rel(want, exact) < 8 * EPS and rel(got, exact) < 8 * EPS


# -- activation quantiser and Q4_0 matvecs ---------------------------------------------------

@pytest.mark.parametrize("bits", (8, 16))
@pytest.mark.parametrize("cols", COLS)
def test_quantize_act(rng, cols, bits):
    top, quantise = (127, act_q8) if bits == 8 else (32767, act_q16)
    x = randn(rng, cols) * rng.uniform(0.1, 10)
    got, want = quantise(cpu, x), quantise(ref, x)
    for g, w in zip(got, want):  # every step is correctly rounded: exact
        assert g.dtype == w.dtype and np.array_equal(g, w)
    xq, xd = want[:2]
    g = x.reshape(-1, 32)
    assert np.array_equal(xd, np.abs(g).max(1) / np.float32(top))
    assert np.array_equal(np.abs(xq.reshape(-1, 32)).max(1), np.full(cols // 32, top))
    if bits == 8:
        assert np.array_equal(want[2], xq.reshape(-1, 32).sum(1))
    err = np.abs(xq.reshape(-1, 32) * xd[:, None].astype(np.float64) - g)
    # half a step, and x * (1/d)'s two roundings: at most 2 eps of a code up to `top`
    assert np.all(err <= xd[:, None] * (0.5 + top * 2 * EPS))


@pytest.mark.parametrize("rows,cols", [(1, 32), (5, 576), (37, 1536)])
def test_fake_quantize_q8_is_quantize_then_scale(rng, rows, cols):
    x = randn(rng, rows, cols) * rng.uniform(0.1, 10)
    got, want = np.empty_like(x), np.empty_like(x)
    cpu.fake_quantize_q8(x, got)
    ref.fake_quantize_q8(x, want)
    assert np.array_equal(got, want)  # the same correctly rounded steps: exact
    for r in range(rows):  # and each row is exactly what the decode quantiser makes of it
        xq, xd, _ = act_q8(ref, x[r].copy())
        assert np.array_equal(want[r], (xq.reshape(-1, 32) * xd[:, None]).reshape(-1))


def test_quantize_act_q16_ties_and_zero_group():
    # amax 32767 gives scale 1 exactly: exact halves round away from zero, as Q8's
    x = np.zeros(64, np.float32)
    x[:6] = [-32767, 2.5, -2.5, 0.5, -0.5, 1.4999999]
    for backend in (ref, cpu):
        xq, xd = act_q16(backend, x)
        assert list(xq[:6]) == [-32767, 3, -3, 1, -1, 1]
        assert xd[0] == 1 and xd[1] == 0 and not xq[32:].any()


def test_quantize_act_q8_ties_and_zero_group():
    # amax 127 gives scale 1 exactly, so x * (1/scale) lands on exact halves: away from zero
    x = np.zeros(64, np.float32)
    x[:6] = [127, 2.5, -2.5, 0.5, -0.5, 1.4999999]
    for backend in (ref, cpu):
        xq, xd, xs = act_q8(backend, x)
        assert list(xq[:6]) == [127, 3, -3, 1, -1, 1]
        assert xd[1] == 0 and not xq[32:].any() and xs[1] == 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("cols", COLS)
def test_matvec_q4_w4a16(rng, rows, cols, kind):
    qs, d, m = random_q4(rng, rows, cols, kind)
    x = randn(rng, cols)
    got = np.empty(rows, np.float32)
    cpu.matvec_q4_w4a16(qs, d, m, x, got)
    assert_w4a16_close(got, qs, d, m, x, split=cpu_target._AVX512BF16, q16=not cpu_target._AVX512F)


# The bf16 lowering's activations: hi = bf16(x) and lo = bf16(x - hi). Rounding to bf16's 8
# significant bits errs by at most 2^-8 relative, so lo misses x - hi by at most 2^-8 |x - hi|
# <= 2^-16 |x|; its products and sums are exact and f32.
SPLIT_ERROR = 2.0 ** -16


def assert_w4a16_close(got, qs, d, m, x, split=False, q16=False):
    """got within ref's bound of ref's matvec (and ref of the f64 product); `split`: got comes
    from the bf16 lowering, whose activations carry SPLIT_ERROR; `q16`: from the integer one on
    Q16 codes, each activation within half its group's step d_x (the W8A16 bound below)."""
    want = np.empty_like(got)
    ref.matvec_q4_w4a16(qs, d, m, x, want)
    w64 = dequant_f64(qs, d, m)
    magnitude = np.abs(w64) @ np.abs(x)
    if m is not None:  # one lowering sums d q x and m x apart: their magnitudes, not the weight's
        magnitude = np.abs(w64 - np.repeat(m.astype(np.float64), 32, axis=1)) @ np.abs(x) + \
            np.abs(np.repeat(m.astype(np.float64), 32, axis=1)) @ np.abs(x)
    step = 0.0
    if q16:
        xd = act_q16(ref, x)[1].astype(np.float64)
        step = np.abs(w64) @ np.repeat(xd * (0.5 + 1e-3), 32)
    assert np.all(np.abs(got.astype(np.float64) - want)
                  <= (sum_tol(x.shape[0]) + (SPLIT_ERROR if split else 0.0)) * magnitude + step)
    assert_dots_close(want, w64 @ x, magnitude, x.shape[0])


def _serial_w4a16(lowering):
    """A fresh, uncached serial driver of one of the W4A16 intrinsics (inspect_asm needs one):
    "bf16-dots" (_w4a16_bf16_row, after _bf16_split), "row-table" or "q16-codes" (W4A8's row
    intrinsic on the Q16 codes of _quantize_q16)."""
    from numba import njit

    @njit
    def bf16_dots(qs, d, m, x, out):
        blocks = x.shape[0] // 32
        words = np.empty((blocks + 1) // 2 * 128, np.uint16)
        sums = np.empty(blocks, np.float32)
        cpu_q4_bf16._bf16_split(x, words, sums)
        for r in range(d.shape[0]):
            out[r] = cpu_q4_bf16._w4a16_bf16_row(qs, d, m, words, sums, r)

    @njit
    def row_table(qs, d, m, x, out):
        for r in range(d.shape[0]):
            out[r] = cpu_q4_float._w4a16_row(qs, d, m, x, r)

    @njit
    def q16_codes(qs, d, m, x, out):
        n = x.shape[0]
        xq, xd, xs = np.empty(n, np.int16), np.empty(n // 32, np.float32), np.empty(n // 32, np.int32)
        cpu_quantize_act._quantize_q16(x, xq, xd, xs)
        for r in range(d.shape[0]):
            out[r] = cpu_q4_w4a8._w4a8_row(qs, d, m, xq, xq, xd, xs, r)
    return {"bf16-dots": bf16_dots, "row-table": row_table, "q16-codes": q16_codes}[lowering]


W4A16_LOWERINGS = {"bf16-dots": "avx512bf16", "row-table": "avx512f", "q16-codes": None}  # -> the feature it needs


def host_w4a16_lowering() -> str:
    return "bf16-dots" if cpu_target._AVX512BF16 else "row-table" if cpu_target._AVX512F else "q16-codes"


@pytest.mark.parametrize("lowering", W4A16_LOWERINGS)
@pytest.mark.parametrize("kind", KINDS)
def test_matvec_q4_w4a16_kernels(rng, kind, lowering):
    # Every W4A16 lowering the host can run (the row tables need AVX-512F, the dots AVX512-BF16);
    # they round differently, so each is held to ref's bound, not to the others' bits, and the
    # host's matvec must be its own lowering's bits.
    needs = W4A16_LOWERINGS[lowering]
    if needs is not None and not cpu_target._host_has(needs):
        pytest.skip(f"this host lacks {needs}")
    rows, cols = 37, 352 + 576  # 29 blocks: a span of 16 and 13 left over (6 pairs and one)
    qs, d, m = random_q4(rng, rows, cols, kind)
    x = randn(rng, cols)
    got, host = np.empty(rows, np.float32), np.empty(rows, np.float32)
    kernel = _serial_w4a16(lowering)
    kernel(qs, d.view(np.uint16), None if m is None else m.view(np.uint16), x, got)
    asm = next(iter(kernel.inspect_asm().values()))
    if cpu_target._AVX2:  # the Q16 codes' dots are vpmaddwd's; the lookups and bf16 dots take none
        assert ("vpmaddwd" in asm) == (lowering == "q16-codes")
    assert ("vdpbf16ps" in asm) == (lowering == "bf16-dots")
    assert_w4a16_close(got, qs, d, m, x, split=lowering == "bf16-dots", q16=lowering == "q16-codes")
    if lowering == host_w4a16_lowering():
        cpu.matvec_q4_w4a16(qs, d, m, x, host)
        assert np.array_equal(host, got)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("cols", COLS)
def test_matvec_q4_w4a8(rng, rows, cols, kind):
    qs, d, m = random_q4(rng, rows, cols, kind)
    xq, xd, xs = act_q8(ref, randn(rng, cols))
    want, got = np.empty(rows, np.float32), np.empty(rows, np.float32)
    ref.matvec_q4_w4a8(qs, d, m, xq, xd, xs, want)
    cpu.matvec_q4_w4a8(qs, d, m, xq, xd, xs, got)
    # Block terms d_w d_x isum (+ m d_x xs for Q4_1) are the same up to a rounding or two (an
    # FMA may skip one); only their f32 sum over nb blocks differs in order: per row at most
    # 2 (nb + 2) eps times the sum of the terms' magnitudes (of both parts, for Q4_1).
    nb = cols // 32
    terms = np.einsum("rbj,bj->rb", dequant_f64(qs, d, m).reshape(rows, nb, 32), xq.reshape(nb, 32)) * xd
    size = np.abs(terms)
    if m is not None:
        offset = m.astype(np.float64) * xd * xs
        size = np.abs(terms - offset) + np.abs(offset)
    bound = 2 * (nb + 2) * EPS * size.sum(1)
    assert np.all(np.abs(got - want) <= bound)
    assert np.all(np.abs(want - terms.sum(1)) <= bound)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", (1, 5, 37, 1536))
@pytest.mark.parametrize("cols", (32, 352, 576, 1536))
def test_matvec_q4_w4a8_integer_dot_exact(rng, rows, cols, kind):
    # With unit scales (and Q4_1 offsets of 1) each block term is the integer
    # sum_j q_w q_x - 8 xs (+ xs) and every partial sum stays below 2^24, so any order is
    # exact: this pins the integer part bit for bit.
    qs = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    d = np.ones((rows, cols // 32), np.float16)
    m = d.copy() if kind == "q4_1" else None
    xq = rng.integers(-127, 128, cols, dtype=np.int8)
    xd = np.ones(cols // 32, np.float32)
    xs = xq.reshape(-1, 32).sum(1, dtype=np.int32)
    want, got = np.empty(rows, np.float32), np.empty(rows, np.float32)
    ref.matvec_q4_w4a8(qs, d, m, xq, xd, xs, want)
    cpu.matvec_q4_w4a8(qs, d, m, xq, xd, xs, got)
    exact = ref.unpack_q4_codes(qs).reshape(rows, cols).astype(np.int64) + (1 if m is not None else -8)
    assert np.array_equal(want, exact @ xq.astype(np.int64))
    assert np.array_equal(got, want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("acts", (1, 3, 4, 8, 13, 21))  # row kernel tiles of 8, 4, 1; lanes from 12 or 16
@pytest.mark.parametrize("cols", (32, 352, 576))  # blocks: one; 8 + a pair + one; 16 + a pair
def test_matmul_q4_w4a8_is_the_matvec_of_each_activation(rng, acts, cols, kind):
    # A prompt's W4A8 GEMM: activation t's outputs are the backend's own matvec of it, bit for bit
    # (the same arithmetic a row; the cpu unpacks a row's codes once for a tile of them: rows in
    # lanes from _LANES_FROM activations, 16 a tile with AVX-512BW and 8 with AVX2, 37 rows
    # leaving a tile of 5), written into a column slice of a wider array and nowhere else. The
    # matvecs are held to ref above.
    rows = 37
    qs, d, m = random_q4(rng, rows, cols, kind)
    x = randn(rng, acts, cols)
    for backend in (cpu, ref):
        xq, xd, xs = np.empty((acts, cols), np.int8), np.empty((acts, cols // 32), np.float32), \
            np.empty((acts, cols // 32), np.int32)
        backend.quantize_act_q8(x.reshape(-1), xq.reshape(-1), xd.reshape(-1), xs.reshape(-1))
        wide = np.full((acts, rows + 7), np.nan, np.float32)
        backend.matmul_q4_w4a8(qs, d, m, xq, xd, xs, wide[:, 3:3 + rows])
        for t in range(acts):
            want = np.empty(rows, np.float32)
            backend.matvec_q4_w4a8(qs, d, m, *act_q8(backend, x[t]), want)
            assert np.array_equal(wide[t, 3:3 + rows], want), (backend.__name__, t)
        assert np.isnan(wide[:, :3]).all() and np.isnan(wide[:, 3 + rows:]).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("acts", (1, 3, 4, 9))  # the cpu's tiles of four and one
@pytest.mark.parametrize("cols", (32, 352 + 576, 576))  # 29 blocks: a span of 16 and 13 left over
def test_matmul_q4_w4a16_is_the_matvec_of_each_activation(rng, acts, cols, kind):
    # As the W4A8 test above, for W4A16's batch form: the row tables' or bf16 dots' (AVX-512F),
    # else the integer walk on each row's Q16 codes.
    rows = 37
    qs, d, m = random_q4(rng, rows, cols, kind)
    x = randn(rng, acts, cols)
    for backend in (cpu, ref):
        wide = np.full((acts, rows + 7), np.nan, np.float32)
        backend.matmul_q4_w4a16(qs, d, m, x, wide[:, 3:3 + rows])
        for t in range(acts):
            want = np.empty(rows, np.float32)
            backend.matvec_q4_w4a16(qs, d, m, x[t], want)
            assert np.array_equal(wide[t, 3:3 + rows], want), (backend.__name__, t)
        assert np.isnan(wide[:, :3]).all() and np.isnan(wide[:, 3 + rows:]).all()


@pytest.mark.skipif(not cpu_target._AVX512BF16, reason="this host lacks avx512bf16")
def test_w4a16_wider_than_the_bf16_stack_scratch(rng):
    # The bf16 matvec splits its activation on its stack, which holds _BF16_MOST_COLS; a wider
    # one takes a heap buffer, with the same arithmetic (so the batch form still equals it).
    rows, cols = 5, cpu_q4_bf16._BF16_MOST_COLS + 32 * 3  # an odd block count: the last block alone
    qs, d, m = random_q4(rng, rows, cols, "q4_1")
    x = randn(rng, 2, cols)
    got = np.empty(rows, np.float32)
    cpu.matvec_q4_w4a16(qs, d, m, x[0], got)
    assert_w4a16_close(got, qs, d, m, x[0], split=True)
    batch = np.empty((2, rows), np.float32)
    cpu.matmul_q4_w4a16(qs, d, m, x, batch)
    assert np.array_equal(batch[0], got)


def random_q8(rng, rows, cols):
    """Q8_0 planes: codes over the whole int8 range (-128 too, which llama.cpp's quantiser does not
    write but a file may hold) and signed scales of a token table's size."""
    q8 = rng.integers(-128, 128, (rows, cols), dtype=np.int8)
    d = rng.uniform(0.0005, 0.005, (rows, cols // 32)) * rng.choice([-1, 1], (rows, cols // 32))
    return q8, d.astype(np.float16)


def dequant_q8_f64(q8, d):
    return q8.astype(np.float64) * np.repeat(d.astype(np.float64), 32, axis=1)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("cols", COLS)
def test_matvec_q8_w8a16(rng, rows, cols):
    q8, d = random_q8(rng, rows, cols)
    x = randn(rng, cols)
    xq, xd = act_q16(ref, x)
    want, got = np.empty(rows, np.float32), np.empty(rows, np.float32)
    ref.matvec_q8_w8a16(q8, d, xq, xd, want)
    cpu.matvec_q8_w8a16(q8, d, xq, xd, got)
    # as test_matvec_q8_w8a8: block terms equal up to a rounding or two, their sum reordered
    nb = cols // 32
    w64 = dequant_q8_f64(q8, d)
    terms = np.einsum("rbj,bj->rb", w64.reshape(rows, nb, 32), xq.reshape(nb, 32)) * xd
    bound = 2 * (nb + 2) * EPS * np.abs(terms).sum(1)
    assert np.all(np.abs(got - want) <= bound)
    assert np.all(np.abs(want - terms.sum(1)) <= bound)
    # against the float activation: each code within half a step of its value (2^-16 of the
    # group's largest), so the row is within sum_b d_x,b / 2 * sum_j |w_bj| of w . x
    step = (np.abs(w64).reshape(rows, nb, 32).sum(2) * xd * (0.5 + 1e-3)).sum(1)
    assert np.all(np.abs(want - w64 @ x) <= step + bound)


@pytest.mark.parametrize("lanes", (8, 16))
@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_q4_at_either_width(rng, monkeypatch, kind, lanes):
    """The Q4 dequantisation at the width a host without AVX-512 compiles (8 floats) and the one
    a host with it does (16), built here fresh whatever the host (16-lane IR lowers to two AVX2
    registers): ref's values bit for bit."""
    from numba import njit

    monkeypatch.setattr(cpu_q4_float, "_LANES", lanes)
    rows, cols = 13, 352  # 11 blocks

    @njit
    def dequantize(qs, d, m, out):
        for r in range(d.shape[0]):
            cpu_q4_float._dequantize_q4_row(qs, d, m, out, r)
    qs, d, m = random_q4(rng, rows, cols, kind)
    bits = (d.view(np.uint16), None if m is None else m.view(np.uint16))
    dense, want = np.empty((rows, cols), np.float32), np.empty((rows, cols), np.float32)
    dequantize(qs, *bits, dense)
    llvm = next(iter(dequantize.inspect_llvm().values()))
    assert f"load <{lanes} x i8>" in llvm and f"load <{24 - lanes} x i8>" not in llvm  # the codes, a vector a load
    ref.dequantize_q4(qs, d, m, want)
    assert np.array_equal(dense, want)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("cols", COLS)
def test_matvec_q8_w8a8(rng, rows, cols):
    q8, d = random_q8(rng, rows, cols)
    xq, xd, _ = act_q8(ref, randn(rng, cols))
    want, got = np.empty(rows, np.float32), np.empty(rows, np.float32)
    ref.matvec_q8_w8a8(q8, d, xq, xd, want)
    cpu.matvec_q8_w8a8(q8, d, xq, xd, got)
    # as test_matvec_q4_w4a8: block terms equal up to a rounding or two, their sum reordered
    nb = cols // 32
    terms = np.einsum("rbj,bj->rb", dequant_q8_f64(q8, d).reshape(rows, nb, 32), xq.reshape(nb, 32)) * xd
    bound = 2 * (nb + 2) * EPS * np.abs(terms).sum(1)
    assert np.all(np.abs(got - want) <= bound)
    assert np.all(np.abs(want - terms.sum(1)) <= bound)


@pytest.mark.parametrize("bits", (8, 16))
@pytest.mark.parametrize("acts", (1, 2, 3, 8, 13, 32))  # the cpu's tiles of 8, 4 and 1
@pytest.mark.parametrize("cols", (32, 352, 576))  # blocks: one; 8 + a pair + one; 16 + a pair
def test_matmul_q8_is_the_matvec_of_each_activation(rng, acts, cols, bits):
    # A batched decode step's Q8_0 lm_head: activation t's outputs are the backend's own matvec
    # of it, bit for bit, written into a column slice of a wider array and nowhere else. The
    # matvecs are held to ref above.
    rows = 37
    q8, d = random_q8(rng, rows, cols)
    x = randn(rng, acts, cols)
    for backend in (cpu, ref):
        matmul, matvec = (backend.matmul_q8_w8a8, backend.matvec_q8_w8a8) if bits == 8 else \
            (backend.matmul_q8_w8a16, backend.matvec_q8_w8a16)
        codes = [act_q8(backend, x[t])[:2] if bits == 8 else act_q16(backend, x[t]) for t in range(acts)]
        xq, xd = np.stack([c[0] for c in codes]), np.stack([c[1] for c in codes])
        wide = np.full((acts, rows + 7), np.nan, np.float32)
        matmul(q8, d, xq, xd, wide[:, 3:3 + rows])
        for t in range(acts):
            want = np.empty(rows, np.float32)
            matvec(q8, d, xq[t], xd[t], want)
            assert np.array_equal(wide[t, 3:3 + rows], want), (backend.__name__, t)
        assert np.isnan(wide[:, :3]).all() and np.isnan(wide[:, 3 + rows:]).all()
    assert cpu.batch_matches_matvec("q8", "w4a16") and cpu.batch_matches_matvec("q8", "w4a8")


@pytest.mark.parametrize("bits", (8, 16))
@pytest.mark.parametrize("rows", (1, 5, 37, 1536))
@pytest.mark.parametrize("cols", (32, 352, 576, 1536))
def test_matvec_q8_integer_dot_exact(rng, rows, cols, bits):
    # Unit scales: each block term is an integer dot. Random signs keep a row's partial sums near
    # sqrt(cols) * 128 * 127 / 2, far below 2^24 (the total is checked), so any order is exact and
    # this pins the integer part bit for bit. W8A16's codes: the full int16 range in the first
    # two groups (vpmaddwd's pairs at their largest), small ones elsewhere.
    q8 = rng.integers(-128, 128, (rows, cols), dtype=np.int8)
    d = np.ones((rows, cols // 32), np.float16)
    if bits == 8:
        xq = rng.integers(-127, 128, cols, dtype=np.int8)
    else:
        xq = rng.integers(-100, 101, cols).astype(np.int16)
        xq[rng.integers(0, 32)] = 32767
        if cols > 32:
            xq[32 + rng.integers(0, 32)] = -32767
    xd = np.ones(cols // 32, np.float32)
    kernels = (ref.matvec_q8_w8a8, cpu.matvec_q8_w8a8) if bits == 8 else (ref.matvec_q8_w8a16, cpu.matvec_q8_w8a16)
    want, got = np.empty(rows, np.float32), np.empty(rows, np.float32)
    kernels[0](q8, d, xq, xd, want)
    kernels[1](q8, d, xq, xd, got)
    exact = q8.astype(np.int64) @ xq.astype(np.int64)
    assert np.all(np.abs(exact) < 2 ** 24)
    assert np.array_equal(want, exact) and np.array_equal(got, want)


@pytest.mark.parametrize("bits, marker", [(8, "vpmaddubsw"), (16, "vpmaddwd")])
def test_matvec_q8_portable_lowering(rng, monkeypatch, bits, marker):
    # As test_matvec_q4_w4a8_lowerings' portable case, for the signed dots: W8A8's (vpsignb and
    # vpmaddubsw with AVX2) and W8A16's (vpmovsxbw and vpmaddwd); widening IR without AVX2.
    from numba import njit

    row, public = (cpu_q8._w8a8_row, cpu.matvec_q8_w8a8) if bits == 8 else (cpu_q8._w8a16_row, cpu.matvec_q8_w8a16)

    def serial():
        @njit
        def matvec(q8, d, xq, xd, out):
            for r in range(d.shape[0]):
                out[r] = row(q8, d, xq, xd, r)
        return matvec

    rows, cols = 37, 576
    q8, d = random_q8(rng, rows, cols)
    x = randn(rng, cols)
    xq, xd = act_q8(ref, x)[:2] if bits == 8 else act_q16(ref, x)
    host, got, want = (np.empty(rows, np.float32) for _ in range(3))
    public(q8, d, xq, xd, host)
    native = serial()
    native(q8, d.view(np.uint16), xq, xd, want)
    monkeypatch.setattr(cpu_integer_dots, "_AVX2", False)
    portable = serial()
    portable(q8, d.view(np.uint16), xq, xd, got)
    assert marker not in next(iter(portable.inspect_asm().values()))
    if cpu_target._host_has("avx2"):
        assert marker in next(iter(native.inspect_asm().values()))
    assert np.array_equal(got, want) and np.array_equal(want, host)


@pytest.mark.parametrize("rows,cols", [(3, 64), (37, 576)])
def test_dequantize_embed_q8(rng, rows, cols):
    q8, d = random_q8(rng, rows, cols)
    want, got = np.empty((rows, cols), np.float32), np.empty((rows, cols), np.float32)
    ref.dequantize_q8(q8, d, want)
    cpu.dequantize_q8(q8, d, got)
    assert np.array_equal(got, want) and np.array_equal(want, dequant_q8_f64(q8, d))  # one product, exact
    for backend in (ref, cpu):
        row = np.empty(cols, np.float32)
        backend.embed_q8(q8, d, rows - 1, row)
        assert np.array_equal(row, want[rows - 1])


def _serial_w4a8():
    """A fresh, uncached serial driver of the W4A8 row intrinsic: it lowers the IR as the
    module's settings stand when it is first called."""
    from numba import njit

    @njit
    def matvec(qs, d, m, xq, x_pairs, xd, xs, out):
        for r in range(d.shape[0]):
            out[r] = cpu_q4_w4a8._w4a8_row(qs, d, m, xq, x_pairs, xd, xs, r)
    return matvec


def _serial_w4a8_row_batch():
    """As _serial_w4a8, for the batch intrinsic: four activations (the rows of 2-D operands) a call."""
    from numba import njit

    @njit
    def matmul(qs, d, m, xq, x_pairs, xd, xs, out):
        for r in range(d.shape[0]):
            v = cpu_q4_w4a8._w4a8_row_batch(qs, d, m, xq, x_pairs, xd, xs, r, 0, 4)
            for t in range(4):
                out[t, r] = v[t]
    return matmul


def _serial_w4a8_lanes():
    """As _serial_w4a8, for the prompt GEMM's rows-in-lanes tile (AVX2 or AVX-512BW), every tile
    of rows (as many as codes' lanes) and eight activations in turn."""
    from numba import njit

    @njit
    def matmul(qs32, d, m, xq, xd, xs, out, codes, scales, offsets):
        for r0 in range(0, d.shape[0], codes.shape[2]):
            cpu_q4_w4a8._pack_lane_rows(qs32, d, m, r0, codes, scales, offsets)
            for t0 in range(0, xq.shape[0], cpu_q4_w4a8._LANE_ACTS):
                cpu_q4_w4a8._w4a8_lane_tile(codes, scales, offsets, xq, xd, xs, out, r0, t0)
    return matmul


# Each lowering of the W4A8 row kernel this host can run, by the flags that pick it: the integer
# dots are exact whichever instructions make them, and the float combine is the same IR, so each
# must give the host kernel's results bit for bit (host vs ref: the tests above).
W4A8_LOWERINGS = {  # name: (_AVX512VNNI, _AVX512BW, _AVX2), what the asm must show, its features
    "avx512-vnni": ((True, True, True), "vpdpbusd\t.*zmm", ("avx512bw", "avx512vnni")),
    "avx512bw": ((False, True, True), "vpmaddubsw\t.*zmm", ("avx512bw",)),
    "avx2": ((False, False, True), "vpmaddubsw\t.*ymm", ("avx2",)),
    "portable": ((False, False, False), None, ()),
}


def test_w4a8_row_batch_loads_a_rows_codes_once():
    # The batch intrinsic generates each activation's dot in full and leaves it to LLVM to merge
    # the identical code loads and unpacking: four activations must make four times the
    # vpdpbusd of one, from the same broadcast loads of the codes.
    if not (cpu_target._AVX512VNNI and cpu_target._host_has("avx512vnni")):
        pytest.skip("this host lacks avx512vnni")
    from numba import njit

    def driver(acts):
        @njit
        def matmul(qs, d, m, xq, x_pairs, xd, xs, out):
            for r in range(d.shape[0]):
                v = cpu_q4_w4a8._w4a8_row_batch(qs, d, m, xq, x_pairs, xd, xs, r, 0, acts)
                for t in range(acts):
                    out[t, r] = v[t]
        return matmul

    rows, cols = 8, 576
    qs, d, m = np.zeros((rows, cols // 2), np.uint8), np.zeros((rows, cols // 32), np.uint16), None
    xq, xd, xs = np.zeros((4, cols), np.int8), np.zeros((4, cols // 32), np.float32), \
        np.zeros((4, cols // 32), np.int32)
    counts = []
    for acts in (1, 4):
        kernel = driver(acts)
        kernel(qs, d, m, xq, xq.copy(), xd, xs, np.zeros((4, rows), np.float32))
        asm = next(iter(kernel.inspect_asm().values()))
        counts.append((len(re.findall(r"vpdpbusd\t", asm)), len(re.findall(r"vbroadcasti64x4\t", asm))))
    (dots1, loads1), (dots4, loads4) = counts
    assert dots1 > 0 and dots4 == 4 * dots1 and loads4 == loads1, counts


@pytest.mark.parametrize("lowering", W4A8_LOWERINGS)
@pytest.mark.parametrize("kind", KINDS)
def test_matvec_q4_w4a8_lowerings(rng, monkeypatch, kind, lowering):
    flags, pattern, features = W4A8_LOWERINGS[lowering]
    if not all(cpu_target._host_has(f) for f in features):
        pytest.skip(f"this host lacks {', '.join(features)}")
    rows, cols = 37, 352 + 576  # 29 blocks: groups of 8, a pair and a single
    qs, d, m = random_q4(rng, rows, cols, kind)
    xq, xd, xs = act_q8(ref, randn(rng, cols))
    x_pairs = np.empty_like(xq)
    cpu_q4_w4a8._pair_order(xq, x_pairs)
    args = (qs, d.view(np.uint16), None if m is None else m.view(np.uint16), xq, x_pairs, xd, xs)
    host, got = np.empty(rows, np.float32), np.empty(rows, np.float32)
    cpu.matvec_q4_w4a8(qs, d, m, xq, xd, xs, host)
    for name, flag in zip(("_AVX512VNNI", "_AVX512BW", "_AVX2"), flags):
        monkeypatch.setattr(cpu_integer_dots, name, flag)  # the row dots'
        if hasattr(cpu_q4_w4a8, name):  # the prompt GEMM's lane tile's
            monkeypatch.setattr(cpu_q4_w4a8, name, flag)
    kernel = _serial_w4a8()
    kernel(*args, got)
    asm = next(iter(kernel.inspect_asm().values()))
    if pattern is None:
        assert "vpmaddubsw" not in asm and "vpdpbusd" not in asm
    else:
        assert re.search(pattern, asm)
    assert np.array_equal(got, host)
    # the batch intrinsic, four activations: the host matvec's bits for each
    stack = [act_q8(ref, randn(rng, cols)) for _ in range(4)]
    xq4, xd4, xs4 = (np.stack([a[i] for a in stack]) for i in range(3))
    pairs4 = np.empty_like(xq4)
    for t in range(4):
        cpu_q4_w4a8._pair_order(xq4[t], pairs4[t])
    got4 = np.empty((4, rows), np.float32)
    _serial_w4a8_row_batch()(*args[:3], xq4, pairs4, xd4, xs4, got4)
    for t in range(4):
        cpu.matvec_q4_w4a8(qs, d, m, xq4[t], xd4[t], xs4[t], host)
        assert np.array_equal(got4[t], host), t
    if not flags[2]:  # the prompt GEMM's lane tile needs AVX2 (8 rows in lanes) or AVX-512BW (16)
        return
    blocks, lanes = cols // 32, cpu_q4_w4a8._lane_rows()
    assert lanes == (16 if flags[1] else 8)
    codes = np.empty((blocks, 4, lanes), np.uint32)
    scales, offsets = (np.empty((blocks, lanes), np.uint16) for _ in range(2))
    lanes = _serial_w4a8_lanes()
    lanes(qs.view(np.uint32), *args[1:3], xq4, xd4, xs4, got4, codes, scales, None if m is None else offsets)
    assert re.search(pattern, next(iter(lanes.inspect_asm().values())))
    for t in range(4):
        cpu.matvec_q4_w4a8(qs, d, m, xq4[t], xd4[t], xs4[t], host)
        assert np.array_equal(got4[t], host), t


def test_matvecs_do_not_depend_on_thread_count(rng):
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs 2 threads")
    qs, d, m = random_q4(rng, 37, 576, "q4_1")
    q8, d8 = random_q8(rng, 37, 576)
    x = randn(rng, 576)
    xq, xd, xs = act_q8(cpu, x)
    outs = []
    before = numba.get_num_threads()
    try:
        for n in (1, 2):
            cpu.set_threads(n)
            a, b = np.empty(37, np.float32), np.empty(37, np.float32)
            c, e = np.empty(37, np.float32), np.empty(37, np.float32)
            cpu.matvec_q4_w4a16(qs, d, None, x, a)
            cpu.matvec_q4_w4a8(qs, d, None, xq, xd, xs, b)
            cpu.matvec_q4_w4a16(qs, d, m, x, c)
            cpu.matvec_q4_w4a8(qs, d, m, xq, xd, xs, e)
            f, g = np.empty(37, np.float32), np.empty(37, np.float32)
            cpu.matvec_q8_w8a16(q8, d8, *act_q16(cpu, x), f)
            cpu.matvec_q8_w8a8(q8, d8, xq, xd, g)
            outs.append((a, b, c, e, f, g))
    finally:
        cpu.set_threads(before)
    assert all(np.array_equal(p, q) for p, q in zip(*outs))  # each row's sum order is fixed


def bf16_f64(bits):
    """bf16 bits (uint16) -> float64 by the format's definition (sign, 8 exponent bits, 7
    mantissa bits), not by the shift the kernels use; inf and NaN included."""
    bits = bits.astype(np.int64)
    sign = np.where(bits >> 15, -1.0, 1.0)
    exp, mant = (bits >> 7) & 0xFF, bits & 0x7F
    with np.errstate(over="ignore"):
        value = np.where(exp == 0, mant / 128 * 2.0 ** -126, (1 + mant / 128) * 2.0 ** (exp - 127))
    value = np.where(exp == 0xFF, np.where(mant == 0, np.inf, np.nan), value)
    return sign * value


def exact_matrix(rng, rows, cols, kind):
    """Fresh random weights as an exact variant stores them: float16, or bf16 bits (uint16, the
    f32's upper half: truncation serves, the kernels only read the bits) -> (stored, its f64)."""
    w = randn(rng, rows, cols)
    if kind == "f16":
        stored = w.astype(np.float16)
        return stored, stored.astype(np.float64)
    stored = (w.view(np.uint32) >> 16).astype(np.uint16)
    return stored, bf16_f64(stored)


@pytest.mark.parametrize("kind", ("f16", "bf16"))
def test_widen_exact_all_bit_patterns(kind):
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    stored = bits.view(np.float16) if kind == "f16" else bits
    want = stored.astype(np.float64) if kind == "f16" else bf16_f64(bits)
    nan = np.isnan(want)
    for backend in (ref, cpu):
        got = np.empty((256, 256), np.float32)
        backend.widen_exact(stored, got)
        assert np.array_equal(np.isnan(got), nan)
        assert np.array_equal(got[~nan], want[~nan])  # every finite value, and inf, exact
        assert np.array_equal(np.signbit(got[~nan]), np.signbit(want[~nan]))  # signed zeros too
        row = np.empty(256, np.float32)
        backend.embed_exact(stored, 201, row)
        assert np.array_equal(row.view(np.uint32), got[201].view(np.uint32))


@pytest.mark.parametrize("kind", ("f16", "bf16"))
@pytest.mark.parametrize("rows,cols", [(3, 64), (37, 576), (130, 1536)])
def test_matvec_exact(rng, rows, cols, kind):
    # widened exactly, so the kernels multiply the stored values themselves: the f64 dot of those
    # is the reference, and only f32's products and sums round (the bound's 4 sqrt(k) eps)
    w, w64 = exact_matrix(rng, rows, cols, kind)
    x = randn(rng, cols)
    want, got = np.empty(rows, np.float32), np.empty(rows, np.float32)
    ref.matvec_exact(w, x, want)
    cpu.matvec_exact(w, x, got)
    magnitude = np.abs(w64) @ np.abs(x)
    assert_dots_close(got, w64 @ x, magnitude, cols)
    assert_dots_close(want, w64 @ x, magnitude, cols)
    # a short prompt's batch: 7 activations (a pass of four, then three one by one) into a
    # column slice of a wider output, as prefill's fused matrices write theirs
    xs = randn(rng, 7, cols)
    for backend in (ref, cpu):
        wide = np.full((7, rows + 5), np.nan, np.float32)
        backend.matmul_exact(w, xs, wide[:, 2:2 + rows])
        assert np.isnan(wide[:, :2]).all() and np.isnan(wide[:, 2 + rows:]).all()
        for t in range(7):
            assert_dots_close(wide[t, 2:2 + rows], w64 @ xs[t], np.abs(w64) @ np.abs(xs[t]), cols)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,cols", [(3, 64), (37, 576)])
def test_dequantize_embed_q4(rng, rows, cols, kind):
    qs, d, m = random_q4(rng, rows, cols, kind)
    want, got = np.empty((rows, cols), np.float32), np.empty((rows, cols), np.float32)
    ref.dequantize_q4(qs, d, m, want)
    cpu.dequantize_q4(qs, d, m, got)
    assert np.array_equal(got, want)
    if m is None:
        assert np.array_equal(want, dequant_f64(qs, d))  # one product, exact
    else:  # d q rounded once, then + m rounded once (no FMA: the ref is NumPy's two steps)
        assert np.all(np.abs(want - dequant_f64(qs, d, m)) <= 2 * EPS * (np.abs(want) + np.abs(m.repeat(32, 1))))
    for backend in (ref, cpu):
        row = np.empty(cols, np.float32)
        backend.embed_q4(qs, d, m, rows - 1, row)
        assert np.array_equal(row, want[rows - 1])


# -- prefill's GEMMs --------------------------------------------------------------------------

def gemm_planes(rng, kind, rows, cols):
    """Fresh random weights of one kind -> (the backends' gemm function name, its planes, their
    f64 dequantised)."""
    if kind in KINDS:
        qs, d, m = random_q4(rng, rows, cols, kind)
        return "gemm_q4", (qs, d, m), dequant_f64(qs, d, m)
    if kind == "q8_0":
        q8, d = random_q8(rng, rows, cols)
        return "gemm_q8", (q8, d), dequant_q8_f64(q8, d)
    w, w64 = exact_matrix(rng, rows, cols, kind)
    return "gemm_exact", (w,), w64


@pytest.mark.parametrize("kind", [*KINDS, "q8_0", "f16", "bf16"])
@pytest.mark.parametrize("T,rows,cols,scratch_rows", [(3, 37, 64, 5), (70, 200, 576, 1000), (33, 576, 1536, 7),
                                                     (9, 128, 4096, 300)])
def test_gemm_against_f64(rng, kind, T, rows, cols, scratch_rows):
    """Prefill's GEMM, into a column range of a wider output (nothing outside it written), in
    slices of rows as the scratch holds them (a scratch of 5 or 7 rows: several slices a
    thread, a last one short), against the f64 product of the dequantised weights: f32 sums
    (4 sqrt(k) eps of the magnitude). The NumPy path (another BLAS) too, on the same slices."""
    name, planes, w64 = gemm_planes(rng, kind, rows, cols)
    x = randn(rng, T, cols)
    want, magnitude = x.astype(np.float64) @ w64.T, np.abs(x.astype(np.float64)) @ np.abs(w64).T
    for backend, sgemm in ((ref, None), (cpu, cpu_gemm._SGEMM), (cpu, 0)):
        out = np.full((T, rows + 9), np.nan, np.float32)
        scratch = randn(rng, scratch_rows * cols)  # noise: nothing may read it unwritten
        old, cpu_gemm._SGEMM = cpu_gemm._SGEMM, cpu_gemm._SGEMM if sgemm is None else sgemm
        try:
            getattr(backend, name)(*planes, x, out, 4, scratch, rows)
        finally:
            cpu_gemm._SGEMM = old
        assert np.isnan(out[:, :4]).all() and np.isnan(out[:, 4 + rows:]).all()
        for t in range(T):
            assert_dots_close(out[t, 4:4 + rows], want[t], magnitude[t], cols)


@pytest.mark.parametrize("threads", [1, 2])
def test_gemm_slices_of_wide_rows_take_at_least_min_rows(threads):
    """Each slice's GEMM packs all of x again, so rows wider than GEMM_SLICE_BYTES holds 64 of
    (3072 columns) take GEMM_MIN_ROWS rows a slice where the engine's scratch holds them, not
    the 12 that 768 KB would give at 16384 columns; narrower rows keep the byte bound."""
    from nerva_cli.residency.arena import DEQUANT_SLICE_BYTES

    scratch = np.empty(DEQUANT_SLICE_BYTES // 4, np.float32)
    old = cpu_numba_setup._threads[0]
    cpu.set_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        heights = {cols: cpu_gemm._gemm_slices(cols, scratch, 2048).shape[1] for cols in (1536, 3072, 8192, 16384)}
    finally:
        cpu.set_threads(old)
    assert cpu.GEMM_MIN_ROWS == 64 and heights == {1536: 128, 3072: 64, 8192: 64, 16384: 64}


def test_gemm_refuses_what_sgemm_would_overrun(rng):
    """sgemm writes T rows of out from the column `col` on, and the slices are as wide as x: a
    mismatch is an error, not a write past a buffer."""
    qs, d, m = random_q4(rng, 8, 64, "q4_1")
    scratch = np.empty(8 * 64, np.float32)
    for x, out, col in ((randn(rng, 3, 32), np.empty((3, 8), np.float32), 0),  # x narrower than the rows
                        (randn(rng, 3, 64), np.empty((2, 8), np.float32), 0),  # out with fewer rows than x
                        (randn(rng, 3, 64), np.empty((3, 8), np.float32), 1),  # columns past out's end
                        (randn(rng, 3, 64), np.empty((3, 16), np.float32)[:, :8], 0)):  # a strided view
        with pytest.raises(ValueError, match="gemm: x must be"):
            cpu.gemm_q4(qs, d, m, x, out, col, scratch, 8)


@pytest.mark.parametrize("kind", ["q4_1", "f16"])
@pytest.mark.parametrize("T", [65, 256])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemm_of_a_stack_equals_its_parts_to_the_bit(rng, kind, T, threads):
    """SmolLM2's q, k, v (576, 192, 192 rows of 576) stacked into one matrix, as a resident layer
    fuses them, against the three multiplied apart, as a paged layer does: with the parts'
    heights' divisor as align the GEMMs are the same, so are the bits. OpenBLAS's sums depend on
    a GEMM's shape where it is narrow (here under 24 rows of weights; measured), so the scratch
    holds 40 rows: slices of 20 (two threads) or 40 (one), which do not divide 192, would
    cross from q into k in the stack and not apart, and this test fails (tried)."""
    from math import gcd

    name, stacked, _ = gemm_planes(rng, kind, 960, 576)
    parts = [tuple(None if p is None else p[a:b] for p in stacked) for a, b in ((0, 576), (576, 768), (768, 960))]
    x, scratch = randn(rng, T, 576), np.empty(40 * 576, np.float32)
    fused, apart = np.empty((T, 960), np.float32), np.empty((T, 960), np.float32)
    old = cpu_numba_setup._threads[0]
    cpu.set_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        getattr(cpu, name)(*stacked, x, fused, 0, scratch, gcd(576, 192))
        for (a, b), planes in zip(((0, 576), (576, 768), (768, 960)), parts):
            getattr(cpu, name)(*planes, x, apart, a, scratch, gcd(576, 192))
    finally:
        cpu.set_threads(old)
    assert np.array_equal(fused, apart)


# -- attention --------------------------------------------------------------------------------

def attention_f64(q, k, v):
    """One query per row of q over all rows of k/v (single head), in float64."""
    s = k.astype(np.float64) @ q.astype(np.float64).T / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(0))
    return (p / p.sum(0)).T @ v


# Scores carry about sqrt(head_dim) eps, the weighted sum over n positions about sqrt(n) eps;
# 4e-6 is ~10x both for head_dim <= 128 and n <= 300 (the worst seen over 40 seeds: 7e-7).
ATT_TOL = 4e-6


# Query heads a kv head serves (group) 3, 1, 4 and 7 (packs of 3, 1, 2 + 2, 3 + 2 + 2 in the cpu
# kernel); head_dim 40 and 18 end in a partial vector of 8 and 2 elements.
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (14, 2, 40), (5, 5, 18)])
# n_ctx: the cpu kernel takes 64 positions a chunk, 8 a score step and 4 a value step, so 7, 130,
# 256 and 299 reach its tails
@pytest.mark.parametrize("n_ctx", [1, 7, 130, 256, 299])
@pytest.mark.parametrize("cache", ["f32", "f16"])
def test_attention_decode(rng, heads, kv_heads, head_dim, n_ctx, cache):
    """The f16 cache is held to the same bound: the kernel and both references read the same f16
    values, widened exactly."""
    max_ctx = 300
    dtype = np.float16 if cache == "f16" else np.float32
    q = randn(rng, heads, head_dim)
    k = np.full((max_ctx, kv_heads, head_dim), np.nan, dtype)  # past n_ctx: never read
    v = np.full((max_ctx, kv_heads, head_dim), np.nan, dtype)
    k[:n_ctx], v[:n_ctx] = 2 * randn(rng, n_ctx, kv_heads, head_dim), randn(rng, n_ctx, kv_heads, head_dim)
    want, got = np.empty_like(q), np.empty_like(q)
    ref.attention_decode(q, k, v, n_ctx, want)
    part = np.full(ref.attention_decode_partials(max_ctx, heads, head_dim), np.nan, np.float32)  # written first
    cpu.attention_decode(q, k, v, n_ctx, got, part)
    assert rel(got, want) < ATT_TOL
    group = heads // kv_heads
    ind = np.stack([attention_f64(q[h:h + 1], k[:n_ctx, h // group].astype(np.float64),
                                  v[:n_ctx, h // group].astype(np.float64))[0] for h in range(heads)])
    assert rel(want, ind) < ATT_TOL


@pytest.mark.parametrize("cache", ["f32", "f16"])
@pytest.mark.parametrize("threads", [1, 2, 16])
def test_attention_decode_rows_match_each_row_alone(rng, cache, threads):
    """A batched step's attention (attention_decode_rows): rows of different lengths, windows
    (first rows past 0) and slots, in a different order from the slots, one of them a slot whose
    cache is NaN (read by no row). Each row equals the one-row call on its own slot's cache, bit
    for bit (its splits and merge are its own: batch invariance), and ref within ATT_TOL; the
    kernel writes every part row it reads (part starts NaN)."""
    heads, kv_heads, dim, ctx, slots_n = 8, 2, 64, 400, 5
    dtype = np.float16 if cache == "f16" else np.float32
    k_all = (2 * randn(rng, slots_n, ctx, kv_heads, dim)).astype(dtype)
    v_all = randn(rng, slots_n, ctx, kv_heads, dim).astype(dtype)
    k_all[1], v_all[1] = np.nan, np.nan
    slots = np.array([3, 0, 4, 2], np.int64)
    firsts = np.array([0, 37, 0, 250], np.int64)
    n_ctx = np.array([1, 300, 129, 150], np.int64)
    q = randn(rng, len(slots), heads, dim)
    part = np.full((slots_n, *ref.attention_decode_partials(ctx, heads, dim)), np.nan, np.float32)
    got = np.empty_like(q)
    kernel = cpu.attention_kernel(heads, kv_heads)
    kernel(q, *(cpu_decode_attention._cache_operand(c) for c in (k_all, v_all)), slots, firsts, n_ctx, got, part,
           threads, np.float32(0))
    for b, (s, first, n) in enumerate(zip(slots, firsts, n_ctx)):
        alone, want = np.empty_like(q[b]), np.empty_like(q[b])
        one = np.full(ref.attention_decode_partials(ctx, heads, dim), np.nan, np.float32)
        kernel(*one_row(q[b], cpu_decode_attention._cache_operand(k_all[s, first:]),
                        cpu_decode_attention._cache_operand(v_all[s, first:]), n, alone, one), threads, np.float32(0))
        assert np.array_equal(got[b], alone), (b, threads)
        ref.attention_decode(q[b], k_all[s, first:], v_all[s, first:], n, want)
        assert rel(got[b], want) < ATT_TOL, b
    want = np.empty_like(q)
    ref.attention_decode_rows(q, k_all, v_all, slots, firsts, n_ctx, want)
    assert rel(got, want) < ATT_TOL


def one_row(q, k_cache, v_cache, n_ctx, out, part):
    """The decode attention kernel's arguments (attention_decode_rows's, before the threads and
    cap) for one sequence: q [heads, dim] over the first n_ctx rows of a cache [ctx, kv, dim]."""
    one = np.zeros(1, np.int64)
    return q[None], k_cache[None], v_cache[None], one, one, np.full(1, n_ctx, np.int64), out[None], part[None]


@pytest.mark.parametrize("n,splits", [(7, 1), (130, 1), (301, 3)])
@pytest.mark.parametrize("cache", ["f32", "f16"])
def test_attention_decode_caps_scores(rng, n, splits, cache):
    """Gemma 2's capped scores, softcap tanh(s / softcap) after the scale: K rows 4x the usual
    make scores of std about 4 (3.5 to 4.4 measured over 5 seeds; cap 5: most of them bent),
    against ref and a float64 reference, in one split and in three (the merge compares capped
    maxima). Same bound as uncapped (ATT_TOL): tanh's own error is an ulp. Uncapped, the outputs
    move by 0.2-0.4 of their size over 7 positions and 2.6-4.7 over 130-301 (same seeds)."""
    heads, kv_heads, dim, cap = 8, 2, 64, 5.0
    dtype = np.float16 if cache == "f16" else np.float32
    q = randn(rng, heads, dim)
    k, v = (4 * randn(rng, n, kv_heads, dim)).astype(dtype), randn(rng, n, kv_heads, dim).astype(dtype)
    want, got, plain = np.empty_like(q), np.empty_like(q), np.empty_like(q)
    ref.attention_decode(q, k, v, n, want, softcap=cap)
    part = np.full((splits, heads, dim + 2), np.nan, np.float32)
    cpu.attention_kernel(heads, kv_heads)(*one_row(q, cpu_decode_attention._cache_operand(k),
                                                   cpu_decode_attention._cache_operand(v), n, got, part),
                                          16, np.float32(cap))
    assert rel(got, want) < ATT_TOL
    s = np.einsum("hd,nhd->hn", q.astype(np.float64), np.repeat(k.astype(np.float64), heads // kv_heads, 1)) / 8
    p = np.exp(cap * np.tanh(s / cap))
    ind = np.einsum("hn,nhd->hd", p / p.sum(1, keepdims=True), np.repeat(v.astype(np.float64), heads // kv_heads, 1))
    assert rel(want, ind) < ATT_TOL
    cpu.attention_decode(q, k, v, n, plain, np.empty_like(part))
    assert rel(plain, want) > 0.1


@pytest.mark.parametrize("direction", [1, -1])
def test_attention_decode_score_ramps(rng, direction):
    # Scores that rise (or fall) steadily over 70 units across 200 positions: with rising ones
    # every chunk's max beats the last and rescales the accumulator; with falling ones the
    # early chunks hold all the weight and later weights underflow towards exp(-70).
    heads, kv_heads, dim, n = 4, 2, 32, 200
    q = randn(rng, heads, dim)
    ramp = direction * np.linspace(-35, 35, n, dtype=np.float32)
    lead = q[:: heads // kv_heads]  # each kv head's first query head scores ramp[t] (+ noise)
    k = ramp[:, None, None] * (np.sqrt(dim) * lead / (lead ** 2).sum(1, keepdims=True))[None]
    k = (k + 0.1 * randn(rng, n, kv_heads, dim)).astype(np.float32)
    v = randn(rng, n, kv_heads, dim)
    want, got = np.empty_like(q), np.empty_like(q)
    ref.attention_decode(q, k, v, n, want)
    cpu.attention_decode(q, k, v, n, got, np.empty(ref.attention_decode_partials(n, heads, dim), np.float32))
    assert rel(got, want) < ATT_TOL


@pytest.mark.parametrize("splits,n", [(1, 301), (2, 301), (3, 301), (4, 301), (4, 130)])
@pytest.mark.parametrize("cache", ["f32", "f16"])
def test_attention_decode_in_splits_of_the_positions(rng, splits, n, cache):
    """The kernel with as many splits as `part` holds (16 threads would take all 5 chunks of 301
    positions; the kernel takes no more than part's): 4 splits take 76, 76, 76 and 73 positions,
    3 take 104, 104 and 93, each in chunks of 64 and the tails of those; 130 positions are 3
    chunks, so no more than 3 splits (44, 44, 42) whatever part holds. Scores that rise across
    the positions put the largest max in the last split, so the merge has to rescale the others.
    Same bound as one split (ATT_TOL)."""
    heads, kv_heads, dim = 8, 2, 64
    dtype = np.float16 if cache == "f16" else np.float32
    q = randn(rng, heads, dim)
    k = (randn(rng, n + 20, kv_heads, dim) + np.linspace(0, 0.3, n + 20, dtype=np.float32)[:, None, None]
         * q[::heads // kv_heads][None]).astype(dtype)
    v = randn(rng, n + 20, kv_heads, dim).astype(dtype)
    k[n:], v[n:] = np.nan, np.nan  # past n_ctx: never read
    want, got = np.empty_like(q), np.empty_like(q)
    ref.attention_decode(q, k, v, n, want)
    part = np.full((splits, heads, dim + 2), np.nan, np.float32)  # the kernel writes all it reads
    cpu.attention_kernel(heads, kv_heads)(*one_row(q, cpu_decode_attention._cache_operand(k),
                                                   cpu_decode_attention._cache_operand(v), n, got, part),
                                          16, np.float32(0))
    assert rel(got, want) < ATT_TOL


def _serial_attention(heads, kv_heads):
    """A fresh, uncached, serial build of the cpu decode attention: it lowers the IR as the
    module's settings stand when it is first called."""
    from numba import njit

    kernel = cpu_decode_attention._attention_decode_for(*cpu.pack_sizes(heads, kv_heads))
    return njit(nogil=True, fastmath=cpu_numba_setup._FAST)(kernel.py_func)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (14, 2, 40), (5, 5, 18)])
def test_attention_decode_avx2_geometry(rng, monkeypatch, heads, kv_heads, head_dim):
    """What a host without AVX-512 compiles: vectors of 8 floats, score steps of 4 positions,
    packs of at most 3 heads (group 7 takes 3 + 2 + 2). Built here on whatever host runs the
    tests; same bound as the host's kernel (ATT_TOL)."""
    n, ctx = 203, 260
    q = randn(rng, heads, head_dim)
    k = (2 * randn(rng, ctx, kv_heads, head_dim)).astype(np.float16)
    v = randn(rng, ctx, kv_heads, head_dim).astype(np.float16)
    k[n:], v[n:] = np.nan, np.nan  # past n_ctx: never read
    want, got = np.empty_like(q), np.empty_like(q)
    ref.attention_decode(q, k, v, n, want)
    for name, value in cpu.attention_geometry(avx512=False).items():
        monkeypatch.setattr(cpu_decode_attention, name, value)
    kernel = _serial_attention(heads, kv_heads)
    part = np.full((3, heads, head_dim + 2), np.nan, np.float32)
    kernel(*one_row(q, cpu_decode_attention._cache_operand(k), cpu_decode_attention._cache_operand(v), n, got, part),
           2, np.float32(0))
    llvm = next(iter(kernel.inspect_llvm().values()))
    assert "<8 x half>" in llvm and "<16 x half>" not in llvm  # the K and V rows widened 8 at a time
    assert rel(got, want) < ATT_TOL


@pytest.mark.parametrize("n_ctx,threads,splits", [
    (1, 2, 1), (64, 2, 1), (65, 2, 2), (300, 1, 1), (300, 2, 2), (900, 1, 3), (900, 2, 4), (1800, 2, 6),
    (1800, 16, 16), (4096, 2, 12)])
def test_decode_splits_share_the_threads_and_fit_l2(n_ctx, threads, splits):
    """SmolLM2's rows (3 kv heads x 64 x f16, K and V: 768 bytes a position): a multiple of the
    threads, at most 256 KB of rows a split, never more splits than 64-position chunks."""
    assert cpu.decode_splits(n_ctx, 768, threads) == splits


def test_exp_nonpositive_within_an_ulp(rng):
    # The attention weights' exp (Taylor to r^7 after ln2 reduction): measured at most 0.62 eps
    # relative to float64's exp over [-87, 0]; held to 1 eps. NaN stays NaN.
    from numba import njit

    @njit
    def exp_all(x, out):
        for i in range(x.shape[0]):
            out[i] = cpu_glu._exp_nonpositive(x[i])

    x = np.clip(-20 * np.abs(randn(rng, 200_000)), -87, 0)
    x = np.concatenate([x, np.linspace(-87, 0, 100_001, dtype=np.float32),
                        np.float32([0, -0.0, -87, np.nan])]).astype(np.float32)
    got = np.empty_like(x)
    exp_all(x, got)
    want = np.exp(x.astype(np.float64))
    finite = ~np.isnan(x)
    assert np.all(np.abs(got[finite] - want[finite]) <= EPS * want[finite])
    assert np.isnan(got[~finite]).all()


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32)])
@pytest.mark.parametrize("T,start", [(1, 0), (5, 0), (37, 11), (3, 200), (150, 20)])
@pytest.mark.parametrize("cache", ["f32", "f16"])
def test_attention_prefill(rng, heads, kv_heads, head_dim, T, start, cache):
    n = start + T
    dtype = np.float16 if cache == "f16" else np.float32
    q = randn(rng, T, heads, head_dim)
    k, v = (2 * randn(rng, n, kv_heads, head_dim)).astype(dtype), randn(rng, n, kv_heads, head_dim).astype(dtype)
    want, got = np.empty_like(q), np.empty_like(q)
    ref.attention_prefill(q, k, v, start, want)
    # work sized for a longer cache, as the engine's, and full of noise: nothing may read it unwritten
    work = randn(rng, ref.attention_prefill_work(T, n + 50, heads, kv_heads, head_dim))
    cpu.attention_prefill(q, k, v, start, got, work)
    assert rel(got, want) < ATT_TOL
    old, cpu_prefill_attention._SGEMM = cpu_prefill_attention._SGEMM, 0  # NumPy with another BLAS: ref's attention
    try:
        other = np.empty_like(q)
        cpu.attention_prefill(q, k, v, start, other, work)
        assert rel(other, want) < ATT_TOL
    finally:
        cpu_prefill_attention._SGEMM = old
    with pytest.raises(ValueError, match="work holds"):
        cpu.attention_prefill(q, k, v, start, got, work[: ref.attention_prefill_work(T, n, heads, kv_heads, head_dim)
                                                         - 1])
    # causal: query t is decode attention over the first start + t + 1 positions
    step = np.empty((heads, head_dim), np.float32)
    for t in range(T):
        ref.attention_decode(q[t], k, v, start + t + 1, step)
        assert rel(want[t], step) < ATT_TOL
    # a sliding window of w positions: query t is decode attention over the w up to its own, on
    # both backends, and on the cpu also through a cache that starts part of the way in (the
    # engine's slice from the chunk's first query's window)
    for w in sorted({1, 5, max(1, n // 2), n + 3}):
        ref.attention_prefill(q, k, v, start, want, window=w)
        cpu.attention_prefill(q, k, v, start, got, work, w)
        assert rel(got, want) < ATT_TOL, w
        lo = max(0, start + 1 - w)
        cpu.attention_prefill(q, k[lo:], v[lo:], start - lo, got, work, w)
        assert rel(got, want) < ATT_TOL, w
        for t in range(T):
            first = max(0, start + t + 1 - w)
            ref.attention_decode(q[t], k[first:], v[first:], start + t + 1 - first, step)
            assert rel(want[t], step) < ATT_TOL, (w, t)
    # Gemma 2's capped scores (ref.capped; 2 * randn K makes scores of std about 2, cap 1.5 bends
    # them), with and without a window: query t is capped decode attention, on both backends
    for w in (0, 5):
        ref.attention_prefill(q, k, v, start, want, window=w, softcap=1.5)
        cpu.attention_prefill(q, k, v, start, got, work, w, 1.5)
        assert rel(got, want) < ATT_TOL, w
        for t in range(T):
            first = max(0, start + t + 1 - w) if w else 0
            ref.attention_decode(q[t], k[first:], v[first:], start + t + 1 - first, step, softcap=1.5)
            assert rel(want[t], step) < ATT_TOL, (w, t)


# -- the decode hot path --------------------------------------------------------------------

def test_decode_kernels_do_not_allocate(rng):
    """numba's own allocation counter around n calls made from compiled code: a call from Python
    unboxes each array argument into a (counted) MemInfo, so what is measured is the difference
    between 4 calls and 1, which is what the kernels themselves allocate."""
    from numba import njit
    from numba.core.runtime import _nrt_python, rtsys

    @njit
    def repeat(n, kernel, *args):
        for _ in range(n):
            kernel(*args)

    def allocs(n, kernel, args):
        before = rtsys.get_allocation_stats().alloc
        repeat(n, kernel, *args)
        return rtsys.get_allocation_stats().alloc - before

    heads, kv, hd, n = 9, 3, 64, 576
    x, w, res, out = randn(rng, n), randn(rng, n), randn(rng, n), np.empty(n, np.float32)
    qs, d, m = random_q4(rng, 37, n, "q4_1")
    d16, m16 = d.view(np.uint16), m.view(np.uint16)  # what the Python wrappers of the Q4 kernels pass on
    q8, d8 = random_q8(rng, 37, n)
    d8 = d8.view(np.uint16)
    xq, xd, xs = act_q8(cpu, x)
    q16 = (np.empty(n, np.int16), np.empty(n // 32, np.float32), np.empty(n // 32, np.int32))  # W4A16's scratch
    mv = np.empty(37, np.float32)
    # exact matrices as _exact_bits passes them on: f16 as int16, bf16 as uint16
    h16, b16 = exact_matrix(rng, 37, n, "f16")[0].view(np.int16), exact_matrix(rng, 37, n, "bf16")[0]
    q = randn(rng, 1, heads, hd)
    cos, sin = rope_tables(16, hd)
    pos = np.array([3], np.int64)
    kc, vc = randn(rng, 16, kv, hd), randn(rng, 16, kv, hd)
    att = np.empty((heads, hd), np.float32)
    part = np.empty((2, heads, hd + 2), np.float32)
    calls = [
        (cpu.rmsnorm, (x, w, 1e-5, out)),
        (cpu.add_rmsnorm, (x, res, w, 1e-5, out)),
        (cpu.rope, (q, pos, cos, sin)),
        (cpu.quantize_act_q8, (x, xq, xd, xs)),
        (cpu_q4._w4a16_kernel, (qs, d16, None, x, *q16, True, mv)),
        (cpu_q4_w4a8._w4a8, (qs, d16, None, xq, np.empty_like(xq), xd, xs, mv)),
        (cpu_q4._w4a16_kernel, (qs, d16, m16, x, *q16, True, mv)),
        (cpu_q4_w4a8._w4a8, (qs, d16, m16, xq, np.empty_like(xq), xd, xs, mv)),
        (cpu_q4_w4a8._w4a8_batch, (qs, d16, m16, np.stack([xq] * 5), np.empty((5, n), np.int8), np.stack([xd] * 5),
                           np.stack([xs] * 5), np.empty((5, 40), np.float32)[:, 2:39])),
        *([(cpu_q4_float._w4a16_batch, (qs, d16, m16, np.stack([x] * 5), np.empty((5, 40), np.float32)[:, 2:39]))]
          if cpu_target._AVX512F else
          [(cpu_q4_w4a8._w4a16_q16_batch, (qs, d16, m16, np.stack([x] * 5), np.empty((5, n), np.int16),
                                           np.empty((5, n // 32), np.float32), np.empty((5, n // 32), np.int32),
                                           np.empty((5, 40), np.float32)[:, 2:39]))]),
        *([(cpu_q4_bf16._w4a16_bf16, (qs, d16, None, x, mv)), (cpu_q4_bf16._w4a16_bf16, (qs, d16, m16, x, mv)),
           (cpu_q4_bf16._w4a16_bf16_batch, (qs, d16, m16, np.stack([x] * 5),
                                            np.empty((5, (n // 32 + 1) // 2 * 128), np.uint16),
                                            np.empty((5, n // 32), np.float32), np.empty((5, 40), np.float32)[:, 2:39]))]
          if cpu_target._AVX512BF16 else []),
        (cpu.silu_mul, (np.concatenate([x, w]), out)),
        (cpu.gelu_mul, (np.concatenate([x, w]), out)),
        (cpu.attention_kernel(heads, kv), (*one_row(q[0], kc, vc, 9, att, part), 2, np.float32(0))),
        (cpu.attention_kernel(heads, kv), (*one_row(q[0], kc.astype(np.float16).view(np.uint16),
                                                    vc.astype(np.float16).view(np.uint16), 9, att, part),
                                           2, np.float32(5))),  # Gemma 2's capped scores too
        (cpu_q4._embed_q4, (qs, d16, None, 5, out)),
        (cpu_q4._embed_q4, (qs, d16, m16, 5, out)),
        (cpu_q8._w8a16, (q8, d8, *act_q16(cpu, x), mv)),
        (cpu.quantize_act_q16, (x, *act_q16(cpu, x))),
        (cpu_q8._w8a8, (q8, d8, xq, xd, mv)),
        (cpu_q8._embed_q8, (q8, d8, 5, out)),
        (cpu_exact._matvec_exact, (h16, x, mv)),
        (cpu_exact._matvec_exact, (b16, x, mv)),
        (cpu_exact._matmul_exact, (b16, np.stack([x] * 5), np.empty((5, 40), np.float32)[:, 2:39])),
        (cpu_exact._widen_exact, (h16, np.empty((37, n), np.float32))),
        (cpu_exact._widen_exact, (b16, np.empty((37, n), np.float32))),
    ]
    was_on = _nrt_python.memsys_stats_enabled()
    _nrt_python.memsys_enable_stats()
    try:
        for kernel, args in calls:
            allocs(1, kernel, args)  # compile first
            assert allocs(4, kernel, args) == allocs(1, kernel, args), kernel
    finally:
        if not was_on:
            _nrt_python.memsys_disable_stats()


def test_cpu_matvec_bench_script_runs():
    # scripts/cpu_matvec_bench.py, where backends/cpu.py's figures come from: one JSON line a
    # kernel, shape and thread count, each naming what it timed
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "cpu_matvec_bench.py"
    run = subprocess.run([sys.executable, str(script), "--kind", "q4_1", "q8_0", "--shape", "64x96",
                          "--threads", "1", "--repeat", "3"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["kernel"] for r in lines] == ["matvec_q4_1_w4a8", "matvec_q4_1_w4a16", "matvec_q8_w8a8", "matvec_q8_w8a16"]
    assert all(r["rows"] == 64 and r["cols"] == 96 and r["gb_s"] > 0 and r["from"] == "cache" for r in lines)


def test_cpu_attention_bench_script_runs():
    # scripts/cpu_attention_bench.py, where the attention comments' figures come from: one JSON
    # line a context length and thread count, each naming what it timed
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "cpu_attention_bench.py"
    run = subprocess.run([sys.executable, str(script), "--shape", "4:2:40", "--ctx", "70", "130", "--threads", "1",
                          "--layers", "2", "--repeat", "2"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["n_ctx"] for r in lines] == [70, 130]
    assert all(r["heads"] == 4 and r["head_dim"] == 40 and r["layers"] == 2 and r["us_per_layer"] > 0 for r in lines)
    bad = subprocess.run([sys.executable, str(script), "--shape", "3:2:64"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "heads a multiple of kv_heads" in bad.stderr
