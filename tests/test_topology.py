"""nerva topology: machine facts (checked, never guessed), the cached probe, and the residency plan
that `run` then uses."""

from __future__ import annotations

import json

import pytest

jsonschema = pytest.importorskip("jsonschema")  # a [test] requirement; not on every GPU machine

from nerva_cli.residency.arena import Arena
from nerva_cli.planes.cpu.engine import Engine, residency_plan
from nerva_cli.store.pull import pull

AVAIL = {"type": "object", "required": ["available", "reason"],
         "properties": {"available": {"type": "boolean"}, "reason": {"type": ["string", "null"]}}}
MEASURED = {"type": "object", "required": ["available"], "oneOf": [
    {"properties": {"available": {"const": True}, "gb_s": {"type": "number", "exclusiveMinimum": 0},
                    "how": {"type": "string", "minLength": 1}}, "required": ["gb_s", "how"]},
    {"properties": {"available": {"const": False}, "reason": {"type": "string", "minLength": 1}},
     "required": ["reason"]}]}
SCHEMA = {
    "type": "object",
    "required": ["cpu", "memory", "numa_nodes", "storage", "gpus", "gpudirect_storage", "peer_memory", "probe"],
    "properties": {
        "cpu": {"type": "object", "required": ["model", "physical_cores", "logical_cores", "simd", "caches"],
                "properties": {"model": {"type": "string"}, "physical_cores": {"type": "integer", "minimum": 1},
                               "logical_cores": {"type": "integer", "minimum": 1},
                               "caches": {"allOf": [AVAIL, {"required": ["levels"]}]},
                               "simd": {"type": "object", "required": ["avx2", "avx512f", "vnni", "avx512bf16", "amx", "neon"],
                                        "additionalProperties": {"type": "boolean"}}}},
        "memory": {"type": "object", "required": ["total_bytes", "available_bytes"],
                   "properties": {"total_bytes": {"type": "integer", "minimum": 1},
                                  "available_bytes": {"type": "integer", "minimum": 1}}},
        "numa_nodes": {"type": "array", "items": {"type": "object", "required": ["node", "cpus"]}},
        "storage": {"type": "object",
                    "required": ["path", "device", "fs_type", "free_bytes", "nvme", "o_direct"],
                    "properties": {"free_bytes": {"type": "integer", "minimum": 0}, "nvme": AVAIL,
                                   "o_direct": AVAIL}},
        "gpus": {"allOf": [AVAIL, {"required": ["devices"]}]},
        "gpudirect_storage": AVAIL, "peer_memory": AVAIL,
        "probe": {"oneOf": [{"type": "null"}, {
            "type": "object", "required": ["measured_at", "ram_read", "disk_read_o_direct", "h2d_pinned", "d2h_pinned"],
            "properties": {"measured_at": {"type": "string"}, "ram_read": MEASURED, "disk_read_o_direct": MEASURED,
                           "h2d_pinned": MEASURED, "d2h_pinned": MEASURED}}]},
    },
}


def topology_json(cli, *args):
    code, out, err = cli("topology", "--json", *args)
    assert code == 0, err
    info = json.loads(out)
    jsonschema.validate(info, SCHEMA)
    return info


def test_json_validates_and_reports_what_is_missing_with_a_reason(cli, nerva_home):
    info = topology_json(cli)
    assert nerva_home.is_dir()  # created when missing
    assert info["storage"]["path"] == str(nerva_home)
    assert info["probe"] is None
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert info["gpus"] == {"available": False, "reason": "cupy is not installed", "devices": []}
    assert not info["gpudirect_storage"]["available"] and info["gpudirect_storage"]["reason"]
    assert info["peer_memory"]["reason"]


def test_o_direct_is_tried_for_real(cli, nerva_home):
    info = topology_json(cli)
    assert info["storage"]["o_direct"]["available"] is True, info["storage"]
    assert not list(nerva_home.iterdir())  # the test file is gone


def test_probe_is_cached_and_shown_again(cli, nerva_home, monkeypatch):
    monkeypatch.setenv("NERVA_PROBE_MB", "16")
    info = topology_json(cli, "--probe")
    probed = info["probe"]
    assert probed["ram_read"]["gb_s"] > 0 and probed["disk_read_o_direct"]["gb_s"] > 0
    if not info["gpus"]["available"]:  # the copy probes say why, as the GPU entry does
        assert probed["h2d_pinned"] == {"available": False, "reason": info["gpus"]["reason"]}
    assert json.loads((nerva_home / "topology.json").read_text()) == probed
    assert topology_json(cli)["probe"] == probed
    code, out, _ = cli("topology")
    assert code == 0 and f"{probed['ram_read']['gb_s']} GB/s" in out and probed["measured_at"] in out
    assert [p.name for p in nerva_home.iterdir()] == ["topology.json"]


def test_arena_sizes_without_allocating(tiny_models, tmp_path):
    for family in ("llama", "qwen2", "gemma3"):
        cfg = pull(str(tiny_models(family)), variant="q4_0", out=tmp_path / family).config
        for ctx, chunk in ((48, 0), (400, 16)):  # gemma3's windowed layers: 8 + 64 + 16 rows at 400
            a = Arena(cfg, ctx, chunk=chunk)
            assert Arena.sizes(cfg, ctx, chunk=chunk) == (a.kv_bytes, a.nbytes)
    assert [c.shape[0] for c in a.k_cache] == [88] * 5 + [400]


