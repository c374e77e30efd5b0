"""The command line: parses, calls one plain function per command, prints. Nothing else."""

from __future__ import annotations

import gc
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer

from nerva_cli.errors import NervaError

app = typer.Typer(
    name="nerva", add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    help="Run LLMs where they don't fit: nerva schedules every block of weights and KV cache "
         "across memory tiers and shows where the time and the bytes went.",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from nerva_cli import __version__

        print(f"nerva {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: Annotated[bool, typer.Option("--version", "-V", callback=_print_version, is_eager=True,
                                                   help="Print nerva's version and exit.")] = False) -> None:
    pass

Quant = Annotated[str, typer.Option("--quant", "-q", help="Variant to write: auto (a Q4_0 or Q4_1 GGUF keeps its format bit for bit, one in another quantised format such as Q4_K_M becomes q4_1, anything else q4_0), q4_0, q4_1, f16 or bf16.")]
Force = Annotated[bool, typer.Option("--force", help="Replace an existing model of the same name and variant.")]
Json = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]


def _pull(spec: str, quant: str, name: Optional[str], out: Optional[Path], force: bool,
          revision: Optional[str] = None, report=None, keep_existing: bool = False):
    from nerva_cli.cli import output
    from nerva_cli.store.pull import pull

    notes: list[str] = []
    with output.step_progress("converting") as progress:
        model = pull(spec, variant=quant, name=name, out=out, force=force, revision=revision,
                     progress=progress, notes=notes, keep_existing=keep_existing)
    for n in notes:
        output.note(n)
    cfg = model.config
    (report or output.out.print)(f"{model.name}:{model.variant}  {cfg.family}, {cfg.num_layers} layers, "
                                 f"{output.human_bytes(model.size)}  -> {model.path}")
    return model


@app.command(short_help="Fetch a model (HF Hub, local directory or GGUF) and convert it into the store.",
             epilog="Examples: nerva pull smollm2-135m | nerva pull smollm2-135m:f16 | "
                    "nerva pull hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M | "
                    "nerva pull Qwen/Qwen3-0.6B --quant f16")
def pull(
    source: Annotated[str, typer.Argument(help="HF repo id (safetensors, or a GGUF repo with its file's quantisation as a tag: hf.co/USER/REPO:Q4_K_M), local HF directory, .gguf file, or alias (smollm2-135m).")],
    name: Annotated[Optional[str], typer.Option(help="Store name (default: from the source).")] = None,
    quant: Quant = "auto",
    revision: Annotated[Optional[str], typer.Option(help="HF branch, tag or commit.")] = None,
    force: Force = False,
):
    """Fetch a model (HF Hub, local directory or GGUF) and convert it into the store; one already
    there is kept (--force converts it again). An alias takes its variant as ollama's tags:
    smollm2-135m:f16."""
    from nerva_cli.store.sources.resolve import ALIASES
    from nerva_cli.store.catalog import VARIANTS

    alias, _, tag = source.partition(":")
    if alias in ALIASES and tag.lower() in VARIANTS:
        if quant not in ("auto", tag.lower()):
            raise NervaError(f"{source} and --quant {quant} name two variants: give one")
        source, quant = alias, tag.lower()
    _pull(source, quant, name, None, force, revision, keep_existing=True)


@app.command(epilog="Example: nerva convert ./SmolLM2-135M-Instruct --quant f16 --out /tmp/smol-f16")
def convert(
    source: Annotated[str, typer.Argument(help="Local HF safetensors directory or .gguf file.")],
    quant: Quant = "auto",
    out: Annotated[Optional[Path], typer.Option(help="Write the model directory here instead of the store.")] = None,
    name: Annotated[Optional[str], typer.Option(help="Store name (default: from the source).")] = None,
    force: Force = False,
):
    """Convert local weights into 4 KB-aligned per-layer files plus metadata.json."""
    if not Path(source).expanduser().exists():
        raise NervaError(f"{source}: no such file or directory (use `nerva pull` for a repo id or alias)")
    _pull(source, quant, name, out, force)


@app.command("list")
def list_(json_: Json = False):
    """List the models in the store."""
    from nerva_cli.cli import output

    from nerva_cli.store import catalog as store
    models = store.list_models()
    rows = [{"name": m.name, "variant": m.variant, "size": m.size, "family": m.config.family,
             "modified": store.modified(m), "path": str(m.path)} for m in models]
    if json_:
        output.print_json(rows)
        return
    if not rows:
        output.err.print(f"no models in {store.models_root()} (try: nerva pull smollm2-135m)")
        return
    output.columns(("NAME", "SIZE", "FAMILY", "MODIFIED"),
                   [(f"{r['name']}:{r['variant']}", output.human_bytes(r["size"]), r["family"], r["modified"])
                    for r in rows])


