"""Sampling on the host that holds the logits: greedy, temperature, top-k, top-p, min-p,
repetition penalty, seeded. A step allocates nothing: the candidates, their weights and the
recent tokens live in buffers made with the Sampler, and the work is done by numba
(planes/cpu/kernels) by the rule ref.sampling_candidates defines, the one the cuda sampler draws by
too."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from nerva_cli.errors import UsageError


@dataclass
class SamplingOptions:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self):
        if not 0 <= self.temperature < math.inf:  # NaN too
            raise UsageError(f"--temperature must be a number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise UsageError(f"--min-p must be in [0, 1] (0 disables it), got {self.min_p}")
        if self.repeat_last_n < 0:
            raise UsageError(f"--repeat-last-n must be >= 0 (0 disables the penalty), got {self.repeat_last_n}")
        if not 0 < self.repeat_penalty < math.inf:
            raise UsageError(f"--repeat-penalty must be a number > 0, got {self.repeat_penalty}")
        if self.seed is not None and self.seed < 0:
            raise UsageError(f"--seed must be >= 0 (without it, a random seed), got {self.seed}")


class Sampler:
    """Draws each token from a step's logits. With a `constraint` (structured output), the
    tokens its grammar forbids are masked out first and each token drawn is told to it."""

    def __init__(self, opts: SamplingOptions, vocab: int, constraint=None):
        self.o = opts
        self.rng = np.random.default_rng(opts.seed)
        self.penalising = opts.repeat_penalty != 1.0 and opts.repeat_last_n > 0
        self.recent = np.zeros(max(opts.repeat_last_n, 1), np.int32)  # a ring of the last tokens
        self.n_recent = 0  # tokens remembered so far
        self.vocab, self.work = vocab, None
        self.hold_to(constraint)
        if self.penalising or opts.temperature > 0:
            self._buffers()

    def _buffers(self) -> None:
        if self.work is None:
            from nerva_cli.planes.cpu import kernels as cpu
            self.cpu = cpu
            self.work = np.empty(self.vocab, np.float32)  # the penalised (and masked) logits
            self.seen = np.zeros(self.vocab, np.bool_)
            self.cand = np.empty(self.vocab, np.int32)
            self.scratch = np.empty(self.vocab, np.float64)

    def hold_to(self, constraint) -> None:
        """Masks the draws from now on with `constraint` (structured.Constraint; None: none)."""
        self.constraint = constraint
        if constraint is not None:
            self._buffers()

    def remember(self, token: int) -> None:
        self.recent[self.n_recent % len(self.recent)] = token
        self.n_recent += 1

    def penalised(self, logits: np.ndarray) -> np.ndarray:
        """llama.cpp's rule: positive logits are divided by the penalty, negative multiplied."""
        if not self.penalising or not self.n_recent:
            return logits
        self.cpu.penalise(logits, self.recent, min(self.n_recent, len(self.recent)), self.o.repeat_penalty,
                          self.seen, self.work)
        return self.work

    def __call__(self, logits: np.ndarray) -> int:
        logits = self.penalised(logits)
        if self.constraint is not None:
            logits = self.constraint.apply(logits, self.work)
        if self.o.temperature == 0:
            token = int(np.argmax(logits))
        else:
            token = int(self.cpu.sample_logits(logits, self.o.temperature, self.o.top_k, self.o.top_p,
                                               self.o.min_p, self.rng.random(), self.cand, self.scratch))
        self.remember(token)
        if self.constraint is not None:
            self.constraint.take(token)
        return token


def log_probs(logits: np.ndarray) -> np.ndarray:
    """The model's log-probabilities, before penalties, temperature and truncation (what OpenAI's
    and llama.cpp's servers report as logprobs), in float64 so the tail does not round to -inf."""
    x = logits.astype(np.float64)
    x -= x.max()
    return x - np.log(np.exp(x).sum())


def warm_kernels(vocab: int) -> None:
    """One draw with a repetition penalty, on random logits, so that the sampling kernels compile
    before an answer (the CLI's warm-up): on a machine's first run their compile came between
    the prompt and the answer's first token (docs/perf/code_figures.md)."""
    sampler = Sampler(SamplingOptions(repeat_penalty=1.1, seed=0), vocab)
    sampler.remember(0)
    sampler(np.random.default_rng(0).standard_normal(vocab, dtype=np.float32))
