"""open_engine: from a model reference and EngineOptions to a ready engine and its tokenizer.

It finds the model in the store (pulling an alias, a path or a Hub GGUF first), checks the RAM
budget from sizes alone before any long work, makes or reads the MCAP profile that picks each
layer's precision, and builds the plane's engine. The CLI calls it, and so can any program (the
server): nothing here prints; a Reporter says what happens.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

from nerva_cli.errors import NervaError
from nerva_cli.runtime.options import EngineOptions
from nerva_cli.runtime.report import Reporter

SILENT = Reporter()


def pull_model(spec: str, quant: str = "auto", name: str | None = None, out: Path | None = None,
               force: bool = False, revision: str | None = None, report: Reporter = SILENT,
               keep_existing: bool = False):
    """store.pull with its progress and notes reported; -> the stored model."""
    from nerva_cli.store.pull import pull

    notes: list[str] = []
    with report.progress("converting") as progress:
        model = pull(spec, variant=quant, name=name, out=out, force=force, revision=revision,
                     progress=progress, notes=notes, keep_existing=keep_existing, say=report.info)
    for n in notes:
        report.note(n)
    return model


def model_line(model) -> str:
    """A stored model in one line: what `pull` prints."""
    from nerva_cli.units import human_bytes

    cfg = model.config
    return f"{model.name}:{model.variant}  {cfg.family}, {cfg.num_layers} layers, {human_bytes(model.size)}  -> {model.path}"


def _pull_reported(spec: str, quant: str, report: Reporter, name=None, force: bool = False):
    model = pull_model(spec, quant, name, None, force, report=report)
    report.info(model_line(model))
    return model


def find_or_pull(model_ref: str, report: Reporter = SILENT):
    """The stored model `model_ref` names, pulled first if it is an alias (with or without a
    variant) or a path not in the store yet, and converted again where its local file changed."""
    from nerva_cli.store import catalog
    from nerva_cli.store.sources.resolve import alias_ref, is_source_spec, source_id

    try:
        model = catalog.find_model(model_ref)
    except catalog.NotInStore:  # a broken entry is reported as it is, not pulled over
        aliased = alias_ref(model_ref)
        if aliased is not None:  # smollm2-135m:f16: the bundled GGUF as f16
            report.info(f"{model_ref} is not in the store yet: pulling it")
            return _pull_reported(*aliased, report)
        if not is_source_spec(model_ref):
            raise
        # `run ./model.gguf` (or hf.co/USER/REPO) a second time: what the first one converted,
        # unless the local file changed since (a Hub repo is pulled again by `pull --force`)
        sid = source_id(model_ref)
        model = catalog.find_pulled_from(sid) if sid else None
        if model is None:
            report.info(f"{model_ref} is not in the store yet: pulling it")
            return _pull_reported(model_ref, "auto", report)
        from nerva_cli.store.pull import source_changed

        if Path(model_ref).expanduser().exists() and source_changed(model, model_ref):
            report.info(f"{model_ref} changed since {model.name}:{model.variant} was converted from it: "
                        "converting it again")
            return _pull_reported(model_ref, model.variant, report, name=model.name, force=True)
    if model.q4_token_table:
        report.note(f"{model.name}:{model.variant} keeps its token table at {model.variant.upper()}, as "
                    f"conversions before Q8_0 tables did (SmolLM2's q4_1: perplexity 26.28 against 24.97 "
                    f"now); `{model.repair_command()}` converts it anew")
    return model


def profiling_backend(backend: str) -> str:
    """MCAP profiles on the CPU plane (its prefill exposes the per-layer taps); a profile is made
    once per model and cached, so the GPU gains little there."""
    return "cpu" if backend in ("auto", "cuda") else backend


def layer_plan(model, options: EngineOptions, report: Reporter = SILENT):
    """MCAP's per-layer plan (precisions, active layers, importance), profiling first if needed."""
    from nerva_cli.runtime import mcap

    with report.progress("profiling") as progress:
        plan = mcap.plan_layers(model, options.precision, options.tau, options.use_profile, options.mode,
                                options.active_fraction, profiling_backend(options.backend),
                                progress=progress, log=report.info)
    if plan.mixed:  # every run's, so --verbose's (the ledger and `show` say it too)
        report.detail(plan.mixed)
    return plan


