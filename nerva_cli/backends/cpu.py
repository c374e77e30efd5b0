"""The CPU backend: ref's kernel contract compiled with numba and threaded (ARCHITECTURE section 7).

Kernels compile on first use and are cached on disk (`cache=True`). They release the GIL
(`nogil`), so the pager's reader thread issues its disk reads while they compute. Decode kernels allocate
nothing; the tiny ones (a few hundred elements, ~300 calls a token) run on one thread because a
parallel region costs more than their work (CPU-NOTES); the matvecs and decode attention run in
parallel. Threads: `set_threads`.

Fast-math: `_FAST` allows reassociation (so reductions vectorise) and FMA contraction, but not
the no-NaN/no-inf assumptions, so inf and NaN still propagate as IEEE says.
"""

from __future__ import annotations

import os
import sys

if "NUMBA_CACHE_DIR" not in os.environ:
    home = os.path.expanduser(os.environ.get("NERVA_HOME") or "~/.nerva")
    os.environ["NUMBA_CACHE_DIR"] = os.path.join(home, "numba-cache")
    if "numba" in sys.modules:  # numba reads its environment once, when first imported
        sys.modules["numba"].core.config.reload_config()

import numba  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

F32 = np.float32
_FAST = {"reassoc", "contract"}


def set_threads(n: int) -> None:
    """Threads for the parallel kernels, 1..the cores numba saw at start."""
    most = numba.config.NUMBA_NUM_THREADS
    if not 1 <= n <= most:
        raise ValueError(f"threads must be between 1 and {most}, got {n}")
    numba.set_num_threads(n)


# -- helpers -------------------------------------------------------------------------------

@intrinsic
def _half_to_f32(typingctx, bits):
    """IEEE half bits (uint16) -> float32 by LLVM's fpext: one vcvtph2ps with F16C, exact for
    every input (subnormals, inf, NaN). Measured 25% faster on the Q4 matvecs than decoding the
    bits in numba code, whose branches sit in the per-block path; tests check all 65536 inputs."""
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@njit(cache=True, fastmath=_FAST, inline="always")
def _nib_dot(byte, xl, xh):
    # Nibbles in float32 (hi = floor(b / 16), lo = b - 16 hi): numba types integer code as
    # int64, which vectorises poorly; this vectorises 8 bytes a register (CPU-NOTES).
    v = F32(byte)
    hi = np.floor(v * F32(0.0625))
    return (v - F32(16) * hi) * xl + hi * xh


@njit(cache=True, inline="always")
def _row_group(g, rows):
    # Rows 4g..4g+3, the ones past the end repeated (they recompute and rewrite the last row):
    # no tail loop. Selects between non-negative values let LLVM drop numba's negative-index
    # wraparound; with min() it stays, and the row loads become gathers (3x slower).
    r0 = 4 * g
    r1 = r0 + 1 if r0 + 1 < rows else r0
    r2 = r0 + 2 if r0 + 2 < rows else r1
    r3 = r0 + 3 if r0 + 3 < rows else r2
    return r0, r1, r2, r3


# -- norms, rope, activation ----------------------------------------------------------------

@njit(cache=True, nogil=True, fastmath=_FAST)
def rmsnorm(x, w, eps, out):
    n = w.shape[0]
    x2, out2 = x.reshape(-1, n), out.reshape(-1, n)  # reshaped here: ~0.3 us less than in Python
    for t in range(x2.shape[0]):
        ss = F32(0)
        for i in range(n):
            ss += x2[t, i] * x2[t, i]
        inv = F32(1) / np.sqrt(ss / F32(n) + F32(eps))
        for i in range(n):
            out2[t, i] = x2[t, i] * inv * w[i]


@njit(cache=True, nogil=True, fastmath=_FAST)
def add_rmsnorm(x, residual, w, eps, out):
    n = w.shape[0]
    x2, res2, out2 = x.reshape(-1, n), residual.reshape(-1, n), out.reshape(-1, n)
    for t in range(x2.shape[0]):
        ss = F32(0)
        for i in range(n):
            r = res2[t, i] + x2[t, i]
            res2[t, i] = r
            ss += r * r
        inv = F32(1) / np.sqrt(ss / F32(n) + F32(eps))
        for i in range(n):
            out2[t, i] = res2[t, i] * inv * w[i]


