#!/usr/bin/env python3
"""Where a resident decode step's GPU time goes, kernel by kernel (needs a CUDA device).

Each launch of one decode step (the launches the step graph holds, then greedy sampling) is
captured alone, REPEAT times in one graph, and that graph's replay is timed with events: the
per-launch figure includes a graph node's launch cost, as in the real step, and none of the
host's. The step graph itself is timed the same way, so the table's sum can be held against it.
Matvec rows also give GB/s over the bytes of the weights they read; each launch's copies reread
one matrix, which a small one finds in L2, so scripts/gpu_matvec_sweep.py (which rotates over
copies) is the measure of matvec bandwidth, this the measure of where the step's time goes.

    python3 scripts/gpu_profile.py MODEL_DIR [--fill 512] [--repeat 20] [--temperature 0.8] [--json OUT]
                                   [--ctx 8192] [--splits LEAST,MOST]

--splits times decode attention with another number of blocks a head than attention_splits
picks (MOST at most what the engine's --ctx allocates): an A/B in one lease, e.g. at --fill
7680 --ctx 8192, `--splits 9,9` (the count before long contexts spread) against the default.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def timed(dev, graph) -> float:
    """Median ms of one replay of graph on the compute stream, after one to warm up."""
    dev.replay(graph, dev.compute)
    return float(np.median(dev.times_ms(lambda: dev.replay(graph, dev.compute))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--fill", type=int, default=512, help="tokens in the KV cache before the step")
    ap.add_argument("--repeat", type=int, default=20, help="copies of each launch in its timing graph")
    ap.add_argument("--precision", default=None)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the sample launch's temperature (0: greedy; above 0: with run's top-k and top-p)")
    ap.add_argument("--ctx", type=int, help="the engine's context length (default: fill + 64)")
    ap.add_argument("--splits", help="LEAST,MOST decode attention blocks a head, in place of attention_splits'")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from nerva_cli.cuda_engine import CudaEngine
    from nerva_cli.sampling import SamplingOptions
    from nerva_cli.store import load_metadata

    model = load_metadata(args.model)
    engine = CudaEngine(model, precision=args.precision, ctx=args.ctx or args.fill + 64)
    if args.splits:
        least, most = (int(v) for v in args.splits.split(","))
        if not 1 <= least <= most <= engine.splits[1]:
            sys.exit(f"gpu_profile.py: --splits {args.splits}: need 1 <= LEAST <= MOST <= {engine.splits[1]} "
                     "(a larger --ctx allocates more)")
        engine.splits = (least, most)
    dev, rng = engine.dev, np.random.default_rng()
    engine.prefill([int(t) for t in rng.integers(0, engine.cfg.vocab_size, args.fill)])
    engine._use_sampling(SamplingOptions(temperature=args.temperature))
    engine._write_state(int(rng.integers(0, engine.cfg.vocab_size)))
    dev.synchronize()

    launches = []  # (kernel name, fn, grid, block, args) of one step, in order
    go = engine.k._go
    engine.k._go = lambda name, grid, block, a: launches.append((name, engine.k.fn[name], grid, block, a))
    engine._record_step()
    engine._record_sample_first()
    engine.k._go = go

    per = defaultdict(lambda: {"launches": 0, "ms": 0.0, "bytes": 0})
    for name, fn, grid, block, a in launches:
        g = dev.capture(dev.compute, lambda fn=fn, grid=grid, block=block, a=a:
                        [dev.launch(fn, grid, block, a) for _ in range(args.repeat)])
        row = per[name]
        row["launches"] += 1
        row["ms"] += timed(dev, g) / args.repeat
        if name.startswith(("matvec", "glu")):  # (weights, scales, out, rows) for each of up to 3 matrices
            planes = (0,) if name.endswith("_exact") else (0, 1)
            row["bytes"] += sum(int(a[4 * j + p].nbytes) for j in range(3) if int(a[4 * j + 3]) for p in planes)
    step_ms = timed(dev, engine._graph("step"))
    sample_ms = per["sample"]["ms"]
    total = sum(r["ms"] for r in per.values())
    rows = sorted(per.items(), key=lambda kv: -kv[1]["ms"])
    print(f"{dev.name}: {model.name}:{model.variant} ({engine.cfg.num_layers} layers), {args.fill} tokens cached, "
          f"precision {engine.precision}, attention blocks a head {engine.splits}")
    print(f"{'kernel':<22}{'launches':>9}{'us/step':>10}{'share':>8}{'GB/s':>9}")
    for name, r in rows:
        gbs = f"{r['bytes'] / (r['ms'] / 1e3) / 1e9:9.0f}" if r["bytes"] and r["ms"] else ""
        print(f"{name:<22}{r['launches']:>9}{r['ms'] * 1e3:>10.1f}{r['ms'] / (total or 1):>8.1%}{gbs}")
    print(f"sum of launches {total * 1e3:.1f} us; step graph {step_ms * 1e3:.1f} us + sample {sample_ms * 1e3:.1f} us")
    if args.json:
        args.json.write_text(json.dumps({"device": dev.name, "model": f"{model.name}:{model.variant}",
                                         "fill": args.fill, "splits": list(engine.splits), "step_graph_ms": step_ms,
                                         "kernels": {k: v for k, v in rows}}, indent=1) + "\n")


if __name__ == "__main__":
    main()
