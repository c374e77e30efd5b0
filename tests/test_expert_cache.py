"""A mixture's experts under a RAM budget (residency/expert_cache.py): the cache policies and
Belady's bound against plain reference caches written here, and cached runs against resident
runs of the same tiny MoE models (the same logits, bit for bit), their reads against the
replay of their own trace, and what a budget too small or a changed file gets."""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict

import numpy as np
import pytest

from nerva_cli.errors import BadInput, NervaError
from nerva_cli.model.layout import expert_span, layer_file
from nerva_cli.planes.cpu.engine import Engine, residency_plan
from nerva_cli.residency.expert_cache import ExpertSlots, replay, replay_policies
from nerva_cli.store.pull import pull

pytest.importorskip("transformers")

PROMPT = [5, 17, 99, 3, 250, 11, 42, 7, 300, 12, 64, 90]


# -- the policies against plain references -----------------------------------------------------
def reference_lru(seq: list[int], capacity: int) -> int:
    """Misses of an LRU cache of `capacity` over single accesses (an OrderedDict's)."""
    cache: OrderedDict[int, None] = OrderedDict()
    misses = 0
    for e in seq:
        if e in cache:
            cache.move_to_end(e)
            continue
        misses += 1
        if len(cache) == capacity:
            cache.popitem(last=False)
        cache[e] = None
    return misses


def reference_optimum(seq: list[int], capacity: int) -> int:
    """The fewest misses any cache of `capacity` can have over single accesses: a search over
    every eviction choice (small cases only), not Belady's rule."""
    from functools import lru_cache

    @lru_cache(maxsize=None)
    def best(n: int, held: frozenset) -> int:
        if n == len(seq):
            return 0
        e = seq[n]
        if e in held:
            return best(n + 1, held)
        if len(held) < capacity:
            return 1 + best(n + 1, held | {e})
        return 1 + min(best(n + 1, (held - {out}) | {e}) for out in held)

    return best(0, frozenset())


def skewed_trace(rng, experts: int, steps: int, k: int) -> list[np.ndarray]:
    """Steps of k distinct experts, some far more often chosen than others (as routers are)."""
    weights = rng.zipf(1.6, experts).astype(float)
    p = weights / weights.sum()
    return [np.sort(rng.choice(experts, k, replace=False, p=p)) for _ in range(steps)]


def test_lru_and_belady_against_references(rng):
    """One expert a step: the LRU policy's misses equal an OrderedDict LRU's, and Belady's equal
    the optimum found by searching every eviction (which no policy beats)."""
    for _ in range(30):
        experts, capacity = int(rng.integers(3, 7)), int(rng.integers(1, 4))
        seq = [int(e) for e in rng.integers(0, experts, int(rng.integers(5, 16)))]
        steps = [np.array([e]) for e in seq]
        assert replay(steps, experts, capacity, "lru")["misses"] == reference_lru(seq, capacity)
        optimum = reference_optimum(seq, capacity)
        assert replay(steps, experts, capacity, "belady")["misses"] == optimum
        assert replay(steps, experts, capacity, "lfu")["misses"] >= optimum


def test_policies_never_beat_belady_on_steps_of_k(rng):
    """Steps of k experts (a token's choices), skewed and uniform: no policy, with or without the
    look-ahead's prefetches, reads fewer experts than Belady's cache; a cache holding every
    expert reads each once; the look-ahead's prefetches are counted among the loads."""
    for skew in (True, False):
        experts, k, capacity = 16, 4, 7
        steps = skewed_trace(rng, experts, 200, k) if skew else \
            [np.sort(rng.choice(experts, k, replace=False)) for _ in range(200)]
        belady = replay(steps, experts, capacity, "belady")
        guesses = [np.sort(rng.choice(experts, k, replace=False)) for _ in steps]
        for policy in ("lru", "lfu"):
            assert replay(steps, experts, capacity, policy)["loads"] >= belady["loads"]
            ahead = replay(steps, experts, capacity, policy, guesses)
            assert ahead["loads"] >= belady["loads"] and ahead["prefetches"] > 0
            assert ahead["loads"] == ahead["misses"] + ahead["prefetches"]
        everything = replay(steps, experts, experts, "lru")
        assert everything["loads"] == len(np.unique(np.concatenate(steps)))


