"""The norms, RoPE and a row add: small kernels on one thread (a parallel region costs more than
their work)."""

from __future__ import annotations

import numpy as np
from numba import njit

from nerva_cli.planes.cpu.kernels.numba_setup import F32, _FAST


@njit(cache=True, nogil=True, fastmath=_FAST)
def rmsnorm(x, w, eps, out):
    n = w.shape[0]
    x2, out2 = x.reshape(-1, n), out.reshape(-1, n)  # reshaped here: cheaper than in Python
    # (docs/perf/code_figures.md)
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
def add_rows(x, b):
    # NumPy's broadcasting `x += b` takes a 32 KB buffer a call (its ufunc buffer); this none.
    n = b.shape[0]
    x2 = x.reshape(-1, n)
    for t in range(x2.shape[0]):
        for i in range(n):
            x2[t, i] += b[i]


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
