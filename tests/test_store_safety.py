"""The store under signals, concurrent writers, runs and damage (issue 49's items 1-4 and 9):
nothing left behind, no race to a traceback, one line naming what happened and the repair."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nerva_cli.store.catalog import models_root

REPO = Path(__file__).resolve().parent.parent

# `nerva ARGS` in a subprocess that stops at one point of a conversion until the test lets it go
# (the file `go` in $HOLD_DIR), after touching `held-<pid>` there: at the layer file named by
# $HOLD_AT, or (HOLD_AT=rename) at the rename of its temporary directory into place. The stops
# make the interleavings the tests need certain rather than likely.
HELD_NERVA = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from nerva_cli.store import catalog

    flags, at = Path(os.environ["HOLD_DIR"]), os.environ["HOLD_AT"]

    def hold():
        (flags / f"held-{os.getpid()}").touch()
        while not (flags / "go").exists():
            time.sleep(0.02)

    if at == "rename":
        real_rename = os.rename

        def rename(src, dst, *args, **kwargs):
            if ".tmp-" in str(src):
                hold()
            return real_rename(src, dst, *args, **kwargs)

        os.rename = rename
    else:
        real_init = catalog.LayerFileWriter.__init__

        def init(self, path):
            if Path(path).name == at:
                hold()
            real_init(self, path)

        catalog.LayerFileWriter.__init__ = init
    from nerva_cli.cli.app import main

    sys.argv = ["nerva", *sys.argv[1:]]
    main()
""")


