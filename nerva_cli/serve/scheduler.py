"""The loaded models and the requests on them.

Engines are not thread-safe, so each loaded model has a worker thread that owns its engines:
it opens them (open_engine, the budgets `run` uses), takes the model's waiting requests onto
free slots, and steps its running requests in rounds (steps.py) until the model has been idle
for its keep_alive.

On the cpu and ref planes --parallel N gives a model one engine of N sequence slots: one copy
of the weights, a KV cache a slot, and each round's decode steps run as one batched step
(Engine.decode_batch, whose rows are each sequence's decode alone, bit for bit), prefill
chunks one by one between them. On cuda, whose engines hold one sequence, N engines (N copies
of the weights), their steps one at a time. Either way N requests make progress together,
none waiting for another's whole answer. Steps of different models never overlap: one compute
lock (numba's thread pool and the cores are shared anyway).

A model's prompt cache (residency/prompt_cache.py) keeps the whole prefill chunks its slots made
after they move on; a request's slot takes from it the chunks of its prompt it does not hold.
Its bytes count in the server's RAM budget as it fills, and give way before any model unloads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import replace
from time import perf_counter_ns

from nerva_cli.errors import NervaError
from nerva_cli.planes import resolve
from nerva_cli.residency.prompt_cache import PromptCache, chunk_keys
from nerva_cli.runtime.generate import common_prefix, reusable_prefix
from nerva_cli.runtime.report import Reporter
from nerva_cli.serve.errors import RETRY_AFTER_S, ApiError, overloaded
from nerva_cli.serve.steps import Decode, Prefill, answer_steps, run_step
from nerva_cli.units import human_bytes

log = logging.getLogger("nerva.serve")
COMPUTE = threading.Lock()


def server_ram_budget(opts) -> int | None:
    """The RAM the loaded models share on the cpu plane: --ram-budget, else 90% of what is
    available when the server starts. None on cuda, where each engine plans its own VRAM (as
    `run`'s) and the models are not counted against one another."""
    from nerva_cli.residency.planner import available_ram

    if resolve(opts.backend) == "cuda":
        return None
    if opts.ram_bytes is not None:
        return opts.ram_bytes
    try:
        return int(available_ram() * 0.9)
    except (OSError, ValueError):  # no MemAvailable and no SC_AVPHYS_PAGES (macOS): no accounting
        return None


def planned_bytes(model, opts, sequences: int) -> int:
    """What the engine of `sequences` slots (the cpu plane's) plans to hold in RAM when all of
    it fits, from sizes alone: the weights once, a KV cache a sequence."""
    from nerva_cli.planes.cpu.engine import residency_plan

    return residency_plan(model, opts.ctx, None, kv_cache=opts.kv_cache, seq_slots=sequences).used_bytes


class LogReporter(Reporter):
    """What open_engine says while a model loads, in the server's log."""

    def __init__(self, key: str):
        self.key = key

    def info(self, text: str) -> None:
        log.info("%s: %s", self.key, text)

    def note(self, text: str) -> None:
        log.warning("%s: %s", self.key, text)

    def detail(self, text: str) -> None:  # a load's, once: the log is the server's verbose output
        log.info("%s: %s", self.key, text)


class Slot:
    """A sequence an engine holds (its sequence slot `seq`, or None for an engine of one), the
    request on it, and the prompt its KV cache holds (steps.answer_steps), which the next
    request may start from."""

    def __init__(self, engine, seq: int | None = None):
        self.engine, self.seq, self.job, self.steps = engine, seq, None, None
        self.step = None  # the step its request waits for (steps.py)
        self.prompt: list[int] = []


def engines_of(slots: list[Slot]) -> list:
    return list({id(s.engine): s.engine for s in slots}.values())


class ModelWorker(threading.Thread):
    def __init__(self, registry: "Registry", key: str, model, need: int | None = None, room: int | None = None,
                 prompt_cache: int = 0):
        """need: the bytes its engines plan to hold (the server's RAM accounting; None: not
        counted); room: the RAM its engines may take together (past it they page), None: as run;
        prompt_cache: the bytes of its prompt cache (PromptCache), 0: none."""
        super().__init__(name=f"nerva-model-{key}", daemon=True)
        self.registry, self.key, self.model = registry, key, model
        self.bytes, self.room = need or 0, room
        self.prompt_cache_bytes = prompt_cache
        self.prompts: PromptCache | None = None  # made at load where its engines can move KV rows
        self.last_used = time.monotonic()
        self.cond = threading.Condition(registry.lock)  # every worker's state is guarded by the registry's lock
        self.pending: deque = deque()
        self.slots: list[Slot] = []
        self.ready = False
        self.loaded = threading.Event()  # set when the load ends, well or not (self.error says)
        self.error: ApiError | None = None
        self.load_started_ns = perf_counter_ns()
        self.load_ns = 0
        self.keep_alive = registry.keep_alive
        self.expires_at: float | None = None  # monotonic; None: never (or busy)

    @property
    def running(self) -> int:
        return sum(s.job is not None for s in self.slots)

    def idle(self) -> bool:
        """Loaded with nothing to do: what may be unloaded to make room. Under the lock."""
        return self.ready and not self.pending and self.running == 0

    def facts(self) -> dict | None:
        """What /api/ps shows of a loaded model; None once it is unloading. `expires_at`: a
        time.monotonic() reading, None for never."""
        with self.cond:
            if not self.ready or not self.slots:
                return None
            engine = self.slots[0].engine
            size = sum(e.plan.used_bytes for e in engines_of(self.slots))
            expires = self.expires_at
            if expires is None and self.keep_alive is not None:  # busy: its keep_alive counts from the end
                expires = time.monotonic() + self.keep_alive
            return {"ctx": engine.ctx, "size": size, "size_vram": size if engine.backend == "cuda" else 0,
                    "expires_at": expires}

    # -- the thread ---------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._load()
        except Exception as e:  # noqa: BLE001  (every waiting request is told; the server lives on)
            if isinstance(e, NervaError):
                log.error("loading %s failed: %s", self.key, e)
                self.error = ApiError(500, f"loading {self.key} failed: {e}")
            else:
                log.exception("loading %s failed", self.key)
                self.error = ApiError(500, f"loading {self.key} failed (the server's log has the details)")
            self._close(self.error)
            self.loaded.set()
            return
        while True:
            with self.cond:
                self._take_waiting()
                busy = [s for s in self.slots if s.job is not None]
                if not busy:
                    if self._expired():
                        break
                    timeout = None if self.expires_at is None else max(0.0, self.expires_at - time.monotonic())
                    self.cond.wait(timeout)
                    continue
            # a round: one step of each running request, the decode steps of one engine together
            for slot in busy:
                if slot.job.cancelled or not isinstance(slot.step, Decode):
                    self._step(slot)
            decoding = [s for s in busy if s.job is not None and isinstance(s.step, Decode)]
            for engine in engines_of(decoding):
                self._decode_together([s for s in decoding if s.engine is engine])
        log.info("%s: unloaded", self.key)
        self._close(None)

    def _load(self) -> None:
        from nerva_cli.runtime.open_engine import SILENT, open_engine

        opts, n = self.registry.engine_options, self.registry.parallel
        engines = 1 if self.registry.batching else n
        if self.registry.batching:
            opts = replace(opts, seq_slots=n)
        if self.room is not None:  # its share of the server's RAM budget, split between its engines
            opts = replace(opts, ram_budget=str(self.room // engines))
        started = time.perf_counter()
        # not in cli.app's long_lived_objects: its gc.freeze would keep, for the server's life, the
        # cyclic garbage of the requests in flight
        for i in range(engines):
            engine, _ = open_engine(str(self.model.path), opts, LogReporter(self.key) if i == 0 else SILENT)
            self.slots += [Slot(engine, seq) for seq in range(n)] if self.registry.batching else [Slot(engine)]
        if self.prompt_cache_bytes and all(getattr(e, "kv_rows_movable", False) for e in engines_of(self.slots)):
            self.prompts = PromptCache(self.prompt_cache_bytes)
        ready = self.slots[0].engine.load_kernels_aside(opts.threads)
        if ready is not None:  # numba's cached kernels and the sampler's, before the first request
            ready()
        with self.cond:
            self.ready = True
            if self.registry.ram_budget is not None:  # what they planned, paged or not
                self.bytes = sum(e.plan.used_bytes for e in engines_of(self.slots))
            self.load_ns = perf_counter_ns() - self.load_started_ns
            self._set_expiry()
        self.loaded.set()
        log.info("%s: loaded in %.2f s (%d sequence slot%s on %d engine%s, context %d; %s)", self.key,
                 time.perf_counter() - started, len(self.slots), "s" * (len(self.slots) > 1), engines,
                 "s" * (engines > 1), self.slots[0].engine.ctx,
                 f"a prompt cache of up to {human_bytes(self.prompt_cache_bytes)} in RAM" if self.prompts is not None
                 else "no prompt cache" + (" (its sliding-window layers' caches are rings)"
                                           if self.prompt_cache_bytes else ""))

    def _take_waiting(self) -> None:
        """The waiting requests, first come first served, each onto the free engine whose cache
        holds the most whole chunks of its prompt's start (a chat's next turn finds its
        conversation)."""
        while self.pending:
            free = [s for s in self.slots if s.job is None]
            if not free:
                return
            job = self.pending.popleft()
            slot = max(free, key=lambda s: common_prefix(s.prompt, job.prompt_ids) // s.engine.prefill_chunk)
            if slot.seq is not None:
                self._share_prefix(slot, job.prompt_ids)
            if self.prompts is not None:
                self._restore_prompt(slot, job.prompt_ids)
            job.started(max(0, self.load_started_ns + self.load_ns - job.arrived_ns))  # 0 where it was loaded
            e = slot.engine
            slot.job, slot.steps = job, answer_steps(job, slot.prompt, e.prefill_chunk, e.ctx, e.cfg.vocab_size)
            slot.step = next(slot.steps)  # its first step, Keep: no engine work yet
            self.expires_at = None
            self.last_used = time.monotonic()

    def _share_prefix(self, slot: Slot, ids: list[int]) -> None:
        """Where another slot of the engine holds more whole prefill chunks of `ids`' start than
        `slot` does (a system prompt another request, running or done, read), they are copied
        into `slot` (Engine.copy_prefix) rather than prefilled again: the same rows the chunks
        would make, so the answer does not change."""
        engine, chunk = slot.engine, slot.engine.prefill_chunk
        held = {s: reusable_prefix(s.prompt, ids, unit=chunk) for s in self.slots if s.engine is engine}
        donor = max(held, key=held.get)
        if held[donor] <= held[slot]:
            return
        with COMPUTE:
            engine.select(slot.seq)
            copied = engine.copy_prefix(donor.seq, held[donor])
        if copied:
            slot.prompt[:] = donor.prompt[:copied]

    def _restore_prompt(self, slot: Slot, ids: list[int]) -> None:
        """Where the prompt cache holds whole chunks of `ids` past those the slot's cache holds,
        one after another, they are copied into the slot (Engine.set_kv_rows) rather than
        prefilled again: the rows those chunks' prefill made, so the answer does not change."""
        engine, chunk = slot.engine, slot.engine.prefill_chunk
        held = reusable_prefix(slot.prompt, ids, unit=chunk) // chunk
        keys = chunk_keys(ids, chunk, (len(ids) - 1) // chunk)  # whole chunks, a token left to run
        more = self.prompts.held_run(keys, held)
        if not more:
            return
        with COMPUTE:
            if slot.seq is not None:
                engine.select(slot.seq)
            engine.truncate(held * chunk)
            for j in range(held, held + more):
                engine.set_kv_rows(j * chunk, *self.prompts.get(keys[j]))
        slot.prompt[:] = ids[:(held + more) * chunk]

    def _keep_prompt(self, slot: Slot, start: int, tokens: list[int]) -> None:
        """A whole chunk the slot just prefilled at a chunk's start: its rows into the prompt cache."""
        engine, chunk = slot.engine, slot.engine.prefill_chunk
        if len(tokens) != chunk or start % chunk:
            return
        key = chunk_keys(slot.prompt[:start] + tokens, chunk, start // chunk + 1)[-1]
        with self.cond:
            if key in self.prompts:
                return
        with COMPUTE:
            if slot.seq is not None:
                engine.select(slot.seq)
            rows = engine.kv_rows(start, chunk)
        with self.cond:  # within what the server's RAM budget leaves, its own older chunks going first
            budget = self.registry.ram_budget
            limit = None if budget is None else self.prompts.bytes + budget - self.registry.held_bytes()
            self.prompts.put(key, *rows, limit=limit)

    def _step(self, slot: Slot) -> None:
        """One step of the slot's request (a cancelled one is dropped instead)."""
        if slot.job.cancelled:
            slot.steps.close()
            log.info("%s: a request was cancelled (its client went away) after %d tokens", self.key, slot.job.made)
            self._release(slot)
            return
        step, start = slot.step, len(slot.prompt)
        try:
            with COMPUTE:
                done = run_step(slot.engine, slot.seq, step)
            if self.prompts is not None and isinstance(step, Prefill):
                self._keep_prompt(slot, start, step.tokens)
        except Exception as e:  # noqa: BLE001  (that request fails alone; _failed says how)
            self._failed(slot, e)
            return
        self._send(slot, done)

    def _decode_together(self, group: list[Slot]) -> None:
        """The decode steps of requests on one engine, as one batched step where it has slots."""
        engine = group[0].engine
        try:
            with COMPUTE:
                if group[0].seq is None:
                    rows = [engine.decode(group[0].step.token)]
                else:
                    rows = engine.decode_batch([s.step.token for s in group], [s.seq for s in group])
        except Exception as e:  # noqa: BLE001
            for slot in group:
                self._failed(slot, e)
            return
        for slot, logits in zip(group, rows):  # each samples its row before the next engine call
            self._send(slot, logits)

    def _send(self, slot: Slot, result) -> None:
        """The step's result to the request's coroutine, which names its next step or ends."""
        try:
            slot.step = slot.steps.send(result)
            return
        except StopIteration:
            pass
        except Exception as e:  # noqa: BLE001
            self._failed(slot, e)
            return
        self._release(slot)

    def _failed(self, slot: Slot, e: Exception) -> None:
        if isinstance(e, NervaError):  # a request the engine refused (its checks): that request fails alone
            slot.job.fail(ApiError(400, str(e)))
        else:  # a bug: logged with its traceback, the other requests go on
            log.error("%s: a request failed", self.key, exc_info=e)
            slot.job.fail(ApiError(500, "internal server error (the server's log has the details)"))
        self._forget(slot)
        self._release(slot)

    def _release(self, slot: Slot) -> None:
        job = slot.job
        with self.cond:
            slot.job = slot.steps = slot.step = None
            self.keep_alive = job.keep_alive
            self.last_used = time.monotonic()
            self._set_expiry()

    @staticmethod
    def _forget(slot: Slot) -> None:
        """After a step that failed, what the cache holds is not known: the next request starts afresh."""
        slot.prompt.clear()
        if slot.seq is not None:
            slot.engine.select(slot.seq)
        slot.engine.reset()

    def _set_expiry(self) -> None:
        """ollama's rule: the last request's keep_alive counts from the end of its answer."""
        self.expires_at = None if self.keep_alive is None else time.monotonic() + self.keep_alive

    def _expired(self) -> bool:
        """Idle past its keep_alive, with nothing waiting: out of the registry at once (under
        its lock), so that no request is queued here while the engines close."""
        if self.pending or self.expires_at is None or time.monotonic() < self.expires_at:
            return False
        if self.registry.workers.get(self.key) is self:  # (an evicted one was taken out already)
            del self.registry.workers[self.key]
        return True

    def evict(self) -> None:
        """Out of the registry now, its engines closed by its thread: room for another model.
        Only an idle one, under the lock."""
        del self.registry.workers[self.key]
        self.keep_alive, self.expires_at = 0, time.monotonic()
        self.cond.notify_all()

    def _close(self, err: ApiError | None) -> None:
        with self.cond:
            if self.registry.workers.get(self.key) is self:
                del self.registry.workers[self.key]
            waiting, self.pending = list(self.pending), deque()
            slots, self.slots = self.slots, []
        for job in waiting:
            job.fail(err or ApiError(500, f"{self.key} was unloaded"))
        for slot in slots:
            slot.engine.close()

    def unload_when_idle(self, keep_alive: float | None) -> None:
        with self.cond:
            self.keep_alive = keep_alive
            if self.ready and self.running == 0:
                self._set_expiry()
            self.cond.notify()


class Registry:
    """The models loaded (or loading) and the admission of requests to them."""

    def __init__(self, engine_options, parallel: int, max_queue: int, keep_alive: float | None,
                 prompt_cache: int = 0):
        self.engine_options, self.parallel, self.max_queue = engine_options, parallel, max_queue
        self.keep_alive = keep_alive
        self.prompt_cache = prompt_cache  # bytes of a model's prompt cache, at most
        self.lock = threading.Lock()
        self.workers: dict[str, ModelWorker] = {}
        self.metrics = None  # set by the app (metrics read this registry's counts)
        self.ram_budget = server_ram_budget(engine_options)
        # the cpu and ref engines hold several sequences (one engine of --parallel slots)
        self.batching = resolve(engine_options.backend) != "cuda"

    def running(self) -> int:
        with self.lock:
            return sum(w.running for w in self.workers.values())

    def waiting(self) -> int:
        with self.lock:
            return sum(len(w.pending) for w in self.workers.values())

    def prompt_cache_bytes(self) -> int:
        """What the loaded models' prompt caches hold now."""
        with self.lock:
            return sum(w.prompts.bytes for w in self.workers.values() if w.prompts is not None)

    def held_bytes(self) -> int:
        """The RAM the loaded models' engines planned and their prompt caches hold. Under the lock."""
        return sum(w.bytes + (w.prompts.bytes if w.prompts is not None else 0) for w in self.workers.values())

    def _over_slots(self) -> int:
        """Requests admitted beyond their model's free slots: those the --max-queue bounds."""
        return sum(max(0, w.running + len(w.pending) - self.parallel) for w in self.workers.values())

    def worker(self, key: str, model) -> ModelWorker:
        """The model's worker, started (its load begun) where there is none. Under the lock."""
        w = self.workers.get(key)
        if w is None:
            need = room = None
            if self.ram_budget is not None:
                need = planned_bytes(model, self.engine_options, self.parallel)
                room = self._make_room(key, need)
            w = self.workers[key] = ModelWorker(self, key, model, need, room, self.prompt_cache)
            log.info("%s: loading", key)
            w.start()
        return w

    def _make_room(self, key: str, need: int) -> int:
        """Unloads idle models, the least recently used first, until `need` bytes fit the
        server's RAM budget beside the models left; -> the room the new one gets (where the
        models still loaded are busy, less than `need`: its engines page past it). Under the lock."""
        held = self.held_bytes()
        for w in sorted(self.workers.values(), key=lambda w: w.last_used):  # prompt caches give way first
            if held + need <= self.ram_budget:
                break
            if w.prompts is not None:
                held -= w.prompts.shrink(max(0, w.prompts.bytes - (held + need - self.ram_budget)))
        idle = sorted((w for w in self.workers.values() if w.idle()), key=lambda w: w.last_used)
        while held + need > self.ram_budget and idle:
            victim = idle.pop(0)
            held -= victim.bytes
            log.info("%s: unloaded to make room for %s (%s of the RAM budget's %s held)", victim.key, key,
                     human_bytes(held + need), human_bytes(self.ram_budget))
            victim.evict()
        room = self.ram_budget - held
        if room <= 0:
            self.metrics.rejected.inc()
            raise ApiError(503, f"the server's RAM budget ({human_bytes(self.ram_budget)}) is held by models "
                                f"answering requests: {key} cannot load now; retry shortly",
                           code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
        return room

    def submit(self, job, model) -> None:
        """Queues `job` on its model (loading it first where it is not loaded), or refuses it at
        once with 503 when no slot is free for it and --max-queue requests already wait."""
        with self.lock:
            w = self.workers.get(job.key)
            if w is not None and w.running + len(w.pending) >= self.parallel and self._over_slots() >= self.max_queue:
                self.metrics.rejected.inc()
                raise overloaded()
            w = self.worker(job.key, model)
            w.pending.append(job)
            w.cond.notify()

    def cancel(self, job) -> None:
        """The client went away: a waiting job leaves the queue now, a running one before its
        next step."""
        with self.lock:
            w = self.workers.get(job.key)
            if w is not None and job in w.pending:
                w.pending.remove(job)
                log.info("%s: a waiting request was cancelled (its client went away)", job.key)
                return
            job.cancelled = True
            if w is not None:
                w.cond.notify()

    def load(self, key: str, model, keep_alive: float | None) -> ModelWorker:
        """ollama's load request (a prompt-less generate): the model loaded, its keep_alive set."""
        with self.lock:
            w = self.worker(key, model)
        w.unload_when_idle(keep_alive)
        return w

    def unload(self, key: str) -> None:
        """ollama's unload request (keep_alive 0 without a prompt): the model goes once idle."""
        with self.lock:
            w = self.workers.get(key)
        if w is not None:
            w.unload_when_idle(0)

    def loading(self) -> list[str]:
        with self.lock:
            return [k for k, w in self.workers.items() if not w.ready]

    def loaded(self) -> list[ModelWorker]:
        with self.lock:
            return [w for w in self.workers.values() if w.ready]

    def close(self) -> None:
        """At shutdown: every model unloads once idle (the threads are daemons: the process may end first)."""
        for w in self.loaded():
            w.unload_when_idle(0)
