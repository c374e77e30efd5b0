#!/usr/bin/env python3
"""Decode rate held to a JSON Schema against the same decode free: `nerva bench MODEL --format
SCHEMA` and `nerva bench MODEL` alternated run by run (a shared machine's load falls on both
alike), greedy, the same prompt. The schema asks for at least 30 short strings, so every run
makes its --gen-tokens tokens inside the grammar. Prints one JSON line: each side's decode rates,
their medians, the ratios (the issue's target: >= 0.9) and the mask's mean time per token.

    python3 scripts/structured_bench.py [MODEL] [--pairs 5] [--gen-tokens 128] [--threads N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_line import bench_line, write_line  # noqa: E402

from nerva_cli.hardware.machine import cpu_name  # noqa: E402

SCHEMA = {"type": "object", "properties": {"facts": {"type": "array", "items": {"type": "string", "maxLength": 60},
                                                     "minItems": 30}},
          "required": ["facts"], "additionalProperties": False}


def bench(model: str, args: argparse.Namespace, extra: list[str]) -> dict:
    threads = ["--threads", str(args.threads)] if args.threads else []
    return bench_line(model, "--gen-tokens", str(args.gen_tokens), "--prompt-tokens", "64", "--repeat", "1",
                      *threads, *extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--pairs", type=int, default=5, help="runs of each side, alternated (default 5)")
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="also write the JSON line to this file")
    args = ap.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(SCHEMA, f)
    try:
        free, held = [], []
        for i in range(args.pairs):
            first, second = (free, held) if i % 2 == 0 else (held, free)  # alternate which side goes first
            for side in (first, second):
                side.append(bench(args.model, args, ["--format", f.name] if side is held else []))
            print(f"pair {i + 1}/{args.pairs}: free {free[-1]['decode_tok_s']} tok/s, held "
                  f"{held[-1]['decode_tok_s']} tok/s", file=sys.stderr)
    finally:
        os.unlink(f.name)
    free_rate = statistics.median(r["decode_tok_s"] for r in free)
    held_rate = statistics.median(r["decode_tok_s"] for r in held)
    line = {"cpu": cpu_name(), "cores": os.cpu_count(), "model": args.model, "threads": free[0]["threads"],
            "gen_tokens": args.gen_tokens, "schema": SCHEMA, "pairs": args.pairs,
            "free_decode_tok_s": [r["decode_tok_s"] for r in free],
            "held_decode_tok_s": [r["decode_tok_s"] for r in held],
            "held_answer_tokens": [r["answer_tokens"][0] for r in held],
            "free_median_tok_s": free_rate, "held_median_tok_s": held_rate,
            "ratio_held_to_free": round(held_rate / free_rate, 3),
            # each pair ran back to back: the median of their ratios shrugs off the load's drift
            "ratio_median_of_pairs": round(statistics.median(h["decode_tok_s"] / f["decode_tok_s"]
                                                             for h, f in zip(held, free)), 3),
            "mask_us_mean": round(statistics.mean(r["mask_us_mean"] for r in held), 1),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_line(line, args.out)


if __name__ == "__main__":
    main()