def held_nerva(tmp_path, at: str, *args):
    flags = tmp_path / "flags"
    flags.mkdir(exist_ok=True)
    env = {**os.environ, "HOLD_DIR": str(flags), "HOLD_AT": at,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    err = open(tmp_path / f"stderr-{len(list(tmp_path.glob('stderr-*')))}", "w+")
    proc = subprocess.Popen([sys.executable, "-c", HELD_NERVA, *map(str, args)], env=env,
                            stdout=subprocess.DEVNULL, stderr=err, text=True)
    proc.stderr_file = err
    return proc


def wait_for(what, timeout: float = 120.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def stderr_of(proc) -> str:
    proc.stderr_file.seek(0)
    return proc.stderr_file.read()


def temp_dirs():
    return sorted(models_root().glob("*/.*.tmp-*"))


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


# -- 1: signals and temporary directories ------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_pull_ended_by_sigterm_or_sighup_leaves_no_temporary_directory(tiny_models, tmp_path, sig):
    proc = held_nerva(tmp_path, "layer_001.bin", "pull", tiny_models("llama"), "--name", "tiny", "--quant", "q4_0")
    try:
        wait_for(lambda: list((tmp_path / "flags").glob("held-*")))
        assert [p.name for p in temp_dirs()] == [f".q4_0.tmp-{proc.pid}"]  # mid-way: embed.bin written
        proc.send_signal(sig)
        assert proc.wait(60) == -sig, stderr_of(proc)  # cleaned up, then ended by the signal
    finally:
        proc.kill()
    assert "Traceback" not in stderr_of(proc)
    assert temp_dirs() == [] and not (models_root() / "tiny").exists()


@pytest.mark.parametrize("command", ["list", "pull", "rm", "convert"])
def test_a_temporary_directory_whose_writer_is_gone_goes_at_the_next_store_operation(tiny_models, cli, command):
    assert cli("pull", tiny_models("llama"), "--name", "tiny", "--quant", "q4_0")[0] == 0
    stale = models_root() / "tiny" / f".q4_0.tmp-{dead_pid()}"
    (stale / "sub").mkdir(parents=True)
    (stale / "layer_000.bin").write_bytes(bytes(5000))
    args = {"list": ["list"], "pull": ["pull", tiny_models("llama"), "--name", "tiny", "--quant", "q4_0"],
            "rm": ["rm", "tiny:q4_0"], "convert": ["convert", tiny_models("llama"), "--name", "other"]}[command]
    code, _, err = cli(*args)
    assert code == 0, err
    assert not stale.exists()


def test_list_json_counts_a_conversion_under_way(tiny_models, cli):
    """A temporary directory whose writer lives (here: this process) stays, and `list --json`
    shows it with its pid and size; the store's own models have status ok."""
    assert cli("pull", tiny_models("llama"), "--name", "tiny", "--quant", "q4_0")[0] == 0
    live = models_root() / "tiny" / f".f16.tmp-{os.getpid()}"
    live.mkdir()
    (live / "embed.bin").write_bytes(bytes(4096))
    code, out, _ = cli("list", "--json")
    rows = json.loads(out)
    assert code == 0 and [(r["name"], r["variant"], r["status"]) for r in rows] == [
        ("tiny", "f16", "writing"), ("tiny", "q4_0", "ok")]
    assert rows[0]["pid"] == os.getpid() and rows[0]["size"] == 4096 and live.exists()
    code, out, _ = cli("list")
    assert f"writing (pid {os.getpid()})" in out


# -- 2: one writer of a name at a time ----------------------------------------------------------
def test_two_concurrent_force_pulls_of_one_name_both_succeed(tiny_models, cli, tmp_path):
    """The second waits for the first's lock, saying whose, where they once raced to
    `os.rename ... Directory not empty`: each stops at its rename until both are under way."""
    src = tiny_models("llama")
    assert cli("pull", src, "--name", "tiny", "--quant", "q4_0")[0] == 0
    args = ("pull", src, "--name", "tiny", "--quant", "q4_0", "--force")
    first = held_nerva(tmp_path, "rename", *args)
    flags = tmp_path / "flags"
    try:
        wait_for(lambda: (flags / f"held-{first.pid}").exists())
        second = held_nerva(tmp_path, "rename", *args)
        try:  # the second either waits for the lock (fixed) or reaches its own rename (the race)
            wait_for(lambda: "waiting for pid" in stderr_of(second) or (flags / f"held-{second.pid}").exists())
            (flags / "go").touch()
            assert first.wait(120) == 0, stderr_of(first)
            assert second.wait(120) == 0, stderr_of(second)
        finally:
            second.kill()
    finally:
        first.kill()
    waits = [ln for ln in stderr_of(second).splitlines() if "waiting for pid" in ln]
    assert waits == [f"waiting for pid {first.pid}, which is writing tiny in the store"], stderr_of(second)
    assert "Traceback" not in stderr_of(first) + stderr_of(second)
    from nerva_cli.store.catalog import find_model

    assert find_model("tiny:q4_0").verify() == []
    assert sorted(p.name for p in (models_root() / "tiny").iterdir()) == ["q4_0"]


# -- 3: rm while a run reads the model ----------------------------------------------------------
# The smallest RAM budget the tiny llama runs in at --ctx 64, every layer streamed (the planner's
# error names it: "the smallest budget that works is ..."); it moves with the arena's buffers.
SMALLEST_BUDGET = "683992"


def paged_engine(name: str):
    """A run's engine over `name`, every layer streamed from disk (the smallest budget that works);
    nothing compiled ahead (decodes=False): the test reads layers, it does not compute."""
    from nerva_cli.runtime.open_engine import open_engine
    from nerva_cli.runtime.options import EngineOptions

    return open_engine(name, EngineOptions(backend="ref", use_profile=False, ctx=64, ram_budget=SMALLEST_BUDGET,
                                           decodes=False))


def test_rm_refuses_a_model_a_run_streams_and_removes_it_after(tiny_models, cli):
    """The behaviour chosen for issue 49.3: `rm` refuses, naming the run's pid, and the run goes on."""
    assert cli("pull", tiny_models("llama"), "--name", "tiny", "--quant", "q4_0")[0] == 0
    engine, _ = paged_engine("tiny")
    try:
        assert engine.plan.resident_layers == [] and len(engine.plan.paged_layers) == 3
        code, out, err = cli("rm", "tiny")
        assert code == 1 and out == "" and err.strip().splitlines() == [
            f"error: tiny:q4_0 ({models_root() / 'tiny' / 'q4_0'}) is in use by a run (pid {os.getpid()}): "
            "end that run first"], err
        code, _, err = cli("pull", tiny_models("llama"), "--name", "tiny", "--quant", "q4_0", "--force")
        assert code == 1 and "is in use by a run" in err and temp_dirs() == [], err
        assert len(list(engine.weights.layers())) == 3  # a pass: every layer read from disk again
    finally:
        engine.close()
    code, out, _ = cli("rm", "tiny")
    assert code == 0 and out == "deleted tiny:q4_0\n" and not (models_root() / "tiny").exists()


def test_a_layer_file_deleted_under_a_run_ends_it_in_one_line(tiny_models, cli, monkeypatch):
    """Deleted outside nerva (rm refuses): the run says which file went and how to convert the
    model again, where it died with FileNotFoundError's traceback from the pager's thread."""
    from nerva_cli.runtime import open_engine as runtime

    assert cli("pull", tiny_models("llama"), "--name", "tiny", "--quant", "q4_0")[0] == 0
    layer = models_root() / "tiny" / "q4_0" / "layer_002.bin"
    real = runtime.open_engine

    def open_then_delete(*args, **kwargs):
        opened = real(*args, **kwargs)
        layer.unlink()
        return opened

    monkeypatch.setattr(runtime, "open_engine", open_then_delete)
    code, out, err = cli("run", "tiny", "-p", "the quick", "-n", "4", "--no-profile", "--ctx", "64",
                         "--ram-budget", SMALLEST_BUDGET, "--backend", "ref")
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("error:")]
    assert code == 1 and "Traceback" not in err and len(lines) == 1, err
    assert f"{layer}: deleted while this run read it" in lines[0], err
    assert "`nerva pull " in lines[0] and "--name tiny --quant q4_0 --force` converts the model again" in lines[0]


# -- 4: damage ----------------------------------------------------------------------------------
def test_pull_over_a_damaged_model_names_the_damage_and_force(tiny_models, cli):
    src = tiny_models("llama")
    assert cli("pull", src, "--name", "tiny", "--quant", "q4_0")[0] == 0
    layer = models_root() / "tiny" / "q4_0" / "layer_001.bin"
    layer.write_bytes(layer.read_bytes()[:1000])
    code, out, err = cli("pull", src, "--name", "tiny", "--quant", "q4_0")
    assert code == 1 and "kept" not in err and len(err.strip().splitlines()) == 1, err
    assert "is damaged (layer_001.bin: 1000 bytes, metadata.json says" in err, err
    assert f"`nerva pull {src} --name tiny --quant q4_0 --force` converts it again" in err, err
    code, _, err = cli("run", "tiny", "-p", "hi", "-n", "1", "--no-profile", "--backend", "ref")
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 1 and len(errors) == 1 and f"{layer}: size 1000 disagrees" in err, err
    assert f"`nerva pull {Path(src).resolve()} --name tiny --quant q4_0 --force` converts the model again" in err, err
    assert cli("pull", src, "--name", "tiny", "--quant", "q4_0", "--force")[0] == 0
    assert cli("run", "tiny", "-p", "hi", "-n", "1", "--no-profile", "--backend", "ref")[0] == 0


def test_pull_over_an_unreadable_metadata_json_names_force(tiny_models, cli):
    src = tiny_models("llama")
    assert cli("pull", src, "--name", "tiny", "--quant", "q4_0")[0] == 0
    (models_root() / "tiny" / "q4_0" / "metadata.json").write_text("{bad")
    code, _, err = cli("pull", src, "--name", "tiny", "--quant", "q4_0")
    assert code == 1 and "not valid JSON" in err and "--force` converts it again" in err, err


def test_list_shows_a_broken_model_as_broken(tiny_models, cli):
    src = tiny_models("llama")
    for name in ("good", "bad"):
        assert cli("pull", src, "--name", name, "--quant", "q4_0")[0] == 0
    meta = models_root() / "bad" / "q4_0" / "metadata.json"
    meta.write_text("{bad")
    code, out, err = cli("list", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert code == 0 and rows["good"]["status"] == "ok" and rows["bad"]["status"] == "broken"
    assert str(meta) in rows["bad"]["error"] and "not valid JSON" in rows["bad"]["error"]
    code, out, err = cli("list")
    assert code == 0 and "bad:q4_0" in out and "broken" in out and "good:q4_0" in out
    assert "`nerva rm bad:q4_0`" in err
    assert cli("rm", "bad")[0] == 0 and not (models_root() / "bad").exists()


# -- 9: name:latest -----------------------------------------------------------------------------
def test_latest_is_the_variant_a_bare_name_picks(tiny_models, cli):
    src = tiny_models("llama")
    assert cli("pull", src, "--name", "tiny:latest", "--quant", "q4_0")[0] == 0
    assert cli("pull", src, "--name", "tiny", "--quant", "f16")[0] == 0
    code, out, _ = cli("show", "tiny:latest", "--json")
    assert code == 0 and json.loads(out)["variant"] == "q4_0"
    code, out, err = cli("run", "tiny:LATEST", "-p", "hi", "-n", "1", "--no-profile", "--backend", "ref")
    assert code == 0, err
    code, out, _ = cli("rm", "tiny:latest")  # the variant `run tiny:latest` ran, not every variant
    assert code == 0 and out == "deleted tiny:q4_0\n"
    assert sorted(p.name for p in (models_root() / "tiny").iterdir()) == ["f16"]
    code, out, _ = cli("show", "tiny:latest", "--json")
    assert code == 0 and json.loads(out)["variant"] == "f16"


def test_latest_as_a_tag_of_an_alias_and_of_a_hub_repo():
    from nerva_cli.store.sources.resolve import alias_ref, hub_spec

    assert alias_ref("smollm2-135m:latest") == ("smollm2-135m", "auto")
    assert alias_ref("smollm2-135m:F16") == ("smollm2-135m", "f16")
    assert alias_ref("smollm2-135m:banana") is None and alias_ref("other:latest") is None
    assert hub_spec("hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:latest") == (
        "bartowski/SmolLM2-135M-Instruct-GGUF", None)
