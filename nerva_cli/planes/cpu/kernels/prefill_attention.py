"""Prefill attention: jobs of a kv head's queries, each two GEMMs (scores, weighted values) on
numba's threads with causal weights between them."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from nerva_cli.planes.cpu.kernels.exact import widen_exact
from nerva_cli.planes.cpu.kernels.gemm import _SGEMM, _sgemm
from nerva_cli.planes.cpu.kernels.glu import _exp_nonpositive
from nerva_cli.planes.cpu.kernels.numba_setup import F32, _FAST, _threads
from nerva_cli.planes.ref import attention_prefill_work


ATT_PREFILL_ROWS = 64  # queries of one kv head's group a job of attention_prefill takes, at most


def attention_prefill(q, k, v, start, out, work, window=0, softcap=0.0):
    # Jobs of up to ATT_PREFILL_ROWS queries of one kv head's group, on numba's threads, each in
    # its own part of `work`: the group's queries copied together, one GEMM for their scores
    # against the positions the job's last query sees (causal: the first jobs read the fewest),
    # each row's visible scores turned into weights exp(s - max) and the rest zeroed, a second
    # GEMM for the weighted values, divided by the weights' totals on the way into `out`
    # (head_dim multiplies a row where normalising the weights took n). An f16 cache is widened
    # for BLAS into `work` first (a copy a layer a chunk: prefill only).
    T, heads, dim = q.shape
    n, kv_heads = start + T, k.shape[1]
    group = heads // kv_heads
    need = attention_prefill_work(T, n, heads, kv_heads, dim)
    if work.size < need:
        raise ValueError(f"attention_prefill: work holds {work.size} floats, {need} needed")
    if not _SGEMM:  # NumPy has another BLAS
        from nerva_cli.planes import ref

        ref.attention_prefill(q, k[:n], v[:n], start, out, window=window, softcap=softcap)
        return
    k, v = k[:n], v[:n]  # a longer cache holds no positions this chunk sees
    if k.dtype != F32:
        wide = work[group * T * (n + 2 * dim + 1):]
        k_f32, v_f32 = wide[: n * kv_heads * dim].reshape(k.shape), wide[n * kv_heads * dim: 2 * n * kv_heads * dim]
        # vcvtph2ps in a vectorised loop through widen_exact, many times faster than NumPy's astype
        # (docs/perf/code_figures.md)
        widen_exact(k.reshape(n, -1), k_f32.reshape(n, -1))
        widen_exact(v.reshape(n, -1), v_f32.reshape(n, -1))
        k, v = k_f32, v_f32.reshape(v.shape)
    rows = max(1, min(ATT_PREFILL_ROWS, T // _threads[0]))  # a job for every thread, even for a short chunk
    workers = min(_threads[0], kv_heads * -(-T // rows), T // rows)  # their parts within the work's bound
    _attention_prefill(_SGEMM, np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v), start,
                       out, work, rows, workers, F32(1.0 / np.sqrt(dim)), window, F32(softcap))


@njit(cache=True, nogil=True, parallel=True, fastmath=_FAST)
def _attention_prefill(sgemm, q, k, v, start, out, work, rows, workers, scale, window, softcap):
    # Job j is query block j // kv_heads of kv head j % kv_heads; a worker takes every workers-th
    # job, so the costly last blocks spread over the threads. A worker's part of work holds the
    # group's queries [group * rows, dim], their scores [group * rows, seen], weighted values
    # [group * rows, dim] and weight totals (workers * rows <= T: attention_prefill_work's bound).
    T, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    blocks = (T + rows - 1) // rows
    part = group * rows * (start + T + 2 * dim + 1)
    for w in prange(workers):
        for job in range(w, blocks * kv_heads, workers):
            g, t0 = job % kv_heads, job // kv_heads * rows
            nb = min(T, t0 + rows) - t0
            seen, R = start + t0 + nb, group * nb
            qg = w * part
            s = qg + R * dim
            pv = s + R * seen
            inv = pv + R * dim
            for j in range(group):
                for i in range(nb):
                    for c in range(dim):
                        work[qg + (j * nb + i) * dim + c] = q[t0 + i, g * group + j, c]
            _sgemm(sgemm, True, R, seen, dim, work, qg, dim, k, g * dim, kv_heads * dim, work, s, seen)
            for r in range(R):
                row, at = s + r * seen, start + t0 + r % nb
                first = max(0, at + 1 - window) if window > 0 else 0  # a sliding window's first position
                for c in range(first):
                    work[row + c] = 0
                if softcap > 0:  # Gemma 2's capped scores, already scaled for _causal_weights
                    for c in range(first, at + 1):
                        work[row + c] = softcap * np.tanh(work[row + c] * scale / softcap)
                    work[inv + r] = F32(1) / _causal_weights(work[row + first:row + seen], at + 1 - first, F32(1))
                else:
                    work[inv + r] = F32(1) / _causal_weights(work[row + first:row + seen], at + 1 - first, scale)
            _sgemm(sgemm, False, R, dim, seen, work, s, seen, v, g * dim, kv_heads * dim, work, pv, dim)
            for j in range(group):
                for i in range(nb):
                    wt = work[inv + j * nb + i]
                    for c in range(dim):
                        out[t0 + i, g * group + j, c] = work[pv + (j * nb + i) * dim + c] * wt


@njit(cache=True, nogil=True, fastmath=_FAST)
def _causal_weights(row, seen, scale):
    # The first `seen` scores of a query's row become exp(scale (s - max)), the rest (the future)
    # 0; -> their sum. The max is taken in 8 running maxima (one was a chain of dependent
    # vmaxss) with the scaling moved into the exp, about twice as fast (docs/perf/code_figures.md).
    # A sliding window's row starts at its first position (the caller zeroes those before): a start
    # argument here was much slower.
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = F32(-np.inf)
    j = 0
    while j + 8 <= seen:
        m0, m1, m2, m3 = max(m0, row[j]), max(m1, row[j + 1]), max(m2, row[j + 2]), max(m3, row[j + 3])
        m4, m5, m6, m7 = max(m4, row[j + 4]), max(m5, row[j + 5]), max(m6, row[j + 6]), max(m7, row[j + 7])
        j += 8
    for i in range(j, seen):
        m0 = max(m0, row[i])
    m = max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))
    total = F32(0)
    for j in range(seen):
        row[j] = _exp_nonpositive(scale * (row[j] - m))
        total += row[j]
    for j in range(seen, row.shape[0]):
        row[j] = 0
    return total