@app.command()
def show(
    model: Annotated[str, typer.Argument(help="name[:variant] in the store, or a model directory.")],
    json_: Json = False,
    verify: Annotated[bool, typer.Option("--verify", help="Re-hash every file against metadata.json.")] = False,
):
    """Show a model's config, files and tensors."""
    from nerva_cli.cli import output

    from nerva_cli.store import catalog as store
    m = store.find_model(model)
    bad = m.verify() if verify else None
    if json_:
        output.print_json({"path": str(m.path), **m.meta, **({"verify_failed": bad} if verify else {})})
    else:
        _print_show(m)
        if verify and not bad:
            output.out.print(f"verified: {len(m.meta['files'])} files match metadata.json")
    if bad:
        raise NervaError(f"{m.path}: {len(bad)} file(s) differ from metadata.json: {', '.join(bad)}")


def _print_show(m) -> None:
    from collections import Counter

    from nerva_cli.cli import output

    cfg = m.config
    output.out.print(f"[bold]{m.name}:{m.variant}[/bold]  {m.path}")
    output.facts([*((k, _config_fact(v)) for k, v in cfg.to_dict().items()), ("arch_hash", m.meta["arch_hash"]),
                  ("source", f"{m.meta['source'].get('kind')}: {m.meta['source'].get('id')}"),
                  ("size", f"{output.human_bytes(m.size)} in {len(m.meta['files'])} files")])
    dtypes = Counter(t["dtype"] for f in m.meta["files"].values() for t in f["tensors"].values())
    largest = max(m.meta["files"].items(), key=lambda kv: kv[1]["size"])
    output.out.print(f"tensors: {sum(dtypes.values())} ({', '.join(f'{n} {d}' for d, n in sorted(dtypes.items()))}); "
                     f"largest file {largest[0]} {output.human_bytes(largest[1]['size'])}")


def _config_fact(value) -> str:
    """A config value for `show`: RoPE's per-frequency factors summarised (64 numbers for a 128-wide
    head; LongRoPE's two lists), anything else as it is (--json gives every value)."""
    if isinstance(value, dict) and value.get("type") == "freq_factors":
        f = value["factors"]
        return f"freq_factors: {len(f)} per-frequency divisors, {min(f):g} to {max(f):g}"
    if isinstance(value, dict) and value.get("type") == "longrope":
        short, long = value["short_factor"], value["long_factor"]
        return (f"longrope: {len(short)} short factors {min(short):g} to {max(short):g}, long {min(long):g} to "
                f"{max(long):g} (past {value['original_max_position_embeddings']} tokens), attention "
                f"factor {value['attention_factor']:g}")
    return str(value)


@app.command()
def rm(models: Annotated[list[str], typer.Argument(help="name or name:variant; a bare name removes every variant.")]):
    """Remove models from the store."""
    from nerva_cli.cli import output

    from nerva_cli.store import catalog as store
    for ref in models:
        for removed in store.remove(ref):
            output.out.print(f"deleted {removed}")


Threads = Annotated[Optional[int], typer.Option("--threads", "-t", help="CPU threads (default: the physical cores).")]
Precision = Annotated[Optional[str], typer.Option(
    help="q4_0 and q4_1 models: mixed (default: W4A16 on layers whose MCAP score >= --tau, W4A8 on the rest), "
         "or w4a16 / w4a8 on every layer; f16/bf16 run exact.")]
Tau = Annotated[float, typer.Option("--tau", help="Mixed precision: normalised MCAP score (0..1) from which a layer runs W4A16.")]
NoProfile = Annotated[bool, typer.Option("--no-profile", help="Do not profile or read a profile: W4A16 on every layer.")]
Mode = Annotated[str, typer.Option("--mode", help="full: every layer runs; hot-only: only the top --active-fraction "
                                                  "of layers by MCAP score run, the others pass the residual "
                                                  "through (outputs differ from the full model).")]
