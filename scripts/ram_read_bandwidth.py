#!/usr/bin/env python3
"""How fast this machine's cores read RAM: the ceiling of a decode step that reads every weight
once a token. numba's threads sum a buffer far larger than the caches (integer adds, which
vectorise and cost less than a load), best of --repeat passes, in GB/s, at each thread count;
one JSON object on stdout with the CPU named.

    python3 scripts/ram_read_bandwidth.py [--gib 2] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="buffer size (default 2 GiB)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    import numba
    from numba import njit, prange

    from nerva_cli.hardware.machine import cpu_name

    @njit(parallel=True, nogil=True)
    def read_all(words, chunks):
        # each chunk read as four streams at once: one stream a thread left the RAM idle between
        # the hardware prefetcher's requests (a third less than a decode step's matvecs read)
        each = words.shape[0] // chunks // 4
        total = np.uint64(0)
        for c in prange(chunks):
            s0 = s1 = s2 = s3 = np.uint64(0)
            base = 4 * c * each
            for i in range(base, base + each):
                s0 += words[i]
                s1 += words[i + each]
                s2 += words[i + 2 * each]
                s3 += words[i + 3 * each]
            total += s0 + s1 + s2 + s3
        return total

    words = np.ones(int(args.gib * (1 << 30)) // 8, np.uint64)  # written: the pages are real
    result = {"cpu": cpu_name(), "gib": args.gib, "gb_s": {}}
    for threads in args.threads:
        numba.set_num_threads(threads)
        read_all(words, 64)
        best = min(_timed(read_all, words) for _ in range(args.repeat))
        result["gb_s"][str(threads)] = round(words.nbytes / best / 1e9, 1)
    print(json.dumps(result))


def _timed(fn, words) -> float:
    t0 = time.perf_counter()
    fn(words, 64)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
