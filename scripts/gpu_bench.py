#!/usr/bin/env python3
"""The GPU benchmarks of the CUDA plane, as ratios against ceilings measured in the same run:

- resident q4_0 decode tok/s against the HBM limit: device-to-device copy bandwidth / the bytes
  a token reads (every layer file, and the lm_head), at W4A16 (bench's precision without a
  profile) and at W4A8 (what `run`'s mixed precision runs most layers at; llama.cpp's Q4_0
  matvecs also multiply 8-bit activation codes);
- paged decode under --vram-budget (2G by default) against the PCIe limit: pinned H2D bandwidth /
  the bytes copied to the GPU a token (bench's h2d_bytes_per_token);
- resident decode (W4A16) again with NERVA_CUDA_PDL=0, every kernel launched without programmatic
  dependent launch (planes/cuda/dependent_launch.py): that change's A/B in the same lease.

Both runs go through `nerva bench --backend cuda`, the one place nerva measures speed. With
--peer-json (llama-bench's JSON from shared/gpu-peers, run on the same model file in the same
lease) the resident figures are also given as ratios to llama.cpp CUDA's. One JSON file naming
the device is written to OUT_DIR.

    python3 scripts/gpu_bench.py MODEL_DIR [--out docs/perf] [--vram-budget 2G] [--peer-json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def bench(model: Path, *extra: str, env: dict | None = None) -> dict:
    cmd = [sys.executable, "-m", "nerva_cli", "bench", str(model), "--backend", "cuda", "--no-profile",
           "--prompt-tokens", "512", "--gen-tokens", "128", "--repeat", "3", *extra]
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def peer_ratios(runs: list[dict], nerva: dict) -> dict:
    """llama-bench rows (decode: n_gen > 0; prefill: n_prompt > 0), by flash attention on/off,
    with nerva's resident figure over each."""
    out = {}
    for r in runs:
        kind = "decode" if r.get("n_gen") else "prefill"
        ours = nerva.get(f"{kind}_tok_s")
        key = f"{kind}_fa{int(bool(r.get('flash_attn')))}"
        out[key] = {"llama_cpp_tok_s": round(r["avg_ts"], 1), "nerva_tok_s": ours,
                    "nerva_over_llama_cpp": round(ours / r["avg_ts"], 3) if ours else None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "perf")
    ap.add_argument("--vram-budget", default="2G")
    ap.add_argument("--peer-json", type=Path, help="llama-bench -o json output on the same model")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from nerva_cli.planes.cuda.launch import CupyDevice
    from nerva_cli.store.catalog import load_metadata

    dev = CupyDevice()
    ceilings = dev.bandwidths(1 << 30)
    model = load_metadata(args.model)
    files = model.meta["files"]
    head = files["lm_head.bin" if "lm_head.bin" in files else "embed.bin"]["size"]
    per_token = sum(v["size"] for k, v in files.items() if k.startswith("layer_")) + head
    resident = bench(args.model)
    resident_w4a8 = bench(args.model, "--precision", "w4a8")
    paged = bench(args.model, "--vram-budget", args.vram_budget)
    serial = bench(args.model, env={"NERVA_CUDA_PDL": "0"})
    hbm_limit = ceilings["device_copy"] * 1e9 / per_token

    def against_hbm(run: dict) -> dict:
        return {**run, "bytes_per_token": per_token, "hbm_limit_tok_s": round(hbm_limit, 1),
                "fraction_of_limit": round(run.get("decode_tok_s", 0) / hbm_limit, 3), "target": 0.5}

    result = {
        "device": dev.name, "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": str(args.model), "ceilings_gb_s": ceilings,
        "resident": against_hbm(resident), "resident_w4a8": against_hbm(resident_w4a8),
        "resident_serial_launches": against_hbm(serial),  # NERVA_CUDA_PDL=0
    }
    h2d = paged.get("h2d_bytes_per_token") or 0
    pcie_limit = ceilings["h2d_pinned"] * 1e9 / h2d if h2d else None
    result["paged"] = {**paged, "vram_budget_arg": args.vram_budget,
                       "pcie_limit_tok_s": round(pcie_limit, 2) if pcie_limit else None,
                       "fraction_of_limit": round(paged["decode_tok_s"] / pcie_limit, 3) if pcie_limit else None,
                       "target": 0.8}
    if args.peer_json is not None:
        peer = json.loads(args.peer_json.read_text())
        result["llama_cpp"] = peer_ratios(peer, resident)
        result["llama_cpp_w4a8"] = peer_ratios(peer, resident_w4a8)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu_{re.sub(r'[^A-Za-z0-9]+', '_', dev.name).strip('_').lower()}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
