#!/usr/bin/env python3
"""The cpu backend's decode matvecs alone, in GB/s of weights read: one JSON line a measurement
(kernel, shape, threads, whether the matrix came from cache or DRAM, the median of --repeat calls).
The figures in planes/cpu/kernels's comments come from this.

    python3 scripts/cpu_matvec_bench.py [--kind q4_1 q4_0 q8_0] [--precision w4a8 w4a16]
        [--shape 3072x576 1024x1536 131072x576] [--threads 1 2] [--dram] [--lowering host|avx512|avx2]

--dram writes a 64 MB buffer between calls, so a matrix smaller than the L3 is read from DRAM as
in a real decode step (SmolLM2's 98 MB of weights do not stay in a 32 MB L3); without it, a
matrix the caches hold is timed from them. --lowering avx2 compiles the kernels as if the host
had no AVX-512 (the 256-bit integer dots, W4A16 on Q16 codes), and --lowering avx512 as if it had
AVX-512 but not AVX512-BF16 (W4A16's row tables instead of its bf16 dots), into a scratch numba
cache, so they can be compared on one machine.
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


def parse_shape(text: str) -> tuple[int, int]:
    rows, cols = (int(v) for v in text.lower().split("x"))
    if rows < 1 or cols < 32 or cols % 32:
        raise argparse.ArgumentTypeError(f"{text}: rows x cols, cols a multiple of 32")
    return rows, cols


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", nargs="+", default=["q4_1", "q4_0"], choices=["q4_0", "q4_1", "q8_0"])
    ap.add_argument("--precision", nargs="+", default=["w4a8", "w4a16"], choices=["w4a8", "w4a16"],
                    help="w4a8 / w4a16; for q8_0, W8A8 / W8A16")
    ap.add_argument("--shape", nargs="+", type=parse_shape, default=[(3072, 576), (1024, 1536), (131072, 576)])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--dram", action="store_true", help="evict the caches between calls")
    ap.add_argument("--repeat", type=int, help="calls timed per figure (default: about 50 MB read)")
    ap.add_argument("--lowering", choices=["host", "avx512", "avx2"], default="host")
    args = ap.parse_args()

    if args.lowering != "host":  # cached machine code keys on the source, not on these flags
        os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="nerva-numba-")
    from nerva_cli.planes.cpu import kernels as cpu
    from nerva_cli.planes.cpu.kernels import (  # the flags and kernel choices are set where they are read
        gemm as cpu_gemm, integer_dots as cpu_integer_dots, q4 as cpu_q4, q4_float as cpu_q4_float,
        q4_w4a8 as cpu_q4_w4a8, target as cpu_target)
    if args.lowering == "avx512":
        if not cpu_target._AVX512F:  # the row tables' lookups are AVX-512 instructions
            sys.exit("--lowering avx512 needs a host with AVX-512F; this one has none")
        cpu_q4._AVX512BF16 = False
        cpu_q4._w4a16_float_kernel = cpu_q4_float._w4a16_by_row  # the row tables, chosen at import as well
    if args.lowering == "avx2":
        for module in (cpu_target, cpu_integer_dots, cpu_q4_w4a8, cpu_q4, cpu_gemm):
            for name in ("_AVX512F", "_AVX512BW", "_AVX512VNNI", "_AVX512BF16"):
                if hasattr(module, name):
                    setattr(module, name, False)
        cpu_q4_float._LANES = 8  # the float kernels' width, set at import from the host
        cpu_q4._w4a16_kernel = cpu_q4_w4a8._w4a16_q16  # W4A16 on Q16 codes, chosen at import as well

    rng = np.random.default_rng()
    evict = np.ones(64 << 20, np.uint8)
    for kind in args.kind:
        for rows, cols in args.shape:
            planes = random_planes(rng, kind, rows, cols)
            nbytes = sum(p.nbytes for p in planes if p is not None)
            x = rng.standard_normal(cols).astype(np.float32)
            xq, xd, xs = np.empty(cols, np.int8), np.empty(cols // 32, np.float32), np.empty(cols // 32, np.int32)
            cpu.quantize_act_q8(x, xq, xd, xs)
            out = np.empty(rows, np.float32)
            for precision in args.precision:
                call, name = kernel(cpu, kind, precision, planes, x, xq, xd, xs, out)
                for threads in args.threads:
                    cpu.set_threads(threads)
                    call()  # compiles, or loads the compiled code
                    times = []
                    for _ in range(args.repeat or max(10, min(2000, (50 << 20) // nbytes))):
                        if args.dram:
                            evict[::64] += 1
                        t0 = time.perf_counter()
                        call()
                        times.append(time.perf_counter() - t0)
                    seconds = float(np.median(times))
                    print(json.dumps({"kernel": name, "rows": rows, "cols": cols, "threads": threads,
                                      "from": "dram" if args.dram else "cache", "lowering": args.lowering,
                                      "bytes": nbytes, "us": round(seconds * 1e6, 2),
                                      "gb_s": round(nbytes / seconds / 1e9, 2)}), flush=True)


def random_planes(rng, kind: str, rows: int, cols: int):
    scales = (rng.uniform(0.001, 0.01, (rows, cols // 32))).astype(np.float16)
    if kind == "q8_0":
        return rng.integers(-128, 128, (rows, cols), dtype=np.int8), scales, None
    codes = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    return codes, scales, (scales.copy() if kind == "q4_1" else None)


def kernel(cpu, kind, precision, planes, x, xq, xd, xs, out):
    codes, d, m = planes
    if kind == "q8_0":
        if precision == "w4a8":
            return (lambda: cpu.matvec_q8_w8a8(codes, d, xq, xd, out)), "matvec_q8_w8a8"
        xq16, xd16 = np.empty(x.shape[0], np.int16), np.empty(x.shape[0] // 32, np.float32)
        cpu.quantize_act_q16(x, xq16, xd16)  # once, outside the timing, as W4A8's activation
        return (lambda: cpu.matvec_q8_w8a16(codes, d, xq16, xd16, out)), "matvec_q8_w8a16"
    name = f"matvec_{kind}_{precision}"
    if precision == "w4a8":
        return (lambda: cpu.matvec_q4_w4a8(codes, d, m, xq, xd, xs, out)), name
    return (lambda: cpu.matvec_q4_w4a16(codes, d, m, x, out)), name


if __name__ == "__main__":
    main()
