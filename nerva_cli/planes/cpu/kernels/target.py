"""The features (LLVM's names) of the CPU numba compiles for, which pick the kernels' lowerings.
Each module imports the flags it reads; tests and scripts set them there to build another
target's lowering on this host."""

from __future__ import annotations

import numba
from llvmlite import binding as llvm


def _host_has(feature: str) -> bool:
    """Whether numba compiles for a target with this LLVM feature (avx2, avx512bw, ...)."""
    if numba.config.CPU_NAME is None:  # numba compiles for this machine
        return bool(llvm.get_host_cpu_features().get(feature))
    return f"+{feature}" in (numba.config.CPU_FEATURES or "")


_AVX2 = _host_has("avx2")
_AVX512F = _host_has("avx512f")
_AVX512BW = _host_has("avx512bw")
_AVX512VNNI = _AVX512BW and _host_has("avx512vnni")
_AVX512BF16 = _AVX512BW and _host_has("avx512bf16")
