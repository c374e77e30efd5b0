"""The prompt cache (residency/prompt_cache.py): chunk keys, least-recently-used eviction by bytes,
and an engine's KV rows moved out and back giving the logits a prefill gives, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from nerva_cli.errors import NervaError
from nerva_cli.planes.cpu.engine import Engine
from nerva_cli.residency.prompt_cache import PromptCache, chunk_keys
from nerva_cli.store.pull import pull


def test_chunk_keys_name_every_token_up_to_the_chunk_end(rng):
    ids = [int(t) for t in rng.integers(0, 50000, 40)]
    keys = chunk_keys(ids, 8, 5)
    assert len(keys) == 5 and len(set(keys)) == 5
    assert chunk_keys(ids[:24] + [7] * 16, 8, 5)[:3] == keys[:3]  # the same first 24 tokens
    changed = list(ids)
    changed[3] += 1  # a token of chunk 0 changes every later key
    assert not set(chunk_keys(changed, 8, 5)) & set(keys)
    shifted = [ids[0]] + ids[:-1]  # chunk 1's tokens at other positions: another key
    assert chunk_keys(shifted, 8, 2)[1] != keys[1]
    assert chunk_keys(ids, 8, 0) == []


def rows(nbytes: int, layers: int = 2):
    """A fake entry of `nbytes` in all: a K and a V array a layer."""
    one = np.zeros(nbytes // (2 * layers), np.uint8)
    return [one.copy() for _ in range(layers)], [one.copy() for _ in range(layers)]


def test_least_recently_used_chunks_go_first_and_bytes_stay_under_capacity():
    cache = PromptCache(1000)
    for key in (b"a", b"b", b"c"):
        assert cache.put(key, *rows(300))
    assert cache.bytes == 900
    assert cache.get(b"a") is not None  # a is now the most recent: b goes next
    assert cache.put(b"d", *rows(300))
    assert [k for k in (b"a", b"b", b"c", b"d") if k in cache] == [b"a", b"c", b"d"] and cache.bytes == 900
    assert cache.put(b"e", *rows(600))  # two must go: c, then a (used before d came)
    assert [k for k in (b"a", b"c", b"d", b"e") if k in cache] == [b"d", b"e"] and cache.bytes == 900
    assert not cache.put(b"f", *rows(1200))  # larger than the whole cache: not kept, nothing dropped
    assert cache.bytes == 900 and b"d" in cache and b"f" not in cache
    assert cache.put(b"d", *rows(300)) and cache.bytes == 900  # held already: not counted twice
    assert cache.get(b"zz") is None
    assert cache.held_run([b"d", b"e", b"x", b"d"], 0) == 2 and cache.held_run([b"d", b"e", b"x"], 2) == 0
    assert cache.put(b"g", *rows(300), limit=600)  # the server's budget leaves 600: e (least recent) goes
    assert [k for k in (b"d", b"e", b"g") if k in cache] == [b"d", b"g"] and cache.bytes == 600
    assert not cache.put(b"h", *rows(300), limit=200) and cache.bytes == 600
    assert cache.shrink(0) == 600 and cache.bytes == 0 and not cache.entries


@pytest.mark.parametrize("variant, precision", [("q4_0", "w4a8"), ("f16", None)])
def test_rows_moved_out_and_back_give_prefills_logits(variant, precision, tiny_models, tmp_path, rng):
    """Two whole chunks' rows taken from one slot (kv_rows) and written into another after a
    reset (set_kv_rows): the rest of the prompt and 4 greedy decode steps give the logits a slot
    that prefilled the whole prompt gives, bit for bit."""
    model = pull(str(tiny_models("llama")), variant=variant, out=tmp_path / "m")
    engine = Engine(model, precision=precision, ctx=64, seq_slots=2, prefill_rows=16)
    chunk = engine.prefill_chunk
    assert chunk == 16 and engine.kv_rows_movable
    ids = [int(t) for t in rng.integers(3, 250, 2 * chunk + 5)]
    engine.select(0)
    want = [engine.prefill(ids)]
    for _ in range(4):
        want.append(engine.decode(int(want[-1].argmax())).copy())
    k_rows, v_rows = engine.kv_rows(0, 2 * chunk)
    assert len(k_rows) == len(v_rows) == model.config.num_layers
    engine.select(1)
    engine.prefill(ids[:7])  # something else in the slot first
    engine.reset()
    engine.set_kv_rows(0, k_rows, v_rows)
    assert engine.n_past == 2 * chunk
    got = [engine.prefill(ids[2 * chunk:])]
    for _ in range(4):
        got.append(engine.decode(int(got[-1].argmax())).copy())
    for w, g in zip(want, got):
        assert np.array_equal(w, g)
    with pytest.raises(NervaError, match="set_kv_rows"):
        engine.set_kv_rows(0, k_rows, v_rows)  # not at the slot's end
    with pytest.raises(NervaError, match="kv_rows"):
        engine.kv_rows(0, 1000)


def test_a_model_that_needs_room_takes_it_from_prompt_caches_before_models():
    """The server's RAM accounting (Registry._make_room): prompt caches count as held, and give
    way first, the least recently used model's first; only then do idle models unload."""
    from types import SimpleNamespace

    from nerva_cli.runtime.options import EngineOptions
    from nerva_cli.serve.scheduler import Registry

    registry = Registry(EngineOptions(backend="cpu"), parallel=1, max_queue=1, keep_alive=None, prompt_cache=10_000)
    registry.ram_budget = 10_000
    evicted = []

    def worker(key, engines, cached, last_used):
        cache = PromptCache(10_000)
        for j in range(cached // 500):
            cache.put(f"{key}{j}".encode(), *rows(500))
        w = SimpleNamespace(key=key, bytes=engines, prompts=cache, last_used=last_used, idle=lambda: True)
        w.evict = lambda: evicted.append(key)
        registry.workers[key] = w
        return w

    old, new = worker("old", 3000, 2000, 1.0), worker("new", 3000, 1500, 2.0)
    assert registry.held_bytes() == 9500
    assert registry._make_room("third", 2000) == 2000  # 1500 of old's cache went, no model
    assert (old.prompts.bytes, new.prompts.bytes, evicted) == (500, 1500, [])
    assert registry._make_room("fourth", 3500) == 3500  # the rest of old's, then 1000 of new's
    assert (old.prompts.bytes, new.prompts.bytes, evicted) == (0, 500, [])
    assert registry._make_room("fifth", 5000) == 7000  # the caches emptied, a model goes: old, used least lately
    assert (new.prompts.bytes, evicted) == (0, ["old"])
