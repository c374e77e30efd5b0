"""One request's work on one engine, a step at a time, so that its model's worker can interleave
the requests it holds and drop a cancelled one between two steps (scheduler.py)."""

from __future__ import annotations

from typing import Iterator

from nerva_cli.runtime.generate import StopMatcher, reuse_prefix
from nerva_cli.runtime.sampling import Sampler, log_probs


def answer_steps(engine, job, prompt: list[int]) -> Iterator[None]:
    """A generator: each next() runs one engine step, a prefill chunk or a decode step, and
    reports to `job` what it made; it returns when the answer ends (after job.finish).

    `prompt` holds the tokens of the engine's cache that prefill chunks made, kept true here:
    whole chunks of them that start this job's prompt too are not prefilled again
    (job.cached_tokens says how many), as llama.cpp's server reuses a slot's cache. Only whole
    chunks, never rows a decode step or a shorter chunk made: a row's numbers depend on the
    kernels that made it (short chunks take the matvecs', long ones the GEMMs'), and an answer
    must not depend on what the engine ran before it (a seed gives the same text).

    The engine samples on the host here even where it could on its device (cuda's `stream`):
    a device stream queues steps ahead of the host, which cannot be interleaved with another
    request's."""
    ids = job.prompt_ids
    chunk = engine.prefill_chunk
    kept = reuse_prefix(engine, prompt, ids, unit=chunk)
    del prompt[kept:]
    job.reused(kept)
    sampler = Sampler(job.sampling, engine.cfg.vocab_size)
    scored = None  # the last token's log-probabilities, when the request asks for them

    def pick(logits) -> int:
        nonlocal scored
        if job.top_logprobs is not None:
            scored = log_probs(logits)
        return sampler(logits)

    for start in range(kept, len(ids), chunk):
        if start > kept:
            yield  # between chunks: a long prompt does not hold up the other requests' tokens
        logits = engine.prefill(ids[start:start + chunk])
        prompt.extend(ids[start:start + chunk])
    token = pick(logits)
    eos = job.tokenizer.eos_ids
    decoder, matcher = job.tokenizer.stream_decoder(), StopMatcher(job.stops)
    # the last token sampled is never fed back, so an answer may take every position left
    limit = min(job.max_tokens, engine.ctx - len(ids))
    while True:
        if token in eos:
            job.token("", answer=False)
            reason = "eos"
            break
        if scored is not None:
            job.scored(token, scored)
        text, hit = matcher.feed(decoder.push(token))
        job.token(text)
        if hit:
            reason = "stop"
            break
        if job.made >= limit:
            reason = "length"
            break
        yield
        token = pick(engine.decode(token))
    if reason != "stop":
        job.text(matcher.feed(decoder.flush())[0] + matcher.flush())
    job.finish(reason)
