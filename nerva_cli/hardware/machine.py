"""Facts about this machine that the CLI needs before numpy is imported (no heavy imports)."""

from __future__ import annotations

import ctypes
import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name, with its family and model where /proc/cpuinfo gives them (a VM's
    "AMD EPYC" alone does not say which generation ran a figure) and AMD's core generation."""
    facts: dict[str, str] = {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "cpu family", "model", "vendor_id"):
                facts.setdefault(key.strip(), value.strip())
            if not line.strip():
                break  # the first processor's block is enough
    except OSError:
        pass
    name = facts.get("model name")
    if name is None:
        return platform.processor() or platform.machine()
    if not (facts.get("cpu family", "").isdigit() and facts.get("model", "").isdigit()):
        return name
    family, model = int(facts["cpu family"]), int(facts["model"])
    zen = _amd_generation(family, model) if facts.get("vendor_id") == "AuthenticAMD" else None
    return f"{name} (family {family} model {model}{', ' + zen if zen else ''})"


def _amd_generation(family: int, model: int) -> str | None:
    if family == 0x17:
        return "Zen 2" if model >= 0x30 else "Zen/Zen+"
    if family == 0x19:
        return "Zen 4" if 0x10 <= model <= 0x1F or 0x60 <= model <= 0xAF else "Zen 3"
    if family == 0x1A:
        return "Zen 5"
    return None


def allowed_cpus() -> list[int]:
    """The logical CPUs this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def most_threads() -> int:
    """The threads numba's pool holds, fixed when numba starts: NUMBA_NUM_THREADS where set, else
    the logical CPUs this process may run on (the cpu backend's set_threads takes at most these)."""
    try:
        return max(1, int(os.environ["NUMBA_NUM_THREADS"]))
    except (KeyError, ValueError):  # unset, or a value numba itself would refuse at its start
        return max(1, len(allowed_cpus()))


def physical_cores() -> int:
    """Cores, not hyper-threads, that this process may run on."""
    seen = set()
    for cpu in allowed_cpus():
        try:
            topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
            seen.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            seen.add(cpu)
    return max(1, len(seen))


def proc_kb(path: str, key: str) -> int | None:
    """A 'Key:  123 kB' line of /proc/meminfo or /proc/self/status, in bytes; None if absent."""
    try:
        for line in open(path):
            name, _, value = line.partition(":")
            if name == key:
                return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def limit_blas_threads(threads: int) -> None:
    """A BLAS reads its settings once, when numpy is first imported. With the OpenBLAS NumPy's
    wheels ship, the cpu backend calls its sgemm from numba's threads and sets its own pool to
    one thread; these settings serve another BLAS, whose GEMMs prefill calls through NumPy.

    OpenBLAS's idle workers spin for 2^OPENBLAS_THREAD_TIMEOUT cycles after each GEMM, 2^28 by
    default: on 2 cores they took the decode threads' core after every prefill. 2^22 still covers
    the gaps between one prefill's GEMMs (docs/perf/code_figures.md)."""
    os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "22")


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def reuse_freed_memory() -> None:
    """Keeps prefill's temporaries in the heap between chunks.

    By default glibc mmaps each block from 128 KiB up until one is freed, then serves blocks up
    to that size from the heap and gives the heap's free top back to the OS past twice that size.
    Prefill's temporaries together outgrow twice the largest of them, so every chunk faulted all
    of them in again (tests/test_machine.py counts the faults), a share that depended on which
    blocks were freed first. These are the ceilings glibc's own adjustment stops at (blocks over
    32 MiB still mmapped; the free top given back past 64 MiB), so the peak is where it was. Off
    glibc (no mallopt) nothing changes. Since prefill writes into its PrefillWorkspace
    (residency/arena.py) it stays for what still comes and goes between chunks (the logits rows
    prefill returns). Figures: docs/perf/code_figures.md."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(M_MMAP_THRESHOLD, 32 << 20)
    mallopt(M_TRIM_THRESHOLD, 64 << 20)


def configure_threads(threads: int | None) -> int:
    """--threads resolved (default: the physical cores) and checked, applied to BLAS, and freed
    memory kept in the heap for reuse (reuse_freed_memory): what a process that will run an
    engine does before anything imports numpy. -> the threads."""
    from nerva_cli.errors import UsageError

    threads = physical_cores() if threads is None else threads
    if threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    most = most_threads()
    if threads > most:
        raise UsageError(f"--threads must be at most {most} here (the CPUs this process may run on, "
                       f"or NUMBA_NUM_THREADS), got {threads}")
    limit_blas_threads(threads)
    reuse_freed_memory()
    return threads
