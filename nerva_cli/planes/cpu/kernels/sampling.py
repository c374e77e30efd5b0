"""Host sampling: a repetition penalty and a draw by ref.sampling_candidates's rule."""

from __future__ import annotations

import numpy as np
from numba import njit

from nerva_cli.planes.cpu.kernels.numba_setup import F32


# -- host sampling --------------------------------------------------------------------------
# Not kernels of the contract: sampling.Sampler calls these on whatever host holds the logits.
# They write only into the buffers they are given, so a sampled decode step allocates nothing.

@njit(cache=True, nogil=True)
def penalise(logits, recent, n_recent, penalty, seen, out):
    """out = logits with llama.cpp's repetition penalty applied once per distinct token of
    recent[:n_recent]: positive logits divided by it, negative multiplied, in float32 as the
    cuda sampler does. `seen` (one flag a token) is all False before and after."""
    p = F32(penalty)
    for i in range(logits.shape[0]):
        out[i] = logits[i]
    for i in range(n_recent):
        t = recent[i]
        if not seen[t]:
            seen[t] = True
            v = out[t]
            out[t] = v / p if v > 0 else v * p
    for i in range(n_recent):
        seen[recent[i]] = False


@njit(cache=True, nogil=True, inline="always")
def _sift_min(heap, n, i):
    while True:
        low, left = i, 2 * i + 1
        if left < n and heap[left] < heap[low]:
            low = left
        if left + 1 < n and heap[left + 1] < heap[low]:
            low = left + 1
        if low == i:
            return
        heap[i], heap[low] = heap[low], heap[i]
        i = low


@njit(cache=True, nogil=True, inline="always")
def _sift_best(logits, cand, n, i):
    """Max-heap order on cand: the larger logit first, on a tie the lower token."""
    while True:
        best, left = i, 2 * i + 1
        for c in (left, left + 1):
            if c < n:
                a, b = cand[c], cand[best]
                if logits[a] > logits[b] or (logits[a] == logits[b] and a < b):
                    best = c
        if best == i:
            return
        cand[i], cand[best] = cand[best], cand[i]
        i = best


@njit(cache=True, nogil=True)
def sample_logits(logits, temperature, top_k, top_p, min_p, u, cand, scratch):
    """Draws one token by the rule of ref.sampling_candidates with the uniform u in [0, 1).
    cand (int32) and scratch (float64) hold at least a vocabulary each.

    The k-th largest logit comes from a k-entry min-heap in one pass; the top-p cut pops a
    max-heap of the candidates only until the kept weight is reached, so neither sorts the
    vocabulary (top_k 0 with top_p < 1 builds that heap over all of it)."""
    vocab = logits.shape[0]
    kth = -np.inf
    if 0 < top_k < vocab:
        for i in range(top_k):
            scratch[i] = logits[i]
        for i in range(top_k // 2 - 1, -1, -1):
            _sift_min(scratch, top_k, i)
        for i in range(top_k, vocab):
            if logits[i] > scratch[0]:
                scratch[0] = logits[i]
                _sift_min(scratch, top_k, 0)
        kth = scratch[0]
    n = 0
    best = -np.inf
    for i in range(vocab):
        if logits[i] >= kth and logits[i] > -np.inf:
            cand[n] = i
            n += 1
            best = max(best, np.float64(logits[i]))
    total = 0.0
    for j in range(n):
        scratch[j] = np.exp((np.float64(logits[cand[j]]) - best) / temperature)
        total += scratch[j]
    if top_p >= 1.0:  # no top-p cut: draw in token order among those reaching min_p, nothing to sort
        kept = 0.0
        for j in range(n):
            if scratch[j] >= min_p:
                kept += scratch[j]
        target, run, last = u * kept, 0.0, cand[0]
        for j in range(n):
            if scratch[j] >= min_p:
                run += scratch[j]
                last = cand[j]
                if run > target:
                    return last
        return last
    for i in range(n // 2 - 1, -1, -1):
        _sift_best(logits, cand, n, i)
    want, kept, end, cut = top_p * total, 0.0, n, np.nan
    while end > 0:  # pop the best to cand[end - 1] until the kept weight reaches top_p
        top = cand[0]
        if not np.isnan(cut) and logits[top] != cut:
            break
        weight = np.exp((np.float64(logits[top]) - best) / temperature)
        if weight < min_p:  # the rest are below min_p too
            break
        end -= 1
        cand[0], cand[end] = cand[end], top
        _sift_best(logits, cand, end, 0)
        kept += weight
        if np.isnan(cut) and kept >= want:
            cut = logits[top]  # ties of the last kept logit stay as well
    target, run = u * kept, 0.0
    for j in range(n - 1, end - 1, -1):
        run += np.exp((np.float64(logits[cand[j]]) - best) / temperature)
        if run > target:
            return cand[j]
    return cand[end]


@njit(cache=True, nogil=True)
def allow_only(logits, allowed, out):
    """out = logits where token t's bit (bit t % 32 of the uint32 allowed[t // 32]) is set, -inf
    elsewhere: structured output's mask (structured.constraint). out may be logits."""
    for i in range(logits.shape[0]):
        out[i] = logits[i] if (allowed[i >> 5] >> (i & 31)) & 1 else -np.inf