@njit(cache=True, nogil=True, fastmath=_FAST)
def rope(x, pos, cos, sin):
    half = cos.shape[1]
    x3 = x.reshape(pos.shape[0], -1, 2 * half)
    for t in range(x3.shape[0]):
        p = pos[t]
        for h in range(x3.shape[1]):
            for i in range(half):
                x1 = x3[t, h, i]
                x2 = x3[t, h, i + half]
                c = cos[p, i]
                s = sin[p, i]
                x3[t, h, i] = x1 * c - x2 * s
                x3[t, h, i + half] = x2 * c + x1 * s


@njit(cache=True, nogil=True, fastmath=_FAST)
def silu_mul(gate, up, out):
    g1, u1, o1 = gate.reshape(-1), up.reshape(-1), out.reshape(-1)
    for i in range(g1.shape[0]):
        g = g1[i]
        o1[i] = g / (F32(1) + np.exp(-g)) * u1[i]


# -- Q4_0 / Q4_1 matvecs --------------------------------------------------------------------
#
# m is None for Q4_0 (w = d (q - 8)) and the Q4_1 offsets (w = d q + m) otherwise; numba compiles
# each case on its own and drops the other branch, so Q4_0 pays nothing for Q4_1.

@njit(cache=True, nogil=True, fastmath=_FAST, parallel=True)
def _w4a16(qs, d, m, x, out):
    # Four rows share every activation load, and two blocks share one horizontal reduction
    # (their scales are applied inside the sum): ~1.2x over one block at a time. An odd last
    # block pairs with itself at scale 0.
    rows, nb = d.shape
    for g in prange((rows + 3) // 4):
        r0, r1, r2, r3 = _row_group(g, rows)
        a0 = a1 = a2 = a3 = F32(0)
        for bb in range((nb + 1) // 2):
            b = 2 * bb
            c = b + 1 if b + 1 < nb else b
            z = F32(1) if b + 1 < nb else F32(0)
            d0b, d0c = _half_to_f32(d[r0, b]), z * _half_to_f32(d[r0, c])
            d1b, d1c = _half_to_f32(d[r1, b]), z * _half_to_f32(d[r1, c])
            d2b, d2c = _half_to_f32(d[r2, b]), z * _half_to_f32(d[r2, c])
            d3b, d3c = _half_to_f32(d[r3, b]), z * _half_to_f32(d[r3, c])
            qb, qc, xb, xc = 16 * b, 16 * c, 32 * b, 32 * c
            s0 = s1 = s2 = s3 = sxb = sxc = F32(0)
            for j in range(16):
                xlb, xhb, xlc, xhc = x[xb + j], x[xb + 16 + j], x[xc + j], x[xc + 16 + j]
                sxb += xlb + xhb
                sxc += xlc + xhc
                s0 += d0b * _nib_dot(qs[r0, qb + j], xlb, xhb) + d0c * _nib_dot(qs[r0, qc + j], xlc, xhc)
                s1 += d1b * _nib_dot(qs[r1, qb + j], xlb, xhb) + d1c * _nib_dot(qs[r1, qc + j], xlc, xhc)
                s2 += d2b * _nib_dot(qs[r2, qb + j], xlb, xhb) + d2c * _nib_dot(qs[r2, qc + j], xlc, xhc)
                s3 += d3b * _nib_dot(qs[r3, qb + j], xlb, xhb) + d3c * _nib_dot(qs[r3, qc + j], xlc, xhc)
            # Deferred bias: sum_j d (q_j - 8) x_j = d sum_j q_j x_j - 8 d sum_j x_j, and
            # sum_j (d q_j + m) x_j = d sum_j q_j x_j + m sum_j x_j.
            if m is None:
                a0 += s0 - F32(8) * (d0b * sxb + d0c * sxc)
                a1 += s1 - F32(8) * (d1b * sxb + d1c * sxc)
                a2 += s2 - F32(8) * (d2b * sxb + d2c * sxc)
                a3 += s3 - F32(8) * (d3b * sxb + d3c * sxc)
            else:
                a0 += s0 + _half_to_f32(m[r0, b]) * sxb + z * _half_to_f32(m[r0, c]) * sxc
                a1 += s1 + _half_to_f32(m[r1, b]) * sxb + z * _half_to_f32(m[r1, c]) * sxc
                a2 += s2 + _half_to_f32(m[r2, b]) * sxb + z * _half_to_f32(m[r2, c]) * sxc
                a3 += s3 + _half_to_f32(m[r3, b]) * sxb + z * _half_to_f32(m[r3, c]) * sxc
        out[r3] = a3
        out[r2] = a2
        out[r1] = a1
        out[r0] = a0


def _bits(a):
    """An f16 plane as the uint16 view the kernels decode (numba has no float16); None stays."""
    return None if a is None else a.view(np.uint16)


def matvec_q4_w4a16(qs, d, m, x, out):
    _w4a16(qs, d.view(np.uint16), _bits(m), x, out)


@njit(cache=True, nogil=True)
def quantize_act_q8(x, xq, xd, xs):
    # No fast-math: every step is a correctly rounded IEEE op, so the codes equal ref's.
    for b in range(xd.shape[0]):
        amax = F32(0)
        for j in range(32):
            amax = max(amax, abs(x[32 * b + j]))
        d = amax / F32(127)
        inv = F32(1) / d if d > 0 else F32(0)
        total = 0
        for j in range(32):
            v = x[32 * b + j] * inv
            t = np.trunc(v)
            if abs(v - t) >= F32(0.5):  # round half away from zero, like C's roundf
                t += np.sign(v)
            q = int(min(max(t, F32(-127)), F32(127)))
            xq[32 * b + j] = q
            total += q
        xd[b] = d
        xs[b] = total


@njit(cache=True, nogil=True)
def fake_quantize_q8(x, out):
    # Prefill's W4A8: rows quantised per 32-group as quantize_act_q8 does, then scaled back, so
    # a GEMM over them gives decode's integer products. Serial: it runs between BLAS GEMMs (see
    # _dequantize_q4).
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            amax = F32(0)
            for j in range(32):
                amax = max(amax, abs(x[r, 32 * b + j]))
            d = amax / F32(127)
            inv = F32(1) / d if d > 0 else F32(0)
            for j in range(32):
                v = x[r, 32 * b + j] * inv
                t = np.trunc(v)
                if abs(v - t) >= F32(0.5):
                    t += np.sign(v)
                out[r, 32 * b + j] = min(max(t, F32(-127)), F32(127)) * d


@njit(cache=True, nogil=True, fastmath=_FAST, parallel=True)
def _w4a8(qs, d, m, xq, xd, xs, out):
    # The block's integer dot runs in float32: every partial sum is an integer below
    # 32 * 15 * 127 < 2^24, so float32 holds it exactly in any order, and float32 vectorises
    # where numba's int64 scalar code does not.
    rows, nb = d.shape
    for g in prange((rows + 3) // 4):
        r0, r1, r2, r3 = _row_group(g, rows)
        a0 = a1 = a2 = a3 = F32(0)
        for b in range(nb):
            qb, xb = 16 * b, 32 * b
            t0 = t1 = t2 = t3 = F32(0)
            for j in range(16):
                xl, xh = F32(xq[xb + j]), F32(xq[xb + 16 + j])
                t0 += _nib_dot(qs[r0, qb + j], xl, xh)
                t1 += _nib_dot(qs[r1, qb + j], xl, xh)
                t2 += _nib_dot(qs[r2, qb + j], xl, xh)
                t3 += _nib_dot(qs[r3, qb + j], xl, xh)
            # Deferred bias: the -8 of every Q4_0 code, or the offset m of a Q4_1 block, enters
            # once, through the code sum xs.
            dx = xd[b]
            if m is None:
                c = F32(8 * xs[b])
                a0 += (_half_to_f32(d[r0, b]) * dx) * (t0 - c)
                a1 += (_half_to_f32(d[r1, b]) * dx) * (t1 - c)
                a2 += (_half_to_f32(d[r2, b]) * dx) * (t2 - c)
                a3 += (_half_to_f32(d[r3, b]) * dx) * (t3 - c)
            else:
                sx = dx * F32(xs[b])
                a0 += (_half_to_f32(d[r0, b]) * dx) * t0 + _half_to_f32(m[r0, b]) * sx
                a1 += (_half_to_f32(d[r1, b]) * dx) * t1 + _half_to_f32(m[r1, b]) * sx
                a2 += (_half_to_f32(d[r2, b]) * dx) * t2 + _half_to_f32(m[r2, b]) * sx
                a3 += (_half_to_f32(d[r3, b]) * dx) * t3 + _half_to_f32(m[r3, b]) * sx
        out[r3] = a3
        out[r2] = a2
        out[r1] = a1
        out[r0] = a0


def matvec_q4_w4a8(qs, d, m, xq, xd, xs, out):
    _w4a8(qs, d.view(np.uint16), _bits(m), xq, xd, xs, out)


@njit(cache=True, nogil=True)
def _dequantize_q4(qs, d, m, out):
    # Serial on purpose: prefill calls this between BLAS GEMMs, and OpenBLAS's worker threads
    # spin-wait on the other core for a while after each GEMM. A parallel version measured
    # 0.26 ms alone but 5.7 ms between GEMMs (1536x576, 2 cores); this one ~0.5 ms in both.
    rows, nb = d.shape
    for r in range(rows):
        for b in range(nb):
            s = _half_to_f32(d[r, b])
            if m is None:
                for j in range(16):
                    v = qs[r, 16 * b + j]
                    out[r, 32 * b + j] = s * F32((v & 15) - 8)
                    out[r, 32 * b + 16 + j] = s * F32((v >> 4) - 8)
            else:
                o = _half_to_f32(m[r, b])
                for j in range(16):
                    v = qs[r, 16 * b + j]
                    out[r, 32 * b + j] = s * F32(v & 15) + o
                    out[r, 32 * b + 16 + j] = s * F32(v >> 4) + o


def dequantize_q4(qs, d, m, out):
    _dequantize_q4(qs, d.view(np.uint16), _bits(m), out)


@njit(cache=True, nogil=True)
def _embed_q4(qs, d, m, token, out):
    row = out.reshape(1, -1)
    if m is None:
        _dequantize_q4(qs[token:token + 1], d[token:token + 1], None, row)
    else:
        _dequantize_q4(qs[token:token + 1], d[token:token + 1], m[token:token + 1], row)


def embed_q4(qs, d, m, token, out):
    _embed_q4(qs, d.view(np.uint16), _bits(m), token, out)


def embed_f32(table, token, out):
    out[...] = table[token]


def matvec_f32(w, x, out):
    np.dot(w, x, out=out)  # BLAS, writes into out without allocating


# -- attention ------------------------------------------------------------------------------

@njit(cache=True, nogil=True, fastmath=_FAST, parallel=True)
def attention_decode(q, k_cache, v_cache, n_ctx, out):
    # Online softmax, out[h] as the accumulator: no scratch. When a score beats the running
    # max m, what was accumulated so far is rescaled by exp(m_old - m_new), so at the end
    # out = sum_t exp(s_t - m) v_t / sum_t exp(s_t - m), the max-subtracted softmax.
    heads, dim = q.shape
    group = heads // k_cache.shape[1]
    scale = F32(1) / np.sqrt(F32(dim))
    for h in prange(heads):
        kv = h // group
        acc = out[h]
        acc[:] = 0
        m = F32(-np.inf)
        total = F32(0)
        for t in range(n_ctx):
            s = F32(0)
            for i in range(dim):
                s += q[h, i] * k_cache[t, kv, i]
            s *= scale
            if s > m:
                alpha = np.exp(m - s)
                total *= alpha
                for i in range(dim):
                    acc[i] *= alpha
                m = s
            p = np.exp(s - m)
            total += p
            for i in range(dim):
                acc[i] += p * v_cache[t, kv, i]
        inv = F32(1) / total
        for i in range(dim):
            acc[i] *= inv


def attention_prefill(q, k, v, start, out):
    # BLAS per kv head: the `group` query heads that share it go through one batched matmul.
    # Positions before the chunk are visible to every query, so the causal mask is a [T, T]
    # triangle added to the chunk's own columns (30x faster than boolean indexing at T = 512).
    T, heads, dim = q.shape
    k, v = k[: start + T], v[: start + T]  # a longer cache holds no positions this chunk sees
    group = heads // k.shape[1]
    scale = F32(1.0 / np.sqrt(dim))
    future = np.triu(np.full((T, T), -np.inf, dtype=F32), k=1)
    for g in range(k.shape[1]):
        hs = slice(g * group, (g + 1) * group)
        s = np.matmul(q[:, hs].transpose(1, 0, 2), k[:, g].T)  # [group, T, start + T]
        s *= scale
        s[:, :, start:] += future
        s -= s.max(axis=2, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=2, keepdims=True)
        out[:, hs] = np.matmul(s, v[:, g]).transpose(1, 0, 2)
