#!/usr/bin/env python3
"""Paged decode of SmolLM2 under a RAM budget (the plan's fixed part: KV cache, workspaces, token
table and norms, plus 30% of the layer weights), ring and LRU, against the bound set by this disk: its
read rate / paged bytes per token, the rate both as the pager saw it in the run and as O_DIRECT
probes of the paged layers' files just before and after the run saw it.

    python3 scripts/paged_bench.py [--variant q4_0] [--out docs/perf/paged_smollm2.json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path


def odirect_bandwidth(files: list[Path], seconds: float = 1.0) -> float:
    """Bytes/s reading whole files with O_DIRECT into one aligned buffer (the pager's way), the
    files over and over for about `seconds`: this disk is shared and bursty, so a short probe
    would catch a burst the bench around it does not see."""
    size = max(f.stat().st_size for f in files)
    buf = mmap.mmap(-1, size)
    total, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        for f in files:
            fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
            try:
                total += os.preadv(fd, [memoryview(buf)[: f.stat().st_size]], 0)
            finally:
                os.close(fd)
    return total / (time.perf_counter() - t)


CTX = 128
LAYER_FRACTION = 0.3


def ram_budget(model, ctx: int, layer_fraction: float) -> int:
    """The plan's fixed part (KV cache, workspaces, token table, norms: in RAM whatever the
    budget) plus `layer_fraction` of the layer files' bytes; the rest of the layers page."""
    from nerva_cli.planes.cpu.engine import residency_plan

    whole = residency_plan(model, ctx, None)
    return int(sum(b.nbytes for b in whole.fixed) + layer_fraction * sum(whole.layer_bytes.values()))


def main() -> None:
    from compare_llamacpp import nerva_commit
    from nerva_cli.planes.cpu.engine import residency_plan
    from nerva_cli.model.layout import layer_file
    from nerva_cli.hardware.machine import cpu_name
    from nerva_cli.store.catalog import find_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/perf/paged_smollm2.json"))
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--variant", choices=("q4_0", "q4_1"), default="q4_0")
    args = ap.parse_args()
    ref = f"smollm2-135m:{args.variant}"
    pulled = subprocess.run([sys.executable, "-m", "nerva_cli", "pull", "smollm2-135m", "--quant", args.variant],
                            capture_output=True, text=True)
    if pulled.returncode and "already" not in pulled.stderr:
        sys.exit(pulled.stderr.strip().splitlines()[-1])
    model = find_model(ref)
    budget = ram_budget(model, CTX, LAYER_FRACTION)
    # the probes read what the pager reads, in its order
    layer_files = [model.path / layer_file(i) for i in residency_plan(model, CTX, budget).paged_layers]
    rows, probes = {}, {}
    for policy in ("ring", "lru"):
        before = odirect_bandwidth(layer_files)
        out = subprocess.run([sys.executable, "-m", "nerva_cli", "bench", ref, "--ram-budget",
                              str(budget), "--ctx", str(CTX), "--prompt-tokens", "16", "--gen-tokens",
                              str(args.gen_tokens), "--repeat", "2", "--precision", "w4a16", "--policy", policy],
                             capture_output=True, text=True)
        if out.returncode:
            sys.exit(out.stderr.strip().splitlines()[-1])
        rows[policy] = json.loads(out.stdout)
        probes[policy] = (before, odirect_bandwidth(layer_files))

    def probe_bound(policy: str) -> float:
        """tok/s if every paged byte came at the better of the probes' rates around this run."""
        return max(probes[policy]) / rows[policy]["disk_bytes_per_token"]

    result = {
        "what": f"SmolLM2-135M {args.variant} paged W4A16 decode, RAM budget = the fixed part (KV cache, "
                "workspaces, token table, norms) + 30% of the layer weights",
        "bounds": "bound_tok_s: the disk's rate while the pager read, in the run (bench's disk_bound_tok_s) / "
                  "paged bytes per token; probe_bound_tok_s: the same from O_DIRECT probes just before and "
                  "after the run (a shared disk drifts between them and the run)",
        "commit": nerva_commit(), "machine": cpu_name(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "ram_budget_bytes": budget,
        **{policy: {k: r[k] for k in ("decode_tok_s", "token_ms_p50", "token_ms_p99", "resident_layers",
                                      "paged_layers", "disk_bytes_per_token", "hit_rate", "stall_ms_per_token",
                                      "direct_io", "hot_path_allocations", "disk_read_bytes_per_s")} | {
            "bound_tok_s": r["disk_bound_tok_s"],
            "fraction_of_bound": round(r["decode_tok_s"] / r["disk_bound_tok_s"], 3),
            "odirect_probe_bytes_per_s_before_after": [round(b) for b in probes[policy]],
            "probe_bound_tok_s": round(probe_bound(policy), 2),
            "fraction_of_probe_bound": round(r["decode_tok_s"] / probe_bound(policy), 3)}
            for policy, r in rows.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
