"""A stand-in for the part of CuPy that planes/cuda/launch.CupyDevice uses, with the signatures CuPy
14.2's source has (memcpyAsync(dst, src, size, kind, stream), Event.done a property, RawModule
loading at get_function, ...). Arrays are NumPy arrays, kernels run on the CPU emulation of
kernels/*.cu, copies complete when issued, a capture records launches. It lets CI run the real
CupyDevice code, so a misspelt CuPy call or a wrong argument order fails here and not in the
first minutes of a GPU lease. It cannot show that CuPy behaves as described: the GPU tests do."""

from __future__ import annotations

import ctypes
import time
import types

import numpy as np


class _Pointer:
    def __init__(self, ptr: int):
        self.ptr = ptr


class ndarray(np.ndarray):  # noqa: N801 (CuPy's name)
    def __new__(cls, shape, dtype=float, memptr=None, strides=None, order="C"):
        """CuPy's constructor over memory someone else allocated (UnownedMemory): here the bytes
        of the fake PinnedMemory that owns them, which the array's base keeps alive."""
        assert memptr is not None and strides is None and order == "C", "nerva builds arrays only over memptr"
        owner = memptr.mem.owner
        assert ctypes.addressof(owner.buf) == memptr.mem.ptr, "UnownedMemory's ptr is its owner's"
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        raw = np.frombuffer(owner.buf, np.uint8)[memptr.offset:memptr.offset + n]
        return raw.view(dtype).reshape(shape).view(cls)

    @property
    def data(self):
        return _Pointer(self.ctypes.data)

    def get(self, stream=None, order="C", out=None, blocking=True):
        if out is None:
            return np.array(self)
        if out.shape != self.shape or out.dtype != self.dtype:
            raise ValueError("out must have the array's shape and dtype")
        out[...] = self
        return out


class _Pool:
    def __init__(self):
        self.total = 0

    def malloc(self, size: int):
        self.total += size
        return size

    def total_bytes(self) -> int:
        return self.total

    def free_all_blocks(self) -> None:
        pass


_pool, _pinned_pool = _Pool(), _Pool()
_state = {"allocator": _pool.malloc, "capturing": None, "stream": None}


def _new(shape, dtype, fill=None) -> ndarray:
    a = np.empty(shape, dtype=dtype).view(ndarray)
    _state["allocator"](a.nbytes)
    if fill is not None:
        a.fill(fill)
    return a


def empty(shape, dtype=np.float32):
    return _new(shape, dtype)


def zeros(shape, dtype=np.float32):
    return _new(shape, dtype, 0)


def asarray(a):
    host = np.ascontiguousarray(a)
    out = _new(host.shape, host.dtype)
    out[...] = host
    return out


def asnumpy(a, stream=None):
    return np.array(a)


def get_default_memory_pool():
    return _pool


def get_default_pinned_memory_pool():
    return _pinned_pool


class CUDARuntimeError(RuntimeError):
    pass


def _memcpy_async(dst: int, src: int, size: int, kind: int, stream: int) -> None:
    assert kind in (1, 2, 3) and all(isinstance(v, int) for v in (dst, src, size, stream))
    ctypes.memmove(dst, src, size)


runtime = types.SimpleNamespace(
    getDeviceCount=lambda: 1, deviceSynchronize=lambda: None, runtimeGetVersion=lambda: 13000,
    memGetInfo=lambda: (1 << 34, 1 << 35),
    getDeviceProperties=lambda i: {"name": b"Fake GPU (tests/fake_cupy.py)", "multiProcessorCount": 4,
                                   "totalGlobalMem": 1 << 35, "major": 9, "minor": 0},
    deviceGetPCIBusId=lambda i: "0000:00:00.0", hostRegister=lambda ptr, size, flags: None,
    hostUnregister=lambda ptr: None, memcpyAsync=_memcpy_async, memcpyHostToDevice=1, memcpyDeviceToHost=2,
    memcpyDeviceToDevice=3, CUDARuntimeError=CUDARuntimeError, CUDA_R_32F=0, CUDA_R_16F=2)


# cuBLAS's GEMM as its documentation defines cublasGemmEx, on the addresses CuPy passes (device
# pointers here are host ones): C = alpha op(A) op(B) + beta C, every matrix column-major with its
# leading dimension, op(A) m x k, op(B) k x n, C m x n; C is not read when beta is 0. Only what
# nerva asks for: f16 or f32 operands, f32 C, CUBLAS_COMPUTE_32F. Constants as CuPy 14.2's
# cupy_backends.cuda.libs.cublas and runtime have them.
_CUDA_R = {0: np.float32, 2: np.float16}  # runtime.CUDA_R_32F, CUDA_R_16F
_CUBLAS_HANDLE = 0x5EED


def _column_major(ptr: int, dtype, rows: int, cols: int, ld: int) -> np.ndarray:
    assert ld >= max(1, rows), f"leading dimension {ld} < {rows} rows"
    item = np.dtype(dtype).itemsize
    base = np.frombuffer((ctypes.c_char * (((cols - 1) * ld + rows) * item)).from_address(ptr), dtype=dtype)
    return np.lib.stride_tricks.as_strided(base, shape=(rows, cols), strides=(item, ld * item))