ActiveFraction = Annotated[float, typer.Option("--active-fraction", help="hot-only: fraction of layers that run, in (0, 1] (at least one layer).")]
RamBudget = Annotated[Optional[str], typer.Option("--ram-budget", help="RAM for weights, KV cache and workspaces (512M, 4G, auto = 90% of what is available); layers that do not fit stream from disk. Default on the cpu: everything in RAM if it fits auto, else auto.")]
VramBudget = Annotated[Optional[str], typer.Option("--vram-budget", help="GPU memory for weights, KV cache and workspaces (2G, auto = 90% of what is free); layers that do not fit stream from pinned RAM (up to --ram-budget) or disk. The cuda backend only.")]
Policy = Annotated[str, typer.Option("--policy", help="Paging: ring (fixed resident set + exact-lookahead ring of slots) or lru (seed 002's cache).")]
Ctx = Annotated[Optional[int], typer.Option("--ctx", help="Context length in tokens (default: min(model max, 4096)).")]
KvCache = Annotated[str, typer.Option("--kv-cache", help="KV cache precision on the cpu: f16 (default, as llama.cpp's: half the bytes) or f32 (exact). The cuda backend's is f16.")]
Backend = Annotated[str, typer.Option(help="Kernel backend: auto (cuda when CuPy finds a GPU, else cpu), cuda (CuPy kernels, CUDA graphs), cpu (numba, threaded) or ref (NumPy reference, slow).")]


def _threads(threads: Optional[int]) -> int:
    """Resolves --threads and applies it to BLAS, and keeps freed memory in the heap for reuse
    (machine.reuse_freed_memory); call before anything imports numpy."""
    from nerva_cli.hardware.machine import limit_blas_threads, most_threads, physical_cores, reuse_freed_memory

    threads = physical_cores() if threads is None else threads
    if threads < 1:
        raise NervaError(f"--threads must be >= 1, got {threads}")
    most = most_threads()
    if threads > most:
        raise NervaError(f"--threads must be at most {most} here (the CPUs this process may run on, "
                         f"or NUMBA_NUM_THREADS), got {threads}")
    limit_blas_threads(threads)
    reuse_freed_memory()
    return threads


def _find_or_pull(model_ref: str):
    """Store model (pulled first if MODEL is an alias, with or without a variant, or a path, and
    not yet in the store)."""
    from nerva_cli.cli import output
    from nerva_cli.store import catalog as store
    from nerva_cli.store.sources.resolve import ALIASES, is_source_spec, source_id

    try:
        model = store.find_model(model_ref)
    except store.NotInStore:  # a broken entry is reported as it is, not pulled over
        alias, _, variant = model_ref.partition(":")
        if alias in ALIASES and variant.lower() in store.VARIANTS:  # smollm2-135m:f16: the bundled GGUF as f16
            output.info(f"{model_ref} is not in the store yet: pulling it")
            return _pull(alias, variant.lower(), None, None, False, report=output.info)
        if not is_source_spec(model_ref):
            raise
        # `run ./model.gguf` (or hf.co/USER/REPO) a second time: what the first one converted,
        # unless the local file changed since (a Hub repo is pulled again by `pull --force`)
        sid = source_id(model_ref)
        model = store.find_pulled_from(sid) if sid else None
        if model is None:
            output.info(f"{model_ref} is not in the store yet: pulling it")
            return _pull(model_ref, "auto", None, None, False, report=output.info)
        from nerva_cli.store.pull import source_changed

        if Path(model_ref).expanduser().exists() and source_changed(model, model_ref):
            output.info(f"{model_ref} changed since {model.name}:{model.variant} was converted from it: "
                        "converting it again")
            return _pull(model_ref, model.variant, model.name, None, True, report=output.info)
    if model.q4_token_table:
        output.note(f"{model.name}:{model.variant} keeps its token table at {model.variant.upper()}, as "
                    f"conversions before Q8_0 tables did (SmolLM2's q4_1: perplexity 26.28 against 24.97 "
                    f"now); `{_repull_command(model)}` converts it anew")
    return model


def _repull_command(model) -> str:
    from shlex import quote

    from nerva_cli.store.sources.resolve import ALIASES

    source = model.meta["source"]
    spec = model.name if model.name in ALIASES else f"{quote(str(source.get('id')))} --name {quote(model.name)}"
    revision = f" --revision {quote(source['revision'])}" if source.get("revision") else ""
    return f"nerva pull {spec}{revision} --quant {model.variant} --force"


def _layer_plan(model, precision, tau: float, use_profile: bool, mode: str, active_fraction: float,
                backend: str):
    """MCAP's per-layer plan (precisions, active layers, importance), profiling first if needed."""
    from nerva_cli.runtime import mcap

    from nerva_cli.cli import output
    with output.step_progress("profiling") as progress:
        return mcap.plan_layers(model, precision, tau, use_profile, mode, active_fraction, backend,
                                progress=progress, log=output.info)


