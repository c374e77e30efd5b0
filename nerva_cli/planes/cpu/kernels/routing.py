"""A mixture of experts' router: each row's top-k experts and their weights, without the
temporaries NumPy's sorts make (a decode step allocates nothing)."""

from __future__ import annotations

import numpy as np
from numba import njit

from nerva_cli.planes.cpu.kernels.numba_setup import F32


@njit(cache=True, nogil=True)
def route_experts(logits, renormalise, ids, weights):
    rows, n = logits.shape
    k = ids.shape[1]
    for r in range(rows):
        top = logits[r, 0]
        for e in range(1, n):
            top = max(top, logits[r, e])
        total = F32(0)
        for e in range(n):
            total += np.exp(logits[r, e] - top)
        for j in range(k):  # the j-th largest probability, ties to the lower index
            best, best_p = -1, F32(-1)
            for e in range(n):
                taken = False
                for i in range(j):
                    taken = taken or ids[r, i] == e
                p = np.exp(logits[r, e] - top) / total
                if not taken and p > best_p:
                    best, best_p = e, p
            ids[r, j] = best
            weights[r, j] = best_p
        for j in range(1, k):  # ascending expert order, each weight with its expert
            e, w, i = ids[r, j], weights[r, j], j - 1
            while i >= 0 and ids[r, i] > e:
                ids[r, i + 1], weights[r, i + 1] = ids[r, i], weights[r, i]
                i -= 1
            ids[r, i + 1], weights[r, i + 1] = e, w
        if renormalise:
            s = F32(0)
            for j in range(k):
                s += weights[r, j]
            for j in range(k):
                weights[r, j] /= s