def _gemm_ex(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
             computeType, algo):  # noqa: N803 (cuBLAS's names)
    args = (handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
            computeType, algo)
    assert all(isinstance(v, int) for v in args), "CuPy's gemmEx takes ints and addresses"
    assert handle == _CUBLAS_HANDLE and transa in (0, 1) and transb in (0, 1) and min(m, n, k) > 0
    assert computeType == cublas.CUBLAS_COMPUTE_32F and Ctype == 0 and algo in (-1, 99)
    a = _column_major(A, _CUDA_R[Atype], *((k, m) if transa else (m, k)), lda)
    b = _column_major(B, _CUDA_R[Btype], *((n, k) if transb else (k, n)), ldb)
    c = _column_major(C, np.float32, m, n, ldc)
    al, be = ctypes.c_float.from_address(alpha).value, ctypes.c_float.from_address(beta).value
    prod = (a.T if transa else a).astype(np.float32) @ (b.T if transb else b).astype(np.float32)
    c[...] = al * prod + (be * c if be else 0)


cublas = types.SimpleNamespace(gemmEx=_gemm_ex, CUBLAS_OP_N=0, CUBLAS_OP_T=1, CUBLAS_COMPUTE_32F=68,
                               CUBLAS_GEMM_DEFAULT=-1, CUBLAS_GEMM_DEFAULT_TENSOR_OP=99)


class Stream:
    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        self.ptr = id(self)

    def __enter__(self):
        self._outer, _state["stream"] = _state["stream"], self
        return self

    def __exit__(self, *exc):
        _state["stream"] = self._outer

    def begin_capture(self, mode=None):
        assert _state["stream"] is self, "capture on the current stream"
        _state["capturing"] = []

    def end_capture(self):
        launches, _state["capturing"] = _state["capturing"], None
        return Graph(launches)

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass


class Graph:
    def __init__(self, launches):
        self.launches = launches

    def launch(self, stream=None):
        for run in self.launches:
            run()


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.at = time.perf_counter()

    @property
    def done(self) -> bool:
        return True

    def record(self, stream=None):
        self.at = time.perf_counter()  # work completes when issued: recording is its completion

    def synchronize(self):
        pass


class PinnedMemory:
    def __init__(self, size: int, flags: int = 0):
        self.buf = (ctypes.c_ubyte * size)()
        self.size, self.ptr = size, ctypes.addressof(self.buf)


class UnownedMemory:
    def __init__(self, ptr: int, size: int, owner, device_id: int = -1):
        assert device_id >= 0, "without a device id CuPy asks the runtime which device the pointer is on"
        self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id


class MemoryPointer:
    def __init__(self, mem, offset: int):
        self.mem, self.offset, self.ptr = mem, offset, mem.ptr + offset


def PinnedMemoryPointer(mem: PinnedMemory, offset: int):  # noqa: N802 (CuPy's class name)
    """CuPy's pointer exports the buffer protocol; a ctypes array does too."""
    assert offset == 0
    return mem.buf


class _RawKernel:
    def __init__(self, emu_kernel):
        self.k = emu_kernel

    def __call__(self, grid, block, args, *, shared_mem=0):
        for a in args:
            assert isinstance(a, (np.generic, ndarray)), f"{type(a).__name__}: CuPy would take it differently"
        run = self.k.prepare(grid, block, tuple(np.asarray(a) if isinstance(a, ndarray) else a for a in args))
        if _state["capturing"] is not None:
            _state["capturing"].append(run)
        else:
            run()


class RawModule:
    _module = None

    def __init__(self, *, code=None, path=None, options=(), backend="nvrtc", name_expressions=None):
        assert path is not None and code is None, "nerva loads its own cubins"
        with open(path, "rb") as f:
            assert f.read(4) == b"\x7fELF", f"{path}: not a cubin"
        if RawModule._module is None:
            from cuda_emu import EmuModule
            from nerva_cli.planes.cuda import nvrtc as kernels

            RawModule._module = EmuModule(list(kernels.sources().values()), kernels.KERNEL_DIR,
                                          dependent_launches=True)

    def get_function(self, name: str):
        return _RawKernel(RawModule._module.get_function(name))


def set_allocator(f=None):
    _state["allocator"] = f or _pool.malloc


class Device:
    def __init__(self, device=None):
        self.id = 0
        self.compute_capability = "90"


cuda = types.SimpleNamespace(
    runtime=runtime, cublas=cublas, get_cublas_handle=lambda: _CUBLAS_HANDLE,
    Stream=Stream, Event=Event, Graph=Graph, Device=Device, PinnedMemory=PinnedMemory,
    PinnedMemoryPointer=PinnedMemoryPointer, UnownedMemory=UnownedMemory, MemoryPointer=MemoryPointer,
    set_allocator=set_allocator,
    get_elapsed_time=lambda start, end: (end.at - start.at) * 1000,
    memory=types.SimpleNamespace(OutOfMemoryError=type("OutOfMemoryError", (MemoryError,), {})))
