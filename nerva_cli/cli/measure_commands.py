"""The commands that measure: bench (speed, one JSON line) and profile (MCAP layer importance)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from nerva_cli.cli.app import app, long_lived_objects
from nerva_cli.cli.options import (ActiveFraction, Backend, Ctx, ExpertPolicy, Json, KvCache, Mode, NoProfile, Policy,
                                   Precision, RamBudget, Tau, Threads, VramBudget)
from nerva_cli.errors import UsageError
from nerva_cli.hardware.machine import configure_threads


@app.command(epilog="Examples: nerva bench smollm2-135m --gen-tokens 128 | jq .decode_tok_s ; "
                     "nerva bench smollm2-135m:q4_0 --concurrency 8 | jq .aggregate_decode_tok_s")
def bench(
    model: Annotated[str, typer.Argument(help="name[:variant] in the store, or a model directory.")],
    prompt_tokens: Annotated[int, typer.Option(help="Prompt length for the prefill figure.")] = 256,
    gen_tokens: Annotated[int, typer.Option(
        help="Tokens to generate per run (the first comes from prefill: 1 times prefill alone).")] = 128,
    repeat: Annotated[int, typer.Option(help="Measured runs after the warm-up (the median is reported).")] = 3,
    ppl: Annotated[Optional[Path], typer.Option("--ppl", help="Also report perplexity over this text file.")] = None,
    ppl_ctx: Annotated[int, typer.Option(help="Window for --ppl, in tokens.")] = 512,
    concurrency: Annotated[Optional[int], typer.Option(
        help="Decode N sequences together (each its own prompt and KV cache, one batched step a token "
             "for all): reports the aggregate and per-sequence rates. cpu and ref backends.")] = None,
    answer_format: Annotated[Optional[str], typer.Option(
        "--format", help="Hold each run's answer to JSON as `run --format` does (json, a JSON Schema file or "
                         "'{...}'): the decode rate with the mask's cost, and the mask's time per token.")] = None,
    grammar: Annotated[Optional[Path], typer.Option(
        "--grammar", help="Hold each run's answer to a Lark or GBNF grammar file, as `run --grammar` does.")] = None,
    ctx: Ctx = None,
    threads: Threads = None,
    precision: Precision = None,
    tau: Tau = 0.7,
    no_profile: NoProfile = False,
    mode: Mode = "full",
    active_fraction: ActiveFraction = 0.75,
    ram_budget: RamBudget = None,
    vram_budget: VramBudget = None,
    policy: Policy = "ring",
    expert_policy: ExpertPolicy = "lfu",
    kv_cache: KvCache = "f16",
    backend: Backend = "auto",
):
    """Measure prefill and decode speed; prints exactly one JSON line on stdout."""
    threads = configure_threads(threads)
    from nerva_cli.cli import output
    from nerva_cli.runtime.bench import BenchOptions, run_bench
    from nerva_cli.runtime.open_engine import open_engine
    from nerva_cli.runtime.options import EngineOptions

    if min(prompt_tokens, gen_tokens, repeat) < 1:
        raise UsageError("--prompt-tokens, --gen-tokens and --repeat must be >= 1")
    if ppl_ctx < 2:
        raise UsageError(f"--ppl-ctx must be >= 2 (a window's first token is context only), got {ppl_ctx}")
    if concurrency is not None and concurrency < 1:
        raise UsageError(f"--concurrency must be >= 1 (sequences), got {concurrency}")
    from nerva_cli.structured.formats import from_flags

    fmt = from_flags(answer_format, grammar)
    if fmt is not None and concurrency is not None:
        raise UsageError("--format and --grammar measure one sequence: leave out --concurrency")
    opts = BenchOptions(prompt_tokens, gen_tokens, repeat, ppl, ppl_ctx, concurrency, fmt)  # reads --ppl's file
    chosen = ctx is None
    if chosen:  # room for the runs, the allocation check's 26 positions, and --ppl's window
        ctx = max(prompt_tokens + gen_tokens + 1, 32, ppl_ctx if ppl else 0)
    options = EngineOptions(backend=backend, precision=precision, tau=tau, use_profile=not no_profile, mode=mode,
                            active_fraction=active_fraction, ctx=ctx, ctx_given=not chosen, threads=threads,
                            ram_budget=ram_budget, vram_budget=vram_budget, policy=policy,
                            expert_policy=expert_policy, kv_cache=kv_cache,
                            seq_slots=concurrency or 1)
    engine, tokenizer = open_engine(model, options, output.CliReporter(), building=long_lived_objects)
    try:  # closed: the model's lock is released (a `nerva rm` meanwhile waits for it)
        result = run_bench(engine, tokenizer, opts, threads, log=output.info)
    finally:
        engine.close()
    output.print_json(result)


@app.command(short_help="MCAP per-layer importance (what run's mixed precision and hot-only mode use).",
             epilog="Examples: nerva profile smollm2-135m | nerva profile qwen3-8b --prompts code.txt --json")
def profile(
    model: Annotated[str, typer.Argument(help="name[:variant] in the store, a model directory, or a source to pull first (smollm2-135m, a .gguf file, hf.co/USER/REPO[:TAG]).")],
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="Calibration prompts instead of the 12 built-in ones: one per line, or a JSON array of strings.")] = None,
    json_: Json = False,
    backend: Backend = "auto",
):
    """MCAP layer importance: the mean over the calibration tokens of ||[Qx, Vx]|| + ||FFN(x')||
    per layer, streamed one layer at a time. Kept in $NERVA_HOME/profiles/<arch_hash>.json (a
    profile shipped with nerva is used first) and made again when the weights or the prompts
    change; run and bench use it for mixed precision and hot-only mode."""
    configure_threads(None)
    from nerva_cli.cli import output
    from nerva_cli.runtime import mcap
    from nerva_cli.runtime.open_engine import find_or_pull, profiling_backend
    from nerva_cli.runtime.options import BACKENDS
    from nerva_cli.store import locks

    if backend not in BACKENDS:
        raise UsageError(f"--backend {backend}: choose one of {', '.join(BACKENDS)}")
    texts = mcap.read_prompts(prompts) if prompts is not None else None
    m = locks.hold(find_or_pull(model, output.CliReporter()))  # as a run's: rm refuses it while profiling
    with output.step_progress("profiling") as progress:
        result = mcap.get_profile(m, texts, backend=profiling_backend(backend), progress=progress)
    measured = result.measurement
    run_info = {"model": f"{m.name}:{m.variant}", "path": str(result.path), "origin": result.origin,
                "seconds": round(measured.seconds, 2) if measured else None,
                "peak_rss_bytes": measured.peak_rss_bytes if measured else None}
    if json_:
        output.print_json({**result.profile, **run_info})
    else:
        _print_profile(result, run_info)


def _print_profile(result, info: dict) -> None:
    from nerva_cli.cli import output
    from nerva_cli.runtime import mcap

    prof, rich = result.profile, output.out.is_terminal
    width = 40
    hot = mcap.layer_precisions(prof, mcap.DEFAULT_TAU)
    output.out.print(f"{'[bold]' if rich else ''}{output.escape(info['model'])}{'[/bold]' if rich else ''}  MCAP profile, "
                     f"{len(prof['scores'])} layers ({prof['variant']}, {prof['precision']})")
    output.out.print(f"{'layer':>5}  {'score':>10}  {'norm':>6}", markup=False)
    for i, (raw, norm) in enumerate(zip(prof["scores"], prof["normalized"])):
        n = round(norm * width)
        tag = "W4A16" if hot[i] == "w4a16" else ""
        if rich:
            color = "green" if tag else "cyan"
            bar = f"[{color}]{'█' * n}[/{color}][dim]{'·' * (width - n)}[/dim]"
        else:
            bar = "#" * n + "." * (width - n)
        output.out.print(f"{i:>5}  {raw:>10.5g}  {norm:>6.4f}  {bar}  {tag}")
    w4a16 = [i for i, p in enumerate(hot) if p == "w4a16"]
    k = max(1, len(prof["scores"]) // 2)
    output.out.print(f"mixed at tau {mcap.DEFAULT_TAU}: W4A16 on layer(s) {', '.join(map(str, w4a16))} "
                     f"({len(w4a16)} of {len(hot)}), W4A8 on the rest")
    output.out.print(f"{prof['prompts']} prompts, {prof['tokens']} tokens; split-half top-{k} overlap "
                     f"{prof['split_half_overlap']:.2f} (prompts of the first half vs the second)")
    if "experts" in prof:  # a mixture's: what an expert cache would see (--json: per layer)
        ex = prof["experts"]
        reuse = "n/a" if ex["reuse"] is None else f"{ex['reuse']:.0%}"
        output.out.print(f"experts: a token re-chooses {reuse} of the previous token's experts (mean over "
                         f"layers); the most chosen eighth of a layer's experts takes {ex['top_eighth_share']:.0%} "
                         "of its choices")
    if info["seconds"] is not None:
        output.out.print(f"profiled in {info['seconds']:.1f} s, one layer at a time; peak RSS of the process "
                         f"{output.human_bytes(info['peak_rss_bytes'])}")
    output.out.print(f"profile ({info['origin']}): {info['path']}", markup=False)
