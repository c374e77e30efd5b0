#!/usr/bin/env python3
"""A prompt chunk's Q4_0 matrix product on the CPU plane, by each way prefill can take it, timed
alternately on random planes and activations: W4A8 through the integer kernel (matmul_q4_w4a8,
with the activations' quantisation: rows in lanes from 12 activations where the CPU has AVX2),
through the integer row kernel it takes below that (`w4a8_rows`), and through dequantise +
OpenBLAS sgemm (fake_quantize_q8 + gemm_q4); W4A16 through gemm_q4 and through its batch kernel
(matmul_q4_w4a16: on Q16 codes without AVX-512F). Median ms of --repeat rounds and GFLOP/s (2 rows cols tokens a
product), one JSON object on stdout; the CPU is named in it.

    python3 scripts/cpu_prompt_gemm_bench.py [--threads 2] [--tokens 32 128 512] [--shape 4096x4096 ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

# Llama-3-8B's q (4096 x 4096), gate/up (14336 x 4096) and down (4096 x 14336); Llama-3.2-3B's gate
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (8192, 3072)]


def parse_shape(text: str) -> tuple[int, int]:
    rows, cols = (int(v) for v in text.lower().split("x"))
    if cols % 32:
        raise argparse.ArgumentTypeError(f"{text}: rows x cols, cols a multiple of 32")
    return rows, cols


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--shape", type=parse_shape, nargs="+", default=SHAPES)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    from nerva_cli.hardware.machine import cpu_name
    from nerva_cli.planes.cpu import kernels as cpu
    from nerva_cli.planes.cpu.kernels.q4 import _pair_scratch
    from nerva_cli.planes.cpu.kernels.q4_w4a8 import _w4a8_batch
    from nerva_cli.residency.arena import DEQUANT_SLICE_BYTES

    cpu.set_threads(args.threads)
    rng = np.random.default_rng(0)
    scratch = np.empty(DEQUANT_SLICE_BYTES // 4, np.float32)
    rows_out = []
    for rows, cols in args.shape:
        qs = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
        d = (rng.uniform(0.5, 1.5, (rows, cols // 32)) * 0.01).astype(np.float16)
        for T in args.tokens:
            x = rng.standard_normal((T, cols)).astype(np.float32)
            out = np.empty((T, rows), np.float32)
            xq, xf = np.empty((T, cols), np.int8), np.empty((T, cols), np.float32)
            xd, xs = np.empty((T, cols // 32), np.float32), np.empty((T, cols // 32), np.int32)

            def w4a8_integer():
                cpu.quantize_act_q8(x.reshape(-1), xq.reshape(-1), xd.reshape(-1), xs.reshape(-1))
                cpu.matmul_q4_w4a8(qs, d, None, xq, xd, xs, out)

            def w4a8_rows():
                cpu.quantize_act_q8(x.reshape(-1), xq.reshape(-1), xd.reshape(-1), xs.reshape(-1))
                pairs = _pair_scratch(T * cols)[:T * cols].reshape(T, cols)
                _w4a8_batch(qs, d.view(np.uint16), None, xq, pairs, xd, xs, out)

            def w4a8_sgemm():
                cpu.fake_quantize_q8(x, xf)
                cpu.gemm_q4(qs, d, None, xf, out, 0, scratch, rows)

            def w4a16_sgemm():
                cpu.gemm_q4(qs, d, None, x, out, 0, scratch, rows)

            def w4a16_batch():
                cpu.matmul_q4_w4a16(qs, d, None, x, out)

            ways = {"w4a8_integer": w4a8_integer, "w4a8_rows": w4a8_rows, "w4a8_sgemm": w4a8_sgemm,
                    "w4a16_sgemm": w4a16_sgemm, "w4a16_batch": w4a16_batch}
            for way in ways.values():
                way()  # compile and warm
            times = {name: [] for name in ways}
            for _ in range(args.repeat):
                for name, way in ways.items():
                    t0 = time.perf_counter()
                    way()
                    times[name].append(time.perf_counter() - t0)
            flop = 2.0 * rows * cols * T
            cell = {"rows": rows, "cols": cols, "tokens": T}
            for name, ts in times.items():
                ms = statistics.median(ts) * 1e3
                cell[name] = {"ms": round(ms, 2), "gflops": round(flop / ms / 1e6, 1)}
            cell["w4a8_integer_over_sgemm"] = round(cell["w4a8_sgemm"]["ms"] / cell["w4a8_integer"]["ms"], 3)
            rows_out.append(cell)
            print(json.dumps(cell), flush=True)
    print(json.dumps({"cpu": cpu_name(), "threads": args.threads, "repeat": args.repeat, "results": rows_out}))


if __name__ == "__main__":
    main()