def _profiling_backend(backend: str) -> str:
    """MCAP profiles on the CPU plane (its prefill exposes the per-layer taps); a profile is made
    once per model and cached, so the GPU gains little there."""
    return "cpu" if backend in ("auto", "cuda") else backend


_owns_collector = False  # set by main(): nerva's own process, not a test or a library user's


@contextmanager
def _long_lived_objects():
    """Building an engine imports numba and makes some 300k objects that live as long as the
    process. The cyclic collector, left alone, scans them about 250 times while they are made:
    85-127 ms of a 0.85-1.25 s `run -p Hi -n 1` on a 2-core EPYC. So nerva's own process makes them with
    the collector off, then freezes them out of its later scans. Nothing compiles in here (numba
    compiles at a kernel's first call, with the collector on: compiling without it held 0.1 GB
    more). Elsewhere the collector is left as it is: a freeze would keep whatever cyclic garbage
    the host process has not collected yet."""
    if not _owns_collector or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def _ram_budget(model, backend: str, ctx, budget, mode: str, kv_cache: str = "f16"):
    """The cpu backend's RAM budget, checked before the MCAP profile is computed (minutes on a
    large model) from the plan's sizes alone. Without --ram-budget: none while the whole model,
    KV cache and workspaces fit 90% of the RAM available now, else that much (`auto`), said in
    a note, so a model that does not fit pages instead of swapping or being killed. Hot-only
    runs fewer layers, which may need less: the default counts them all, the check skips them."""
    if backend == "cuda":
        return budget
    from nerva_cli.cli import output
    from nerva_cli.planes.cpu.engine import residency_plan
    from nerva_cli.residency.planner import available_ram

    if budget is None:
        try:
            room = int(available_ram() * 0.9)
        except (OSError, ValueError):  # no MemAvailable and no SC_AVPHYS_PAGES (macOS): no default
            return None
        need = residency_plan(model, ctx, None, kv_cache=kv_cache).used_bytes
        if need <= room:
            return None
        output.note(f"{model.name} needs {output.human_bytes(need)} of RAM here and "
                    f"{output.human_bytes(room)} is available: layers that do not fit stream from disk "
                    "(--ram-budget sets the budget)")
        budget = room
    if mode == "full":
        residency_plan(model, ctx, budget, kv_cache=kv_cache)
    return budget


