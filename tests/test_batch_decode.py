"""Batched decode (Engine.decode_batch): sequences in slots of one engine, each over its own KV
cache, against the same sequences decoded alone and against transformers."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import hf_greedy
from nerva_cli.errors import NervaError
from nerva_cli.planes.cpu.engine import Engine, residency_plan
from nerva_cli.residency.arena import Arena, PrefillWorkspace
from nerva_cli.store.pull import pull

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# five prompts of different lengths; the tiny Gemmas' 8-position windows are passed by all but the first
PROMPTS = [[5, 17, 99], [3, 250, 11, 42, 7, 300, 12], [9, 8, 7, 6, 5, 4, 3, 2, 1, 100, 200],
           [44, 45, 46, 47, 48], [300, 301, 2, 4, 8, 16, 32, 64, 128, 256, 3, 5, 7, 11, 13, 17]]
STEPS = 14


def batch_run(engine: Engine, prompts, steps: int, leave=lambda step, slot: False):
    """Prefills prompt s into slot s, then `steps` batched steps, each slot its own greedy
    token, `leave(step, slot)` slots sitting a step out (the batch then has fewer rows). ->
    (tokens fed, logits returned) per slot: the prefill's logits first, then each step's."""
    fed, seen = [[] for _ in prompts], []
    for s, prompt in enumerate(prompts):
        engine.select(s)
        seen.append([engine.prefill(prompt).copy()])
    for step in range(steps):
        slots = [s for s in range(len(prompts)) if not leave(step, s)]
        tokens = [int(np.argmax(seen[s][-1])) for s in slots]
        logits = engine.decode_batch(tokens, slots)
        assert logits.shape == (len(slots), engine.cfg.vocab_size)
        for row, (s, t) in enumerate(zip(slots, tokens)):
            fed[s].append(t)
            seen[s].append(logits[row].copy())
    return fed, seen


def alone(engine: Engine, prompt, fed):
    """The same sequence on its own: prefill, then decode() token by token."""
    engine.reset()
    out = [engine.prefill(prompt).copy()]
    for t in fed:
        out.append(engine.decode(t).copy())
    return out


def largest_difference(a, b) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


CASES = [  # family, variant, precision, backend
    ("llama", "q4_0", "w4a8", "cpu"), ("llama-untied", "q4_1", "w4a16", "cpu"), ("qwen2", "q4_1", "w4a8", "cpu"),
    ("qwen3", "q4_0", "w4a16", "cpu"), ("qwen3", "f16", None, "cpu"), ("phi3", "q4_0", "w4a8", "cpu"),
    ("gemma2", "q4_0", "w4a8", "cpu"), ("gemma3", "q4_1", "w4a16", "cpu"), ("gemma3", "bf16", None, "cpu"),
    ("smollm3", "q4_0", "w4a8", "cpu"),
    ("llama", "q4_0", "w4a8", "ref"), ("qwen2", "f16", None, "ref"), ("gemma3", "q4_1", "w4a16", "ref"),
    ("gemma2", "f16", None, "ref"),
    # mixtures of experts: a step's rows choose different experts, each expert runs the rows that chose it
    ("qwen2moe", "q4_0", "w4a8", "cpu"), ("qwen3moe", "q4_0", "w4a16", "cpu"), ("olmoe", "q4_1", "w4a16", "cpu"),
    ("mixtral", "f16", None, "cpu"),
    ("mixtral", "q4_0", "w4a16", "ref")]


@pytest.mark.parametrize("family, variant, precision, backend", CASES)
def test_a_sequence_decodes_the_same_alone_and_in_a_batch(family, variant, precision, backend, tiny_models,
                                                          tmp_path, monkeypatch):
    """Five sequences of different prompt lengths in one engine, decoded together (some steps
    with a slot sitting out, so the batch changes size): each sequence's logits at every step
    equal, bit for bit, those of the sequence decoded alone by decode() in an engine of one slot,
    whatever the family, variant and precision. The Gemmas' sliding layers hold 16 rows
    (ROLLBACK 4, chunks of 4), so each slot's ring moves its rows on its own several times."""
    from nerva_cli.residency import arena

    monkeypatch.setattr(arena, "ROLLBACK", 4)
    model = pull(str(tiny_models(family)), variant=variant, out=tmp_path / "m")
    batched = Engine(model, backend=backend, precision=precision, ctx=64, prefill_rows=4, seq_slots=len(PROMPTS))
    single = Engine(model, backend=backend, precision=precision, ctx=64, prefill_rows=4)
    fed, seen = batch_run(batched, PROMPTS, STEPS, leave=lambda step, s: (step + s) % 4 == 0)
    for s, prompt in enumerate(PROMPTS):
        want = alone(single, prompt, fed[s])
        assert len(want) == len(seen[s]) and len(set(fed[s])) > 1
        assert all(np.array_equal(g, w) for g, w in zip(seen[s], want)), \
            f"slot {s}: largest difference {largest_difference(seen[s], want)}"
    if family.startswith("gemma"):
        assert batched.ring and (batched.a.kv_bases > 0).sum() >= 3  # the rings moved, each slot its own