def test_a_step_never_evicts_its_own_experts():
    """The experts of one step all stay: a capacity of exactly k takes any step whole."""
    slots = ExpertSlots(8, 3, "lfu")
    for ids in ([0, 1, 2], [3, 4, 5], [2, 5, 7], [0, 1, 2]):
        slots.access(np.array(ids))
        assert sorted(slots.held.tolist()) == sorted(ids)


# -- cached runs against resident runs ---------------------------------------------------------
def budget_for(model, slots: int, seq_slots: int = 1) -> int:
    """A RAM budget whose plan caches `slots` experts a MoE layer (at --ctx 64)."""
    full = residency_plan(model, 64, None, seq_slots=seq_slots).used_bytes
    cfg = model.config
    for b in range(full, 0, -512):
        plan = residency_plan(model, 64, b, seq_slots=seq_slots)
        if plan.expert_layers and plan.expert_slots == slots:
            return b
    raise AssertionError(f"no budget caches {slots} of {cfg.num_experts} experts")


@pytest.mark.parametrize("family,variant,precision,backend,policy", [
    *(("olmoe", "q4_0", "w4a8", "cpu", p) for p in ("lru", "lfu", "lru+lookahead", "lfu+lookahead")),
    ("olmoe", "q4_0", "w4a16", "cpu", "lfu"), ("qwen2moe", "q4_1", "w4a8", "cpu", "lfu+lookahead"),
    ("mixtral", "f16", None, "cpu", "lru"), ("qwen3moe", "q4_0", "w4a8", "ref", "lfu+lookahead")])
def test_cached_experts_give_the_resident_logits(family, variant, precision, backend, policy, tiny_models, tmp_path):
    """Experts read from disk into a cache of k slots (every step a search for room) and of k + 2:
    the prompt's logits (a chunk's experts one at a time where the cache cannot hold them all)
    and 16 decode steps' equal the resident engine's bit for bit, on the cpu plane and the ref,
    and the cache did read (with the look-ahead, on its own thread too)."""
    model = pull(str(tiny_models(family)), variant=variant, out=tmp_path / "m")
    k = model.config.experts_per_token
    resident = Engine(model, ctx=64, precision=precision, backend=backend)
    want = [resident.prefill(PROMPT)]
    for step in range(16):
        want.append(resident.decode(int(np.argmax(want[-1]))))
    for slots in (k, k + 2):
        cached = Engine(model, ctx=64, precision=precision, ram_budget=budget_for(model, slots), expert_policy=policy,
                        backend=backend)
        try:
            assert cached.plan.expert_slots == slots and not cached.plan.paged_layers
            got = [cached.prefill(PROMPT)]
            for step in range(16):
                got.append(cached.decode(int(np.argmax(got[-1]))))
            for step, (a, b) in enumerate(zip(got, want)):
                assert np.array_equal(a, b), (slots, step)
            cached.weights.clear()  # waits for the prefetches still reading
            stats = cached.weights.stats
            assert stats.faults > 0 and stats.reads == stats.faults + stats.prefetched
            assert stats.disk_bytes == stats.reads * cached.weights.reader.nbytes
            line = cached.residency_lines()[0]
            assert f"keeps {slots} of its" in line or f"a slot for each of its {slots}" in line
        finally:
            cached.close()


def decode_run(engine, steps: int = 8) -> list:
    got = [engine.prefill(PROMPT)]
    for _ in range(steps):
        got.append(engine.decode(int(np.argmax(got[-1]))))
    return got


