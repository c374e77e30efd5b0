"""What numba's disk cache holds for these sources: whether a run's kernels compiled before."""

from __future__ import annotations

import os

import numba

from nerva_cli.planes.cpu.kernels.prefill_attention import _attention_prefill
from nerva_cli.planes.cpu.kernels.norms import add_rmsnorm
from nerva_cli.planes.cpu.kernels.numba_setup import KERNELS, folder_stamp


def warm_marker(kinds: str):
    """A file in numba's cache directory that stands for "a decode step with kernels of these
    kinds (Engine.kernel_kinds) has run since these sources last changed, so their code is on disk".
    compiled_before looks at one kernel; another variant, precision mix or a paged layer calls
    others, which compiled in the middle of a first answer and slowed it several times over
    (docs/perf/code_figures.md)."""
    import hashlib
    from pathlib import Path

    stamp = f"{kinds}|{folder_stamp(KERNELS)}|{numba.__version__}"  # the stamp of every kernel's cache entry
    root = numba.config.CACHE_DIR or os.path.join(os.path.dirname(__file__), "__pycache__")  # numba's default
    return Path(root) / "nerva-warmed" / hashlib.sha1(stamp.encode()).hexdigest()[:20]


def compiled_before(decodes: bool = True) -> bool:
    """Whether the disk cache holds compiled code for these sources and the kernels a run needs:
    numba's index for `add_rmsnorm`, which only a decode compiles (of any layer: compiled halves
    or kernel by kernel), standing for all of them, or for `_attention_prefill` when the run only
    prefills (`-n 1`). False on a machine's first run, when compiling them takes a while
    (docs/perf/code_figures.md)."""
    kernel = add_rmsnorm if decodes else _attention_prefill
    try:
        return bool(kernel._cache._cache_file._load_index())
    except Exception:  # numba internals: should they change, say nothing rather than fail a run
        return True