def _open_engine(model_ref: str, backend: str, precision, ctx, threads: int, tau: float = 0.7,
                 use_profile: bool = True, mode: str = "full", active_fraction: float = 1.0,
                 ram_budget: Optional[str] = None, vram_budget: Optional[str] = None, policy: str = "ring",
                 kv_cache: str = "f16", decodes: bool = True, ctx_given: bool = True):
    """-> (engine, tokenizer, threads); the MCAP profile (computed if missing) picks each layer's
    precision and, in hot-only mode, which layers run. `decodes`: whether the caller will decode
    (not a `-n 1` run), so that the first-run note counts the kernels it will compile. `ctx_given`:
    whether `ctx` is the user's --ctx (noted when past the model's), not one bench chose."""
    from nerva_cli import planes as backends

    from nerva_cli.runtime import mcap
    from nerva_cli.cli import output
    from nerva_cli.residency.planner import parse_budget

    mcap.check_tau(tau)
    mcap.check_fraction(active_fraction)
    budget = parse_budget(ram_budget, "ram-budget")
    backend = backends.resolve(backend)
    model = _find_or_pull(model_ref)
    if ctx_given and ctx is not None and ctx > model.config.max_context:
        output.note(f"--ctx {ctx} is past the {model.config.max_context} tokens {model.name} attends over "
                    f"(its training context, or its attention window where smaller); using {model.config.max_context}")
    if vram_budget is not None and backend != "cuda":
        output.note(f"--vram-budget {vram_budget} is ignored: the {backend} backend holds everything in RAM")
    if kv_cache != "f16" and backend == "cuda":
        raise NervaError(f"--kv-cache {kv_cache}: the cuda backend keeps its KV cache in f16 (--backend cpu for f32)")
    budget = _ram_budget(model, backend, ctx, budget, mode, kv_cache)
    plan = _layer_plan(model, precision, tau, use_profile, mode, active_fraction, _profiling_backend(backend))
    from nerva_cli.store.tokenizer import open_tokenizer

    tokenizer = open_tokenizer(model.path)
    importance = getattr(plan, "importance", None)
    if backend == "cuda":
        from nerva_cli.planes.cuda.engine import CudaEngine

        vram = None if vram_budget in (None, "auto") else parse_budget(vram_budget, "vram-budget")
        with _long_lived_objects():
            engine = CudaEngine(model, precision=plan.precision, ctx=ctx, layer_precisions=plan.layer_precisions,
                                active_layers=plan.active_layers, vram_budget=vram, ram_budget=budget,
                                policy=policy, importance=importance)
        gp = engine.gpu_plan
        if gp.vram.paged_layers:
            output.info(f"residency on {engine.dev.name}: {len(gp.vram.resident_layers)} layers in VRAM, "
                        f"{len(gp.vram.paged_layers)} stream through {gp.vram.slots} VRAM slots "
                        f"({output.human_bytes(gp.vram.paged_bytes_per_token)} a token) from pinned RAM "
                        f"({len(gp.warm)} layers) and disk ({len(gp.cold)})"
                        + ("; the token table stays in pinned RAM, a row read in place a token"
                           if gp.host_fixed else ""))
        if gp.cold:
            output.info("GPUDirect Storage: " + ("used for the layers read from disk" if engine.gds["used"]
                                                 else f"not used ({engine.gds['reason']}); disk reads are "
                                                      "staged through pinned RAM"))
        return engine, tokenizer, threads
    from nerva_cli.planes.cpu.engine import Engine

    with _long_lived_objects():
        engine = Engine(model, backend=backend, precision=plan.precision, ctx=ctx,
                        layer_precisions=plan.layer_precisions, active_layers=plan.active_layers,
                        ram_budget=budget, policy=policy, importance=importance, kv_cache=kv_cache)
    if engine.plan.paged_layers:
        p = engine.plan
        output.info(f"residency: {len(p.resident_layers)} layers resident, {len(p.paged_layers)} stream from "
                    f"disk through {p.slots} slots ({output.human_bytes(p.paged_bytes_per_token)} a token, "
                    f"policy {policy})" + ("; the token table stays in its file, a row read a token"
                                           if p.table_aside else ""))
    if hasattr(engine.k, "set_threads"):
        engine.k.set_threads(threads)
    if hasattr(engine.k, "warm_marker"):  # a backend that compiles its kernels here (cpu: numba)
        _compile_ahead(engine, decodes)
    return engine, tokenizer, threads


def _compile_ahead(engine, decodes: bool) -> None:
    """Compiles a decode step's kernels before an answer starts (Engine.warm_up), once for each
    kind of model on this machine, so that the answer does not stall after its first token."""
    from nerva_cli.cli import output

    from nerva_cli.runtime import sampling
    first = not engine.k.compiled_before(decodes)
    if not decodes:  # a prefill's kernels compile in the prefill itself, before any text
        if first:
            output.info("compiling the CPU kernels for this machine: once, a few seconds on 2 cores; "
                        "later runs reuse them")
        return
    marker = engine.k.warm_marker(engine.kernel_kinds())
    if marker.exists():
        return
    started = time.perf_counter()
    aside = engine.compile_aside()  # before the spinner starts its thread: the fork copies this one
    try:
        with output.working("compiling the CPU kernels for this machine, once (about 10 s)" if first else
                            "compiling the CPU kernels this model needs, once"):
            engine.warm_up(aside, also=lambda: sampling.warm_kernels(engine.cfg.vocab_size))
    finally:
        if aside is not None:
            aside.close()
    took = time.perf_counter() - started
    if first or took > 0.5:
        output.info(f"compiled the CPU kernels in {took:.1f} s; later runs reuse them")
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:  # a cache directory nerva cannot write: the warm-up runs again next time
        pass


