"""One request's answer as a coroutine of engine steps, so that its model's worker can interleave
the requests it holds, drop a cancelled one between two steps, and (with a batching engine) run
the decode steps of several requests as one (scheduler.py). The coroutine names each step it
needs (Keep, Prefill, Decode) and is sent what the engine returned; it never touches an engine,
so it is the same whether its steps run one by one or batched."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, Union

from nerva_cli.runtime.generate import StopMatcher, reusable_prefix
from nerva_cli.runtime.sampling import Sampler, log_probs


@dataclass
class Keep:
    """Keep the cache's first `n` positions, forget the rest; -> the positions kept."""
    n: int


@dataclass
class Prefill:
    """Run `tokens` after what the cache holds; -> the last position's logits."""
    tokens: list[int]


@dataclass
class Decode:
    """Run one token; -> its logits."""
    token: int


Step = Union[Keep, Prefill, Decode]


def answer_steps(job, prompt: list[int], chunk: int, ctx: int, vocab: int) -> Generator[Step, object, None]:
    """The steps of `job`'s answer on an engine of context `ctx` whose prefill takes `chunk`
    tokens a pass; it reports to `job` what it makes and returns when the answer ends (after
    job.finish).

    `prompt` holds the tokens of the engine's cache that prefill chunks made, kept true here:
    whole chunks of them that start this job's prompt too are not prefilled again
    (job.cached_tokens says how many), as llama.cpp's server reuses a slot's cache. Only whole
    chunks, never rows a decode step or a shorter chunk made: a row's numbers depend on the
    kernels that made it (short chunks take the matvecs', long ones the GEMMs'), and an answer
    must not depend on what the engine ran before it (a seed gives the same text).

    Sampling is on the host here even where an engine could sample on its device (cuda's
    `stream`): a device stream queues steps ahead of the host, which cannot be interleaved."""
    ids = job.prompt_ids
    kept = yield Keep(reusable_prefix(prompt, ids, unit=chunk))
    del prompt[kept:]
    job.reused(kept)
    sampler = Sampler(job.sampling, vocab, job.constraint)
    scored = None  # the last token's log-probabilities, when the request asks for them

    def pick(logits) -> int:
        nonlocal scored
        if job.top_logprobs is not None:
            scored = log_probs(logits)
        return sampler(logits)

    for start in range(kept, len(ids), chunk):  # a step each: a long prompt holds up no other request long
        logits = yield Prefill(ids[start:start + chunk])
        prompt.extend(ids[start:start + chunk])
    token = pick(logits)
    eos = job.tokenizer.eos_ids
    decoder, matcher = job.tokenizer.stream_decoder(), StopMatcher(job.stops)
    # the last token sampled is never fed back, so an answer may take every position left
    limit = min(job.max_tokens, ctx - len(ids))
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
        token = pick((yield Decode(token)))
    if reason != "stop":
        job.text(matcher.feed(decoder.flush())[0] + matcher.flush())
    job.finish(reason)


def run_step(engine, seq: int | None, step: Step):
    """One step on sequence slot `seq` of an engine (None: an engine of one sequence)."""
    if seq is not None:
        engine.select(seq)
    if isinstance(step, Decode):
        return engine.decode(step.token)
    if isinstance(step, Prefill):
        return engine.prefill(step.tokens)
    return engine.truncate(step.n)