@pytest.mark.parametrize("family, variant, precision, backend", [
    ("llama", "q4_0", "w4a8", "cpu"), ("qwen3", "f16", None, "cpu"), ("gemma2", "q4_0", "w4a8", "cpu"),
    ("llama", "q4_1", "w4a16", "ref")])
def test_a_prefix_copied_from_another_slot_answers_as_if_prefilled(family, variant, precision, backend,
                                                                    tiny_models, tmp_path):
    """copy_prefix: slot 1 takes slot 0's first whole prefill chunks of a shared prompt start
    (a system prompt another request read), prefills only the rest, and its logits, at the
    prefill and at every decode step after, equal bit for bit those of the same prompt prefilled
    whole in a fresh slot with the same chunk boundaries. A sliding layer whose ring has moved
    past the start gives nothing to copy (0), never a wrong row."""
    model = pull(str(tiny_models(family)), variant=variant, out=tmp_path / "m")
    engine = Engine(model, backend=backend, precision=precision, ctx=64, prefill_rows=4, seq_slots=3)
    shared = [5, 17, 99, 3, 250, 11, 42, 7]  # two chunks of 4
    first, second = shared + [300, 12, 9], shared + [44, 45, 46, 47, 48]
    engine.select(0)
    engine.prefill(first)
    engine.decode(8)  # the donor goes on decoding past the copied rows
    engine.select(1)
    assert engine.copy_prefix(0, len(shared)) == len(shared) and engine.n_past == len(shared)
    copied = [engine.prefill(second[len(shared):]).copy()]
    engine.select(2)
    whole = [engine.prefill(second).copy()]
    for t in (3, 1, 4, 1, 5):
        for slot, out in ((1, copied), (2, whole)):
            engine.select(slot)
            out.append(engine.decode(t).copy())
    assert all(np.array_equal(c, w) for c, w in zip(copied, whole)), largest_difference(copied, whole)
    if engine.ring:  # a donor whose window moved on (64 positions through 8-position windows)
        engine.select(0)
        engine.prefill(list(range(20, 60)))
        assert engine.a.kv_bases[0] > 0
        engine.select(1)
        assert engine.copy_prefix(0, 8) == 0


def test_a_paged_engine_decodes_a_batch_to_the_bit(tmp_path, rng):
    """Layers streamed from disk through staging slots (q, k, v and gate, up apart, as their
    files keep them) in a batched step: the same logits as the resident engine's decode()."""
    from conftest import make_tiny_model

    model = pull(str(make_tiny_model(tmp_path / "src", "qwen2", layers=12)), variant="q4_0", out=tmp_path / "m")
    full = Engine(model, precision="w4a8", ctx=64)
    weights = sum(f["size"] for f in model.meta["files"].values())
    fixed = sum(b.nbytes for b in residency_plan(model, 64, None, seq_slots=3).fixed if b.kind != "embed")
    paged = Engine(model, precision="w4a8", ctx=64, seq_slots=3, ram_budget=int(fixed + 0.4 * weights))
    assert paged.plan.paged_layers
    try:
        fed, seen = batch_run(paged, PROMPTS[:3], 8)
    finally:
        paged.weights.close()
    for s, prompt in enumerate(PROMPTS[:3]):
        assert all(np.array_equal(g, w) for g, w in zip(seen[s], alone(full, prompt, fed[s])))


