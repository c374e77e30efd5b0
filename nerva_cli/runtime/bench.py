"""`nerva bench`: one JSON line of measured figures (ARCHITECTURE 12)."""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nerva_cli import __version__
from nerva_cli.errors import NervaError
from nerva_cli.runtime.generate import generate
from nerva_cli.runtime.sampling import Sampler, SamplingOptions

PROMPT_SEED_TEXT = (
    "The history of computing is a story of memory as much as of arithmetic. Early machines "
    "stored a few hundred numbers in mercury delay lines; later ones used magnetic cores, then "
    "transistors, and every step changed what programs could be written. ")


@dataclass
class BenchOptions:
    prompt_tokens: int = 256
    gen_tokens: int = 128
    repeat: int = 3
    ppl_file: Path | None = None
    ppl_ctx: int = 512
    concurrency: int | None = None  # N sequences decoded together (decode_batch); None: generate()'s one
    format: object = None  # structured.Format the answers are held to (--format, --grammar), or None

    def __post_init__(self):
        self.ppl_text = None if self.ppl_file is None else read_ppl_text(self.ppl_file)  # before any run


def read_ppl_text(path: Path) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as e:
        raise NervaError(f"{path}: {e.strerror}") from None
    if not text.strip():
        raise NervaError(f"{path}: no text for a perplexity")
    return text


