"""numba's disk cache shared by two nerva processes that compile at the same moment."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("fcntl")

MODULE = """
from numba import njit


@njit(cache=True)
def twice_sum(x):
    s = x[0] * 0
    for i in range(x.shape[0]):
        s += x[i] * 2
    return s
"""

# a slow disk: each process writes the index 0.5 s after reading it, so two saves overlap
COMPILE = """
import sys, time
import numpy as np
import nerva_cli.planes.cpu.kernels  # noqa: F401  (what nerva does to numba's cache, at import)
import numba.core.caching as caching
write = caching.IndexDataCacheFile._save_index
def slow(self, overloads):
    time.sleep(0.5)
    return write(self, overloads)
caching.IndexDataCacheFile._save_index = slow
import mod
while time.time() < float(sys.argv[2]):
    pass
mod.twice_sum(np.arange(5, dtype=sys.argv[1]))
"""

CHECK = """
import numpy as np
import mod
assert mod.twice_sum(np.arange(5, dtype="float32")) == 20.0
assert mod.twice_sum(np.arange(5, dtype="int64")) == 20
print(sorted(str(sig[0].dtype) for sig in mod.twice_sum.stats.cache_hits), dict(mod.twice_sum.stats.cache_misses))
"""


def test_two_processes_compiling_one_function_keep_both_entries(tmp_path):
    (tmp_path / "mod.py").write_text(MODULE)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    start = str(time.time() + 4)  # both past their imports, then compiling together
    run = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(COMPILE), dtype, start], env=env)
           for dtype in ("float32", "int64")]
    assert [p.wait(timeout=120) for p in run] == [0, 0]
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['float32', 'int64'] {}", out.stdout  # both loaded from the cache
