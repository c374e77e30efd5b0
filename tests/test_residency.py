"""Residency: block states, the planner, paged decode under a RAM budget, the ledger."""

from __future__ import annotations

import json
import mmap

import numpy as np
import pytest

from nerva_cli.planes.cpu.engine import Engine, residency_plan
from nerva_cli.errors import NervaError
from nerva_cli.store.pull import pull
from nerva_cli.residency.planner import IllegalTransition, ResidentBlock, State, fitting_ctx, parse_budget, plan


def test_block_state_machine_refuses_illegal_transitions():
    b = ResidentBlock("layer", "layer_003", 4096, "host")
    with pytest.raises(IllegalTransition):
        b.move(State.READY)  # Unmapped -> Ready skips allocation and the read
    with pytest.raises(IllegalTransition):
        b.require_ready()  # nothing computes on a block that is not Ready
    for s in (State.ALLOCATED, State.PREFETCHING, State.READY, State.IN_USE, State.READY,
              State.EVICTING, State.UNMAPPED):
        b.move(s)
    assert b.version == 1
    b.move(State.ALLOCATED)
    with pytest.raises(IllegalTransition):
        b.move(State.IN_USE)  # Allocated -> InUse: its bytes were never read
    b.move(State.PREFETCHING)
    with pytest.raises(IllegalTransition):
        b.move(State.EVICTING)  # a read in flight is not evicted
    b.move(State.READY)
    b.require_ready()
    assert b.version == 2


def test_parse_budget():
    assert parse_budget("512M", "ram-budget") == 512 << 20
    assert parse_budget("1.5G", "ram-budget") == int(1.5 * (1 << 30))
    assert parse_budget("4096", "ram-budget") == 4096
    assert parse_budget("auto", "ram-budget") > 0
    assert parse_budget(None, "ram-budget") is None
    with pytest.raises(NervaError, match="ram-budget"):
        parse_budget("lots", "ram-budget")


def test_planner_fills_by_importance_and_refuses_too_small_budgets():
    fixed = {"kv_cache": ("kv_cache", 1000), "embed": ("embed", 500)}
    layers = {i: 100 for i in range(10)}
    whole = plan(fixed, layers, budget=None)
    assert whole.paged_layers == [] and whole.slots == 0
    p = plan(fixed, layers, budget=1500 + 2 * 100 + 300, importance={7: 1.0, 2: 0.9, 5: 0.8, 1: 0.1})
    assert p.resident_layers == [2, 5, 7] and p.paged_layers == [0, 1, 3, 4, 6, 8, 9]
    assert p.slots == 2 and p.used_bytes <= p.budget and p.paged_bytes_per_token == 700
    with pytest.raises(NervaError, match=r"smallest budget that works is .*\(1700 bytes\)"):
        plan(fixed, layers, budget=1699)


@pytest.fixture(scope="module")
def deep_tiny(tmp_path_factory):
    """family -> a 12-layer tiny model: deep enough that 30% of it holds the embeddings, two
    staging slots and some resident layers."""
    pytest.importorskip("transformers")
    from conftest import make_tiny_model

    root = tmp_path_factory.mktemp("deep")
    made = {}

    def get(family):
        if family not in made:
            made[family] = make_tiny_model(root / family, family, layers=12)
        return made[family]

    return get


def budget_at(model_engine: Engine, fraction: float) -> int:
    """KV cache and workspaces, plus `fraction` of the weights' bytes."""
    p = model_engine.plan
    weights = sum(f["size"] for f in model_engine.model.meta["files"].values())
    return int(sum(b.nbytes for b in p.fixed if b.kind in ("kv_cache", "workspace")) + fraction * weights)


def greedy(engine, prompt, n):
    toks = [int(np.argmax(engine.prefill(prompt)))]
    while len(toks) < n:
        toks.append(int(np.argmax(engine.decode(toks[-1]))))
    return toks


@pytest.mark.parametrize("family, variant, precision", [
    ("qwen3", "q4_0", "w4a8"), ("qwen3", "q4_1", "w4a16"), ("qwen3", "bf16", None),
    ("qwen3-hd48", "q4_0", "w4a8"), ("qwen3-h80", "q4_1", "w4a8")])  # f16 matrices among Q4 ones