def ram_budget(model, backend: str, options: EngineOptions, report: Reporter = SILENT) -> int | None:
    """The cpu plane's RAM budget, checked before the MCAP profile is computed (minutes on a large
    model) from the plan's sizes alone. Without --ram-budget: none while the whole model, KV
    cache and workspaces fit 90% of the RAM available now, else that much (`auto`), said in a
    note, so a model that does not fit pages instead of swapping or being killed. Hot-only runs
    fewer layers, which may need less: the default counts them all, the check skips them."""
    budget = options.ram_bytes
    if backend == "cuda":
        return budget
    from nerva_cli.units import human_bytes
    from nerva_cli.planes.cpu.engine import residency_plan
    from nerva_cli.residency import planner

    ctx, kv_cache, seqs = options.ctx, options.kv_cache, options.seq_slots
    if budget is None:
        try:
            room = int(planner.available_ram() * 0.9)
        except (OSError, ValueError):  # no MemAvailable and no SC_AVPHYS_PAGES (macOS): no default
            return None
        need = residency_plan(model, ctx, None, kv_cache=kv_cache, seq_slots=seqs).used_bytes
        if need <= room:
            return None
        report.note(f"{model.name} needs {human_bytes(need)} of RAM here and {human_bytes(room)} is available: "
                    "layers that do not fit stream from disk (--ram-budget sets the budget)")
        budget = room
    if options.mode == "full":
        residency_plan(model, ctx, budget, kv_cache=kv_cache, seq_slots=seqs)
    return budget


def open_engine(model_ref: str, options: EngineOptions, report: Reporter = SILENT, building=nullcontext):
    """-> (engine, tokenizer), the engine prepared (EngineBase.prepare) for the options' work.
    `building()`: a context manager the engine is made in (nerva's own process keeps the
    collector out of its long-lived objects)."""
    from nerva_cli.planes import resolve
    from nerva_cli.store import locks

    backend = resolve(options.backend)
    # held until engine.close(): `nerva rm` and `pull --force` refuse this model meanwhile
    model = locks.hold(find_or_pull(model_ref, report))
    try:
        return _open(model, backend, options, report, building)
    except BaseException:
        locks.release(model)
        raise


def _open(model, backend: str, options: EngineOptions, report: Reporter, building):
    from nerva_cli.store.tokenizer import open_tokenizer

    ctx = options.ctx
    if options.ctx_given and ctx is not None and ctx > model.config.max_context:
        report.note(f"--ctx {ctx} is past the {model.config.max_context} tokens {model.name} attends over "
                    f"(its training context, or its attention window where smaller); using {model.config.max_context}")
    if backend == "cuda" and model.config.num_experts:
        if options.backend != "auto":
            raise NervaError(f"{model.name} is a mixture of experts, which the cuda backend does not run yet: "
                             "--backend cpu")
        report.note(f"{model.name} is a mixture of experts, which runs on the cpu plane only for now: using the cpu plane")
        backend = "cpu"
    if options.vram_budget is not None and backend != "cuda":
        report.note(f"--vram-budget {options.vram_budget} is ignored: the {backend} backend holds everything in RAM")
    if options.seq_slots > 1 and backend == "cuda":
        raise NervaError("the cuda backend decodes one sequence at a time (batched decode is built on the cpu "
                         "plane so far): --backend cpu")
    if options.kv_cache != "f16" and backend == "cuda":
        raise NervaError(f"--kv-cache {options.kv_cache}: the cuda backend keeps its KV cache in f16 "
                         "(--backend cpu for f32)")
    budget = ram_budget(model, backend, options, report)
    plan = layer_plan(model, options, report)
    tokenizer = open_tokenizer(model.path)
    importance = getattr(plan, "importance", None)
    if backend == "cuda":
        from nerva_cli.planes.cuda.engine import CudaEngine

        with building():
            engine = CudaEngine(model, precision=plan.precision, ctx=ctx, layer_precisions=plan.layer_precisions,
                                active_layers=plan.active_layers, vram_budget=options.vram_bytes,
                                ram_budget=budget, policy=options.policy, importance=importance)
    else:
        from nerva_cli.planes.cpu.engine import Engine

        with building():
            engine = Engine(model, backend=backend, precision=plan.precision, ctx=ctx,
                            layer_precisions=plan.layer_precisions, active_layers=plan.active_layers,
                            ram_budget=budget, policy=options.policy, importance=importance,
                            kv_cache=options.kv_cache, seq_slots=options.seq_slots,
                            expert_policy=options.expert_policy)
    for line in engine.residency_lines():
        report.info(line)
    engine.prepare(options.threads, options.decodes, say=report.info, working=report.working)
    return engine, tokenizer
