"""Layer weights that do not fit the RAM budget stream from their files through staging slots.

`ring` (default): a fixed resident set plus a ring of slots; decode visits layers in a fixed
cycle, so a reader thread fills slot after slot exactly in the order they will be used, while
the kernels (which release the GIL) compute. `lru`: seed 002's cache, every layer through one
LRU pool of the same bytes, read on demand. Both read with O_DIRECT into page-aligned buffers
made once; where the filesystem refuses O_DIRECT the reads are buffered and reported so (a
page-cache hit is not a disk read).
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from nerva_cli.errors import BadInput, UsageError
from nerva_cli.model.layout import layer_file
from nerva_cli.residency.planner import ResidentBlock, State
from nerva_cli.store.catalog import StoredModel, tensors_in

POLICIES = ("ring", "lru")
IDENTITY_EVERY = 4


@dataclass
class PagerStats:
    """Cumulative counters; the ledger reads deltas per token."""

    disk_bytes: int = 0
    reads: int = 0
    hits: int = 0
    faults: int = 0  # a layer needed and not (yet) there
    stall_ns: int = 0  # time compute waited for a read
    read_ns: int = 0  # time inside disk reads (open to close): disk_bytes / read_ns is the disk's rate as read
    prefetched: int = 0
    evicted: int = 0
    h2d_bytes: int = 0  # host -> GPU copies of paged layers (the cuda backend)
    d2h_bytes: int = 0  # GPU -> host copies of logits and tokens (the cuda backend)


class LayerFileReader:
    """Whole layer files into aligned buffers, checking size always and sha256 whenever the
    file's identity (size, mtime, inode) is new: a file changed after load stops the run."""

    def __init__(self, model: StoredModel):
        self.model = model
        self.direct: bool | None = None  # unknown until the first read
        self._known: dict[str, tuple] = {}
        self._paths: dict[str, str] = {}
        self._reads: dict[str, int] = {}

    def read(self, fname: str, iov: list) -> int:
        """Reads the whole file into iov ([one memoryview over a slot]). It runs beside decode,
        so it makes few objects: paths and views are made once, the size is checked on every
        read (lseek), the file's identity (fstat: ~600 bytes of objects) on the first read and
        every IDENTITY_EVERY-th after, the sha256 whenever that identity is new. A file changed
        after load is caught within that many reads of it."""
        info = self.model.meta["files"][fname]
        path = self._paths.get(fname) or self._paths.setdefault(fname, str(self.model.path / fname))
        try:
            fd = self._open(path)
        except FileNotFoundError:  # `nerva rm` refuses a model a run holds: this was deleted otherwise
            raise self.model.damaged(path, "deleted while this run read it") from None
        try:
            size = os.lseek(fd, 0, os.SEEK_END)
            if size != info["size"]:
                raise self.model.damaged(path, f"size {size} disagrees with metadata.json ({info['size']}): "
                                         "changed on disk")
            n = self._reads[fname] = self._reads.get(fname, -1) + 1
            identity = None
            if n % IDENTITY_EVERY == 0:
                st = os.fstat(fd)
                identity = (st.st_size, st.st_mtime_ns, st.st_ino)
            got = os.preadv(fd, iov, 0)
            if got < info["size"]:  # O_DIRECT reads of a 4 KB-padded file come whole; a short one is damage
                raise self.model.damaged(path, f"short read ({got} of {info['size']} bytes)")
        finally:
            os.close(fd)
        if identity is not None and self._known.get(fname) != identity:
            if hashlib.sha256(iov[0][: info["size"]]).hexdigest() != info["sha256"]:
                raise self.model.damaged(path, "sha256 disagrees with metadata.json: changed on disk")
            self._known[fname] = identity
        return info["size"]

    def _open(self, path) -> int:
        fd, self.direct = open_for_reading(path, self.direct)
        return fd