@pytest.mark.parametrize("family,direct", [("olmoe-pages", None), ("olmoe", False), ("olmoe", None)])
def test_reads_land_in_the_slots_where_the_layout_allows(family, direct, tiny_models, tmp_path):
    """An expert's span is read straight into its slot's rows where every plane is whole pages
    (olmoe-pages) or the file is read buffered (direct False: as on tmpfs), else (64-wide olmoe
    on a filesystem with O_DIRECT) through a staging buffer and copied: the same logits as
    resident either way, the look-ahead's reads too. A read that fails leaves its slot empty,
    and the next step reads the expert again."""
    model = pull(str(tiny_models(family)), variant="q4_0", out=tmp_path / "m")
    k = model.config.experts_per_token
    want = decode_run(Engine(model, ctx=64, precision="w4a8"))
    cached = Engine(model, ctx=64, precision="w4a8", ram_budget=budget_for(model, k + 1),
                    expert_policy="lfu+lookahead")
    try:
        if direct is not None:
            cached.weights.reader.direct = direct
        got = decode_run(cached)
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
        caches = [layer.moe.cache for layer in cached.weights.layers() if layer.moe is not None]
        assert {c.aligned for c in caches} == {family == "olmoe-pages"}
        assert {c.scatter for c in caches} == {family == "olmoe-pages" or not cached.weights.reader.direct}
        assert cached.weights.stats.prefetched > 0

        for cache in caches:  # no look-ahead read left running into the failing preadv
            cache.wait()
        cache = caches[0]
        held = int(np.flatnonzero(cache.slots.held >= 0)[0])
        expert = int(cache.slots.held[held])
        cache.slots.forget(held)

        def failing(*args):
            raise OSError(5, "Input/output error")

        real, os.preadv = os.preadv, failing
        try:
            with pytest.raises(OSError):
                cache.slots_for(np.array([expert]))
        finally:
            os.preadv = real
        assert cache.slots.slot_of[expert] == -1 and np.count_nonzero(cache.slots.held == expert) == 0
        slot = int(cache.slots_for(np.array([expert]))[0])
        assert cache.slots.held[slot] == expert
    finally:
        cached.close()


def test_batched_decode_with_cached_experts(tiny_models, tmp_path):
    """Two sequences in one batched step, experts cached in k slots (the rows' experts loaded one
    at a time where they do not fit): each row's logits equal its own sequence's resident decode
    bit for bit."""
    model = pull(str(tiny_models("qwen3moe")), variant="q4_0", out=tmp_path / "m")
    k = model.config.experts_per_token
    resident = Engine(model, ctx=64, precision="w4a8")
    cached = Engine(model, ctx=64, precision="w4a8", ram_budget=budget_for(model, k, 2), seq_slots=2)
    prompts = [PROMPT[:6], PROMPT[3:]]
    history = []
    for s, p in enumerate(prompts):
        cached.select(s)
        cached.prefill(p)
        resident.reset()
        history.append([int(np.argmax(resident.prefill(p)))])
    try:
        for _ in range(4):
            rows = cached.decode_batch([h[-1] for h in history], [0, 1])
            for s, p in enumerate(prompts):
                resident.reset()
                logits = resident.prefill(p)
                for t in history[s]:
                    logits = resident.decode(t)
                assert np.array_equal(rows[s], logits), s
                history[s].append(int(np.argmax(logits)))
    finally:
        cached.close()


def test_cache_reads_equal_the_replay_of_its_trace(tiny_models, tmp_path):
    """A run from empty caches reads exactly the experts the replay of its own trace says the
    policy would (prefill and decode steps alike), and Belady's replay reads no more."""
    from nerva_cli.residency.expert_cache import trace_steps

    model = pull(str(tiny_models("olmoe")), variant="q4_0", out=tmp_path / "m")
    cfg = model.config
    for policy in ("lru", "lfu", "lru+lookahead", "lfu+lookahead"):
        engine = Engine(model, ctx=64, precision="w4a8", ram_budget=budget_for(model, 3), expert_policy=policy)
        engine.expert_trace, engine.expert_predicted = [], []
        token = int(np.argmax(engine.prefill(PROMPT)))
        for _ in range(20):
            token = int(np.argmax(engine.decode(token)))
        engine.weights.clear()  # waits for the last prefetches
        replays = replay_policies(engine.expert_trace, cfg.num_experts, 3, engine.expert_predicted)
        stats = engine.weights.stats
        assert stats.faults == replays[policy]["misses"]
        assert stats.reads == stats.faults + stats.prefetched == replays[policy]["loads"]
        assert (stats.prefetched > 0) == policy.endswith("lookahead")
        assert replays["belady"]["loads"] <= replays[policy]["loads"]
        steps = trace_steps(engine.expert_trace, 3)
        assert sum(len(s) for s, _, _ in steps.values()) >= len(engine.expert_trace)
        engine.close()


