"""Sampling on the host that holds the logits: greedy, temperature, top-k, top-p, repetition
penalty, seeded. Greedy allocates nothing; the stochastic path makes a few small arrays of at
most top_k entries per token (counted by the hot-path counter like any other allocation)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nerva_cli.errors import NervaError


@dataclass
class SamplingOptions:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise NervaError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise NervaError(f"--top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise NervaError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.repeat_penalty <= 0:
            raise NervaError(f"--repeat-penalty must be > 0, got {self.repeat_penalty}")


class Sampler:
    def __init__(self, opts: SamplingOptions, vocab: int):
        self.o = opts
        self.rng = np.random.default_rng(opts.seed)
        self.work = np.empty(vocab, dtype=np.float32)
        self.recent: list[int] = []

    def _penalise(self, logits: np.ndarray) -> np.ndarray:
        """llama.cpp's rule: positive logits are divided by the penalty, negative multiplied."""
        if self.o.repeat_penalty == 1.0 or not self.recent:
            return logits
        np.copyto(self.work, logits)
        for t in set(self.recent[-self.o.repeat_last_n:]):
            v = self.work[t]
            self.work[t] = v / self.o.repeat_penalty if v > 0 else v * self.o.repeat_penalty
        return self.work

    def __call__(self, logits: np.ndarray) -> int:
        logits = self._penalise(logits)
        if self.o.temperature == 0:
            token = int(np.argmax(logits))
        else:
            token = self._sample(logits)
        self.recent.append(token)
        if len(self.recent) > 4 * max(self.o.repeat_last_n, 1):
            del self.recent[: -self.o.repeat_last_n]
        return token

    def _sample(self, logits: np.ndarray) -> int:
        k = self.o.top_k if 0 < self.o.top_k < logits.shape[0] else logits.shape[0]
        cand = np.argpartition(logits, -k)[-k:] if k < logits.shape[0] else np.arange(logits.shape[0])
        vals = logits[cand].astype(np.float64) / self.o.temperature
        order = np.argsort(-vals, kind="stable")
        cand, vals = cand[order], vals[order]
        p = np.exp(vals - vals[0])
        p /= p.sum()
        if self.o.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(p), self.o.top_p) + 1)
            cand, p = cand[:keep], p[:keep] / p[:keep].sum()
        return int(cand[self.rng.choice(len(p), p=p)])
