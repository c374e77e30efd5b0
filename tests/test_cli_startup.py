"""What `nerva run` and `bench` do to start (and end) quickly: the engine's long-lived objects are
made with the cyclic collector off and then frozen out of its scans, in nerva's own process only,
as is everything when main returns; what numba and a one-prompt run import; and the options nerva
itself takes (--version)."""

from __future__ import annotations

import gc

import pytest

from nerva_cli.planes.cpu.engine import Engine
from nerva_cli.errors import NervaError
from nerva_cli.store.pull import pull


@pytest.fixture
def q4_model(tiny_models, tmp_path):
    return pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")


@pytest.fixture
def collector_seen(monkeypatch):
    """Records whether the collector ran while an Engine was built, and every gc.freeze()."""
    seen = {"enabled_in_engine": [], "freezes": 0}
    build = Engine.__init__

    def spying_init(self, *args, **kwargs):
        seen["enabled_in_engine"].append(gc.isenabled())
        build(self, *args, **kwargs)

    real_freeze = gc.freeze

    def spying_freeze():
        seen["freezes"] += 1
        real_freeze()

    monkeypatch.setattr(Engine, "__init__", spying_init)
    monkeypatch.setattr(gc, "freeze", spying_freeze)
    return seen


@pytest.mark.parametrize("command", ["run", "bench"])
def test_nervas_process_builds_the_engine_with_the_collector_off_then_freezes(command, q4_model, cli,
                                                                             collector_seen):
    args = (["-p", "hi", "-n", "2", "--temperature", "0", "--raw"] if command == "run"
            else ["--prompt-tokens", "4", "--gen-tokens", "2", "--repeat", "1"])
    code, _, err = cli(command, q4_model.path, *args, "--no-profile", "--ctx", "64")
    assert code == 0, err
    # the engine's objects once built, then everything as main returns (the interpreter's
    # finalisation then scans none of it)
    assert collector_seen == {"enabled_in_engine": [False], "freezes": 2}
    assert gc.isenabled()


def test_outside_nervas_process_the_collector_is_left_alone(q4_model, collector_seen):
    """A library user or a test that opens an engine: a freeze would keep the host process's
    uncollected cyclic garbage for good."""
    from nerva_cli.runtime.open_engine import open_engine
    from nerva_cli.runtime.options import EngineOptions

    engine, _ = open_engine(str(q4_model.path), EngineOptions(backend="cpu", ctx=64, threads=1, use_profile=False))
    assert collector_seen == {"enabled_in_engine": [True], "freezes": 0}
    assert gc.isenabled()
    del engine


def test_a_failed_engine_build_turns_the_collector_back_on(q4_model, cli, collector_seen, monkeypatch):
    def refuse(self, *args, **kwargs):
        collector_seen["enabled_in_engine"].append(gc.isenabled())
        raise NervaError("no engine today")

    monkeypatch.setattr(Engine, "__init__", refuse)
    code, _, err = cli("run", q4_model.path, "-p", "hi", "-n", "2", "--no-profile")
    assert code == 1 and "no engine today" in err
    assert collector_seen["enabled_in_engine"] == [False]
    assert gc.isenabled()


def test_version(cli):
    from nerva_cli import __version__

    for flag in ("--version", "-V"):
        code, out, _ = cli(flag)
        assert code == 0 and out == f"nerva {__version__}\n"


def _probe(tmp_path, code: str, cwd=None) -> str:
    """`code` run in a fresh interpreter (this one has imported everything already); -> stdout."""
    import subprocess
    import sys

    script = tmp_path / "probe.py"
    script.write_text(code)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.strip()


def test_numba_is_imported_without_scipy_and_yaml_which_still_import(tmp_path):
    """numba imports scipy only to check its version and PyYAML only to read a config file: the
    kernels import numba with both hidden (0.03-0.07 s a run), and both import as usual after."""
    pytest.importorskip("scipy")
    pytest.importorskip("yaml")
    out = _probe(tmp_path, """
import sys
import nerva_cli.planes.cpu.kernels.numba_setup
import numba
print("scipy" in sys.modules, "yaml" in sys.modules, end=" ")
import scipy, yaml
print(scipy.__version__ > "1" and yaml.safe_load("a: 1") == {"a": 1})
""")
    assert out == "False False True"


def test_a_numba_config_file_in_the_working_directory_is_still_read(tmp_path):
    pytest.importorskip("yaml")
    (tmp_path / ".numba_config.yaml").write_text("debuginfo: 1\n")
    out = _probe(tmp_path, """
import nerva_cli.planes.cpu.kernels.numba_setup
import numba
print(numba.core.config.DEBUGINFO_DEFAULT)
""", cwd=tmp_path)
    assert out == "1"


def test_a_one_prompt_run_imports_only_what_it_uses(q4_model, cli, tmp_path):
    """In a fresh process (this one has imported everything): `run -p` with --raw and
    --no-server imports neither rich (it prints nothing on stderr), jinja2 (no template), the
    server's modules nor the ledger's; its answer is the in-process one."""
    args = [str(q4_model.path), "-p", "the quick brown fox", "-n", "4", "--temperature", "0", "--raw",
            "--no-server", "--ctx", "64"]
    code, answer, err = cli("run", *args)
    assert code == 0, err
    out = _probe(tmp_path, f"""
import sys
from nerva_cli.cli.app import main
sys.argv = ["nerva", "run", *{args!r}]
try:
    main()
except SystemExit as e:
    assert not e.code, e.code
loaded = [m for m in ("rich", "jinja2", "nerva_cli.serve", "nerva_cli.runtime.ledger") if any(n == m or n.startswith(m + ".") for n in sys.modules)]
print("|", loaded)
""")
    said, _, loaded = out.rpartition("|")
    assert said == answer and loaded.strip() == "[]"
