#!/usr/bin/env python3
"""Where a resident decode step's GPU time goes, kernel by kernel (needs a CUDA device); with
--prefill T, where a T-token prefill pass's goes, kernels and cuBLAS GEMMs alike.

Each launch of one decode step (the launches the step graph holds, then greedy sampling) is
captured alone, REPEAT times in one graph, and that graph's replay is timed with events: the
per-launch figure includes a graph node's launch cost, as in the real step, and none of the
host's. The step graph itself is timed the same way, so the table's sum can be held against it.
Matvec rows also give GB/s over the bytes of the weights they read; each launch's copies reread
one matrix, which a small one finds in L2, so scripts/gpu_matvec_sweep.py (which rotates over
copies) is the measure of matvec bandwidth, this the measure of where the step's time goes.

A prefill pass is not a graph: the host queues it op by op. Its ops (kernel launches and
gemm_t's cuBLAS calls) are recorded during one pass after --fill cached tokens and each is
timed alone the same way (a GEMM that cuBLAS will not let a graph capture is timed as REPEAT
calls queued from the host, and marked so). The table's sum is held against the whole pass as
the GPU ran it (events around it: what the ops leave out is CuPy's own elementwise work, such
as Qwen2's q/k/v biases, and the GPU waiting on the host) and against the host's time to queue it.

    python3 scripts/gpu_profile.py MODEL_DIR [--fill 512] [--repeat 20] [--temperature 0.8] [--json OUT]
                                   [--ctx 8192] [--splits LEAST,MOST] [--prefill T [--slice-mb MB]]

--splits times decode attention with another number of blocks a head set than attention_splits
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


def time_alone(dev, queue, repeat: int) -> tuple[float, bool]:
    """(ms, captured) of one queue() on the compute stream: REPEAT copies in a graph, or, where
    the op cannot be captured (a cuBLAS call may refuse), REPEAT copies queued by the host."""
    try:
        graph = dev.capture(dev.compute, lambda: [queue() for _ in range(repeat)])
    except Exception:  # noqa: BLE001 - any refusal to capture: time it uncaptured instead
        dev.synchronize()
        with dev.on(dev.compute):
            queue()
            return float(np.median(dev.times_ms(lambda: [queue() for _ in range(repeat)]))) / repeat, False
    return timed(dev, graph) / repeat, True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--fill", type=int, default=512, help="tokens in the KV cache before the step (or the pass)")
    ap.add_argument("--repeat", type=int, default=20, help="copies of each launch in its timing graph")
    ap.add_argument("--precision", default=None)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the sample launch's temperature (0: greedy; above 0: with run's top-k and top-p)")
    ap.add_argument("--ctx", type=int, help="the engine's context length (default: fill + 64, or fill + T)")
    ap.add_argument("--splits", help="LEAST,MOST decode attention blocks a head set (the query heads of a kv group one block takes), in place of attention_splits'")
    ap.add_argument("--prefill", type=int, metavar="T",
                    help="profile a prefill pass of T prompt tokens (at most the engine's chunk) instead")
    ap.add_argument("--slice-mb", type=int, metavar="MB",
                    help="with --prefill: dequantise at most MB of f16 weights at a time (the engine's: its "
                         "scratch, 64), e.g. slices that L2 holds for the GEMM that reads them")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from nerva_cli.planes.cuda.engine import PREFILL_CHUNK, CudaEngine
    from nerva_cli.store.catalog import load_metadata

    if args.prefill is not None and not 1 <= args.prefill <= PREFILL_CHUNK:
        sys.exit(f"gpu_profile.py: --prefill {args.prefill}: a pass takes 1 to {PREFILL_CHUNK} tokens")
    model = load_metadata(args.model)
    ctx = args.ctx or args.fill + (args.prefill or 64)
    engine = CudaEngine(model, precision=args.precision, ctx=ctx)
    if args.splits:
        least, most = (int(v) for v in args.splits.split(","))
        if not 1 <= least <= most <= engine.splits[1]:
            sys.exit(f"gpu_profile.py: --splits {args.splits}: need 1 <= LEAST <= MOST <= {engine.splits[1]} "
                     "(a larger --ctx allocates more)")
        engine.splits = (least, most)
    if args.slice_mb is not None:
        if not 0 < args.slice_mb << 19 <= engine.a.scratch.size:
            sys.exit(f"gpu_profile.py: --slice-mb {args.slice_mb}: 1 to {engine.a.scratch.size >> 19} "
                     "(the engine's scratch)")
        engine.a.scratch = engine.a.scratch[: args.slice_mb << 19]  # f16: 2^19 of them a MB
    rng = np.random.default_rng()
    if args.fill:
        engine.prefill([int(t) for t in rng.integers(0, engine.cfg.vocab_size, args.fill)])
    result = (profile_prefill if args.prefill else profile_decode)(engine, model, args, rng)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


def print_rows(rows, total_ms: float, unit: str) -> None:
    width = max([22] + [len(name) + 1 for name, _ in rows])
    print(f"{'op':<{width}}{'launches':>9}{unit:>10}{'share':>8}{'GB/s':>9}{'TFLOP/s':>9}")
    for name, r in rows:
        gbs = f"{r['bytes'] / (r['ms'] / 1e3) / 1e9:9.0f}" if r["bytes"] and r["ms"] else " " * 9
        tfs = f"{r['flops'] / (r['ms'] / 1e3) / 1e12:9.1f}" if r.get("flops") and r["ms"] else ""
        print(f"{name:<{width}}{r['launches']:>9}{r['ms'] * 1e3:>10.1f}{r['ms'] / (total_ms or 1):>8.1%}{gbs}{tfs}")


def profile_decode(engine, model, args, rng) -> dict:
    from nerva_cli.runtime.sampling import SamplingOptions

    dev = engine.dev
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
    shapes = defaultdict(lambda: {"launches": 0, "ms": 0.0, "bytes": 0})  # matvecs by launch shape
    for name, fn, grid, block, a in launches:
        g = dev.capture(dev.compute, lambda fn=fn, grid=grid, block=block, a=a:
                        [dev.launch(fn, grid, block, a) for _ in range(args.repeat)])
        ms = timed(dev, g) / args.repeat
        rows = [per[name]]
        nbytes = 0
        if name.startswith(("matvec", "glu")):  # (weights, scales, out, rows) for each of up to 3 matrices,
            exact = name.endswith("_exact")      # then (exact: is_bf16), x, cols
            planes = (0,) if exact else (0, 1)
            nbytes = sum(int(a[4 * j + p].nbytes) for j in range(3) if int(a[4 * j + 3]) for p in planes)
            shape = "+".join(str(int(a[4 * j + 3])) for j in range(3) if int(a[4 * j + 3]))
            rows.append(shapes[f"{name} {shape}x{int(a[14 if exact else 13])}"])
        for row in rows:
            row["launches"] += 1
            row["ms"] += ms
            row["bytes"] += nbytes
    step_ms = timed(dev, engine._graph("step").graph)
    sample_ms = per["sample"]["ms"]
    total = sum(r["ms"] for r in per.values())
    rows = sorted(per.items(), key=lambda kv: -kv[1]["ms"])
    print(f"{dev.name}: {model.name}:{model.variant} ({engine.cfg.num_layers} layers), {args.fill} tokens cached, "
          f"precision {engine.precision}, attention blocks a head set {engine.splits}")
    print_rows(rows, total, "us/step")
    print(f"sum of launches {total * 1e3:.1f} us; step graph {step_ms * 1e3:.1f} us + sample {sample_ms * 1e3:.1f} us")
    by_shape = sorted(shapes.items(), key=lambda kv: -kv[1]["ms"])
    print("the matvecs by launch shape (rows of each matrix x columns):")
    print_rows(by_shape, total, "us/step")
    return {"device": dev.name, "model": f"{model.name}:{model.variant}", "fill": args.fill,
            "splits": list(engine.splits), "step_graph_ms": step_ms, "kernels": dict(rows),
            "matvec_shapes": dict(by_shape)}


def profile_prefill(engine, model, args, rng) -> dict:
    """One pass of args.prefill tokens, op by op: see the module's docstring."""
    import time

    dev, T = engine.dev, args.prefill
    tokens = [int(t) for t in rng.integers(0, engine.cfg.vocab_size, T)]
    ops = []  # (name, queue, bytes, flops) in the pass's order
    go, gemm = engine.k._go, dev.gemm_t

    def record_launch(name, grid, block, a):
        ops.append((name, lambda: dev.launch(engine.k.fn[name], grid, block, a), launch_bytes(name, a), 0))
        go(name, grid, block, a)

    def record_gemm(a, b, out, accumulate=False):
        (rows, k), n = a.shape, b.shape[0]
        nbytes = a.nbytes + b.nbytes + out.size * 4 * (1 + accumulate)
        ops.append(("gemm_t (cuBLAS)", lambda: gemm(a, b, out, accumulate), nbytes, 2 * rows * k * n))
        gemm(a, b, out, accumulate)

    def one_pass():
        engine.n_past = args.fill
        with dev.on(dev.compute):
            engine._prefill_chunk(tokens)

    engine.k._go, dev.gemm_t = record_launch, record_gemm
    try:
        one_pass()
    finally:
        engine.k._go, dev.gemm_t = go, gemm
    dev.synchronize()

    per = defaultdict(lambda: {"launches": 0, "ms": 0.0, "bytes": 0, "flops": 0, "uncaptured": 0})
    for name, queue, nbytes, flops in ops:
        ms, captured = time_alone(dev, queue, args.repeat)
        row = per[name]
        row["launches"] += 1
        row["ms"] += ms
        row["bytes"] += nbytes
        row["flops"] += flops
        row["uncaptured"] += not captured
    pass_ms = float(np.median(dev.times_ms(one_pass, rounds=3)))
    dev.synchronize()
    started = time.perf_counter()
    one_pass()  # the host's time to queue a pass (_prefill_chunk's one wait, on the state copy, is at its start)
    queue_ms = (time.perf_counter() - started) * 1e3
    dev.synchronize()
    engine.n_past = args.fill

    total = sum(r["ms"] for r in per.values())
    rows = sorted(per.items(), key=lambda kv: -kv[1]["ms"])
    print(f"{dev.name}: {model.name}:{model.variant} ({engine.cfg.num_layers} layers), a {T}-token prefill pass "
          f"after {args.fill} cached tokens, precision {engine.precision}, "
          f"dequantised slices of at most {engine.a.scratch.nbytes / 2**20:.0f} MB")
    print_rows(rows, total, "us/pass")
    uncaptured = sum(r["uncaptured"] for r in per.values())
    if uncaptured:
        print(f"({uncaptured} ops would not go into a graph and were timed as queued by the host)")
    rate = f" ({T / (pass_ms / 1e3):.0f} tok/s)" if pass_ms else ""
    print(f"sum of ops {total:.2f} ms; the pass on the GPU {pass_ms:.2f} ms{rate}; "
          f"the host queued it in {queue_ms:.2f} ms")
    return {"device": dev.name, "model": f"{model.name}:{model.variant}", "fill": args.fill, "prefill_tokens": T,
            "slice_bytes": int(engine.a.scratch.nbytes), "pass_ms": pass_ms, "host_queue_ms": queue_ms,
            "ops_ms": total, "ops": dict(rows)}


def launch_bytes(name: str, a) -> int:
    """Bytes a prefill kernel reads and writes where they are its arrays' whole size: the weight
    conversions (their source and the f16 copy) and the activations' (f32 in, f16 out)."""
    if name == "dequantize_q4":  # (qs, d, out, blocks)
        return int(a[0].nbytes + a[1].nbytes + a[2].nbytes)
    if name == "dequantize_q4_1":  # (qs, d, m, out, blocks)
        return int(a[0].nbytes + a[1].nbytes + a[2].nbytes + a[3].nbytes)
    if name in ("bf16_to_half", "to_half", "fake_quantize_q8"):  # (src, out, n)
        return int(a[0].nbytes + a[1].nbytes)
    return 0


if __name__ == "__main__":
    main()
