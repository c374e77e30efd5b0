"""`nerva topology`: what this machine offers, and the residency plan `run` would use here."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from nerva_cli.cli.app import app
from nerva_cli.cli.options import ActiveFraction, Backend, Ctx, Json, Mode, NoProfile, Precision, RamBudget, Tau, VramBudget


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
    from nerva_cli.cli import output
    from nerva_cli.hardware import topology as topo
    from nerva_cli.planes import resolve
    from nerva_cli.runtime import open_engine as runtime
    from nerva_cli.runtime.options import EngineOptions

    options = EngineOptions(backend=backend, precision=precision, tau=tau, use_profile=not no_profile, mode=mode,
                            active_fraction=active_fraction, ctx=ctx, ram_budget=ram_budget,
                            vram_budget=vram_budget)
    info = topo.collect(probe)
    if model is not None:
        report = output.CliReporter()
        stored = runtime.find_or_pull(model, report)
        backend = resolve(backend)
        budget = runtime.ram_budget(stored, backend, options, report)
        layers = runtime.layer_plan(stored, options, report)
        importance = getattr(layers, "importance", None)
        if backend == "cuda":
            from nerva_cli.planes.cuda.engine import auto_vram_budget, gpu_residency_plan
            from nerva_cli.planes.cuda.launch import CupyDevice

            dev = CupyDevice()
            vram = auto_vram_budget(dev) if options.vram_bytes is None else options.vram_bytes
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
