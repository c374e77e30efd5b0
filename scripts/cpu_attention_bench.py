#!/usr/bin/env python3
"""The cpu backend's decode attention alone: one JSON line a measurement (shape, positions,
threads, layers, the median of --repeat passes), in microseconds a layer. A pass calls it once
for each of --layers caches, as a decode step does, so with 30 layers of SmolLM2's shape at 1800
positions (41 MB of f16 K and V) the rows come from DRAM; --layers 1 times a cache the caches
hold. The figures in planes/cpu/kernels's attention comments come from this.

    python3 scripts/cpu_attention_bench.py [--shape 9:3:64] [--ctx 300 1800] [--threads 1 2]
        [--layers 30] [--cache f16|f32] [--lowering host|avx2]

--shape is heads:kv_heads:head_dim. --lowering avx2 compiles the kernel with the geometry a host
without AVX-512 gets (cpu.attention_geometry(False): 8-float vectors, 4-position score steps)
into a scratch numba cache, so the two can be compared on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        heads, kv_heads, dim = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: heads:kv_heads:head_dim, three integers") from None
    if min(heads, kv_heads, dim) < 1 or heads % kv_heads or dim % 2:
        raise argparse.ArgumentTypeError(f"{text}: heads a multiple of kv_heads, head_dim even")
    return heads, kv_heads, dim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=parse_shape, default=(9, 3, 64), help="heads:kv_heads:head_dim")
    ap.add_argument("--ctx", nargs="+", type=int, default=[300, 1800], help="positions attended")
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--layers", type=int, default=30, help="caches a pass reads, one call each")
    ap.add_argument("--cache", choices=["f16", "f32"], default="f16")
    ap.add_argument("--repeat", type=int, default=15, help="passes timed per figure")
    ap.add_argument("--lowering", choices=["host", "avx2"], default="host")
    args = ap.parse_args()
    if min(args.ctx) < 1 or args.layers < 1 or args.repeat < 1:
        ap.error("--ctx, --layers and --repeat must be at least 1")

    if args.lowering != "host":  # cached machine code keys on the source, not on these settings
        os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="nerva-numba-")
    from nerva_cli.planes import ref
    from nerva_cli.planes.cpu import kernels as cpu
    from nerva_cli.planes.cpu.kernels import decode_attention as cpu_decode_attention  # where the geometry is read
    if args.lowering == "avx2":
        for name, value in cpu.attention_geometry(avx512=False).items():
            setattr(cpu_decode_attention, name, value)

    heads, kv_heads, dim = args.shape
    rng = np.random.default_rng()
    dtype = np.float16 if args.cache == "f16" else np.float32
    ctx = max(args.ctx)
    caches = [(rng.standard_normal((ctx, kv_heads, dim)).astype(dtype),
               rng.standard_normal((ctx, kv_heads, dim)).astype(dtype)) for _ in range(args.layers)]
    q = rng.standard_normal((heads, dim)).astype(np.float32)
    out = np.empty_like(q)
    part = np.empty(ref.attention_decode_partials(ctx, heads, dim), np.float32)
    for n_ctx in args.ctx:
        for threads in args.threads:
            cpu.set_threads(threads)
            cpu.attention_decode(q, *caches[0], n_ctx, out, part)  # compiles, or loads the compiled code
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                for k, v in caches:
                    cpu.attention_decode(q, k, v, n_ctx, out, part)
                times.append(time.perf_counter() - t0)
            seconds = float(np.median(times)) / args.layers
            nbytes = 2 * n_ctx * kv_heads * dim * np.dtype(dtype).itemsize  # K and V rows read a layer
            print(json.dumps({"kernel": "attention_decode", "heads": heads, "kv_heads": kv_heads,
                              "head_dim": dim, "cache": args.cache, "n_ctx": n_ctx, "threads": threads,
                              "layers": args.layers, "lowering": args.lowering,
                              "us_per_layer": round(seconds * 1e6, 2),
                              "gb_s": round(nbytes / seconds / 1e9, 2)}), flush=True)


if __name__ == "__main__":
    main()
