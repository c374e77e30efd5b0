"""One request's work on one engine, a step at a time, so that its model's worker can interleave
the requests it holds and drop a cancelled one between two steps (scheduler.py)."""

from __future__ import annotations

from typing import Iterator

from nerva_cli.runtime.generate import StopMatcher, reuse_prefix
from nerva_cli.runtime.sampling import Sampler


def answer_steps(engine, job, cached: list[int]) -> Iterator[None]:
    """A generator: each next() runs one engine step, a prefill chunk or a decode step, and
    reports to `job` what it made; it returns when the answer ends (after job.finish).

    `cached` is what the engine's cache holds (the tokens, in order), kept true as the cache
    changes: the prompt's start that it already holds is not prefilled again (job.cached_tokens
    says how much), as llama.cpp's server reuses a slot's cache.

    The engine samples on the host here even where it could on its device (cuda's `stream`):
    a device stream queues steps ahead of the host, which cannot be interleaved with another
    request's."""
    ids = job.prompt_ids
    kept = reuse_prefix(engine, cached, ids)
    del cached[kept:]
    job.reused(kept)
    sampler = Sampler(job.sampling, engine.cfg.vocab_size)
    chunk = engine.prefill_chunk
    for start in range(kept, len(ids), chunk):
        if start > kept:
            yield  # between chunks: a long prompt does not hold up the other requests' tokens
        logits = engine.prefill(ids[start:start + chunk])
        cached.extend(ids[start:start + chunk])
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
        logits = engine.decode(token)
        cached.append(token)
        token = sampler(logits)
    if reason != "stop":
        job.text(matcher.feed(decoder.flush())[0] + matcher.flush())
    job.finish(reason)