def _warm_up_while_typing(engine, tokenizer, threads: int, template: bool):
    """Loads, while the chat waits for its first message, what its first answer would load on
    the way: numba's cached kernels for a short prompt, a decode step and sampling (Engine.warm_up),
    and jinja2 for the chat template. SmolLM2's first answer to "Hi" in a warm run on the 2-core
    Zen 4 EPYC (`nerva run smollm2-135m --temperature 0 -n 8` in a pty, the message sent a second
    after the prompt, six runs each alternating with the commit before): its first text 180-260
    -> 62-89 ms after the message, the next prompt 245-360 -> 99-134 ms. A cpu engine whose
    layers are all resident: a paged one's reads are its answers'. It only loads: where the warm
    marker says a decode step's kernels are on disk (a `-n 1` chat's first run compiled none, and
    compiling them would hold the first message for seconds). -> None, or ready(quiet=False),
    which waits for it and, the first time, raises what it raised (quiet: never); the chat calls
    it before acting on a message and on leaving."""
    if not hasattr(engine.k, "warm_marker") or engine.plan.paged_layers or \
            not engine.k.warm_marker(engine.kernel_kinds()).exists():
        return None
    import threading

    from nerva_cli.runtime import sampling

    failed = []

    def work():
        try:
            engine.k.set_threads(threads)  # numba's count is per thread
            engine.warm_up(also=lambda: sampling.warm_kernels(engine.cfg.vocab_size))
            if template:
                try:
                    tokenizer.render_chat([{"role": "user", "content": "Hi"}])
                except NervaError:  # a template refusing this message may take the user's: theirs will tell
                    pass
        except BaseException as e:  # noqa: BLE001  (raised in the chat's thread, at its first message)
            failed.append(e)

    thread = threading.Thread(target=work, name="nerva-warm-up", daemon=True)
    thread.start()

    def ready(quiet: bool = False) -> None:
        thread.join()
        if failed and not quiet:
            raise failed.pop()

    return ready


@app.command(epilog='Examples: nerva run smollm2-135m -p "Why is the sky blue?" | nerva run smollm2-135m Why is the sky blue? | '
                     'echo "hi" | nerva run smollm2-135m | cat notes.txt | nerva run smollm2-135m summarise this')
def run(
    model: Annotated[str, typer.Argument(help="name[:variant] in the store, a model directory, or a source to pull first (smollm2-135m, a .gguf file, hf.co/USER/REPO[:TAG]).")],
    words: Annotated[Optional[list[str]], typer.Argument(metavar="[PROMPT]...", show_default=False, help="The prompt as ollama takes it: the words after the model, joined by spaces, after the text piped to stdin if any.")] = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="One prompt, answer, exit; stdin is not read. Without it or words: interactive chat (or the prompt from stdin when piped).")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="Send the prompt as is, without the chat template (a model that has none always does).")] = False,
    system: Annotated[Optional[str], typer.Option(help="System message for the chat template.")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens to generate per answer.")] = 512,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.8,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens (0: all).")] = 40,
    top_p: Annotated[float, typer.Option(help="Keep the smallest set whose probability reaches p.")] = 0.95,
    min_p: Annotated[float, typer.Option(help="Keep tokens whose probability is at least p times the likeliest's (0: off; llama.cpp's default is 0.05).")] = 0.0,
    repeat_penalty: Annotated[float, typer.Option(help="Penalise the last --repeat-last-n tokens (1.0: off).")] = 1.0,
    repeat_last_n: Annotated[int, typer.Option(help="The tokens --repeat-penalty looks back over (0: none).")] = 64,
    seed: Annotated[Optional[int], typer.Option(help="Random seed for sampling.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop when this text appears (repeatable).")] = None,
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
    kv_cache: KvCache = "f16",
    backend: Backend = "auto",
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Print the load time, then timings after each answer.")] = False,
    ledger: Annotated[bool, typer.Option("--ledger", help="Print the per-token ledger (time per phase, bytes per tier) after each answer.")] = False,
    ledger_every: Annotated[int, typer.Option("--ledger-every", help="With --ledger: show every Nth token (the summary counts all).")] = 1,
    ledger_file: Annotated[Optional[Path], typer.Option("--ledger-file", help="Write the ledger as JSON lines to this file.")] = None,
):
    """Chat with a model (in the chat, /? lists its commands), or answer one prompt (-p)."""
    started = time.perf_counter()
    threads = _threads(threads)
    from nerva_cli.cli import output
    from nerva_cli.runtime.chat import ChatSession
    from nerva_cli.runtime.sampling import SamplingOptions

    opts = SamplingOptions(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                           repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed)
    if max_tokens < 1:
        raise NervaError(f"--max-tokens must be >= 1, got {max_tokens}")
    if ledger_every < 1:
        raise NervaError(f"--ledger-every must be >= 1, got {ledger_every}")
    if raw and system is not None:
        raise NervaError("--system goes into the chat template, which --raw leaves out")
    if words:
        if prompt is not None:
            raise NervaError(f"give the prompt once: -p or the words after the model, not both ({' '.join(words)!r})")
        prompt = " ".join(words)
        if not sys.stdin.isatty():  # ollama's way: `cat notes.txt | nerva run MODEL summarise this`
            piped = _read_stdin().rstrip()
            prompt = f"{piped}\n\n{prompt}" if piped.strip() else prompt
    elif prompt is None and not sys.stdin.isatty():
        prompt = _read_stdin()
        if not prompt.strip():
            raise NervaError("stdin is not a terminal and held no prompt: pipe text in, or give -p or the words")
    engine, tokenizer, _ = _open_engine(model, backend, precision, ctx, threads, tau, not no_profile, mode,
                                        active_fraction, ram_budget, vram_budget, policy, kv_cache,
                                        decodes=max_tokens > 1)
    if verbose:  # ollama's "load duration": model, profile, tokenizer, arena, any kernels compiled ahead
        output.info(f"loaded in {time.perf_counter() - started:.2f} s")
    from nerva_cli.runtime.ledger import Ledger

    if not raw and not tokenizer.template:  # a base model: ollama sends its prompt as is too
        if system is not None:
            raise NervaError(f"{engine.model.name} has no chat template, so --system has nowhere to go")
        output.note(f"{engine.model.name} has no chat template: prompts go to it as they are (--raw)")
        raw = True
    book = Ledger(engine, tokenizer, ledger_file) if ledger or ledger_file else None
    session = ChatSession(engine, tokenizer, opts, max_tokens=max_tokens, raw=raw, system=system,
                          stops=stop or [], ledger=book, note=output.note)
    try:
        if prompt is not None:
            stats = session.answer(prompt, write=_write_stdout)
            _write_stdout("\n")
            if stats.stop_reason == "context":
                output.note(session.context_note())
            if verbose:
                output.info(_stats_line(stats))
            if ledger:
                book.print_table(output.err, ledger_every)
            if stats.stop_reason == "interrupted":  # Ctrl-C: a script must not take half an answer for one
                raise typer.Exit(130)
            return
        from nerva_cli.cli.repl import chat_loop

        gpu = getattr(engine, "dev", None)
        runtime = f"cuda on {gpu.name}" if gpu else f"{engine.backend}, {threads} threads"
        chat_loop(session, _write_stdout, runtime, verbose, _stats_line, book if ledger else None, ledger_every,
                  ready=_warm_up_while_typing(engine, tokenizer, threads, not raw))
    finally:
        if book:
            book.close()
        engine.weights.close()


