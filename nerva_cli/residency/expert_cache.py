"""A mixture's routed experts under a RAM budget (ARCHITECTURE 15): each MoE layer keeps
`capacity` of its experts in slots, and an expert a token chooses that is not there is read
from its layer file (one O_DIRECT read of its span) into the slot the eviction policy frees.

ExpertSlots is the bookkeeping alone (which expert is in which slot, which to evict), shared
by the running engine and by `replay`, which runs a recorded expert trace through every policy
and through Belady's optimal offline cache (evict the expert next chosen furthest ahead), the
bound a policy is measured against (docs/residency.md)."""

from __future__ import annotations

import os
import queue
import threading
import time

import numpy as np

EVICTIONS = ("lru", "lfu")  # which cached expert a read replaces; replay adds "belady"
# what a run may choose: an eviction, alone or with the look-ahead's prefetches
EXPERT_POLICIES = (*EVICTIONS, *(f"{p}+lookahead" for p in EVICTIONS))
# read fewer bytes than lru on every trace measured, and the look-ahead more (docs/performance.md)
DEFAULT_EXPERT_POLICY = "lfu"


class ExpertSlots:
    """Which of a layer's experts each of `capacity` slots holds, and which slot a new one takes:
    lru (the slot least recently used), lfu (the expert chosen fewest times so far in this run,
    the least recent among equals) or belady (the expert next chosen furthest ahead: next_use(e,
    step) says when, known only to a replay). A slot used in the current step is never taken."""

    def __init__(self, experts: int, capacity: int, policy: str, next_use=None):
        if policy not in (*EVICTIONS, "belady"):
            raise ValueError(f"expert cache policy {policy!r}")
        if policy == "belady" and next_use is None:
            raise ValueError("belady needs the trace's future (next_use)")
        self.capacity, self.policy, self.next_use = capacity, policy, next_use
        self.slot_of = np.full(experts, -1, dtype=np.int64)  # expert -> its slot, -1 where not held
        self.held = np.full(capacity, -1, dtype=np.int64)  # slot -> its expert, -1 while empty
        self.last = np.full(capacity, -1, dtype=np.int64)  # slot -> the step it was last used or filled in
        self.uses = np.zeros(experts, dtype=np.int64)  # expert -> times chosen (lfu)
        self.unused = np.zeros(capacity, dtype=bool)  # slot -> prefetched and not chosen since
        self.step = 0
        self.hits = self.misses = self.prefetches = self.prefetch_hits = 0

    def access(self, ids) -> list[tuple[int, int]]:
        """A step chooses the distinct experts `ids` (at most capacity): each is placed in a slot,
        none evicting another of them. -> the (slot, expert) pairs whose bytes must be loaded."""
        self.step += 1
        for e in ids:  # the held ones first, so no miss evicts them
            s = self.slot_of[e]
            if s >= 0:
                self.last[s] = self.step
        loads = []
        for e in ids:
            self.uses[e] += 1
            s = self.slot_of[e]
            if s >= 0:
                self.hits += 1
                self.prefetch_hits += bool(self.unused[s])
                self.unused[s] = False
                continue
            self.misses += 1
            s = self._take(e)
            loads.append((s, int(e)))
        return loads

    def prefetch(self, ids) -> list[tuple[int, int]]:
        """Experts a coming step is predicted to choose (at most capacity), placed ahead of it where
        not held. -> the (slot, expert) pairs to load."""
        self.step += 1
        loads = []
        for e in ids:
            if self.slot_of[e] >= 0:
                continue
            s = self._take(e)
            self.unused[s] = True
            self.prefetches += 1
            loads.append((s, int(e)))
        return loads

    def forget(self, s: int) -> None:
        """Slot s empty again (its read failed: what it holds is not its expert)."""
        e = self.held[s]
        if e >= 0:
            self.slot_of[e] = -1
        self.held[s], self.unused[s] = -1, False

    def _take(self, e: int) -> int:
        s = self._victim()
        old = self.held[s]
        if old >= 0:
            self.slot_of[old] = -1
        self.held[s], self.slot_of[e], self.last[s], self.unused[s] = e, s, self.step, False
        return s

    def _victim(self) -> int:
        """The first empty slot, else the policy's choice among the slots not used in this step
        (the lowest slot among equals). A loop over the slots, not array expressions, whose
        temporaries counted as hot-path allocations."""
        held, last, uses, step = self.held, self.last, self.uses, self.step
        best, best_key = -1, None
        for s in range(self.capacity):
            e = held[s]
            if e < 0:
                return s
            if last[s] >= step:
                continue
            if self.policy == "lru":
                key = (last[s], 0)
            elif self.policy == "lfu":  # fewest uses, then least recent
                key = (uses[e], last[s])
            else:  # belady: the furthest next use first
                key = (-self.next_use(int(e), step), 0)
            if best_key is None or key < best_key:
                best, best_key = s, key
        if best < 0:
            raise RuntimeError("expert cache: every slot is in use in this step")
        return best


