"""EmuDevice with streams that really are asynchronous: work queues per stream and runs only when
the host waits for it, in an order CUDA allows but a careless host program would not expect.

Ops on a stream run in issue order; `wait_event` holds a stream until the work recorded before
the event on its stream has run; a host wait (stream or event synchronize, `event.done` is a
query and forces nothing) runs what it needs and nothing more. Copies read their source when
they run, not when they are queued, as a DMA from pinned memory does. Two schedules:

- lazy: every stream runs only when a host wait needs it. A compute step that forgot to wait for
  a slot's copy reads what the slot held before;
- eager copies: the copy stream runs as far ahead as its waits allow the moment work is queued
  on it. A copy that forgot to wait for compute to release a slot overwrites a layer still to
  be used, and a host that refills a pinned buffer under a queued copy sends the new bytes.

Either way such a bug decodes other tokens than the synchronous EmuDevice does. Inside
`with dev.on(stream)` (prefill, which mixes kernels with NumPy-side array operations) the
stream runs synchronously, as CuPy's array operations on a current stream are ordered.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager

from cuda_emu.device import EmuDevice


class AsyncEvent:
    def __init__(self):
        self.stream, self.position = None, 0

    def record(self, stream) -> None:
        self.stream, self.position = stream, stream.issued

    @property
    def done(self) -> bool:
        return self.stream is None or self.stream.ran >= self.position

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.position)


class AsyncStream:
    def __init__(self, dev, eager: bool = False):
        self.dev, self.eager = dev, eager
        self.ops: deque = deque()
        self.issued = self.ran = 0

    def push(self, op) -> None:
        self.ops.append(op)
        self.issued += 1
        if self.dev.sync_stream is self:
            self.run_until(self.issued)
        elif self.eager:
            self.run_while_unblocked()

    def wait_event(self, event) -> None:
        target = (event.stream, event.position)
        self.push(("wait", target))

    def synchronize(self) -> None:
        self.run_until(self.issued)

    def _run_head(self, force: bool) -> bool:
        op = self.ops[0]
        if isinstance(op, tuple):  # a wait
            stream, position = op[1]
            if stream is not None and stream.ran < position:
                if not force:
                    return False
                stream.run_until(position)
        else:
            op()
        self.ops.popleft()
        self.ran += 1
        return True

    def run_until(self, position: int) -> None:
        while self.ran < position:
            self._run_head(force=True)

    def run_while_unblocked(self) -> None:
        while self.ops and self._run_head(force=False):
            pass


class AsyncEmuDevice(EmuDevice):
    name = "CPU emulation of kernels/*.cu, asynchronous streams"

    def __init__(self, eager_copies: bool, cache_dir=None):
        super().__init__(cache_dir)
        self.sync_stream = None
        self.compute, self.copy = AsyncStream(self), AsyncStream(self, eager=eager_copies)

    def stream(self):
        return AsyncStream(self)

    def event(self):
        return AsyncEvent()

    timing_event = event

    @contextmanager
    def on(self, stream):
        stream.synchronize()
        outer, self.sync_stream = self.sync_stream, stream
        try:
            yield
        finally:
            self.sync_stream = outer

    def launch(self, fn, grid, block, args) -> None:
        if self._recording is not None or self.sync_stream is None:
            # a capture records; an eager launch outside any stream context runs in place
            super().launch(fn, grid, block, args)
            return
        self.sync_stream.push(fn.prepare(grid, block, args))

    def replay(self, graph, stream) -> None:
        def run():
            for launch in graph:
                launch()

        stream.push(run)

    def copy_async(self, dst, src, stream) -> None:
        stream.push(lambda: super(AsyncEmuDevice, self).copy_async(dst, src, stream))

    def copy_to_host_async(self, dst, src, stream) -> None:
        stream.push(lambda: super(AsyncEmuDevice, self).copy_to_host_async(dst, src, stream))

    def synchronize(self) -> None:
        self.compute.synchronize()
        self.copy.synchronize()

    def settle(self) -> None:
        self.synchronize()