def _read_stdin() -> str:
    """All of stdin; bytes that are not UTF-8 become U+FFFD, whatever the locale (a strict one
    raised UnicodeDecodeError)."""
    raw = getattr(sys.stdin, "buffer", None)
    return raw.read().decode("utf-8", "replace") if raw is not None else sys.stdin.read()


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _stats_line(stats) -> str:
    return (f"prompt {stats.prompt_tokens} tok, {stats.prefill_tok_s:.1f} tok/s | "
            f"answer {stats.gen_tokens} tok, {stats.decode_tok_s:.1f} tok/s | "
            f"ttft {stats.ttft_s * 1000:.0f} ms | stop: {stats.stop_reason}")


@app.command(epilog="Examples: nerva topology | nerva topology --probe --json | "
                       "nerva topology --model qwen3-8b --ram-budget 4G")
def topology(
    json_out: Json = False,
    probe: Annotated[bool, typer.Option("--probe", help="Measure RAM and O_DIRECT disk bandwidth now and cache them.")] = False,
    model: Annotated[Optional[str], typer.Option("--model", help="Show the residency plan `run` would use for this model here.")] = None,
    ram_budget: RamBudget = None,
    vram_budget: VramBudget = None,
    ctx: Ctx = None,
    precision: Precision = None,
    tau: Tau = 0.7,
    no_profile: NoProfile = False,
    mode: Mode = "full",
    active_fraction: ActiveFraction = 0.75,
    backend: Backend = "auto",
):
    """CPU, memory, NUMA, the store's disk, GPUs and GPUDirect Storage; measured bandwidths with --probe."""
    from nerva_cli import planes as backends
    from nerva_cli.cli import output
    from nerva_cli.hardware import topology as topo
    from nerva_cli.residency.planner import parse_budget

    budget = parse_budget(ram_budget, "ram-budget")
    info = topo.collect(probe)
    if model is not None:
        stored = _find_or_pull(model)
        backend = backends.resolve(backend)
        budget = _ram_budget(stored, backend, ctx, budget, mode)
        layers = _layer_plan(stored, precision, tau, not no_profile, mode, active_fraction,
                             _profiling_backend(backend))
        importance = getattr(layers, "importance", None)
        if backend == "cuda":
            from nerva_cli.planes.cuda.launch import CupyDevice
            from nerva_cli.planes.cuda.engine import auto_vram_budget, gpu_residency_plan

            dev = CupyDevice()
            vram = (auto_vram_budget(dev) if vram_budget in (None, "auto")
                    else parse_budget(vram_budget, "vram-budget"))
            gp = gpu_residency_plan(stored, ctx, vram, budget, importance, layers.active_layers, dev.sms)
            info["plan"] = topo.gpu_plan_report(stored, gp, dev.name, info["probe"])
        else:
            from nerva_cli.planes.cpu.engine import residency_plan

            plan = residency_plan(stored, ctx, budget, importance, layers.active_layers)
            info["plan"] = topo.plan_report(stored, plan, info["probe"])
    if json_out:
        output.print_json(info)
    else:
        output.facts(topo.describe(info))


