#!/usr/bin/env python3
"""The GPU benchmarks of the CUDA plane, as ratios against ceilings and llama.cpp CUDA measured in
the same run (issue 53's targets):

- resident q4_0 decode at W4A8 (what `run`'s mixed precision runs most layers at; llama.cpp's Q4_0
  matvecs also multiply 8-bit activation codes) and at W4A16 (bench's precision without a
  profile), after a 512-token prompt, against the HBM limit (device-to-device copy bandwidth /
  the bytes a token reads: every layer file and the lm_head); W4A8 again after a 4096-token prompt;
- prefill of 512 tokens (those runs) and of 2048;
- with --small-model, a SmolLM2-shaped model's decode (launch-bound: the bench's kernel launches
  and host calls a step are kept, and the bytes-only bound beside them);
- with --bf16-model, the same for a bf16 model (scripts/synthetic_model.py --quant bf16), against
  the pinned PCIe bound alone;
- with --half, decode with VRAM for half the layers (the budget the planner needs for that many
  resident, found from sizes alone), the rest streamed over PCIe from pinned RAM, against the
  PCIe limit (pinned H2D bandwidth / bytes copied a token) and llama.cpp's `-ngl` of as many.

Every run goes through `nerva bench --backend cuda`, the one place nerva measures speed. With
--peer-json (llama-bench's JSON rows, any number of files, run on the same model files in the same
lease) the top-level `ratios` object gives nerva over llama.cpp for each pairing measured, and
`llama_cpp` the pairs themselves. One JSON file naming the device is written to OUT_DIR, again
after each run, so that a run cut short keeps what finished.

    python3 scripts/gpu_bench.py MODEL_DIR [--out docs/perf] [--small-model DIR] [--half] [--bf16-model DIR]
        [--peer-json FILE ...] [--name SUFFIX]     (NERVA_COMMIT: the commit to name, where there is no .git)
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

def bench(model: Path, *extra: str, prompt: int = 512, gen: int = 128, repeat: int = 3) -> dict:
    cmd = [sys.executable, "-m", "nerva_cli", "bench", str(model), "--backend", "cuda", "--no-profile",
           "--prompt-tokens", str(prompt), "--gen-tokens", str(gen), "--repeat", str(repeat), *extra]
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def bytes_per_token(model) -> int:
    """What a resident decode step reads: every layer file and the lm_head (the token table when tied)."""
    files = model.meta["files"]
    head = files["lm_head.bin" if "lm_head.bin" in files else "embed.bin"]["size"]
    return sum(v["size"] for k, v in files.items() if k.startswith("layer_")) + head


def budget_for_resident(model, layers: int, sms: int, ctx: int) -> int:
    """The smallest --vram-budget (bytes, to 1 MiB) at which the planner keeps `layers` layers in
    VRAM at a context of ctx positions, from sizes alone (planes/cuda/engine.gpu_residency_plan).
    ctx must be the run's: bench sizes its own to the prompt and the tokens it generates."""
    from nerva_cli.errors import NervaError
    from nerva_cli.planes.cuda.engine import gpu_residency_plan

    def holds(budget: int) -> bool:
        try:
            return len(gpu_residency_plan(model, ctx, budget, None, sms=sms).vram.resident_layers) >= layers
        except NervaError:
            return False

    lo, hi = 1 << 20, 1 << 40
    while hi - lo > 1 << 20:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds(mid) else (mid, hi)
    return hi


def peer_rows(paths: list[Path]) -> list[dict]:
    rows = []
    for p in paths:
        try:
            rows += json.loads(p.read_text())
        except (OSError, ValueError) as e:
            print(f"gpu_bench: {p}: no llama-bench rows ({e})", file=sys.stderr)
    return rows