def test_paged_layers_run_the_compiled_decode_layer_to_the_bit(family, variant, precision, deep_tiny, tmp_path,
                                                               rng):
    """A staging slot's layer runs the cpu plane's one decode layer (decode_layer_halves, bound for
    each layer the slot may hold), its q, k, v and gate, up apart as its file keeps them: the
    logits equal the resident engine's to the bit, every step, and equal the paged engine's own
    kernel-by-kernel layer (the ref path) to the bit too."""
    model = pull(str(deep_tiny(family)), variant=variant, out=tmp_path / "m")
    prompt = [int(t) for t in rng.integers(0, 384, size=9)]
    steps = [int(t) for t in rng.integers(0, 384, size=12)]
    full = Engine(model, precision=precision, ctx=64)
    budget = budget_at(full, 0.4)
    runs = []
    for engine in (full, Engine(model, precision=precision, ctx=64, ram_budget=budget),
                   Engine(model, precision=precision, ctx=64, ram_budget=budget)):
        runs.append(engine)
    paged, apart = runs[1], runs[2]
    assert paged.plan.paged_layers
    for view in paged.weights.views():
        assert set(view.slot_halves) == set(paged.plan.paged_layers)
    for view in apart.weights.views():
        view.slot_halves = {}  # the kernel-by-kernel layer, as the ref backend runs it
    logits = []
    try:
        for engine in runs:
            engine.prefill(prompt)
            logits.append(np.array([engine.decode(t).copy() for t in steps]))
    finally:
        for engine in runs[1:]:
            engine.weights.close()
    np.testing.assert_array_equal(logits[1], logits[0])
    np.testing.assert_array_equal(logits[2], logits[0])


@pytest.mark.parametrize("variant", ["q4_0", "f16"])
@pytest.mark.parametrize("policy", ["ring", "lru"])
def test_paged_decode_equals_resident_at_30_percent(variant, policy, deep_tiny, tmp_path, rng):
    model = pull(str(deep_tiny("qwen2")), variant=variant, out=tmp_path / "m")
    prompt = [int(t) for t in rng.integers(0, 384, size=12)]
    full = Engine(model, ctx=128)
    want = greedy(full, prompt, 64)
    paged = Engine(model, ctx=128, ram_budget=budget_at(full, 0.3), policy=policy)
    assert paged.plan.paged_layers and paged.plan.used_bytes <= paged.plan.budget
    # the resident layers run compiled (cpu.decode_layer_halves), the paged ones kernel by kernel
    assert set(paged.compiled_layers) == set(paged.plan.resident_layers)
    try:
        assert greedy(paged, prompt, 64) == want
        s = paged.weights.stats
        passes = 1 + 63  # one prefill chunk, 63 decode steps
        extra = s.disk_bytes - passes * paged.plan.paged_bytes_per_token
        # exactly the paged bytes per pass; the ring may have read up to its slots ahead
        assert 0 <= extra <= paged.plan.slots * paged.plan.slot_bytes * (policy == "ring"), s
        # the reads are timed: lru reads inside compute's wait, so within its stall
        assert s.read_ns > 0 and (policy == "ring" or s.read_ns <= s.stall_ns), s
        full.reset(), paged.reset()  # unfused (paged) and fused (resident) matrices: the same GEMMs
        assert np.array_equal(paged.prefill(prompt), full.prefill(prompt))
    finally:
        paged.weights.close()


@pytest.mark.parametrize("variant", ["q4_0", "f16"])
def test_a_paged_gemma3_decodes_as_resident(variant, deep_tiny, tmp_path, rng):
    """Gemma 3's post norms come from a staging slot's views as from a resident layer's copies:
    paged, a 30-token prompt (past its 8-position window) and 40 greedy tokens are the resident
    engine's, and so are the prompt's logits, to the bit."""
    model = pull(str(deep_tiny("gemma3")), variant=variant, out=tmp_path / "m")
    prompt = [int(t) for t in rng.integers(0, 384, size=30)]
    full = Engine(model, ctx=128)
    want = greedy(full, prompt, 40)
    paged = Engine(model, ctx=128, ram_budget=budget_at(full, 0.5))
    assert paged.plan.paged_layers and paged.plan.used_bytes <= paged.plan.budget
    try:
        assert greedy(paged, prompt, 40) == want
        full.reset(), paged.reset()
        assert np.array_equal(paged.prefill(prompt), full.prefill(prompt))
    finally:
        paged.weights.close()


