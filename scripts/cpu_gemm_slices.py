#!/usr/bin/env python3
"""Prefill's Q4_0 GEMM (cpu.gemm_q4: dequantise a slice of weight rows, OpenBLAS sgemm it) over
a few matrix shapes, at the slice heights the engine picks (`now`) and at fixed heights, on
random planes and activations: best of three, in ms. The scratch is the engine's (8 MB).

    python3 scripts/cpu_gemm_slices.py [--threads 2] [--tokens 250] [--heights 32 64 128]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

SHAPES = [(2048, 16384), (2304, 9216), (2048, 8192), (576, 1536)]  # Gemma 1 2B's down, Gemma 2's, ...


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=250)
    ap.add_argument("--heights", type=int, nargs="+", default=[32, 64, 128])
    args = ap.parse_args()
    from nerva_cli.residency.arena import DEQUANT_SLICE_BYTES
    from nerva_cli.planes.cpu import kernels as cpu
    from nerva_cli.planes.cpu.kernels import gemm as cpu_gemm  # where the slice bounds are read

    cpu.set_threads(args.threads)
    rng = np.random.default_rng()
    bytes_now = cpu_gemm.GEMM_SLICE_BYTES
    for rows, cols in SHAPES:
        qs = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
        d = (rng.uniform(0.5, 1.5, (rows, cols // 32)) * 0.01).astype(np.float16)
        x = rng.standard_normal((args.tokens, cols)).astype(np.float32)
        out = np.empty((args.tokens, rows), np.float32)
        scratch = np.empty(DEQUANT_SLICE_BYTES // 4, np.float32)
        cells = []
        for h in ["now", *args.heights]:
            # a fixed height: the byte bound at exactly h rows, and no row floor under it
            cpu_gemm.GEMM_SLICE_BYTES, floor = (bytes_now, cpu_gemm.GEMM_MIN_ROWS) if h == "now" else (h * 4 * cols, 1)
            saved, cpu_gemm.GEMM_MIN_ROWS = cpu_gemm.GEMM_MIN_ROWS, floor
            height = cpu_gemm._gemm_slices(cols, scratch, rows).shape[1]
            cpu.gemm_q4(qs, d, None, x, out, 0, scratch, rows)  # compiles, warms
            best = float("inf")
            for _ in range(3):
                t = time.perf_counter()
                cpu.gemm_q4(qs, d, None, x, out, 0, scratch, rows)
                best = min(best, time.perf_counter() - t)
            cpu_gemm.GEMM_MIN_ROWS = saved
            cells.append(f"{h} -> {height} rows {best * 1e3:.0f} ms")
        cpu_gemm.GEMM_SLICE_BYTES = bytes_now
        print(f"{args.tokens} tokens, {args.threads} threads, {rows}x{cols}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