def replay(steps: list, experts: int, capacity: int, policy: str, predicted: list | None = None,
           measured: list | None = None) -> dict:
    """One layer's recorded steps (the distinct experts each chose, in order) through a cache of
    `capacity` slots under `policy` (lru, lfu or belady), from empty; with `predicted` (per step,
    the experts a look-ahead predicted for it, or None), those are prefetched before the step.
    -> loads (experts read: misses and prefetches) and misses, counted over the steps `measured`
    marks (all by default), and the prefetches made and used."""
    next_use = None
    if policy == "belady":
        if predicted is not None:
            raise ValueError("belady knows the trace: it has nothing to prefetch")
        at: dict[int, list[int]] = {}
        for n, ids in enumerate(steps, start=1):  # ExpertSlots counts steps from 1
            for e in ids:
                at.setdefault(int(e), []).append(n)
        when = {e: np.array(v) for e, v in at.items()}

        def next_use(e: int, step: int) -> float:
            v = when.get(e)
            i = 0 if v is None else int(np.searchsorted(v, step, side="right"))
            return float("inf") if v is None or i == len(v) else float(v[i])
    slots = ExpertSlots(experts, capacity, policy, next_use)
    loads = misses = 0
    for n, ids in enumerate(steps):
        counted = measured is None or measured[n]
        if predicted is not None and predicted[n] is not None:
            loads += counted * len(slots.prefetch(predicted[n]))
        got = len(slots.access(ids))
        loads += counted * got
        misses += counted * got
    return {"loads": loads, "misses": misses, "prefetches": slots.prefetches, "prefetch_hits": slots.prefetch_hits}


def trace_steps(trace: list, capacity: int, predicted: list | None = None, measure_from: int = 0) -> dict:
    """An engine's expert_trace ((layer, ids [rows, k]) entries) as the steps each layer's cache
    took (planes/cpu/experts.py: a step's distinct experts at once where they fit the cache, else
    one at a time): layer -> (steps, the look-ahead's prediction for each or None, whether each
    comes from entry measure_from on)."""
    layers: dict[int, tuple[list, list, list]] = {}
    for n, (i, ids) in enumerate(trace):
        chosen = np.unique(ids)
        parts = [chosen] if len(chosen) <= capacity else [chosen[j:j + 1] for j in range(len(chosen))]
        guess = None if predicted is None or len(parts) > 1 else predicted[n]
        steps, guesses, measured = layers.setdefault(i, ([], [], []))
        for part in parts:
            steps.append(part)
            guesses.append(guess)
            measured.append(n >= measure_from)
    return layers