@pytest.mark.parametrize("variant,precision", [("q4_0", "w4a8"), ("q4_1", "w4a16"), ("f16", None)])
def test_paged_prefill_gemms_equal_resident_to_the_bit(variant, precision, deep_tiny, tmp_path, rng):
    """A prompt past the short-chunk kernels (SHORT_PREFILL_MOST) goes through the GEMMs, where a
    paged layer multiplies q, k, v and gate, up apart and a resident one its fused matrices:
    the logits are the same to the bit. (At these tiny widths OpenBLAS's bits hardly depend on
    the slices; test_kernels.py's stack test holds the slicing at SmolLM2's shapes.)"""
    from nerva_cli.planes.ref import SHORT_PREFILL_MOST

    model = pull(str(deep_tiny("qwen2")), variant=variant, out=tmp_path / "m")
    prompt = [int(t) for t in rng.integers(0, 384, size=SHORT_PREFILL_MOST + 37)]
    full = Engine(model, precision=precision, ctx=128)
    paged = Engine(model, precision=precision, ctx=128, ram_budget=budget_at(full, 0.3))
    assert paged.plan.paged_layers
    try:
        assert np.array_equal(paged.prefill(prompt, all_logits=True), full.prefill(prompt, all_logits=True))
    finally:
        paged.weights.close()


