#!/usr/bin/env python3
"""Tunes the decode matvecs (kernels/matvec.cu) on a CUDA device: rows a block (MV_ROWS) by most
threads a block (MV_THREADS in planes/cuda/launch.py; both compiled in, as MV_ROWS and
MV_MAX_THREADS), over the matrix shapes of a Llama-3-8B and a SmolLM2-135M decode step, in GB/s of weights read. Each shape runs over enough
copies of random weights (at least 512 MB) that no launch finds its matrix in L2, as in a real
step, and the launches are replayed from a graph, as in a real step.

    python3 scripts/gpu_matvec_sweep.py [--rows 4,8,16] [--threads 64,128,256] [--precision w4a16|w4a8]
                                        [--kind q4_0|q4_1|q8_0] [-D MACRO=VALUE]

-D adds a macro to every compile: `--rows 8 --threads 128` with and without `-D MV_MIN_BLOCKS=4`
is the A/B of W4A16 at 121 registers and 4 blocks an SM against 96 and 5; `--precision w4a8`
with `-D MV_W4A8_MIN_BLOCKS=5` times the plain W4A8 matvec as it was before 2026-11-27 (96
registers, 14 spill reloads a round; scripts/sass_mix.py shows both). `--kind q4_1`
times the Q4_1 kernels (an offset plane more, spilling more at the same bound: matvec.cu says how
much); `--kind q8_0` the token table's (the Q4 variants' lm_head: W8A16, or W8A8 with `--precision
w4a8`), whose shapes that matter are the lm_heads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"8b qo": (4096, 4096), "8b kv": (1024, 4096), "8b gate/up": (14336, 4096), "8b down": (4096, 14336),
          "8b lm_head": (128256, 4096), "135m q": (576, 576), "135m gate": (1536, 576), "135m down": (576, 1536),
          "135m lm_head": (49152, 576)}


def kernel_name(precision: str, kind: str) -> str:
    if kind == "q8_0":
        return f"matvec_q8_0_{'w8a8' if precision == 'w4a8' else 'w8a16'}"
    return f"matvec_{'q4_1' if kind == 'q4_1' else 'q4'}_{'w4a8' if precision == 'w4a8' else 'w4a16'}"


def sweep(dev, fns: dict, shapes: dict, precision: str, kind: str = "q4_0") -> dict:
    """{(shape label, rows a block, most threads): (ms a launch, GB/s)}. fns: (rows a block, most
    threads) -> the matvec kernel compiled with that MV_ROWS and MV_MAX_THREADS (its launch
    bounds depend on it). Launches go through Kernels.matvec, the engine's own launch code, with
    planes/cuda/launch.py's MV_ROWS and MV_THREADS set to each pair."""
    from nerva_cli.planes.cuda import launch as cuda

    k, rng, results = cuda.Kernels(dev), np.random.default_rng(), {}
    name = kernel_name(precision, kind)
    saved = cuda.MV_ROWS, cuda.MV_THREADS
    try:
        for label, (rows, cols) in shapes.items():
            if kind == "q8_0":
                planes = {"q8": rng.integers(-127, 128, (rows, cols), dtype=np.int8)}
            else:
                planes = {"qs": rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)}
            planes["d"] = rng.standard_normal((rows, cols // 32)).astype(np.float16)
            if kind == "q4_1":
                planes["m"] = rng.standard_normal((rows, cols // 32)).astype(np.float16)
            nbytes = sum(a.nbytes for a in planes.values())
            # copies at other addresses (the values do not matter): no launch finds its matrix in L2
            copies = max(1, min(64, (512 << 20) // nbytes))
            mats = [{key: dev.upload(a) for key, a in planes.items()} for _ in range(copies)]
            x = dev.upload(rng.standard_normal(cols).astype(np.float32))
            out = dev.zeros(rows, np.float32)
            for (rows_per_block, cap), fn in fns.items():
                k.fn = {**k.fn, name: fn}
                cuda.MV_ROWS, cuda.MV_THREADS = rows_per_block, cap
                g = dev.capture(dev.compute, lambda mats=mats, x=x, out=out:
                                [k.matvec(m, x, out, precision) for m in mats])
                dev.replay(g, dev.compute)  # warm
                ms = float(np.median(dev.times_ms(lambda g=g: dev.replay(g, dev.compute)))) / copies
                results[label, rows_per_block, cap] = (ms, nbytes / ms / 1e6 if ms else 0.0)
            del mats
    finally:
        cuda.MV_ROWS, cuda.MV_THREADS = saved
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="4,8,16")
    ap.add_argument("--threads", default="64,128,256")
    ap.add_argument("--precision", default="w4a16", choices=["w4a16", "w4a8"])
    ap.add_argument("--kind", default="q4_0", choices=["q4_0", "q4_1", "q8_0"], help="the weights' format")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="a macro for NVRTC, e.g. MV_MIN_BLOCKS=4")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from nerva_cli.planes.cuda import nvrtc as kernels
    from nerva_cli.planes.cuda import launch as cuda

    dev = cuda.CupyDevice()
    cp = dev.cp
    arch = f"sm_{cp.cuda.Device().compute_capability}"
    major = cp.cuda.runtime.runtimeGetVersion() // 1000
    name = kernel_name(args.precision, args.kind)
    fns = {}
    for rows_per_block in map(int, args.rows.split(",")):
        for cap in map(int, args.threads.split(",")):
            defines = (f"MV_ROWS={rows_per_block}", f"MV_MAX_THREADS={cap}", *args.defines)
            cubin = Path(f"/tmp/matvec-{'-'.join(defines)}.cubin")
            cubin.write_bytes(kernels.compile_cubin(kernels.sources()["matvec"], arch, major, defines))
            fns[rows_per_block, cap] = cp.RawModule(path=str(cubin)).get_function(name)
    results = sweep(dev, fns, SHAPES, args.precision, args.kind)
    print(f"{dev.name}, {name}{''.join(' -D ' + d for d in args.defines)}: GB/s (us a launch) by MV_ROWS x MV_THREADS")
    configs = sorted({(r, t) for _, r, t in results})
    print(f"{'shape':<14}" + "".join(f"{f'{r}x{t}':>16}" for r, t in configs))
    for label in SHAPES:
        print(f"{label:<14}" + "".join(f"{results[label, r, t][1]:>8.0f}{f'({results[label, r, t][0] * 1e3:.1f})':>8}"
                                       for r, t in configs))
    step = {c: sum(results[(lbl, *c)][0] * n for lbl, n in (("8b qo", 64), ("8b kv", 64), ("8b gate/up", 64),
                                                             ("8b down", 32), ("8b lm_head", 1))) for c in configs}
    print("8b step's matvecs, ms: " + ", ".join(f"{r}x{t} {ms:.2f}" for (r, t), ms in step.items()))


if __name__ == "__main__":
    main()