def synthetic_prompt(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(PROMPT_SEED_TEXT * (n // 40 + 2), add_special=False)
    if len(ids) < n:
        raise NervaError(f"could not build a prompt of {n} tokens")
    return ids[:n]


PROMPT_SHIFT = 7  # tokens between the starts of --concurrency's prompts in the synthetic text


def concurrent_prompts(tokenizer, n: int, count: int) -> list[list[int]]:
    """`count` fixed prompts of n tokens, each the synthetic text from a different start."""
    ids = synthetic_prompt(tokenizer, n + PROMPT_SHIFT * (count - 1))
    return [ids[PROMPT_SHIFT * s:PROMPT_SHIFT * s + n] for s in range(count)]


@dataclass
class ConcurrentRun:
    prefill_ns: list[int]  # each sequence's prefill and first token
    step_ns: list[int]  # each batched step's wall time, sampling included

    @property
    def aggregate_tok_s(self) -> float:
        return len(self.prefill_ns) * len(self.step_ns) / sum(self.step_ns) * 1e9

    @property
    def sequence_tok_s(self) -> float:
        return len(self.step_ns) / sum(self.step_ns) * 1e9


def run_concurrent(engine, prompts: list[list[int]], gen_tokens: int) -> ConcurrentRun:
    """Each prompt prefilled into a sequence slot of its own, one after another, then the
    sequences decoded greedily together by decode_batch until each has gen_tokens tokens."""
    slots = list(range(len(prompts)))
    samplers = [Sampler(SamplingOptions(temperature=0.0), engine.cfg.vocab_size) for _ in slots]
    prefill_ns, step_ns, tokens = [], [], []
    for s in slots:
        engine.select(s)
        engine.reset()
        t0 = time.perf_counter_ns()
        tokens.append(samplers[s](engine.prefill(prompts[s])))
        prefill_ns.append(time.perf_counter_ns() - t0)
    for _ in range(gen_tokens - 1):
        t0 = time.perf_counter_ns()
        logits = engine.decode_batch(tokens, slots)
        tokens = [samplers[s](logits[s]) for s in slots]
        step_ns.append(time.perf_counter_ns() - t0)
    return ConcurrentRun(prefill_ns, step_ns)


def concurrent_figures(engine, tokenizer, opts: BenchOptions, log) -> tuple[dict, int]:
    """--concurrency N: the warm-up and the measured runs (run_concurrent); -> (the figures of the
    JSON line, layer passes made, the pager's counters over them), the per-sequence ones of a
    sequence's view: a step gives each one token."""
    n = opts.concurrency
    prompts = concurrent_prompts(tokenizer, opts.prompt_tokens, n)
    log(f"warm-up: {n} sequences (compiles kernels on first use)")
    run_concurrent(engine, [p[:16] for p in prompts], 4)
    pager0 = _pager_counters(engine)  # the measured runs' reads, not the warm-up's
    runs = []
    for r in range(opts.repeat):
        runs.append(run_concurrent(engine, prompts, opts.gen_tokens))
        if runs[-1].step_ns:
            log(f"run {r + 1}/{opts.repeat}: {n} sequences, decode {runs[-1].aggregate_tok_s:.1f} tok/s in all, "
                f"{runs[-1].sequence_tok_s:.1f} each")
    for s in range(n):
        engine.select(s)
        engine.reset()
    engine.select(0)
    step_ms = np.array([t for r in runs for t in r.step_ns]) / 1e6
    prefill_s = [sum(r.prefill_ns) / 1e9 for r in runs]
    decoded = step_ms.size > 0
    figures = {
        "prefill_tok_s": round(float(np.median([n * opts.prompt_tokens / s for s in prefill_s])), 2),
        "decode_tok_s": round(float(np.median([r.sequence_tok_s for r in runs])), 2) if decoded else None,
        "decode_tok_s_best": round(max(r.sequence_tok_s for r in runs), 2) if decoded else None,
        "ttft_ms": round(float(np.median([t for r in runs for t in r.prefill_ns])) / 1e6, 2),
        "token_ms_p50": round(float(np.percentile(step_ms, 50)), 3) if decoded else None,
        "token_ms_p99": round(float(np.percentile(step_ms, 99)), 3) if decoded else None,
        "concurrency": n,
        "aggregate_decode_tok_s": round(float(np.median([r.aggregate_tok_s for r in runs])), 2) if decoded else None,
        "per_sequence_token_ms_p50": round(float(np.percentile(step_ms, 50)), 3) if decoded else None,
    }
    passes = opts.repeat * (n * math.ceil(opts.prompt_tokens / engine.prefill_chunk) + opts.gen_tokens - 1)
    return figures, passes, [b - a for a, b in zip(pager0, _pager_counters(engine))]


def single_figures(engine, tokenizer, prompt: list[int], opts: BenchOptions, log) -> tuple[dict, int]:
    """One sequence through generate(): the warm-up and the measured runs; -> (figures, layer
    passes made, the pager's counters over them). With a format, each run is held to it and ends
    where its grammar does (at the end of sequence it then allows)."""
    greedy = SamplingOptions(temperature=0.0)
    masks = []  # with a format: each run's constraint, for its mask times

    def sampler() -> Sampler:
        if opts.format is None:
            return Sampler(greedy, engine.cfg.vocab_size)
        from nerva_cli.structured.constraint import Constraint

        masks.append(Constraint(opts.format, tokenizer, engine.cfg.vocab_size))
        return Sampler(greedy, engine.cfg.vocab_size, masks[-1])

    eos = tokenizer.eos_ids if opts.format is not None else frozenset()
    log("warm-up (compiles kernels on first use)")
    engine.reset()
    generate(engine, prompt[:16], sampler(), max_tokens=4, eos_ids=eos)
    masks.clear()
    pager0 = _pager_counters(engine)  # the measured runs' reads, not the warm-up's
    runs = []
    for r in range(opts.repeat):
        engine.reset()
        _, stats = generate(engine, prompt, sampler(), max_tokens=opts.gen_tokens, eos_ids=eos)
        if stats.stop_reason == "interrupted":
            raise KeyboardInterrupt
        runs.append(stats)
        log(f"run {r + 1}/{opts.repeat}: prefill {stats.prefill_tok_s:.1f} tok/s, "
            f"decode {stats.decode_tok_s:.1f} tok/s")
    token_ms = np.array([t for s in runs for t in s.token_s]) * 1000
    passes = sum(s.gen_tokens - 1 + math.ceil(s.prompt_tokens / engine.prefill_chunk) for s in runs)  # layer passes
    best = max(runs, key=lambda s: s.decode_tok_s)
    decode = round(float(np.median([s.decode_tok_s for s in runs])), 2) if token_ms.size else None
    p50 = round(float(np.percentile(token_ms, 50)), 3) if token_ms.size else None
    figures = {
        "prefill_tok_s": round(float(np.median([s.prefill_tok_s for s in runs])), 2),
        # --gen-tokens 1 times prefill alone (its token is the first): no decode step, no figure
        "decode_tok_s": decode,
        "decode_tok_s_best": round(best.decode_tok_s, 2) if token_ms.size else None,
        "ttft_ms": round(float(np.median([s.ttft_s for s in runs])) * 1000, 2),
        "token_ms_p50": p50,
        "token_ms_p99": round(float(np.percentile(token_ms, 99)), 3) if token_ms.size else None,
        "concurrency": 1, "aggregate_decode_tok_s": decode, "per_sequence_token_ms_p50": p50,
    }
    if opts.format is not None:
        figures.update({"format": opts.format.describe(), "answer_tokens": [s.gen_tokens for s in runs],
                        "mask_us_mean": round(sum(m.mask_ns_total for m in masks) / 1000 /
                                              max(1, sum(m.masks for m in masks)), 1)})
    return figures, passes, [b - a for a, b in zip(pager0, _pager_counters(engine))]


def perplexity(engine, ids: list[int], window: int) -> tuple[float, int]:
    """exp(mean NLL) over non-overlapping windows; the first token of each window is context only."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            break
        engine.reset()
        logits = engine.prefill(chunk, all_logits=True).astype(np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        targets = np.asarray(chunk[1:])
        nll -= logp[np.arange(len(targets)), targets].sum()
        count += len(targets)
    engine.reset()
    return math.exp(nll / count), count


def decode_step_counts(engine, prompt: list[int], steps: int) -> tuple[int, float, float]:
    """(hot-path allocations over `steps` decode steps, kernels a step runs, host calls a step
    makes to run them: one where the step is a replayed graph). The allocation check runs twice,
    with 0 and with `steps` steps after the same prefill and warm-up, and the kernels counted in
    the first are taken from the second's, leaving the steps' own (sampling included)."""
    c = engine.counters
    k0, d0, _ = c.snapshot()
    engine.count_hot_path_allocations(prompt, steps=0)
    k1, d1, _ = c.snapshot()
    allocs = engine.count_hot_path_allocations(prompt, steps=steps)
    k2, d2, _ = c.snapshot()
    return allocs, ((k2 - k1) - (k1 - k0)) / steps, ((d2 - d1) - (d1 - d0)) / steps


def run_bench(engine, tokenizer, opts: BenchOptions, threads: int, log=lambda s: None) -> dict:
    if opts.prompt_tokens + opts.gen_tokens + 1 > engine.ctx:
        most = engine.cfg.max_context
        raise NervaError(f"prompt {opts.prompt_tokens} + gen {opts.gen_tokens} tokens exceed the context "
                         f"({engine.ctx}); " + ("raise --ctx" if engine.ctx < most else
                                                f"{engine.model.name} attends over {most} positions at most"))
    ppl_ids = None
    if opts.ppl_text is not None:
        ppl_ids = tokenizer.encode(opts.ppl_text, add_special=False)
        if len(ppl_ids) < 2:
            raise NervaError(f"{opts.ppl_file}: too little text for a perplexity ({len(ppl_ids)} token)")
    prompt = synthetic_prompt(tokenizer, opts.prompt_tokens)
    if opts.concurrency is None:
        figures, passes, pager = single_figures(engine, tokenizer, prompt, opts, log)
    else:
        figures, passes, pager = concurrent_figures(engine, tokenizer, opts, log)
    allocs, launches, dispatches = decode_step_counts(engine, prompt[:8], steps=16)
    # the disk's rate while the pager read (open to close), and the decode rate it allows if every
    # paged byte came at it: a shared, bursty disk is judged against itself, in the same run
    read_rate = pager[0] / pager[5] * 1e9 if pager[5] else None
    result = {
        "model": engine.model.name, "variant": engine.model.variant, "backend": engine.backend,
        "device": engine.device_name, "threads": threads,
        "mode": "hot-only" if len(engine.active) < engine.cfg.num_layers else "full",
        "precision": engine.precision,
        **engine.budgets,
        "policy": engine.policy if engine.plan.paged_layers else
        f"expert cache ({engine.expert_policy})" if engine.plan.expert_layers else "resident",
        "resident_layers": len(engine.plan.resident_layers), "paged_layers": len(engine.plan.paged_layers),
        "disk_bytes_per_token": round(pager[0] / passes), "hit_rate": round(pager[1] / (pager[1] + pager[2]), 4)
        if pager[1] + pager[2] else 1.0, "stall_ms_per_token": round(pager[3] / 1e6 / passes, 3),
        "disk_read_bytes_per_s": None if read_rate is None else round(read_rate),
        "disk_bound_tok_s": None if read_rate is None else round(read_rate / (pager[0] / passes), 2),
        "h2d_bytes_per_token": round(pager[4] / passes),
        "direct_io": engine.weights.direct_io,
        "token_table_aside": engine.plan.table_aside,  # in its file (cpu) or pinned RAM (cuda), not the budget's
        **engine.plane_facts(),
        "prompt_tokens": opts.prompt_tokens, "gen_tokens": opts.gen_tokens, "repeat": opts.repeat,
        **figures,
        "w4a8_layers": engine.precision_counts["w4a8"], "w4a16_layers": engine.precision_counts["w4a16"],
        "exact_layers": engine.precision_counts["exact"], "active_layers": len(engine.active),
        "weight_bytes": engine.weight_bytes, "kv_cache_bytes": engine.a.kv_bytes, "kv_cache": engine.kv_cache,
        "hot_path_allocations": allocs,
        "kernel_launches_per_token": launches, "dispatches_per_token": dispatches,
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_vram_bytes": engine.peak_vram_bytes,
        "nerva_version": __version__,
    }
    cfg = engine.cfg
    if cfg.num_experts:  # a token multiplies by its k experts' bytes in each layer
        result.update(experts_per_layer=cfg.num_experts, experts_per_token=cfg.experts_per_token,
                      expert_bytes=engine.expert_bytes,
                      expert_bytes_per_token=engine.expert_bytes * cfg.experts_per_token * len(cfg.moe_layers),
                      expert_hit_rate=1.0)  # every expert in RAM, unless a cache's run says otherwise
        if engine.plan.expert_layers:  # over --ppl's text where it is long enough, else greedy
            text = ppl_ids if ppl_ids is not None and len(ppl_ids) >= opts.prompt_tokens + opts.gen_tokens else None
            cache = expert_cache_figures(engine, prompt if text is None else text[:opts.prompt_tokens],
                                         opts.gen_tokens, log, None if text is None else
                                         text[opts.prompt_tokens:opts.prompt_tokens + opts.gen_tokens])
            result.update(expert_hit_rate=cache["expert_hit_rate"], expert_cache=cache)
    if ppl_ids is not None:
        log(f"perplexity over {opts.ppl_file}")
        window = min(opts.ppl_ctx, engine.ctx)
        t = time.perf_counter()
        result["perplexity"], result["ppl_tokens"] = perplexity(engine, ppl_ids, window)
        result["perplexity"] = round(result["perplexity"], 4)
        result["ppl_window"] = window
        result["ppl_seconds"] = round(time.perf_counter() - t, 2)
    return result


def expert_cache_figures(engine, prompt: list[int], gen_tokens: int, log, forced: list[int] | None = None) -> dict:
    """A mixture whose experts do not all fit: one run from empty expert caches, its experts
    traced, greedy or fed the tokens `forced` (a text's, for the routes a text takes): decode's
    expert hit rate, disk bytes a token, rate, and the rate the disk would allow at those bytes
    were it read all the time; and the same trace replayed through each policy, Belady's optimal
    cache (the bound) and a look-ahead's prefetches (the next MoE layer's router on the current
    residual), from empty caches of the same size: the disk bytes a decoded token each would read."""
    from nerva_cli.residency.expert_cache import replay_policies

    cfg, plan, stats = engine.cfg, engine.plan, engine.weights.stats
    log(f"expert cache: a run of {gen_tokens} tokens from empty caches, its experts traced")
    engine.weights.clear()
    engine.reset()
    engine.expert_trace, engine.expert_predicted = [], []
    try:
        token = int(np.argmax(engine.prefill(prompt)))
        start = len(engine.expert_trace)
        before = (stats.disk_bytes, stats.hits, stats.faults, stats.read_ns, stats.reads)
        t = time.perf_counter()
        for n in range(gen_tokens - 1):
            token = int(np.argmax(engine.decode(token if forced is None else forced[n])))
        seconds = time.perf_counter() - t
        trace, predicted = engine.expert_trace, engine.expert_predicted
    finally:
        engine.expert_trace = engine.expert_predicted = None
    n = gen_tokens - 1
    disk, hits, faults, read_ns, reads = (b - a for a, b in zip(before, (stats.disk_bytes, stats.hits, stats.faults,
                                                                           stats.read_ns, stats.reads)))
    caches = [layer.moe.cache for layer in engine.weights.layers() if layer.moe is not None]
    figures = {"policy": engine.expert_policy, "slots_per_layer": plan.expert_slots, "decode_tokens": n,
               "tokens": "greedy" if forced is None else "the --ppl text's",
               "expert_hit_rate": round(hits / (hits + faults), 4) if hits + faults else 1.0,
               # whether a read landed in its slot's rows, or was staged and copied (docs/residency.md)
               "reads_into_slots": all(c.scatter for c in caches)}
    if n < 1:
        return figures
    per_read = disk / reads if reads else engine.weights.reader.nbytes
    rate = disk / read_ns * 1e9 if read_ns else None
    replays = replay_policies(trace, cfg.num_experts, plan.expert_slots, predicted, start)
    guessed = [(p, ids) for p, (_, ids) in zip(predicted[start:], trace[start:]) if p is not None]
    figures.update(
        decode_tok_s=round(n / seconds, 3), expert_disk_bytes_per_token=round(disk / n),
        disk_read_bytes_per_s=None if rate is None else round(rate),
        disk_bound_tok_s=None if not disk or rate is None else round(rate / (disk / n), 3),
        replay_disk_bytes_per_token={k: round(r["loads"] * per_read / n) for k, r in replays.items()},
        lookahead_accuracy=round(float(np.mean([np.isin(p, ids[0]).mean() for p, ids in guessed])), 4)
        if guessed else None)
    belady = figures["replay_disk_bytes_per_token"]["belady"]
    figures["vs_belady"] = round(disk / n / belady, 3) if belady else None
    if figures["disk_bound_tok_s"]:
        figures["vs_disk_bound"] = round(figures["decode_tok_s"] / figures["disk_bound_tok_s"], 3)
    return figures


def _pager_counters(engine) -> list[int]:
    s = engine.weights.stats
    return [0] * 6 if s is None else [s.disk_bytes, s.hits, s.faults, s.stall_ns, s.h2d_bytes, s.read_ns]


def peak_rss_bytes() -> int:
    """This process image's peak RSS (VmHWM; ru_maxrss would include a forking parent's)."""
    from nerva_cli.hardware.machine import proc_kb

    peak = proc_kb("/proc/self/status", "VmHWM")
    if peak is not None:
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