@pytest.mark.parametrize("variant", ["q4_0", "f16"])
def test_an_untied_token_table_stays_in_its_file_for_a_layer(variant, deep_tiny, tmp_path, rng, cli):
    """Under a RAM budget that pages layers, an untied token table (a token reads one row) is
    mapped from its file instead of read into RAM, where that lets a layer stay resident: the
    greedy tokens are the resident engine's and the pager still reads exactly the paged layers.
    A tied table is the lm_head, read whole every token: it stays, as does an untied one when
    nothing is paged or leaving it out would page as much."""
    from nerva_cli.model.layout import layer_file

    model = pull(str(deep_tiny("llama-untied")), variant=variant, out=tmp_path / "m")
    prompt = [int(t) for t in rng.integers(0, 384, size=12)]
    full = Engine(model, ctx=128)
    assert not full.plan.table_aside
    want = greedy(full, prompt, 24)
    files = model.meta["files"]
    layer, table = files[layer_file(0)]["size"], files["embed.bin"]["size"]
    fixed = sum(b.nbytes for b in full.plan.fixed)  # with the table
    budget = fixed + 2 * layer + max(0, layer - table)  # short of a layer with the table, not without
    with_table = plan({b.name: (b.kind, b.nbytes) for b in full.plan.fixed}, full.plan.layer_bytes, budget)
    paged = Engine(model, ctx=128, ram_budget=budget)
    p = paged.plan
    assert p.table_aside and "embed" not in {b.name for b in p.fixed} and p.used_bytes <= budget
    assert len(p.resident_layers) > len(with_table.resident_layers)
    assert p.to_dict()["token_table_aside"] is True
    for a in (x for x in (paged.embed.w, paged.embed.q8, paged.embed.qs, paged.embed.d) if x is not None):
        while isinstance(a, np.ndarray):
            a = a.base
        assert isinstance(a.obj if isinstance(a, memoryview) else a, mmap.mmap)  # views of the file's map
    try:
        assert greedy(paged, prompt, 24) == want
        extra = paged.weights.stats.disk_bytes - 24 * p.paged_bytes_per_token  # a prefill pass, 23 steps
        assert 0 <= extra <= p.slots * p.slot_bytes  # the paged layers' bytes (the ring reads ahead), no table
    finally:
        paged.weights.close()
    if table < layer:  # moving it would page as much: it stays
        assert not residency_plan(model, 128, fixed + 2 * layer + (layer - table) // 2).table_aside
    tied = pull(str(deep_tiny("llama")), variant=variant, out=tmp_path / "tied")
    tied_full = residency_plan(tied, 128, None)
    tied_fixed, tied_layer = sum(b.nbytes for b in tied_full.fixed), max(tied_full.layer_bytes.values())
    assert not residency_plan(tied, 128, tied_fixed + 2 * tied_layer).table_aside
    code, out, err = cli("run", str(model.path), "-p", "the license", "-n", "2", "--temperature", "0", "--raw",
                         "--no-profile", "--ctx", "128", "--ram-budget", str(budget))
    assert code == 0, err
    assert "the token table stays in its file, a row read a token" in err
    code, out, err = cli("topology", "--model", str(model.path), "--no-profile", "--ctx", "128",
                         "--ram-budget", str(budget))
    assert code == 0, err
    assert "token table: mapped from its file, a row read a token" in out


def test_paged_smollm2_equals_resident_and_reads_exactly_the_paged_bytes(smollm2_store, cli):
    model = smollm2_store["q4_1"]
    prompt = list(range(1000, 1016))
    full = Engine(model, ctx=128)
    want = greedy(full, prompt, 64)
    budget = budget_at(full, 0.45)  # the Q8_0 token table alone is 31% of the weights' bytes
    paged = Engine(model, ctx=128, ram_budget=budget)
    try:
        assert len(paged.plan.paged_layers) > len(paged.plan.resident_layers)
        assert greedy(paged, prompt, 64) == want
    finally:
        paged.weights.close()
    code, out, err = cli("bench", model.path, "--ram-budget", str(budget), "--ctx", "128",
                         "--prompt-tokens", "16", "--gen-tokens", "24", "--repeat", "1", "--precision", "w4a16")
    assert code == 0, err
    r = json.loads(out)
    files = model.meta["files"]
    nonresident = sum(files[f"layer_{i:03d}.bin"]["size"] for i in range(30)) - \
        sum(files[f"layer_{i:03d}.bin"]["size"] for i in range(30)) * r["resident_layers"] // 30
    assert r["paged_layers"] == 30 - r["resident_layers"] > 0
    assert abs(r["disk_bytes_per_token"] / nonresident - 1) < 0.01, (r, nonresident)
    assert r["hot_path_allocations"] == 0
    assert 0 <= r["hit_rate"] <= 1 and r["stall_ms_per_token"] >= 0
    assert r["disk_read_bytes_per_s"] > 0
    assert r["disk_bound_tok_s"] == pytest.approx(r["disk_read_bytes_per_s"] / r["disk_bytes_per_token"], rel=1e-3)


def test_paged_decode_allocates_nothing_after_warmup(deep_tiny, tmp_path):

    model = pull(str(deep_tiny("llama")), variant="q4_0", out=tmp_path / "m")
    full = Engine(model, ctx=64)
    for policy in ("ring", "lru"):
        paged = Engine(model, ctx=64, ram_budget=budget_at(full, 0.3), policy=policy)
        try:
            assert paged.count_hot_path_allocations([3, 4, 5], steps=16) == 0, policy
        finally:
            paged.weights.close()


@pytest.mark.parametrize("damage", ["bytes", "size"])
def test_layer_file_changed_after_load_stops_the_run(damage, deep_tiny, tmp_path):
    model = pull(str(deep_tiny("llama")), variant="q4_0", out=tmp_path / "m")
    full = Engine(model, ctx=64)
    paged = Engine(model, ctx=64, ram_budget=budget_at(full, 0.3), policy="lru")
    try:
        victim = model.path / f"layer_{paged.plan.paged_layers[-1]:03d}.bin"
        paged.prefill([1, 2, 3])
        data = bytearray(victim.read_bytes())
        if damage == "bytes":
            data[100] ^= 0xFF
        else:
            data += bytes(4096)
        victim.write_bytes(bytes(data))
        with pytest.raises(NervaError, match=victim.name):
            for _ in range(3 * 4):  # a changed file is caught within IDENTITY_EVERY reads of it
                paged.decode(5)
    finally:
        paged.weights.close()


def test_budget_too_small_is_refused_before_any_work(deep_tiny, tmp_path, cli, monkeypatch):
    from nerva_cli.runtime import open_engine as runtime

    model = pull(str(deep_tiny("llama")), variant="q4_0", out=tmp_path / "m")
    code, out, err = cli("run", model.path, "-p", "hi", "--ram-budget", "64K", "--no-profile")
    assert code == 1 and "smallest budget that works" in err and out == ""

    def no_profiling(*args, **kwargs):  # the MCAP profile takes minutes on a large model
        raise AssertionError("profiled before refusing the budget")

    monkeypatch.setattr(runtime, "layer_plan", no_profiling)
    for command in (["run", model.path, "-p", "hi"], ["topology", "--model", model.path]):
        code, out, err = cli(*command, "--ram-budget", "64K")
        assert code == 1 and "smallest budget that works" in err and "profiled" not in err, err


def test_without_a_budget_a_model_larger_than_the_ram_available_pages(deep_tiny, tmp_path, cli, monkeypatch):
    from nerva_cli.residency import planner as residency

    model = pull(str(deep_tiny("llama")), variant="q4_0", out=tmp_path / "m")
    need = residency_plan(model, 64, None).used_bytes
    greedy_run = ["run", model.path, "-p", "the quick brown fox", "-n", "6", "--temperature", "0", "--raw",
                  "--no-profile", "--ctx", "64"]
    code, resident, err = cli(*greedy_run)
    assert code == 0 and "stream from disk" not in err, err
    monkeypatch.setattr(residency, "available_ram", lambda: int(need * 0.7 / 0.9))  # 70% of it is free
    code, paged, err = cli(*greedy_run)
    assert code == 0, err
    assert "needs" in err and "layers that do not fit stream from disk" in err and "layers resident" in err
    assert paged == resident
    code, _, err = cli(*greedy_run, "--ram-budget", str(need))  # a budget given is the budget
    assert code == 0 and "stream from disk" not in err, err
    monkeypatch.setattr(residency, "available_ram", lambda: 4096)  # not even the fixed part
    code, _, err = cli(*greedy_run)
    assert code == 1 and "smallest budget that works" in err

    def unknown():  # a system without MemAvailable or SC_AVPHYS_PAGES
        raise ValueError("unrecognized configuration name")

    monkeypatch.setattr(residency, "available_ram", unknown)
    code, out, err = cli(*greedy_run)
    assert code == 0 and out == resident and "stream from disk" not in err, err


def test_fitting_ctx_is_the_longest_context_that_fits(rng):
    for _ in range(200):
        per_position, rest = int(rng.integers(1, 1000)), int(rng.integers(0, 10**6))
        ctx, budget = int(rng.integers(1, 9000)), int(rng.integers(0, 10**7))
        at = lambda n: rest + per_position * n + n * n // 64  # noqa: E731  grows with n, as the workspaces do
        want = max((n for n in range(256, ctx, 256) if at(n) <= budget), default=None)
        assert fitting_ctx(at, budget, ctx) == want, (per_position, rest, ctx, budget)


def test_a_budget_too_small_at_this_context_names_one_that_fits(deep_tiny, tmp_path):
    model = pull(str(deep_tiny("llama")), variant="q4_0", out=tmp_path / "m")
    fixed = {n: sum(b.nbytes for b in residency_plan(model, n, None).fixed) for n in (256, 512)}
    slots = 2 * max(residency_plan(model, 512, None).layer_bytes.values())
    budget = fixed[256] + slots + (fixed[512] - fixed[256]) // 2
    with pytest.raises(NervaError, match=r"^RAM budget .* \(KV cache .*, workspaces .*, token table .*\) plus 2 "
                                         r"staging slots .* at --ctx 512; --ctx 256 fits"):
        Engine(model, ctx=512, ram_budget=budget)
    p = Engine(model, ctx=256, ram_budget=budget).plan
    assert p.used_bytes <= budget and p.paged_layers


def test_run_ledger_table_and_file(deep_tiny, tmp_path, cli):
    model = pull(str(deep_tiny("llama")), variant="q4_0", out=tmp_path / "m")
    full = Engine(model, ctx=64)
    path = tmp_path / "ledger.jsonl"
    code, out, err = cli("run", model.path, "-p", "the quick brown fox", "-n", "10", "--temperature", "0",
                         "--raw", "--no-profile", "--ctx", "64", "--ram-budget", str(budget_at(full, 0.3)),
                         "--ledger", "--ledger-file", path)
    assert code == 0, err
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert 1 <= len(rows) <= 10
    assert all(r["disk_bytes"] > 0 and r["kernel_launches"] > 0 and r["wall_us"] > 0 for r in rows)
    assert sum(r["disk_read_us"] for r in rows) > 0 and "/s while reading" in err
    assert rows[-1]["w4a16_layers"] == 12
    assert "ledger" in err and "summary" in err and ("O_DIRECT" in err or "buffered" in err)


@pytest.mark.parametrize("width", [80, 250])
def test_ledger_table_on_a_narrow_terminal_says_its_constant_columns_once(deep_tiny, tmp_path, width):
    import io

    from rich.console import Console

    from nerva_cli.runtime.generate import generate
    from nerva_cli.runtime.ledger import Ledger
    from nerva_cli.runtime.sampling import Sampler, SamplingOptions
    from nerva_cli.store.tokenizer import open_tokenizer

    model = pull(str(deep_tiny("llama")), variant="q4_0", out=tmp_path / "m")
    engine = Engine(model, ctx=64)
    book = Ledger(engine, open_tokenizer(model.path), None)
    generate(engine, [3, 4, 5], Sampler(SamplingOptions(temperature=0), engine.cfg.vocab_size), 6, ledger=book)
    book.close()
    text = io.StringIO()
    book.print_table(Console(file=text, force_terminal=True, width=width, color_system=None), every=1)
    lines = text.getvalue().splitlines()
    header = next(line for line in lines if "wall" in line)
    if width == 80:  # resident: no disk, no faults, the same precisions on every token
        assert "hits/faults" not in header and "…" not in text.getvalue()
        said = text.getvalue().split("the same on every token: ")[1].replace("\n", " ")
        assert "hits/faults 0/0" in said and "disk 0 B" in said
        table = lines[:next(i for i, line in enumerate(lines) if line.startswith("the same"))]
        assert all(len(line) <= 80 for line in table)
    else:
        assert "hits/faults" in header and not any(line.startswith("the same on every token") for line in lines)
