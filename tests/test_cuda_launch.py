"""The cuda backend's programmatic dependent launches (nerva_cli/planes/cuda/dependent_launch.py) without
a GPU: the ctypes structures against cuda.h's layout, the kernel parameters as bytes, what the
launcher hands cuLaunchKernelEx (through a stand-in for the driver library), and when it is
used. On a GPU, the GPU tests run every launch through it (sm_90 and later)."""

from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest

from nerva_cli.planes.cuda import dependent_launch as cuda_launch
from nerva_cli.planes.cuda.dependent_launch import (PROGRAMMATIC_STREAM_SERIALIZATION, DependentLauncher, LaunchAttribute,
                                            LaunchConfig, dependent_launcher, kernel_params)


class DeviceArray:
    """What the launcher reads of a CuPy array: .data.ptr."""

    def __init__(self, ptr: int):
        self.data = types.SimpleNamespace(ptr=ptr)


def test_structures_have_cuda_h_layout():
    # offsetof/sizeof in cuda.h (CUDA 12.9's nvidia-cuda-runtime-cu12 wheel and 13.0.96's
    # nvidia-cuda-runtime, the leases' CUDA, compiled with gcc on x86-64; the attribute id 6 in
    # both): CUlaunchAttribute 72 bytes, its value at 8; CUlaunchConfig 56 bytes, hStream at 32,
    # attrs at 40, numAttrs at 48, sharedMemBytes at 24
    assert ctypes.sizeof(LaunchAttribute) == 72 and LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(LaunchConfig) == 56
    assert [getattr(LaunchConfig, f).offset for f in ("shared_mem", "stream", "attrs", "num_attrs")] == [24, 32, 40, 48]


def test_kernel_params_point_at_each_argument_as_the_kernel_declares_it():
    rng = np.random.default_rng()
    ptr = int(rng.integers(1 << 40, 1 << 47))
    i32, f32 = np.int32(rng.integers(-2**31, 2**31)), np.float32(rng.standard_normal())
    i64, u32 = np.int64(rng.integers(-2**62, 2**62)), np.uint32(rng.integers(0, 2**32))
    params, values = kernel_params((DeviceArray(ptr), i32, f32, i64, u32))
    assert len(params) == 5
    read = [ctypes.c_uint64, ctypes.c_int32, ctypes.c_float, ctypes.c_int64, ctypes.c_uint32]
    got = [t.from_address(params[i]).value for i, t in enumerate(read)]
    assert got[0] == ptr and got[1] == i32 and np.float32(got[2]) == f32 and got[3] == i64 and got[4] == u32
    for bad in (3, 1.5, np.zeros(2, np.float32), np.complex64(1)):  # CuPy would pass 64-bit ints and doubles
        with pytest.raises(TypeError, match="kernel argument 1: a device array or a numpy scalar"):
            kernel_params((DeviceArray(ptr), bad))


class FakeDriver:
    """libcuda's two functions the launcher calls, recording what cuLaunchKernelEx was given."""

    def __init__(self, rc: int = 0):
        self.calls, self.rc = [], rc
        # plain functions, as a CDLL's are: the launcher sets their argtypes
        self.cuLaunchKernelEx = lambda *a: self._launch(*a)
        self.cuGetErrorName = lambda *a: self._name(*a)

    def _launch(self, config, function, params, extra):
        c = config._obj  # ctypes.byref's object
        attr = c.attrs[0]
        self.calls.append({"grid": tuple(c.grid), "block": tuple(c.block), "shared": c.shared_mem,
                           "stream": c.stream, "attrs": c.num_attrs, "attr_id": attr.id,
                           "allowed": int.from_bytes(bytes(attr.value[:4]), "little"), "function": function,
                           "first_param": ctypes.c_uint64.from_address(params[0]).value, "extra": extra})
        return self.rc

    def _name(self, rc, out):
        out._obj.value = b"CUDA_ERROR_NOT_SUPPORTED"
        return 0


def test_the_launcher_asks_for_programmatic_stream_serialisation():
    driver = FakeDriver()
    launch = DependentLauncher(driver)
    launch(0xF00, (7, 2), (128,), (DeviceArray(0xBEEF), np.int32(3)), 0x5EA)
    assert driver.calls == [{"grid": (7, 2, 1), "block": (128, 1, 1), "shared": 0, "stream": 0x5EA, "attrs": 1,
                             "attr_id": PROGRAMMATIC_STREAM_SERIALIZATION, "allowed": 1, "function": 0xF00,
                             "first_param": 0xBEEF, "extra": None}]
    with pytest.raises(RuntimeError, match=r"cuLaunchKernelEx failed: CUDA_ERROR_NOT_SUPPORTED \(801\)"):
        DependentLauncher(FakeDriver(rc=801))(0xF00, 1, 32, (np.int32(1),), 0)


def test_dependent_launch_is_used_only_where_it_can_be(monkeypatch):
    probed = []
    monkeypatch.setattr(cuda_launch.ctypes, "CDLL", lambda name: FakeDriver())
    launcher, state = dependent_launcher("90", probed.append)
    assert isinstance(launcher, DependentLauncher) and state == "on" and probed == [launcher]
    assert dependent_launcher("100", probed.append)[1] == "on"  # Blackwell's sm_100 too
    assert dependent_launcher("89", probed.append) == (None, "off (sm_89: it needs sm_90 or later)")

    def refused(launcher):
        raise RuntimeError("cuLaunchKernelEx failed: CUDA_ERROR_NOT_SUPPORTED (801)")

    assert dependent_launcher("90", refused) == (None, "off (a probe launch failed: cuLaunchKernelEx failed: "
                                                       "CUDA_ERROR_NOT_SUPPORTED (801))")
    monkeypatch.setenv("NERVA_CUDA_PDL", "0")
    assert dependent_launcher("90", probed.append) == (None, "off (NERVA_CUDA_PDL=0)")
    monkeypatch.delenv("NERVA_CUDA_PDL")

    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(cuda_launch.ctypes, "CDLL", no_library)
    launcher, state = dependent_launcher("90", probed.append)
    assert launcher is None and state.startswith("off (no CUDA driver library with cuLaunchKernelEx: libcuda.so.1")
