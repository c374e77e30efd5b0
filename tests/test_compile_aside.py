"""A first run's kernels compiled by two processes (planes/cpu/compile_aside.py, Engine.warm_up)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from numba import njit, prange

from nerva_cli.planes.cpu.compile_aside import CompileAside, compile_only
from nerva_cli.store.pull import pull

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="compile_aside forks")


@njit(parallel=True)
def _add_one(x):
    for i in prange(x.shape[0]):
        x[i] += 1


def test_compile_only_compiles_a_kernel_and_does_not_run_it(rng):
    x = rng.standard_normal(37).astype(np.float32)
    before, seen = x.copy(), []
    with compile_only(lambda: seen.append(1)):
        assert _add_one(x) is None
    assert np.array_equal(x, before) and seen == [1]
    assert len(_add_one.signatures) == 1
    _add_one(x)  # numba's own call again: compiled and run
    np.testing.assert_array_equal(x, before + 1)


def test_a_stuck_child_is_stopped_and_a_failing_one_reported():
    stuck = CompileAside(lambda: time.sleep(60))
    started = time.perf_counter()
    stuck.wait(patience=0.5)
    assert stuck.exit_code == -9 and time.perf_counter() - started < 10
    failing = CompileAside(lambda: 1 / 0)
    failing.wait()
    assert failing.exit_code == 1


# A fresh numba cache in a process of its own (numba fixes its cache directory at import)
FIRST_WARM_UP = """
import sys
from pathlib import Path
import numba
from numba.core import event
from nerva_cli.runtime import sampling
from nerva_cli.planes.cpu.kernels import counting_compiles
from nerva_cli.planes.ref import SHORT_PREFILL_MOST
from nerva_cli.planes.cpu.engine import Engine
from nerva_cli.store.catalog import load_metadata

model = load_metadata(Path(sys.argv[1]))
layers = model.config.num_layers
precisions = (["w4a8", "w4a16"] * layers)[:layers]
budget = None
if sys.argv[2] == "paged":  # the fixed part, two staging slots and two resident layers of six
    fixed = Engine(model, ctx=128, layer_precisions=precisions).plan.fixed
    budget = sum(b.nbytes for b in fixed) + 4 * model.meta["files"]["layer_000.bin"]["size"]
engine = Engine(model, ctx=128, layer_precisions=precisions, ram_budget=budget)
assert len(engine.plan.paged_layers) == (4 if sys.argv[2] == "paged" else 0), engine.plan.paged_layers
phase, compiled = ["before decode"], set()

class Seen(event.Listener):
    def on_start(self, ev):
        compiled.add((phase[0], ev.data["dispatcher"].py_func.__name__))
    def on_end(self, ev):
        pass

event.register("numba:compile", Seen())
decode = engine.decode
def decoding(token):
    phase[0] = "decode"
    return decode(token)
engine.decode = decoding
aside = engine.compile_aside()
vocab = model.config.vocab_size
told = []
with counting_compiles(told.append) as poll:
    engine.warm_up(aside, also=lambda: sampling.warm_kernels(vocab), progress=poll)
saved = len(list(Path(numba.config.CACHE_DIR).rglob("*.nbc")))
phase[0] = "answer"  # prompts short and long (past every short bound: the GEMMs), a draw, a decode step
sampler = sampling.Sampler(sampling.SamplingOptions(temperature=0.7, repeat_penalty=1.3, seed=1), vocab)
sampler.remember(5)
engine.decode(sampler(engine.prefill([3, 4, 5, 6, 7, 8, 9])))
engine.reset()
engine.decode(sampler(engine.prefill([3 + t % 300 for t in range(SHORT_PREFILL_MOST + 1)])))
engine.weights.close()
print(repr((aside.exit_code, told, saved, sorted(compiled))))
"""


@pytest.mark.parametrize("residency", ["resident", "paged"])
def test_a_first_warm_up_compiles_the_attention_half_in_a_child(tmp_path, residency):
    """On a fresh cache the child compiles the attention halves' kernels (a paged layer's from
    a slot, beside the pager's thread), the parent the prefill's, the MLP halves' and the
    sampler's, so that neither warm_up's real decode nor an answer after it compiles anything,
    however long its prompt.
    Prefill's attention the child compiles first, and the parent too where it reaches it first
    (a race either may win: neither is asserted)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: compile_aside does not fork")
    pytest.importorskip("transformers")
    from conftest import make_tiny_model

    model = pull(str(make_tiny_model(tmp_path / "hf", "llama", layers=6)), variant="q4_0", out=tmp_path / "m")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(FIRST_WARM_UP), str(model.path), residency],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    code, told, saved, compiled = eval(out.stdout)  # compiled: (phase, kernel name) pairs
    assert code == 0, out.stdout
    # the progress a first run shows: kernels compiled by both processes, counted as they are saved
    assert told == sorted(told) and len(told) > 3 and told[-1] == saved > 10, (told, saved)
    assert not [k for phase, k in compiled if phase in ("decode", "answer")], compiled
    names = {k for _, k in compiled}
    assert {"_mlp", "rope", "sample_logits", "penalise"} <= names  # compiled here
    assert not names & {"_attention_inputs", "_attention_decode"}, compiled  # loaded from the child's


def test_a_first_compile_shows_kernels_compiled_not_an_estimate(tiny_models, tmp_path, monkeypatch):
    """The first run's compile said "about 10 s" where it took 38-54 s on 2 cores (issue 49.11):
    it says what it is doing, shows the kernels compiled so far, and the count and time after."""
    import re
    import shutil
    from contextlib import contextmanager

    from nerva_cli.planes.cpu import kernels as cpu
    from nerva_cli.planes.cpu.engine import Engine

    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    engine = Engine(model, ctx=64)
    shutil.rmtree(cpu.warm_marker("x").parent, ignore_errors=True)  # as on a machine's first run
    monkeypatch.setattr(cpu, "compiled_before", lambda decodes=True: False)
    titles, statuses, said = [], [], []

    @contextmanager
    def working(title):
        titles.append(title)
        yield statuses.append

    engine.prepare(1, True, say=said.append, working=working)
    assert titles == ["compiling the CPU kernels for this machine, once"]
    done = re.fullmatch(r"compiled (\d+) CPU kernels? in \d+\.\d s; later runs reuse them", said[-1]) or \
        re.fullmatch(r"compiled the CPU kernels in \d+\.\d s; later runs reuse them()", said[-1])  # none new
    assert done, said
    # on this session's cache the kernels may be there already (none compiled, none shown)
    counts = [int(re.fullmatch(r"(\d+) kernels? compiled", x)[1]) for x in statuses]
    assert counts == sorted(set(counts)) and counts[-1:] in ([], [int(done[1] or 0)]) and 0 not in counts, statuses
