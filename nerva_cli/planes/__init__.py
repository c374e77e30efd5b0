"""The planes and their kernel backends: one contract (see ref.py, its readable definition), several implementations."""

from __future__ import annotations

import importlib
from types import ModuleType

# kernel modules of the CPU engine; cuda has an engine of its own
BACKENDS = {"cpu": "nerva_cli.planes.cpu.kernels", "ref": "nerva_cli.planes.ref"}
CHOICES = ("auto", "cpu", "cuda", "ref")


def resolve(name: str) -> str:
    """--backend: auto is cuda when CuPy imports and a device answers, else cpu."""
    from nerva_cli.errors import NervaError, UsageError

    if name not in CHOICES:
        raise UsageError(f"--backend {name}: choose one of {', '.join(CHOICES)}")
    if name in ("auto", "cuda"):
        from nerva_cli.planes.cuda import launch as cuda

        if cuda.cupy_or_none() is not None:
            return "cuda"
        if name == "cuda":
            raise NervaError(f"--backend cuda: {cuda.why_no_cuda}")
        return "cpu"
    return name


def get_backend(name: str) -> ModuleType:
    """The kernel module for `name`, imported on first use (cpu pulls in numba)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])