def replay_policies(trace: list, experts: int, capacity: int, predicted: list | None = None,
                    measure_from: int = 0) -> dict:
    """Experts read over the trace's entries from measure_from on, every MoE layer's cache of
    `capacity` slots starting empty, under each policy, Belady's optimum, and each policy with
    the look-ahead's prefetches where `predicted` is given: name -> {loads, misses, ...}."""
    layers = trace_steps(trace, capacity, predicted, measure_from)
    runs = [(p, p, False) for p in (*EVICTIONS, "belady")]
    if predicted is not None:
        runs += [(f"{p}+lookahead", p, True) for p in EVICTIONS]
    out = {}
    for name, policy, ahead in runs:
        total: dict[str, int] = {}
        for steps, guesses, measured in layers.values():
            r = replay(steps, experts, capacity, policy, guesses if ahead else None, measured)
            for key, v in r.items():
                total[key] = total.get(key, 0) + v
        out[name] = total
    return out


class ExpertReader:
    """Expert spans from the MoE layer files, read straight into a slot's rows where the layout
    allows it (ExpertCache.targets), else into page-aligned staging buffers (one a reading
    thread): O_DIRECT where the filesystem allows it (else buffered, and reported so), each file
    opened once and its identity (size, mtime, inode) checked every few reads against the one its
    sha256 was checked at, so a file changed under a run stops it."""

    IDENTITY_EVERY = 16

    def __init__(self, model, span_bytes: int, stats):
        """stats: the PagerStats its reads are counted in (disk_bytes, reads, read_ns)."""
        from nerva_cli.store.catalog import ALIGN

        self.model = model
        self.nbytes = -(-span_bytes // ALIGN) * ALIGN  # O_DIRECT reads whole pages; files are padded to them
        self.buf, self.iov = self.staging()  # the compute thread's; a prefetching thread has its own
        self.fds: dict[str, tuple[int, tuple]] = {}
        self.direct: bool | None = None
        self.reads = 0
        self.stats = stats
        self.lock = threading.Lock()  # two threads read: files open once, counters add up

    def staging(self) -> tuple[np.ndarray, list]:
        """A page-aligned buffer of one span, and the iovec preadv reads into it with."""
        import mmap

        mem = mmap.mmap(-1, self.nbytes)
        return np.frombuffer(mem, dtype=np.uint8), [memoryview(mem)]

    def scatters(self, fname: str, aligned: bool) -> bool:
        """Whether reads of `fname` may land in buffers that are not whole aligned pages (`aligned`
        says whether they are): a buffered file takes any, an O_DIRECT one pages."""
        with self.lock:
            if fname not in self.fds:
                self._open(fname)
        return aligned or not self.direct

    def read(self, fname: str, offset: int, iov: list) -> None:
        """The span at `offset` of file `fname` into the buffers `iov`, one after another."""
        with self.lock:
            fd, identity = self.fds.get(fname) or self._open(fname)
            self.reads += 1
            check = self.reads % self.IDENTITY_EVERY == 0
        if check:
            st = os.fstat(fd)
            if (st.st_size, st.st_mtime_ns, st.st_ino) != identity:
                raise self.model.damaged(self.model.path / fname, "changed on disk while this run read it")
        t = time.perf_counter_ns()
        got = os.preadv(fd, iov, offset)
        t = time.perf_counter_ns() - t
        if got < self.nbytes:
            raise self.model.damaged(self.model.path / fname, f"short read at {offset} ({got} of {self.nbytes} bytes)")
        with self.lock:
            self.stats.read_ns += t
            self.stats.disk_bytes += got
            self.stats.reads += 1

    def _open(self, fname: str):
        from nerva_cli.residency.pager import open_for_reading

        self.model.verify_file(fname)  # its sha256, unless this identity was checked before
        fd, direct = open_for_reading(str(self.model.path / fname), self.direct)
        self.direct = direct
        st = os.fstat(fd)
        self.fds[fname] = fd, (st.st_size, st.st_mtime_ns, st.st_ino)
        return self.fds[fname]

    def close(self) -> None:
        for fd, _ in self.fds.values():
            os.close(fd)
        self.fds.clear()


class ExpertCache:
    """One MoE layer's cached experts: its ExpertSlots, and the stacked gate/up and down matrices
    of `capacity` experts (moe.gate_up_stack, moe.down_stack: slot s's rows where the resident
    stacks hold expert s's) that a step's chosen experts are multiplied from by slot."""

    def __init__(self, model, index: int, moe, capacity: int, policy: str, reader: ExpertReader,
                 prefetcher: "Prefetcher | None" = None):
        from nerva_cli.model.layout import expert_span, layer_file

        self.fname = layer_file(index)
        table = model.meta["files"][self.fname]["tensors"]
        self.spans = [expert_span(table, e)[0] for e in range(moe.count)]
        base = self.spans[0]
        # expert 0's tensors by their plain names ("gate.qs"), at offsets within its span: every
        # expert's span lays them out alike
        self.table = {n.split(".", 2)[2]: {**t, "offset": t["offset"] - base}
                      for n, t in table.items() if n.startswith("experts.0.")}
        self.slots = ExpertSlots(moe.count, capacity, policy.split("+")[0])
        self.moe, self.reader, self.stats = moe, reader, reader.stats
        self.out = np.zeros(capacity, dtype=np.int64)
        self.views: dict[int, dict] = {}  # id(staging buffer) -> the expert's tensors over it
        self.targets, self.aligned = self._scatter_targets()
        self.scatter: bool | None = None  # whether reads land in the slots (decided at the first)
        self.prefetcher = prefetcher  # where the policy looks ahead: its thread reads what prefetch() places
        self.pending = 0  # prefetched reads not yet seen done (wait)
        self.done: queue.SimpleQueue = queue.SimpleQueue()  # the prefetcher's word on each: None or its error

    @property
    def capacity(self) -> int:
        return self.slots.capacity

    def clear(self) -> None:
        """Empties the cache (its bookkeeping; the slots' bytes are overwritten as they refill)."""
        self.wait()
        self.slots = ExpertSlots(self.slots.slot_of.shape[0], self.capacity, self.slots.policy)

    def prefetch(self, ids: np.ndarray) -> None:
        """Places the experts predicted for this layer's next step (ExpertSlots.prefetch) and has
        the prefetcher's thread read those not held, while the compute goes on."""
        for s, e in self.slots.prefetch(ids):
            self.pending += 1
            self.stats.prefetched += 1
            self.prefetcher.jobs.put((self, s, e))

    def wait(self) -> None:
        """Until this layer's prefetched reads are in their slots (their time a stall)."""
        t = time.perf_counter_ns()
        error = None
        while self.pending:
            error = self.done.get() or error
            self.pending -= 1
        self.stats.stall_ns += time.perf_counter_ns() - t
        if error is not None:
            raise error

    def slots_for(self, ids: np.ndarray) -> np.ndarray:
        """The slots of the distinct experts ids (at most capacity), loading the missing ones;
        -> a view of len(ids) slot numbers, in ids' order (until the next call)."""
        if self.pending:
            self.wait()
        loads = self.slots.access(ids)
        self.stats.hits += len(ids) - len(loads)
        self.stats.faults += len(loads)
        for s, e in loads:
            t = time.perf_counter_ns()
            self._load(s, e)
            self.stats.stall_ns += time.perf_counter_ns() - t
        out = self.out[:len(ids)]
        np.take(self.slots.slot_of, ids, out=out)
        return out

    def _rows(self, slot: int, name: str) -> np.ndarray:
        """Slot `slot`'s rows of the stack plane that expert tensor `name` ("gate.qs", "down.d",
        "up" for a float matrix) goes into."""
        part, _, field = name.partition(".")
        if part == "down":
            stack, at, parts = self.moe.down_stack, 0, 1
        else:
            stack, at, parts = self.moe.gate_up_stack, ("gate", "up").index(part), 2
        rows = stack.rows // (parts * self.capacity)
        lo = (slot * parts + at) * rows
        return getattr(stack, field or "w")[lo:lo + rows]

    def _scatter_targets(self) -> tuple[list | None, bool]:
        """(per slot, the buffers a read of an expert's span fills in file order: each tensor's
        rows in the slot's part of the stacks, a scratch buffer for the padding between them;
        whether all of them are whole pages at page-aligned addresses, as O_DIRECT needs).
        Reading there spares a copy of every byte read (docs/residency.md)."""
        import mmap

        from nerva_cli.store.catalog import ALIGN

        order = sorted(self.table.items(), key=lambda item: item[1]["offset"])
        gaps, end = [], 0
        for _, t in order:
            gaps.append(t["offset"] - end)
            end = t["offset"] + t["nbytes"]
        gaps.append(self.reader.nbytes - end)  # the span's last page
        scratch = np.frombuffer(mmap.mmap(-1, max(*gaps, ALIGN)), dtype=np.uint8)
        targets, aligned = [], True
        for slot in range(self.capacity):
            parts = []
            for (name, t), gap in zip(order, gaps):
                rows = self._rows(slot, name)
                if rows.nbytes != t["nbytes"] or not rows.flags.c_contiguous:
                    return None, False
                parts += [scratch[:gap]] * bool(gap) + [rows.reshape(-1).view(np.uint8)]
            parts += [scratch[:gaps[-1]]] * bool(gaps[-1])
            aligned &= all(a.ctypes.data % ALIGN == 0 and a.nbytes % ALIGN == 0 for a in parts)
            targets.append([memoryview(a) for a in parts])
        return targets, aligned

    def _load(self, slot: int, e: int, staging=None) -> None:
        """Expert e's span read into slot `slot`'s rows of the stacks: straight there where the
        reader allows it, else into `staging` (by default the compute thread's buffer) and
        copied. A read that fails leaves the slot empty."""
        from nerva_cli.store.catalog import tensors_in

        try:
            if self.scatter is None:
                self.scatter = self.targets is not None and self.reader.scatters(self.fname, self.aligned)
            if self.scatter:
                self.reader.read(self.fname, self.spans[e], self.targets[slot])
                return
            buf, iov = staging or (self.reader.buf, self.reader.iov)
            self.reader.read(self.fname, self.spans[e], iov)
            t = self.views.get(id(buf))
            if t is None:  # a staging buffer's tensor views, made once: fewer objects a read
                t = self.views[id(buf)] = tensors_in(buf, self.table)
            for name in self.table:
                self._rows(slot, name)[...] = t[name]
        except BaseException:
            self.slots.forget(slot)
            raise


class Prefetcher:
    """The thread that reads the look-ahead's experts into the slots ExpertCache.prefetch chose,
    into a staging buffer of its own, while the compute thread runs (its kernels and the reads
    release the GIL); each read's end, or its error, goes back on its cache's `done` queue."""

    def __init__(self, reader: ExpertReader):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.staging = reader.staging()
        self.thread = threading.Thread(target=self._run, name="nerva-experts", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            cache, slot, e = job
            try:
                cache._load(slot, e, self.staging)
                cache.done.put(None)
            except BaseException as error:  # raised on the compute thread, at its wait
                cache.done.put(error)

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()


class CachedExperts:
    """The weights of an engine whose MoE layers cache their experts (every layer otherwise
    resident): a pass is the list of layers; `stats` counts expert hits, misses (faults) and
    the reads they made, which the ledger shows per token."""

    def __init__(self, layers: list, reader: ExpertReader, policy: str, prefetcher: Prefetcher | None):
        self._layers, self.reader, self.policy = layers, reader, f"expert cache ({policy})"
        self.stats, self.prefetcher = reader.stats, prefetcher

    def layers(self):
        return self._layers

    @property
    def direct_io(self) -> bool | None:
        return self.reader.direct

    def clear(self) -> None:
        """Empties every layer's expert cache (bench measures from empty caches)."""
        for layer in self._layers:
            if layer.moe is not None:
                layer.moe.cache.clear()

    def close(self) -> None:
        if self.prefetcher is not None:
            for layer in self._layers:  # no read left running into a file about to close
                if layer.moe is not None:
                    layer.moe.cache.wait()
            self.prefetcher.close()
        self.reader.close()