@pytest.mark.parametrize("family, backend", [("llama", "cpu"), ("qwen3", "cpu"), ("gemma3", "cpu"), ("phi3", "ref")])
def test_batched_greedy_tokens_are_transformers(family, backend, tiny_models, tmp_path):
    """Three prompts decoded greedily together: each one's tokens are transformers' greedy
    continuation of it alone."""
    src = tiny_models(family)
    model = pull(str(src), variant="f16", out=tmp_path / "m")
    engine = Engine(model, backend=backend, ctx=64, kv_cache="f32", seq_slots=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 2:
                p.copy_(p.half().float())
    prompts = PROMPTS[1:4]
    fed, seen = batch_run(engine, prompts, 24)
    for s, prompt in enumerate(prompts):
        got = fed[s] + [int(np.argmax(seen[s][-1]))]
        assert prompt + got == hf_greedy(hf.eval(), prompt, len(got)), s


def test_slots_keep_their_own_positions_and_caches(tiny_models, tmp_path):
    """select() switches what prefill, decode, reset and truncate act on; the other slots keep
    their positions. Bad batches are refused in one line, before any slot moves."""
    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    engine = Engine(model, ctx=16, seq_slots=3)
    engine.prefill([1, 2, 3])
    engine.select(2)
    assert engine.n_past == 0
    engine.prefill([4, 5])
    engine.select(0)
    assert engine.n_past == 3 and engine.slot_n_past == [3, 0, 2]
    engine.decode_batch([7, 8], [0, 2])
    assert engine.slot_n_past == [4, 0, 3]
    engine.select(1)
    engine.reset()
    assert engine.slot_n_past == [4, 0, 3]
    for tokens, slots, says in (([1, 2], [0, 0], "appears twice"), ([1], [3], "does not exist"),
                                ([1, 2, 3, 4], [0, 1, 2, 0], "1 to 3 tokens"), ([1, 2], [0], "1 to 3 tokens"),
                                ([1, 999], [0, 1], "outside the vocabulary")):
        with pytest.raises(NervaError, match=says):
            engine.decode_batch(tokens, slots)
    assert engine.slot_n_past == [4, 0, 3]
    engine.select(2)
    engine.prefill(list(range(10, 23)))  # slot 2 full: 16 positions
    with pytest.raises(NervaError, match="context is full"):
        engine.decode_batch([1, 2], [0, 2])
    assert engine.slot_n_past == [4, 0, 16]


def test_the_plan_counts_every_slots_kv_cache(tiny_models, tmp_path):
    """The residency plan, the arena and the prefill workspace agree on their sizes with several
    slots, and the plan's KV cache is one slot's times their number."""
    model = pull(str(tiny_models("gemma3")), variant="q4_0", out=tmp_path / "m")
    cfg = model.config
    one, four = (residency_plan(model, 64, None, seq_slots=n) for n in (1, 4))
    kv = {n: sum(b.nbytes for b in p.fixed if b.kind == "kv_cache") for n, p in ((1, one), (4, four))}
    assert kv[4] == 4 * kv[1]
    a = Arena(cfg, 64, "f16", 16, seq_slots=4)
    assert Arena.sizes(cfg, 64, "f16", 16, seq_slots=4) == (a.kv_bytes, a.nbytes) and a.kv_bytes == kv[4]
    pw = PrefillWorkspace(cfg, 2, 64, batch=4)
    assert PrefillWorkspace.size(cfg, 2, 64, batch=4) == pw.nbytes and pw.rows == 2
    engine = Engine(model, ctx=64, seq_slots=4)  # prompt chunks of 64 rows
    assert engine.a.kv_bytes == kv[4]
    assert sum(b.nbytes for b in engine.plan.fixed if b.kind == "workspace") == \
        engine.a.nbytes - engine.a.kv_bytes + engine.pw.nbytes


@pytest.mark.parametrize("variant, precision", [("q4_0", "w4a8"), ("q4_1", "w4a16"), ("f16", None)])
def test_batched_decode_allocates_nothing_after_warmup(variant, precision, tiny_models, tmp_path):
    from nerva_cli.runtime.hotpath import AllocationCounter

    model = pull(str(tiny_models("gemma3")), variant=variant, out=tmp_path / "m")
    engine = Engine(model, precision=precision, ctx=64, seq_slots=4)
    for s in range(4):
        engine.select(s)
        engine.prefill(PROMPTS[s])
    tokens, slots = [3, 4, 5, 6], [0, 1, 2, 3]
    for _ in range(2):
        engine.decode_batch(tokens, slots)
    with AllocationCounter() as counter:
        for step in range(8):
            with counter.step():
                logits = engine.decode_batch(tokens, slots)
                tokens = [int(t) for t in logits.argmax(axis=1)]
    assert counter.count == 0


def test_bench_concurrency_reports_aggregate_and_per_sequence_rates(tiny_models, tmp_path, cli):
    """`nerva bench --concurrency N`: N sequences decoded together; the JSON line says N, the
    aggregate rate (N tokens a step) and a sequence's time per token (a step's)."""
    import json

    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    code, out, err = cli("bench", model.path, "--concurrency", "3", "--prompt-tokens", "12", "--gen-tokens", "5",
                         "--repeat", "2", "--no-profile", "--precision", "w4a8", "--backend", "cpu")
    assert code == 0, err
    got = json.loads(out)
    assert got["concurrency"] == 3 and got["hot_path_allocations"] == 0 and "3 sequences" in err
    assert got["aggregate_decode_tok_s"] == pytest.approx(3 * got["decode_tok_s"], rel=0.01)
    assert got["per_sequence_token_ms_p50"] == got["token_ms_p50"] > 0
    assert got["kv_cache_bytes"] == 3 * Engine(model, precision="w4a8", ctx=32).a.kv_bytes  # bench picks 32
    code, out, err = cli("bench", model.path, "--prompt-tokens", "12", "--gen-tokens", "5", "--repeat", "1",
                         "--no-profile", "--backend", "cpu")
    plain = json.loads(out)
    assert plain["concurrency"] == 1 and plain["aggregate_decode_tok_s"] == plain["decode_tok_s"]