def find_row(rows: list[dict], model_file: str, *, ngl: int = 99, fa: int | None, gen: int = 0,
             prompt: int = 0, depth: int = 0) -> dict | None:
    """The llama-bench row of that setting on that GGUF (fa None: the faster of off and on)."""
    found = [r for r in rows if Path(r.get("model_filename", "")).name == model_file
             and r.get("n_gpu_layers") == ngl and r.get("n_gen") == gen and r.get("n_prompt") == prompt
             and r.get("n_depth", 0) == depth and (fa is None or int(bool(r.get("flash_attn"))) == fa)]
    return max(found, key=lambda r: r["avg_ts"]) if found else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="a resident 8B-shaped q4_0 model directory")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "perf")
    ap.add_argument("--small-model", type=Path, help="a SmolLM2-shaped q4_0 model directory")
    ap.add_argument("--half", action="store_true", help="also decode with VRAM for half the layers")
    ap.add_argument("--bf16-model", type=Path, help="a bf16 8B-shaped model directory: decode with VRAM for half "
                                                     "its layers, against the pinned PCIe bound")
    ap.add_argument("--peer-json", type=Path, nargs="*", default=[], help="llama-bench -o json outputs")
    ap.add_argument("--gguf", default="r8b.gguf", help="the 8B model's GGUF file name in the peer's rows")
    ap.add_argument("--small-gguf", default="rsmall.gguf", help="the small model's GGUF file name")
    ap.add_argument("--name", default="", help="suffix of the JSON file's name (e.g. the commit)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from nerva_cli.planes.cuda.launch import CupyDevice
    from nerva_cli.store.catalog import load_metadata

    dev = CupyDevice()
    ceilings = dev.bandwidths(1 << 30)
    model = load_metadata(args.model)
    per_token = bytes_per_token(model)
    hbm_limit = ceilings["device_copy"] * 1e9 / per_token
    commit = os.environ.get("NERVA_COMMIT")  # a lease's copy of the tree may have no .git
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        except OSError:
            commit = None
    result = {"device": dev.name, "sms": dev.sms, "commit": commit or None,
              "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "model": str(args.model), "ceilings_gb_s": ceilings, "ratios": {}}
    stem = re.sub(r"[^A-Za-z0-9]+", "_", dev.name).strip("_").lower()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu_{stem}{'_' + args.name if args.name else ''}.json"
    rows = peer_rows(args.peer_json)

    def against_hbm(run: dict, limit: float = hbm_limit, nbytes: int = per_token) -> dict:
        return {**run, "bytes_per_token": nbytes, "hbm_limit_tok_s": round(limit, 1),
                "fraction_of_limit": round((run.get("decode_tok_s") or 0) / limit, 3)}

    def pair(key: str, ours: float | None, row: dict | None, **what) -> None:
        """ratios[key] = ours / llama.cpp's row, with the pair kept under llama_cpp[key]."""
        if not ours or row is None:
            return
        result.setdefault("llama_cpp", {})[key] = {
            "nerva_tok_s": ours, "llama_cpp_tok_s": round(row["avg_ts"], 2),
            "llama_cpp_stddev_tok_s": round(row.get("stddev_ts", 0.0), 2),
            "llama_cpp_setting": {k: row.get(k) for k in ("n_gpu_layers", "flash_attn", "n_prompt", "n_gen",
                                                          "n_depth", "n_threads")}, **what}
        result["ratios"][key] = round(ours / row["avg_ts"], 3)

    def save() -> None:
        path.write_text(json.dumps(result, indent=1) + "\n")

    g = args.gguf
    # most important first: a run cut short keeps what finished
    w4a8 = result["resident_w4a8"] = against_hbm(bench(args.model, "--precision", "w4a8"))
    result["ratios"]["decode_8b_hbm_fraction"] = w4a8["fraction_of_limit"]
    for fa in (1, 0):
        pair(f"decode_8b_vs_llamacpp_fa{fa}", w4a8.get("decode_tok_s"),
             find_row(rows, g, fa=fa, gen=128, depth=512) or find_row(rows, g, fa=fa, gen=128),
             nerva="w4a8, 128 tokens after a 512-token prompt")
        pair(f"prefill512_vs_llamacpp_fa{fa}", w4a8.get("prefill_tok_s"), find_row(rows, g, fa=fa, prompt=512))
    save()
    if args.small_model is not None:
        small = load_metadata(args.small_model)
        small_bytes = bytes_per_token(small)
        run = against_hbm(bench(args.small_model, "--precision", "w4a8"),
                          ceilings["device_copy"] * 1e9 / small_bytes, small_bytes)
        result["small_w4a8"] = run
        pair("decode_small_vs_llamacpp", run.get("decode_tok_s"),
             find_row(rows, args.small_gguf, fa=None, gen=128, depth=512)
             or find_row(rows, args.small_gguf, fa=None, gen=128),
             nerva="w4a8, 128 tokens after a 512-token prompt; llama.cpp's faster of flash attention off and on",
             kernel_launches_per_token=run.get("kernel_launches_per_token"),
             dispatches_per_token=run.get("dispatches_per_token"))
        save()
    long = result["resident_w4a8_4096"] = against_hbm(
        bench(args.model, "--precision", "w4a8", "--ctx", "4352", prompt=4096, repeat=2))
    pair("decode_8b_4096_vs_llamacpp_fa1", long.get("decode_tok_s"), find_row(rows, g, fa=1, gen=128, depth=4096),
         nerva="w4a8, 128 tokens after a 4096-token prompt")
    save()
    pf = result["prefill_2048"] = bench(args.model, "--precision", "w4a8", prompt=2048, gen=2, repeat=3)
    pair("prefill2048_vs_llamacpp_fa1", pf.get("prefill_tok_s"), find_row(rows, g, fa=1, prompt=2048))
    save()
    if args.half:
        layers = model.config.num_layers // 2
        ctx = 512 + 128 + 1  # the bench's prompt and tokens, as llama-bench's -d 512 -n 128 sizes its own
        budget = budget_for_resident(model, layers, dev.sms, ctx)
        half = bench(args.model, "--precision", "w4a8", "--vram-budget", str(budget), "--ctx", str(ctx), repeat=2)
        h2d = half.get("h2d_bytes_per_token") or 0
        pcie = ceilings["h2d_pinned"] * 1e9 / h2d if h2d else None
        result["half_vram"] = {**half, "vram_budget_bytes": budget,
                               "pcie_limit_tok_s": round(pcie, 2) if pcie else None,
                               "fraction_of_pcie_limit": round((half.get("decode_tok_s") or 0) / pcie, 3) if pcie else None}
        # the pairing holds only where the planner kept as many layers as llama.cpp's -ngl
        same = half.get("resident_layers") == layers
        pair("hybrid_half_vs_llamacpp_ngl16" if same else f"half_vram_{half.get('resident_layers')}_layers_vs_llamacpp_ngl16",
             half.get("decode_tok_s"), find_row(rows, g, ngl=layers, fa=1, gen=128, depth=512),
             nerva=f"w4a8, {half.get('resident_layers')} layers in VRAM and {half.get('paged_layers')} streamed over "
                   "PCIe from pinned RAM (no layer computed on the host's cores: the hybrid's CPU half is not built)")
        save()
    if args.bf16_model is not None:
        exact = load_metadata(args.bf16_model)
        layers, ctx = exact.config.num_layers // 2, 512 + 128 + 1
        budget = budget_for_resident(exact, layers, dev.sms, ctx)
        run = bench(args.bf16_model, "--vram-budget", str(budget), "--ctx", str(ctx), gen=32, repeat=2)
        h2d = run.get("h2d_bytes_per_token") or 0
        bound = ceilings["h2d_pinned"] * 1e9 / h2d if h2d else None
        result["bf16_half_vram"] = {**run, "vram_budget_bytes": budget, "pinned_bound_tok_s": round(bound, 2)
                                    if bound else None}
        if bound and run.get("decode_tok_s") and run.get("resident_layers") == layers:
            result["ratios"]["bf16_half_vs_pinned_bound"] = round(run["decode_tok_s"] / bound, 3)
        save()
    result["resident_w4a16"] = against_hbm(bench(args.model))
    save()
    print(json.dumps(result))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
