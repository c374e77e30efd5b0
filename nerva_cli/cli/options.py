"""The options several commands share, declared once as typer's types with their help. run, bench
and topology turn theirs into the runtime's EngineOptions (runtime/options.py), which checks them."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

Quant = Annotated[str, typer.Option("--quant", "-q", help="Variant to write: auto (a Q4_0 or Q4_1 GGUF keeps its format bit for bit, one in another quantised format such as Q4_K_M becomes q4_1, anything else q4_0), q4_0, q4_1, f16 or bf16.")]
Force = Annotated[bool, typer.Option("--force", help="Replace an existing model of the same name and variant.")]
Json = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
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
ExpertPolicy = Annotated[str, typer.Option("--expert-policy", help="A mixture of experts whose experts do not all fit --ram-budget keeps as many as fit in each layer's cache and reads the others from disk when chosen; which cached expert a read replaces: lfu (the least often chosen so far, default) or lru (the least recently used); lru+lookahead and lfu+lookahead also read ahead, while a layer computes, the experts the next layer is predicted to choose.")]
Ctx = Annotated[Optional[int], typer.Option("--ctx", help="Context length in tokens (default: min(model max, 4096)).")]
KvCache = Annotated[str, typer.Option("--kv-cache", help="KV cache precision on the cpu: f16 (default, as llama.cpp's: half the bytes) or f32 (exact). The cuda backend's is f16.")]
Backend = Annotated[str, typer.Option(help="Kernel backend: auto (cuda when CuPy finds a GPU, else cpu), cuda (CuPy kernels, CUDA graphs), cpu (numba, threaded) or ref (NumPy reference, slow).")]


