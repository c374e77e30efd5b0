"""Counts allocations on the decode hot path: decode steps during which traced memory rose above
where the step began (NumPy reports its data buffers to tracemalloc). Anything > 0 after warm-up
is a bug: decode writes only into the arena. The numba kernels are held allocation-free by
tests/test_kernels.py (numba's own counter also counts argument boxing from Python, so it cannot
serve here).

tracemalloc knows live blocks and the peak, not how many blocks came and went, so a step that
allocates counts once however many temporaries it made; that is enough to hold it at 0. Calls
into numpy and numba themselves make short-lived Python objects (argument tuples, a view in a
wrapper), and tracemalloc sees every thread, the pager's reader too (a few ints per read, a stat
result now and then): measured up to ~450 bytes at once in a resident decode step and ~2 KB
with the reader running beside it. A step counts when its peak rose more than SLACK_BYTES, so a
buffer under about 4 KiB can go unseen: a model's intermediate- and vocabulary-sized buffers
(6 KB and 196 KB for SmolLM2) are larger, a hidden-sized one (2.3 KB there) may not be.
"""

from __future__ import annotations

import tracemalloc

SLACK_BYTES = 4096


class AllocationCounter:
    """Wraps decode steps: `with counter.step(): engine.decode(t)`; `counter.count` so far."""

    def __init__(self):
        self.count = 0
        self.steps = 0

    def __enter__(self):
        self._was_tracing = tracemalloc.is_tracing()
        if not self._was_tracing:
            tracemalloc.start()
        return self

    def __exit__(self, *exc):
        if not self._was_tracing:
            tracemalloc.stop()
        return False

    def step(self):
        return _Step(self)


class _Step:
    def __init__(self, counter: AllocationCounter):
        self.c = counter

    def __enter__(self):
        tracemalloc.reset_peak()
        self.start, _ = tracemalloc.get_traced_memory()

    def __exit__(self, *exc):
        _, peak = tracemalloc.get_traced_memory()
        self.c.steps += 1
        self.c.count += peak - self.start > SLACK_BYTES
        return False
