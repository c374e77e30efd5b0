"""Programmatic dependent launch: on a GPU of compute capability 9.0 or later, kernels go through
the driver's cuLaunchKernelEx with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, so a
kernel may start while the one before it in the stream (or in a graph captured from the stream)
still runs: its blocks are placed and issue their first weight loads meanwhile, and
kernels/common.cuh's wait_prior_kernels holds back the rest until the kernel before has finished.
A decode step is many short launches, and the GPU sat idle between them (docs/perf/gpu_h100.md,
docs/perf/code_figures.md). CuPy's RawKernel launches through cuLaunchKernel,
which takes no attributes, hence ctypes here.

NERVA_CUDA_PDL=0 launches every kernel CuPy's way instead (the A/B of scripts/gpu_bench.py)."""

from __future__ import annotations

import ctypes
import os

import numpy as np

PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID in cuda.h


class LaunchAttribute(ctypes.Structure):
    """cuda.h's CUlaunchAttribute (72 bytes): an id, then a 64-byte union at offset 8."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_ubyte * 64)]


class LaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig (56 bytes)."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


def dims(v) -> tuple[int, int, int]:
    v = (v,) if isinstance(v, (int, np.integer)) else tuple(v)
    if not 1 <= len(v) <= 3:
        raise ValueError(f"grid and block take 1 to 3 dimensions, got {v!r}")
    return tuple(int(d) for d in v) + (1,) * (3 - len(v))


# numpy scalar types -> the ctypes type of the same width a kernel parameter is read as
_SCALARS = {np.dtype(t): c for t, c in ((np.int8, ctypes.c_int8), (np.uint8, ctypes.c_uint8), (np.int16, ctypes.c_int16),
                                         (np.uint16, ctypes.c_uint16), (np.int32, ctypes.c_int32),
                                         (np.uint32, ctypes.c_uint32), (np.int64, ctypes.c_int64),
                                         (np.uint64, ctypes.c_uint64), (np.float32, ctypes.c_float),
                                         (np.float64, ctypes.c_double), (np.bool_, ctypes.c_bool))}


def kernel_params(args) -> tuple[ctypes.Array, list]:
    """cuLaunchKernelEx's kernelParams for args (device arrays, passed as their pointers; numpy
    scalars, as their bytes): (the void* array, the values it points at, which must stay alive
    until the launch returns). A Python int or float is refused, as the kernels' declared widths
    (int, float) would misread what CuPy would pass (64 bits, a double)."""
    values = []
    for i, a in enumerate(args):
        if isinstance(a, np.generic) and a.dtype in _SCALARS:
            values.append(_SCALARS[a.dtype](a.item()))
        elif hasattr(getattr(a, "data", None), "ptr"):
            values.append(ctypes.c_void_p(a.data.ptr))
        else:
            raise TypeError(f"kernel argument {i}: a device array or a numpy scalar, got {type(a).__name__}")
    return (ctypes.c_void_p * len(values))(*map(ctypes.addressof, values)), values


class DependentLauncher:
    """Launches a CUfunction as a programmatic dependent of the stream's previous kernel."""

    def __init__(self, libcuda: ctypes.CDLL):
        self._launch = libcuda.cuLaunchKernelEx
        self._launch.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._launch.restype = ctypes.c_int
        self._error_name = libcuda.cuGetErrorName
        self._error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self._attr = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
        self._attr.value[0] = 1  # programmaticStreamSerializationAllowed, an int at the union's start
        # one config, refilled each launch (the engine launches from one thread)
        self._config = LaunchConfig(attrs=ctypes.pointer(self._attr), num_attrs=1)

    def __call__(self, function: int, grid, block, args, stream: int) -> None:
        config = self._config
        config.grid[:], config.block[:], config.stream = dims(grid), dims(block), stream
        params, values = kernel_params(args)
        rc = self._launch(ctypes.byref(config), function, params, None)
        del values  # cuLaunchKernelEx copied the parameters
        if rc:
            name = ctypes.c_char_p()
            self._error_name(rc, ctypes.byref(name))
            raise RuntimeError(f"cuLaunchKernelEx failed: {(name.value or b'?').decode()} ({rc})")


def dependent_launcher(compute_capability: str, probe) -> tuple[DependentLauncher | None, str]:
    """(a launcher, "on") where the GPU and driver take programmatic dependent launch, else
    (None, why not). probe(launcher) launches a kernel with it, eagerly and in a captured graph
    replayed, and raises if that fails."""
    if os.environ.get("NERVA_CUDA_PDL", "1") == "0":
        return None, "off (NERVA_CUDA_PDL=0)"
    if int(compute_capability) < 90:
        return None, f"off (sm_{compute_capability}: it needs sm_90 or later)"
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        launcher = DependentLauncher(libcuda)
    except (OSError, AttributeError) as e:  # no driver library here, or one before CUDA 12
        return None, f"off (no CUDA driver library with cuLaunchKernelEx: {e})"
    try:
        probe(launcher)
    except Exception as e:  # noqa: BLE001 (whatever the driver says, launch CuPy's way)
        return None, f"off (a probe launch failed: {e})"
    return launcher, "on"
