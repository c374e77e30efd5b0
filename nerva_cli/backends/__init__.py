"""Kernel backends: one contract (see ref.py, its readable definition), several implementations."""

from __future__ import annotations

import importlib
from types import ModuleType

BACKENDS = ("cpu", "ref")


def get_backend(name: str) -> ModuleType:
    """The kernel module for `name`, imported on first use (cpu pulls in numba)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    return importlib.import_module(f"{__name__}.{name}")
