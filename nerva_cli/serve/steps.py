"""One request's work on one engine, a step at a time, so that its model's worker can interleave
the requests it holds and drop a cancelled one between two steps (scheduler.py)."""

from __future__ import annotations

from typing import Iterator

from nerva_cli.runtime.generate import StopMatcher
from nerva_cli.runtime.sampling import Sampler


def answer_steps(engine, job) -> Iterator[None]:
    """A generator: each next() runs one engine step, a prefill chunk or a decode step, and
    reports to `job` what it made; it returns when the answer ends (after job.finish).

    The engine samples on the host here even where it could on its device (cuda's `stream`):
    a device stream queues steps ahead of the host, which cannot be interleaved with another
    request's. Each request starts from an empty cache (no prefix is reused across requests yet)."""
    engine.reset()
    ids = job.prompt_ids
    sampler = Sampler(job.sampling, engine.cfg.vocab_size)
    chunk = engine.prefill_chunk
    for start in range(0, len(ids), chunk):
        if start:
            yield  # between chunks: a long prompt does not hold up the other requests' tokens
        logits = engine.prefill(ids[start:start + chunk])
    token = sampler(logits)
    eos = job.tokenizer.eos_ids
    decoder, matcher = job.tokenizer.stream_decoder(), StopMatcher(job.stops)
    # the last token sampled is never fed back, so an answer may take every position left
    limit = min(job.max_tokens, engine.ctx - len(ids))
    while True:
        if token in eos:
            job.token("", answer=False)
            reason = "eos"
            break
        text, hit = matcher.feed(decoder.push(token))
        job.token(text)
        if hit:
            reason = "stop"
            break
        if job.made >= limit:
            reason = "length"
            break
        yield
        token = sampler(engine.decode(token))
    if reason != "stop":
        job.text(matcher.feed(decoder.flush())[0] + matcher.flush())
    job.finish(reason)