@pytest.mark.parametrize("layers", [3, 12])
def test_plan_is_what_run_uses(layers, tiny_models, tmp_path, cli):
    from conftest import make_tiny_model

    src = tiny_models("llama") if layers == 3 else make_tiny_model(tmp_path / "deep", "llama", layers=12)
    model = pull(str(src), variant="q4_0", out=tmp_path / "m")
    fixed = sum(b.nbytes for b in residency_plan(model, 64, None).fixed)
    whole = fixed + sum(f["size"] for n, f in model.meta["files"].items() if n.startswith("layer_"))
    budget = str(fixed + (whole - fixed) * 3 // 4)
    shown = topology_json(cli, "--model", model.path, "--ram-budget", budget, "--ctx", "64", "--no-profile")["plan"]
    assert shown["decode_bound"] == {"available": False, "reason": "run with --probe for a bound"}
    engine = Engine(model, ctx=64, ram_budget=int(budget))
    try:
        assert shown["paged_layers"] and (shown["resident_layers"] or layers == 3)  # 3 layers: 2 are slots
        assert (shown["resident_layers"], shown["paged_layers"]) == (engine.plan.resident_layers,
                                                                     engine.plan.paged_layers)
        assert shown == {**shown, **engine.plan.to_dict()}
    finally:
        engine.weights.close()
    ledger = tmp_path / "ledger.jsonl"
    code, _, err = cli("run", model.path, "-p", "hi", "-n", "4", "--temperature", "0", "--raw", "--no-profile",
                       "--ctx", "64", "--ram-budget", budget, "--ledger-file", ledger)
    assert code == 0, err
    rows = [json.loads(line) for line in ledger.read_text().splitlines()]
    paged, ahead = shown["paged_bytes_per_token"], shown["slots"] * shown["slot_bytes"]
    assert rows and all(abs(r["disk_bytes"] - paged) <= ahead for r in rows), (rows, paged)
    assert abs(sum(r["disk_bytes"] for r in rows) - len(rows) * paged) <= ahead


def test_plan_bound_from_the_probe_and_profile_importance(tiny_models, tmp_path, cli, monkeypatch):
    from nerva_cli.runtime import mcap

    monkeypatch.setenv("NERVA_PROBE_MB", "16")
    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    fixed = sum(b.nbytes for b in residency_plan(model, 64, None).fixed)
    budget = str(fixed + 2 * max(f["size"] for f in model.meta["files"].values()) + 1)
    info = topology_json(cli, "--probe", "--model", model.path, "--ram-budget", budget, "--ctx", "64")
    plan, disk = info["plan"], info["probe"]["disk_read_o_direct"]
    assert plan["paged_layers"] and plan["decode_bound"]["available"]
    assert plan["decode_bound"]["tok_s"] == pytest.approx(disk["gb_s"] * 1e9 / plan["paged_bytes_per_token"])
    layers = mcap.plan_layers(model, None, 0.7, True, "full", 0.75)  # the profile topology computed
    assert layers.importance
    engine = Engine(model, ctx=64, ram_budget=int(budget), importance=layers.importance,
                    layer_precisions=layers.layer_precisions)
    try:
        assert (plan["resident_layers"], plan["paged_layers"]) == (engine.plan.resident_layers,
                                                                   engine.plan.paged_layers)
    finally:
        engine.weights.close()


@pytest.mark.parametrize("budget, says, exit_code", [("lots", "expected a size like", 2),  # not a size: usage
                                                    ("64K", "smallest budget that works", 1)])  # too small for the model
def test_bad_budget_is_one_error_line(budget, says, exit_code, tiny_models, tmp_path, cli):
    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    code, out, err = cli("topology", "--model", model.path, "--ram-budget", budget, "--no-profile")
    assert code == exit_code and out == ""
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and says in errors[0] and err.strip().endswith(errors[0]), err


def test_caches_come_from_sysfs_and_a_broken_entry_says_why(tmp_path):
    from nerva_cli.units import human_bytes
    from nerva_cli.hardware.topology import _caches_line, cpu_caches

    for i, (level, kind, size, shared) in enumerate([(1, "Data", "48K", "0"), (2, "Unified", "2048K", "0"),
                                                     (3, "Unified", "96M", "0-7,16-23")]):
        d = tmp_path / f"index{i}"
        d.mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
            (d / name).write_text(f"{value}\n")
    caches = cpu_caches(tmp_path)
    assert [(c["level"], c["type"], c["size_bytes"]) for c in caches["levels"]] == [
        (1, "data", 48 << 10), (2, "unified", 2 << 20), (3, "unified", 96 << 20)]
    assert _caches_line(caches, human_bytes) == "L1d 48.0 KB, L2 2.0 MB, L3 96.0 MB (cpus 0-7,16-23)"
    (tmp_path / "index1" / "size").write_text("lots\n")
    broken = cpu_caches(tmp_path)
    assert not broken["available"] and "index1" in broken["reason"]
    assert not cpu_caches(tmp_path / "none")["available"]
