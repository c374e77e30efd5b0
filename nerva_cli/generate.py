"""Prompt -> tokens -> streamed text, with the timings `run` prints and `bench` reports."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from nerva_cli.sampling import Sampler


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    gen_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    token_s: list[float] = field(default_factory=list)  # wall time of each decode step
    stop_reason: str = ""  # eos / stop / length / interrupted

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


def generate(engine, prompt_ids: list[int], sampler: Sampler, max_tokens: int,
             eos_ids: set[int] = frozenset(), decoder=None, stops: list[str] = (),
             on_text: Callable[[str], None] | None = None,
             ledger=None) -> tuple[list[int], GenerationStats]:
    """Prefills `prompt_ids` (on top of what the engine already holds) and decodes up to
    `max_tokens`. Ctrl-C stops the answer and returns what was made so far."""
    stats = GenerationStats(prompt_tokens=len(prompt_ids))
    matcher = StopMatcher(list(stops))
    out: list[int] = []
    emit = on_text or (lambda s: None)
    t0 = time.perf_counter()
    try:
        logits = engine.prefill(prompt_ids)
        stats.prefill_s = time.perf_counter() - t0
        token = sampler(logits)
        stats.ttft_s = time.perf_counter() - t0
        while True:
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
            t = time.perf_counter()
            if ledger is not None:
                token = ledger.step(engine.decode, sampler, token)
            else:
                token = sampler(engine.decode(token))
            stats.token_s.append(time.perf_counter() - t)
    except KeyboardInterrupt:
        stats.stop_reason = "interrupted"
    if decoder is not None and stats.stop_reason != "stop":
        emit(matcher.feed(decoder.flush())[0] + matcher.flush())
    stats.gen_tokens = len(out)
    return out, stats
