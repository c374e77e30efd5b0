#!/usr/bin/env python3
"""Tunes the decode matvecs (kernels/matvec.cu) on a CUDA device: rows a block (MV_ROWS, compiled
in) by most threads a block (MV_THREADS in backends/cuda.py), over the matrix shapes of a
Llama-3-8B and a SmolLM2-135M decode step, in GB/s of weights read. Each shape runs over enough
copies of random weights (at least 512 MB) that no launch finds its matrix in L2, as in a real
step, and the launches are replayed from a graph, as in a real step.

    python3 scripts/gpu_matvec_sweep.py [--rows 4,8,16] [--threads 64,128,256] [--kernel matvec_q4_w4a16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"8b qo": (4096, 4096), "8b kv": (1024, 4096), "8b gate/up": (14336, 4096), "8b down": (4096, 14336),
          "8b lm_head": (128256, 4096), "135m q": (576, 576), "135m gate": (1536, 576), "135m down": (576, 1536)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="4,8,16")
    ap.add_argument("--threads", default="64,128,256")
    ap.add_argument("--kernel", default="matvec_q4_w4a16", choices=["matvec_q4_w4a16", "matvec_q4_w4a8"])
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from nerva_cli import kernels
    from nerva_cli.backends import cuda

    dev = cuda.CupyDevice()
    cp = dev.cp
    arch = f"sm_{cp.cuda.Device().compute_capability}"
    major = cp.cuda.runtime.runtimeGetVersion() // 1000
    rng = np.random.default_rng()
    s = dev.compute
    start, end = dev.timing_event(), dev.timing_event()
    results = {}
    fns = {}
    for rows_per_block in map(int, args.rows.split(",")):
        cubin = Path(f"/tmp/matvec-rows{rows_per_block}.cubin")
        cubin.write_bytes(kernels.compile_cubin(kernels.sources()["matvec"], arch, major, (f"MV_ROWS={rows_per_block}",)))
        fns[rows_per_block] = cp.RawModule(path=str(cubin)).get_function(args.kernel)
    for label, (rows, cols) in SHAPES.items():
        nbytes = rows * cols // 2 + rows * cols // 32 * 2
        copies = max(1, min(64, (512 << 20) // nbytes))
        mats = [((cp.random.random((rows, cols // 2), dtype=np.float32) * 256).astype(np.uint8),
                 cp.random.standard_normal((rows, cols // 32), dtype=np.float32).astype(np.float16))
                for _ in range(copies)]
        x = cp.asarray(rng.standard_normal(cols).astype(np.float32))
        xq = cp.asarray(rng.integers(-127, 128, cols, dtype=np.int8))
        xd = cp.asarray(rng.random(cols // 32).astype(np.float32))
        xs = xq.reshape(-1, 32).sum(axis=1, dtype=np.int32)
        out = cp.empty(rows, np.float32)
        for rows_per_block, fn in fns.items():
            for cap in map(int, args.threads.split(",")):
                threads = min(cap, 32 * -(-cols // 32 // 32))
                grid = (-(-rows // rows_per_block),)
                launches = [((qs, d, x, out) if args.kernel.endswith("w4a16") else (qs, d, xq, xd, xs, out))
                            + (np.int32(rows), np.int32(cols)) for qs, d in mats]
                g = dev.capture(s, lambda fn=fn, launches=launches, grid=grid, threads=threads:
                                [fn(grid, (threads,), a) for a in launches])
                dev.replay(g, s)
                times = []
                for _ in range(5):
                    start.record(s)
                    dev.replay(g, s)
                    end.record(s)
                    end.synchronize()
                    times.append(dev.elapsed_ms(start, end) / copies)
                ms = float(np.median(times))
                results[label, rows_per_block, cap] = (ms, nbytes / ms / 1e6)
        del mats
        cp.get_default_memory_pool().free_all_blocks()
    print(f"{dev.name}, {args.kernel}: GB/s (us a launch) by MV_ROWS x MV_THREADS")
    configs = sorted({(r, t) for _, r, t in results})
    print(f"{'shape':<14}" + "".join(f"{f'{r}x{t}':>16}" for r, t in configs))
    for label in SHAPES:
        print(f"{label:<14}" + "".join(f"{results[label, r, t][1]:>8.0f}{f'({results[label, r, t][0] * 1e3:.1f})':>8}"
                                       for r, t in configs))
    step = {c: sum(results[lbl, *c][0] * n for lbl, n in (("8b qo", 64), ("8b kv", 64), ("8b gate/up", 64),
                                                             ("8b down", 32), ("8b lm_head", 1))) for c in configs}
    print("8b step's matvecs, ms: " + ", ".join(f"{r}x{t} {ms:.2f}" for (r, t), ms in step.items()))


if __name__ == "__main__":
    main()