def test_expert_cache_refusals(tiny_models, tmp_path, cli):
    """A budget that cannot hold the dense parts and k experts a layer names the smallest that
    works (exit 1); an unknown --expert-policy is refused before the model is read (exit 2); a
    layer file changed on disk is refused when the cache opens it."""
    model = pull(str(tiny_models("olmoe")), variant="q4_0", out=tmp_path / "m")
    k = model.config.experts_per_token
    with pytest.raises(NervaError, match=r"smallest budget that works is .* at --ctx 64") as e:
        Engine(model, ctx=64, ram_budget=budget_for(model, k) // 2)
    least = int(re.search(r"\((\d+) bytes\)", str(e.value)).group(1))
    assert residency_plan(model, 64, least).expert_slots == k  # what it names does work
    code, out, err = cli("run", str(model.path), "hello", "-n", "2", "--expert-policy", "fifo")
    assert code == 2 and "--expert-policy fifo: choose one of lru, lfu, lru+lookahead" in err and len(err.strip().splitlines()) == 1
    path = model.path / layer_file(model.config.moe_layers[0])
    offset, _ = expert_span(model.meta["files"][layer_file(model.config.moe_layers[0])]["tensors"], 1)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(BadInput, match="sha256 disagrees"):
        Engine(model, ctx=64, ram_budget=least)


def test_topology_and_bench_give_the_expert_cache(tiny_models, tmp_path, cli):
    """topology --model says how many experts each layer caches and bounds the disk bytes a
    token by every expert missing; bench's JSON gives the cache's hit rate, the disk bytes a
    decoded token and the replay's figures for every policy and Belady."""
    model = pull(str(tiny_models("olmoe")), variant="q4_0", out=tmp_path / "m")
    cfg, budget = model.config, budget_for(model, 3)
    code, out, err = cli("topology", "--model", str(model.path), "--ram-budget", str(budget), "--ctx", "64", "--json")
    assert code == 0, err
    plan = json.loads(out)["plan"]
    span = plan["experts"]["expert_bytes"]
    assert plan["expert_cache"] == {"layers": len(cfg.moe_layers), "slots_per_layer": 3, "expert_bytes": span}
    assert plan["experts"]["cached_per_layer"] == 3
    assert plan["tiers"]["disk"]["read_bytes_per_token"] == span * cfg.experts_per_token * len(cfg.moe_layers)
    code, out, err = cli("bench", str(model.path), "--ram-budget", str(budget), "--ctx", "64", "--prompt-tokens", "8",
                         "--gen-tokens", "12", "--repeat", "1")
    assert code == 0, err
    result = json.loads(out)
    cache = result["expert_cache"]
    assert result["policy"] == "expert cache (lfu)" and cache["slots_per_layer"] == 3
    assert 0 < cache["expert_hit_rate"] < 1 and result["expert_hit_rate"] == cache["expert_hit_rate"]
    replayed = cache["replay_disk_bytes_per_token"]
    assert set(replayed) == {"lru", "lfu", "belady", "lru+lookahead", "lfu+lookahead"}
    assert replayed["lfu"] == cache["expert_disk_bytes_per_token"]  # the run is its policy's replay
    assert replayed["belady"] <= min(replayed.values())
    assert cache["vs_belady"] >= 1 and 0 <= cache["lookahead_accuracy"] <= 1
    assert cache["reads_into_slots"] == (not result["direct_io"])  # 64-wide experts: whole pages they are not


@pytest.mark.parametrize("policy", ["lfu", "lfu+lookahead"])
def test_cached_decode_allocates_nothing(policy, tiny_models, tmp_path):
    """The hot path's allocation count holds with experts read on misses and, with the
    look-ahead, on its own thread."""
    model = pull(str(tiny_models("olmoe")), variant="q4_0", out=tmp_path / "m")
    engine = Engine(model, ctx=64, precision="w4a8", ram_budget=budget_for(model, 3), expert_policy=policy)
    try:
        assert engine.count_hot_path_allocations(PROMPT[:8], steps=16) == 0
        assert engine.weights.stats.faults > 0
    finally:
        engine.close()