@app.command(epilog="Example: nerva bench smollm2-135m --gen-tokens 128 | jq .decode_tok_s")
def bench(
    model: Annotated[str, typer.Argument(help="name[:variant] in the store, or a model directory.")],
    prompt_tokens: Annotated[int, typer.Option(help="Prompt length for the prefill figure.")] = 256,
    gen_tokens: Annotated[int, typer.Option(
        help="Tokens to generate per run (the first comes from prefill: 1 times prefill alone).")] = 128,
    repeat: Annotated[int, typer.Option(help="Measured runs after the warm-up (the median is reported).")] = 3,
    ppl: Annotated[Optional[Path], typer.Option("--ppl", help="Also report perplexity over this text file.")] = None,
    ppl_ctx: Annotated[int, typer.Option(help="Window for --ppl, in tokens.")] = 512,
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
    kv_cache: KvCache = "f16",
    backend: Backend = "auto",
):
    """Measure prefill and decode speed; prints exactly one JSON line on stdout."""
    threads = _threads(threads)
    from nerva_cli.cli import output
    from nerva_cli.runtime.bench import BenchOptions, run_bench

    if min(prompt_tokens, gen_tokens, repeat) < 1:
        raise NervaError("--prompt-tokens, --gen-tokens and --repeat must be >= 1")
    if ppl_ctx < 2:
        raise NervaError(f"--ppl-ctx must be >= 2 (a window's first token is context only), got {ppl_ctx}")
    opts = BenchOptions(prompt_tokens, gen_tokens, repeat, ppl, ppl_ctx)  # reads --ppl's file
    chosen = ctx is None
    if chosen:  # room for the runs, the allocation check's 26 positions, and --ppl's window
        ctx = max(prompt_tokens + gen_tokens + 1, 32, ppl_ctx if ppl else 0)
    engine, tokenizer, threads = _open_engine(model, backend, precision, ctx, threads, tau, not no_profile,
                                              mode, active_fraction, ram_budget, vram_budget, policy, kv_cache,
                                              ctx_given=not chosen)
    result = run_bench(engine, tokenizer, opts, threads, log=output.info)
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
    _threads(None)
    from nerva_cli.runtime import mcap

    from nerva_cli.cli import output
    texts = mcap.read_prompts(prompts) if prompts is not None else None
    m = _find_or_pull(model)
    with output.step_progress("profiling") as progress:
        result = mcap.get_profile(m, texts, backend=_profiling_backend(backend), progress=progress)
    measured = result.measurement
    run_info = {"model": f"{m.name}:{m.variant}", "path": str(result.path), "origin": result.origin,
                "seconds": round(measured.seconds, 2) if measured else None,
                "peak_rss_bytes": measured.peak_rss_bytes if measured else None}
    if json_:
        output.print_json({**result.profile, **run_info})
    else:
        _print_profile(result, run_info)


def _print_profile(result, info: dict) -> None:
    from nerva_cli.runtime import mcap

    from nerva_cli.cli import output
    prof, rich = result.profile, output.out.is_terminal
    width = 40
    hot = mcap.layer_precisions(prof, mcap.DEFAULT_TAU)
    output.out.print(f"{'[bold]' if rich else ''}{info['model']}{'[/bold]' if rich else ''}  MCAP profile, "
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
    if info["seconds"] is not None:
        output.out.print(f"profiled in {info['seconds']:.1f} s, one layer at a time; peak RSS of the process "
                         f"{output.human_bytes(info['peak_rss_bytes'])}")
    output.out.print(f"profile ({info['origin']}): {info['path']}", markup=False)


def main() -> None:
    global _owns_collector
    _owns_collector = True
    try:
        app()
    except NervaError as e:
        from nerva_cli.cli import output

        output.error(str(e))
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    finally:
        _owns_collector = False
