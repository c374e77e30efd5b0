"""Prompt -> tokens -> streamed text, with the timings `run` prints and `bench` reports."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from nerva_cli.runtime.sampling import Sampler


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    gen_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    token_s: list[float] = field(default_factory=list)  # wall time of each decode step
    stop_reason: str = ""  # eos / stop / length / interrupted (ChatSession: context)
    cut_short: bool = False  # structured output stopped (length, context, Ctrl-C) before its grammar was complete

    @property
    def decode_s(self) -> float:
        return sum(self.token_s)

    @property
    def decode_tok_s(self) -> float:
        return len(self.token_s) / self.decode_s if self.token_s else 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0


class StopMatcher:
    """Holds back text that may be the start of a stop string, so a stop string never prints."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """-> (text safe to print, whether a stop string was reached)."""
        self.pending += text
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0:
                out, self.pending = self.pending[:i], ""
                return out, True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out):]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def reusable_prefix(cached: list[int], ids: list[int], unit: int = 1) -> int:
    """How many of `ids`' first tokens a cache holding `cached` (in order) can keep, in whole
    multiples of `unit`, leaving at least one token to run (for the logits). The engine's
    truncate() may keep fewer (a sliding window's cache that lost them)."""
    keep = min(common_prefix(cached, ids), len(ids) - 1)
    return keep - keep % unit


def _host_tokens(engine, prompt_ids: list[int], sampler: Sampler, stats: GenerationStats, ledger=None):
    """Prefill, then decode and sample on the host, one token at a time."""
    t0 = time.perf_counter()
    logits = engine.prefill(prompt_ids)
    stats.prefill_s = time.perf_counter() - t0
    token = sampler(logits)
    while True:
        yield token
        token = ledger.step(engine.decode, sampler, token) if ledger is not None else sampler(engine.decode(token))


def generate(engine, prompt_ids: list[int], sampler: Sampler, max_tokens: int,
             eos_ids: set[int] = frozenset(), decoder=None, stops: list[str] = (),
             on_text: Callable[[str], None] | None = None,
             ledger=None) -> tuple[list[int], GenerationStats]:
    """Prefills `prompt_ids` (on top of what the engine already holds) and decodes up to
    `max_tokens`. Ctrl-C stops the answer and returns what was made so far.

    An engine that samples on its device (cuda) streams tokens while it computes the next ones;
    its token times are the intervals between arrivals, since the device does not wait for this
    loop. On the host path nothing runs while this loop prints, so a token's time is the time
    spent making it. The ledger measures one token at a time, so it takes the host path."""
    stats = GenerationStats(prompt_tokens=len(prompt_ids))
    matcher = StopMatcher(list(stops))
    out: list[int] = []
    emit = on_text or (lambda s: None)
    # the device samples without the host's structured-output mask
    on_device = engine.device_sampling and ledger is None and sampler.constraint is None
    tokens = (engine.stream(prompt_ids, sampler.o, max_tokens) if on_device
              else _host_tokens(engine, prompt_ids, sampler, stats, ledger))
    t0 = time.perf_counter()
    try:
        last = t0
        while True:
            if not on_device:
                last = time.perf_counter()
            token = next(tokens, None)
            now = time.perf_counter()
            if token is None:
                stats.stop_reason = "length"
                break
            if not out and not stats.ttft_s:
                stats.ttft_s = now - t0
                if on_device:
                    stats.prefill_s = engine.last_prefill_s
            else:
                stats.token_s.append(now - last)
            last = now
            if token in eos_ids:
                stats.stop_reason = "eos"
                break
            out.append(token)
            if decoder is not None:
                text, hit = matcher.feed(decoder.push(token))
                emit(text)
                if hit:
                    stats.stop_reason = "stop"
                    break
            if len(out) >= max_tokens:
                stats.stop_reason = "length"
                break
    except KeyboardInterrupt:
        stats.stop_reason = "interrupted"
    finally:
        tokens.close()
    if decoder is not None and stats.stop_reason != "stop":
        emit(matcher.feed(decoder.flush())[0] + matcher.flush())
    stats.gen_tokens = len(out)
    if sampler.constraint is not None:
        stats.cut_short = stats.stop_reason in ("length", "interrupted") and not sampler.constraint.complete
    return out, stats
