"""One generation request between its handler, on the event loop, and its model's worker, a
thread: what to run, the text and the end the worker reports back, and the request's timings."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from time import perf_counter_ns

import numpy as np

from nerva_cli.runtime.sampling import SamplingOptions
from nerva_cli.serve.errors import ApiError


@dataclass
class Result:
    """How an answer ended, in ollama's terms (durations in ns)."""

    reason: str  # eos, stop (a stop string), length
    prompt_tokens: int
    cached_tokens: int  # of the prompt's, those its engine's cache already held (not prefilled again)
    gen_tokens: int
    total_ns: int  # arrival to the end, waiting included
    load_ns: int  # waiting for the model to load (0 where it was loaded)
    prompt_ns: int  # the prefill, from its first step to the first token
    eval_ns: int  # from the first token to the last


@dataclass
class Job:
    key: str  # the model, name:variant
    prompt_ids: list[int]
    sampling: SamplingOptions
    max_tokens: int  # already held to the context's room
    stops: list[str]
    keep_alive: float | None  # seconds the model stays loaded after this answer; None: for ever
    tokenizer: object
    metrics: object
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False  # set by the handler (a client gone); the worker drops the job before its next step
    arrived_ns: int = field(default_factory=perf_counter_ns)
    load_ns: int = 0
    started_ns: int = 0
    first_ns: int = 0
    last_ns: int = 0
    made: int = 0
    cached_tokens: int = 0
    tool_style: str | None = None  # the template's way of writing tool calls, where the request has tools
    top_logprobs: int | None = None  # None: no log-probabilities; n: each token's and the n likeliest's
    constraint: object = None  # structured.Constraint the answer is held to, or None
    # (token id, its log-probability, [(id, log-probability)] of the likeliest), appended by the
    # worker before the token's text event is sent (the handler reads what the events announced)
    logprobs: list = field(default_factory=list)

    # -- the worker's side: called on its thread, each hands an event to the loop -----------
    def _push(self, kind: str, payload) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the loop closed (the server is stopping): nobody is listening
            pass

    def started(self, waited_for_load_ns: int) -> None:
        self.load_ns = waited_for_load_ns
        self.started_ns = perf_counter_ns()

    def reused(self, tokens: int) -> None:
        """The prompt's first `tokens` were in the engine's cache already."""
        self.cached_tokens = tokens
        self.metrics.prefix_cache_hit_tokens.inc(tokens)

    def scored(self, token: int, logprobs) -> None:
        """The answer's next token's log-probability and the top_logprobs likeliest's."""
        n = self.top_logprobs
        top = np.argpartition(logprobs, -n)[-n:] if n else np.empty(0, dtype=np.int64)
        top = top[np.argsort(-logprobs[top], kind="stable")]
        self.logprobs.append((token, float(logprobs[token]), [(int(i), float(logprobs[i])) for i in top]))

    def token(self, text: str, answer: bool = True) -> None:
        """A token was sampled; `text` is what it adds to the answer (possibly ""). An end of
        sequence is timed but not `answer`: it is not part of the answer or its count."""
        now = perf_counter_ns()
        if not self.first_ns:
            self.first_ns = now
            self.metrics.ttft.observe((now - self.arrived_ns) / 1e9)
            self.metrics.prompt_tokens.inc(len(self.prompt_ids))
        else:
            self.metrics.tpot.observe((now - self.last_ns) / 1e9)
        self.last_ns = now
        if answer:
            self.made += 1
            self.metrics.generated_tokens.inc()
            self.text(text)

    def text(self, text: str) -> None:
        """Text held back until the answer's end (the tail of a possible stop string)."""
        if text:
            self._push("text", text)

    def finish(self, reason: str) -> None:
        now = perf_counter_ns()
        first = self.first_ns or now
        self._push("done", Result(reason, len(self.prompt_ids), self.cached_tokens, self.made, now - self.arrived_ns,
                                  self.load_ns,
                                  first - (self.started_ns or first), (self.last_ns or first) - first))

    def fail(self, err: ApiError) -> None:
        self._push("error", err)