def open_for_reading(path: str, direct: bool | None) -> tuple[int, bool]:
    """(fd, whether it reads O_DIRECT): O_DIRECT unless `direct` is False (an earlier open found
    the filesystem refuses it, as tmpfs does), buffered where refused."""
    if direct is not False:
        try:
            return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)), hasattr(os, "O_DIRECT")
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, os.O_RDONLY), False


class Slot:
    """One staging buffer and the Layer object that views it (made once: no hot-path objects)."""

    def __init__(self, n: int, nbytes: int, make_layer):
        self.mem = mmap.mmap(-1, nbytes)  # anonymous: page-aligned, as O_DIRECT needs
        self.buf = np.frombuffer(self.mem, dtype=np.uint8)
        self.iov = [memoryview(self.mem)]
        # the Layer views the buffer; refresh() re-derives what it keeps beside it (the fused
        # bias) after each read
        self.layer, self.refresh = make_layer(self.buf)
        self.block = ResidentBlock("slot", f"slot{n}", nbytes, "host", State.ALLOCATED)
        self.free = threading.Lock()  # held by the reader while it may not fill the slot
        self.filled = threading.Lock()  # held while the slot holds nothing to compute on
        self.filled.acquire()


class PagedWeights:
    """Yields every layer once per pass, in order: resident ones from RAM, paged ones from slots."""

    def __init__(self, model: StoredModel, resident: dict, paged: list[int], precisions: dict[int, str],
                 slots: int, slot_bytes: int, policy: str, view_layer, view_buffer=None):
        """view_layer(tensors) -> (layer, refresh) makes what a slot yields from its tensors;
        view_buffer(buf), when given, from its raw bytes instead (the cuda backend copies whole
        slots to the GPU)."""
        if policy not in POLICIES:
            raise UsageError(f"--policy {policy}: choose one of {', '.join(POLICIES)}")
        tables = {layer_file(i): model.meta["files"][layer_file(i)]["tensors"] for i in paged}
        first = next(iter(tables.values()))
        if any(t != first for t in tables.values()):
            raise BadInput(f"{model.path}: layer files differ in layout; they cannot share staging slots")
        self.model, self.resident, self.paged = model, resident, paged
        self.files = {i: layer_file(i) for i in paged}
        self.precisions, self.policy = precisions, policy
        self.order = sorted(list(resident) + paged)
        self.stats = PagerStats()
        self.reader = LayerFileReader(model)
        make = view_buffer or (lambda buf: view_layer(tensors_in(buf, first)))
        self.slots = [Slot(n, slot_bytes, make) for n in range(slots)]
        self.error: BaseException | None = None
        self.visits = 0  # paged visits consumed so far (ring)
        self.lru: OrderedDict[int, Slot] = OrderedDict()
        self._closed = False
        self._pos, self._held = len(self.order), None  # no pass under way
        if policy == "ring":
            self.thread = threading.Thread(target=self._ring_reader, name="nerva-pager", daemon=True)
            self.thread.start()

    # -- ring ----------------------------------------------------------------------------------
    # Visit n of the paged cycle always uses slot n % slots, on both sides, so two locks per
    # slot hand it back and forth: `filled` (reader -> compute) and `free` (compute -> reader).
    # Plain locks, not a Condition: notify_all makes a deque per call, a hot-path allocation.
    def _ring_reader(self) -> None:
        n = 0
        try:
            while True:
                slot = self.slots[n % len(self.slots)]
                slot.free.acquire()
                if self._closed:
                    return
                if slot.block.state is State.READY:
                    slot.block.move(State.EVICTING)
                    slot.block.move(State.ALLOCATED)
                    self.stats.evicted += 1
                slot.block.move(State.PREFETCHING)
                t = time.perf_counter_ns()
                got = self.reader.read(self.files[self.paged[n % len(self.paged)]], slot.iov)
                self.stats.read_ns += time.perf_counter_ns() - t
                slot.refresh()
                slot.block.move(State.READY)
                self.stats.disk_bytes += got
                self.stats.reads += 1
                self.stats.prefetched += 1
                slot.filled.release()
                n += 1
        except BaseException as e:  # handed to the compute thread, which raises it
            self.error = e
            for other in self.slots:
                if other.filled.locked():
                    other.filled.release()

    def _ring_acquire(self, layer_index: int):
        slot = self.slots[self.visits % len(self.slots)]
        if slot.filled.acquire(blocking=False):
            self.stats.hits += 1
        else:
            self.stats.faults += 1
            t = time.perf_counter_ns()
            slot.filled.acquire()
            self.stats.stall_ns += time.perf_counter_ns() - t
        if self.error is not None:
            raise self.error
        slot.block.move(State.IN_USE)
        slot.layer.index, slot.layer.precision = layer_index, self.precisions[layer_index]
        return slot

    def _ring_release(self, slot: Slot) -> None:
        slot.block.move(State.READY)
        self.visits += 1
        slot.free.release()

    # -- lru -----------------------------------------------------------------------------------
    def _lru_acquire(self, layer_index: int):
        slot = self.lru.get(layer_index)
        if slot is not None:
            self.lru.move_to_end(layer_index)
            self.stats.hits += 1
        else:
            self.stats.faults += 1
            if len(self.lru) < len(self.slots):
                slot = self.slots[len(self.lru)]
            else:
                _, slot = self.lru.popitem(last=False)
                slot.block.move(State.EVICTING)
                slot.block.move(State.ALLOCATED)
                self.stats.evicted += 1
            t = time.perf_counter_ns()
            slot.block.move(State.PREFETCHING)
            self.stats.disk_bytes += self.reader.read(self.files[layer_index], slot.iov)
            self.stats.read_ns += time.perf_counter_ns() - t
            slot.refresh()
            self.stats.reads += 1
            slot.block.move(State.READY)
            self.stats.stall_ns += time.perf_counter_ns() - t
            self.lru[layer_index] = slot
        slot.block.move(State.IN_USE)
        slot.layer.index, slot.layer.precision = layer_index, self.precisions[layer_index]
        return slot

    # -- the pass ------------------------------------------------------------------------------
    def layers(self):
        """One pass over the layers, in order: resident ones from RAM, paged ones from slots.
        The pass is this object, reused (a generator per pass would be an allocation per
        token). A pass cut short (an error, Ctrl-C) is finished by the next one's start, so
        the ring's cycle stays aligned."""
        self._finish_pass()
        self._pos, self._held = 0, None
        return self

    def __iter__(self):
        return self

    def __next__(self):
        self._release_held()
        if self._pos >= len(self.order):
            raise StopIteration
        i = self.order[self._pos]
        self._pos += 1
        layer = self.resident.get(i)
        if layer is not None:
            return layer
        self._held = self._ring_acquire(i) if self.policy == "ring" else self._lru_acquire(i)
        return self._held.layer

    def _release_held(self) -> None:
        slot, self._held = self._held, None
        if slot is None:
            return
        if self.policy == "ring":
            self._ring_release(slot)
        else:
            slot.block.move(State.READY)

    def _finish_pass(self) -> None:
        self._release_held()
        if self.policy != "ring" or self.error is not None:
            return
        while self._pos < len(self.order):
            i = self.order[self._pos]
            self._pos += 1
            if i not in self.resident:
                self._ring_release(self._ring_acquire(i))

    def close(self) -> None:
        self._closed = True
        for slot in self.slots:  # wake a reader waiting for a free slot, so it can see _closed
            if slot.free.locked():
                try:
                    slot.free.release()
                except RuntimeError:
                    pass

    def views(self) -> list:
        """The Layer objects the slots lend, whatever their buffers hold now: what a paged layer's
        kernels compile for (Engine.compile_aside), without a read or the pass's locks."""
        return [slot.layer for slot in self.slots]

    @property
    def direct_io(self) -> bool | None:
        return self.reader.direct
