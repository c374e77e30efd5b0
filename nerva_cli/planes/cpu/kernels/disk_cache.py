"""What numba's disk cache holds for these sources: whether a run's kernels compiled before, and
how many a first run has compiled so far."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

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

    stamp = f"{kinds}|{folder_stamp(KERNELS)}|{numba.__version__}"  # the stamp of every kernel's cache entry
    return _cache_root() / "nerva-warmed" / hashlib.sha1(stamp.encode()).hexdigest()[:20]


def _cache_root() -> Path:
    return Path(numba.config.CACHE_DIR or os.path.join(os.path.dirname(__file__), "__pycache__"))  # numba's default


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


@contextmanager
def counting_compiles(tell):
    """Calls tell(n) as this process starts and ends compiling a function, and as `poll()` is
    called (a compile_aside child's progress), n the compiled functions saved to the disk cache
    since the block began, by this process and any other (the child): the progress of a first
    run's compile, in kernels actually compiled (a total is not known before: it depends on the
    model's kinds and this CPU's features). Yields poll."""
    from numba.core import event

    def saved() -> dict:
        try:
            return {str(p): p.stat().st_mtime_ns for p in _cache_root().rglob("*.nbc")}
        except OSError:  # a cache directory nerva cannot read: no count, the compile goes on
            return {}

    before = saved()
    shown = [-1]

    def poll() -> None:
        n = sum(1 for p, t in saved().items() if before.get(p) != t)
        if n != shown[0]:
            shown[0] = n
            tell(n)

    class Listener(event.Listener):
        def on_start(self, ev):
            poll()

        def on_end(self, ev):
            poll()

    with event.install_listener("numba:compile", Listener()):
        yield poll
    poll()
