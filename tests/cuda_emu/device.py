"""A stand-in for planes.cuda.launch.CupyDevice that runs kernels/*.cu on the CPU (EmuModule), so
CudaEngine's host code (plans, slots, graphs, the token ring) runs in CI without a GPU.

Arrays are NumPy arrays. Streams and events do nothing: every copy and launch completes when
it is issued, in issue order, which is one of the orders CUDA allows (streams.py runs the
orders a careless host program would not expect). A capture records the
launches without running them and a replay runs the recording with the arguments captured, as
a CUDA graph does: a step that depended on a host value changing between replays would
decode wrong tokens here too.
"""

from __future__ import annotations

import mmap
from contextlib import contextmanager, nullcontext

import numpy as np

from cuda_emu import EmuModule
from nerva_cli.planes.cuda import nvrtc as kernels
from nerva_cli.planes.cuda.launch import kernel_names


class EmuStream:
    def synchronize(self) -> None:
        pass

    def wait_event(self, event) -> None:
        pass


class EmuEvent:
    done = True

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class EmuDevice:
    name = "CPU emulation of kernels/*.cu"
    sms = 4
    dependent_launch = "checked (the emulation runs every launch as a programmatic dependent)"

    def __init__(self, cache_dir=None):
        self.module = EmuModule(list(kernels.sources().values()), kernels.KERNEL_DIR, cache_dir,
                                dependent_launches=True)
        self.compute, self.copy = EmuStream(), EmuStream()
        self.total_bytes = 1 << 34
        self.allocated = 0
        self.allocations = 0
        self._recording: list | None = None

    def functions(self) -> dict:
        return {name: self.module.get_function(name) for name in kernel_names()}

    def launch(self, fn, grid, block, args) -> None:
        if self._recording is not None:
            self._recording.append(fn.prepare(grid, block, args))
            return
        fn(grid, block, args)

    def capture(self, stream, record):
        self._recording = []
        try:
            record()
        finally:
            graph, self._recording = self._recording, None
        return graph

    def replay(self, graph, stream) -> None:
        for launch in graph:
            launch()

    def _count(self, a: np.ndarray) -> np.ndarray:
        self.allocated += a.nbytes
        self.allocations += 1
        return a

    @contextmanager
    def count_allocations(self):
        start, count = self.allocations, [0]
        try:
            yield count
        finally:
            count[0] = self.allocations - start

    def empty(self, shape, dtype):
        return self._count(np.empty(shape, dtype=dtype))

    def zeros(self, shape, dtype):
        return self._count(np.zeros(shape, dtype=dtype))

    def upload(self, host):
        return self._count(np.array(host, copy=True))

    def download(self, dev, out=None):
        if out is None:
            return np.array(dev, copy=True)
        out[...] = dev
        return out

    def pinned(self, nbytes: int) -> np.ndarray:
        return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8, count=nbytes)  # page-aligned

    def mapped(self, nbytes: int):
        host = np.empty(nbytes, np.uint8)  # host memory: not counted as VRAM
        return host, host

    def pin(self, host) -> None:
        pass

    def unpin(self, host) -> None:
        pass

    def settle(self) -> None:
        pass

    def copy_async(self, dst, src, stream) -> None:
        dst[...] = src.view(dst.dtype).reshape(dst.shape)

    def copy_to_host_async(self, dst, src, stream) -> None:
        dst[...] = src.view(dst.dtype).reshape(dst.shape)

    def gemm_t(self, a, b, out, accumulate: bool = False) -> None:
        """As cuBLAS on f16 operands with f32 sums: each product of two f16 values is exact in f32."""
        prod = np.matmul(a.astype(np.float32), b.astype(np.float32).T)
        out[...] = out + prod if accumulate else prod

    def stream(self):
        return EmuStream()

    def event(self):
        return EmuEvent()

    def timing_event(self):
        return EmuEvent()

    def elapsed_ms(self, start, end) -> float:
        return 0.0  # copies complete when issued: compute never waits for one

    def times_ms(self, work, rounds: int = 5) -> list[float]:
        for _ in range(rounds):
            work()
        return [0.0] * rounds  # as elapsed_ms: no GPU clock to read

    def on(self, stream):
        return nullcontext()

    def synchronize(self) -> None:
        pass

    def used_bytes(self) -> int:
        return self.allocated

    def free_bytes(self) -> int:
        return self.total_bytes - self.allocated

    def is_out_of_memory(self, e: BaseException) -> bool:
        return isinstance(e, MemoryError)
