"""A first run's kernels compiled on two cores: numba compiles one function at a time in a
process (a global lock), so a forked child compiles the attention halves of a decode step's
kernels while the parent prefills and compiles the MLP halves (Engine.warm_up). Both save into
numba's disk cache, from which the parent then loads the child's half.

The child only compiles: the kernels it reaches are not run (compile_only). That is what makes
the fork safe here: GNU OpenMP, numba's threading layer on Linux, is not fork-safe once its
threads exist (numba terminates a child that enters a parallel region), and the child never
enters one. Nor does it print: its output goes to /dev/null, so a warning numba gives is given
once, by the parent.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import warnings
from contextlib import contextmanager
from typing import Callable, Optional

# A child that has finished no kernel for this long is taken as stuck and stopped: one kernel
# takes at most about 3 s on the 2-core Zen 4 EPYC; the parent then compiles what is left itself.
PATIENCE_S = 60.0


@contextmanager
def compile_only(compiled: Callable[[], None] = lambda: None):
    """In this block a call from Python to a numba kernel compiles it for its arguments' types
    (into the disk cache, as a first call does), calls `compiled()`, and returns None without
    running it. Kernels called from compiled code compile with their callers. The patch is the
    process's: no other thread may call a kernel meanwhile (the pager's reader calls none)."""
    from numba.core.registry import CPUDispatcher

    def compile_without_running(dispatcher, *args, **kws):
        dispatcher._compile_for_args(*args, **kws)
        compiled()

    CPUDispatcher.__call__ = compile_without_running
    try:
        yield
    finally:
        del CPUDispatcher.__call__  # back to numba's own call, which compiles and runs


class CompileAside:
    """A forked child running `work` under compile_only, then exiting. `wait` returns when it
    is done; `close` stops it if it is not, and reaps it."""

    def __init__(self, work: Callable[[], None]):
        read_end, write_end = os.pipe()
        with warnings.catch_warnings():
            # Python 3.12 warns of fork() in a process with other threads: here those are GNU
            # OpenMP's idle workers, which the child never enters, the tokenizer's pool, and a
            # paged engine's reader, whose locks the child never takes (compile_aside's `threads`).
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            os.close(read_end)
            _child(work, write_end)
        os.close(write_end)
        self.pid: Optional[int] = pid
        self._progress: Optional[int] = read_end
        self.exit_code: Optional[int] = None  # once reaped: 0 done, 1 failed, -9 stopped

    def wait(self, patience: float = PATIENCE_S, progress: Callable[[], None] = lambda: None) -> None:
        """Until the child exits, or has compiled nothing for `patience` seconds (then stopped);
        progress() each time it says it compiled a kernel."""
        while self.pid is not None:
            ready, _, _ = select.select([self._progress], [], [], patience)
            if not ready:  # stuck
                break
            told = os.read(self._progress, 4096)
            progress()
            if not told:  # the pipe's end: the child is exiting
                self.exit_code = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
                self.pid = None
        self.close()

    def close(self) -> None:
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                self.exit_code = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
            except (ProcessLookupError, ChildProcessError):
                pass
            self.pid = None
        if self._progress is not None:
            os.close(self._progress)
            self._progress = None


def _child(work: Callable[[], None], progress: int) -> None:
    """The forked child: never returns into the parent's code."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends it at once, as it ends the parent
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
        # new objects, not the parent's: what those hold is the parent's to write, and a lock in
        # them may be held by a thread the fork did not copy (a CompileAside made directly)
        sys.stdout = sys.stderr = open(os.devnull, "w")
        os.set_blocking(progress, False)  # a full pipe (a parent not reading yet) must not stop it
        with compile_only(lambda: _tell(progress)):
            work()
        code = 0
    finally:
        os._exit(code)


def _tell(progress: int) -> None:
    try:
        os.write(progress, b".")
    except BlockingIOError:  # the parent has bytes enough to see progress
        pass


def compile_aside(work: Callable[[], None], threads=()) -> Optional[CompileAside]:
    """A CompileAside running `work`, or None where a second process cannot help or a fork is
    not safe: no fork (Windows), a single CPU to run on, numba's JIT off (NUMBA_DISABLE_JIT: the
    kernels are Python functions, which the child would run), or a Python thread other than
    this one and `threads` (those whose locks `work` never takes: a lock another held at the
    fork would stay held in the child)."""
    import numba

    others = [t for t in threading.enumerate() if t is not threading.current_thread() and t not in threads]
    if not hasattr(os, "fork") or others or numba.config.DISABLE_JIT:
        return None
    from nerva_cli.hardware.machine import allowed_cpus

    if len(allowed_cpus()) < 2:
        return None
    return CompileAside(work)
