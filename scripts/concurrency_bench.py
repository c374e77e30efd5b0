#!/usr/bin/env python3
"""`nerva bench MODEL --concurrency N` for several N, alternated round by round (a shared machine's
drift falls on every N alike): each N's aggregate decode rate and a sequence's time per token,
their medians over the rounds, and the aggregate's ratio to N = 1's (issue 50's targets: >= 2.0
at 4 sequences, >= 3.0 at 8). One JSON line on stdout (and in --out).

    python3 scripts/concurrency_bench.py [MODEL] [--sequences 1,4,8] [--rounds 3] [--threads T] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_line import bench_line, write_line  # noqa: E402

from nerva_cli.hardware.machine import cpu_name  # noqa: E402


def bench(model: str, n: int, args: argparse.Namespace) -> dict:
    return bench_line(model, "--concurrency", str(n), "--threads", str(args.threads), "--prompt-tokens",
                      str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens), "--repeat", "1", *args.flags.split())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m:q4_0")
    ap.add_argument("--sequences", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--flags", default="--no-profile --precision w4a8", help="more `nerva bench` flags")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    counts = [int(n) for n in args.sequences.split(",")]
    runs: dict[int, list[dict]] = {n: [] for n in counts}
    for r in range(args.rounds):
        for n in (counts if r % 2 == 0 else counts[::-1]):
            line = bench(args.model, n, args)
            runs[n].append({"aggregate_tok_s": line["aggregate_decode_tok_s"],
                            "sequence_token_ms_p50": line["per_sequence_token_ms_p50"],
                            "hot_path_allocations": line["hot_path_allocations"]})
            print(f"round {r + 1}/{args.rounds}, {n} sequences: {line['aggregate_decode_tok_s']} tok/s", file=sys.stderr)
    median = {n: statistics.median(x["aggregate_tok_s"] for x in v) for n, v in runs.items()}
    one = median.get(1)
    result = {"what": "nerva bench --concurrency N, alternated (scripts/concurrency_bench.py)", "cpu": cpu_name(),
              "cores": os.cpu_count(), "model": args.model, "threads": args.threads, "flags": args.flags,
              "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens, "rounds": args.rounds,
              "runs": {str(n): v for n, v in runs.items()},
              "aggregate_tok_s_median": {str(n): m for n, m in median.items()},
              "sequence_token_ms_p50_median": {str(n): statistics.median(x["sequence_token_ms_p50"] for x in v)
                                               for n, v in runs.items()},
              "ratio_to_one": {str(n): round(m / one, 3) for n, m in median.items()} if one else None,
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_line(result, args.out)


if __name__ == "__main__":
    main()
