"""The ledger's kernel count per token against a count taken where the kernels are dispatched."""

from __future__ import annotations

import pytest

from nerva_cli.planes import ref
from nerva_cli.planes.cpu import kernels as cpu
from nerva_cli.planes.cpu.engine import Engine
from nerva_cli.runtime.generate import generate
from nerva_cli.runtime.ledger import Ledger
from nerva_cli.runtime.sampling import Sampler, SamplingOptions
from nerva_cli.store.pull import pull

PROMPT = [5, 17, 99, 3, 250, 11]


def engine_with_counted_dispatch(monkeypatch, model, **kwargs):
    """An engine built while each kernel of the contract in the cpu module is wrapped by this
    test's own counter: it keeps the wrappers (the module gets its functions back at once, so
    numba compiles against the real ones). -> (engine, calls), calls[0] the kernels it called."""
    calls = [0]

    def counting(kernel):
        def counted(*args, **kw):
            calls[0] += 1
            return kernel(*args, **kw)

        return counted

    with monkeypatch.context() as m:
        for name in ref.KERNELS:
            if hasattr(cpu, name):
                m.setattr(cpu, name, counting(getattr(cpu, name)))
        engine = Engine(model, **kwargs)
    return engine, calls


@pytest.mark.parametrize("family, variant, precision", [
    ("llama", "q4_0", "w4a8"), ("qwen2", "q4_1", "w4a16"), ("qwen3", "q4_0", "w4a8"), ("gemma3", "q4_0", "w4a16"),
    ("gemma2", "f16", None), ("qwen3-hd48", "q4_0", "w4a8"), ("qwen3-h80", "q4_1", "w4a8")])
def test_the_ledger_counts_each_kernel_a_decode_step_runs(family, variant, precision, tiny_models, tmp_path,
                                                          monkeypatch):
    """The compiled decode halves run several kernels in one call each: the ledger counts every
    kernel in them, as many as the same layers dispatch one at a time (counted at the dispatch,
    here), where it counted about 4 a token for a 30-layer model (only those outside the halves)."""
    model = pull(str(tiny_models(family)), variant=variant, out=tmp_path / "m")
    layers = model.config.num_layers
    fused = Engine(model, precision=precision, ctx=64)
    assert len(fused.compiled_layers) == layers
    book = Ledger(fused)
    generate(fused, PROMPT, Sampler(SamplingOptions(temperature=0.0), model.config.vocab_size), 5, ledger=book)
    book.close()

    apart, calls = engine_with_counted_dispatch(monkeypatch, model, precision=precision, ctx=64)
    apart.compiled_layers.clear()  # every layer kernel by kernel, through the wrapped functions
    apart.prefill(PROMPT)
    before, engine_before = calls[0], apart.counters.kernels
    apart.decode(PROMPT[-1])
    dispatched = calls[0] - before
    assert dispatched >= 7 * layers  # at least norm, qkv, 2 ropes, attention, o, then the MLP's
    assert apart.counters.kernels - engine_before == dispatched
    assert [r.kernel_launches for r in book.records] == [dispatched] * len(book.records)
    # the host's calls: two halves a layer, the embedding, the final norm and the head's
    assert all(2 * layers < r.dispatches < dispatched for r in book.records)


def test_a_paged_engine_counts_its_kernels_too(tiny_models, tmp_path):
    """A paged layer runs kernel by kernel over its file's matrices: q, k and v apart, gate and up
    apart, three kernels more than a resident layer's fused ones."""
    from nerva_cli.planes.cpu.engine import residency_plan

    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    resident = Engine(model, ctx=64)
    budget = residency_plan(model, 64, None).used_bytes - model.meta["files"]["layer_001.bin"]["size"]
    paged = Engine(model, ctx=64, ram_budget=budget)
    assert paged.plan.paged_layers and len(paged.compiled_layers) < model.config.num_layers
    counts = []
    for engine in (resident, paged):
        book = Ledger(engine)
        generate(engine, PROMPT, Sampler(SamplingOptions(temperature=0.0), model.config.vocab_size), 4,
                 ledger=book)
        book.close()
        engine.close()
        counts.append({r.kernel_launches for r in book.records})
    assert len(counts[0]) == 1 and counts[1] == {counts[0].pop() + 3 * len(paged.plan.paged_layers)}


def test_bench_reports_the_kernels_and_calls_of_a_decode_step_as_the_ledger_counts_them(tiny_models, tmp_path):
    """bench's kernel_launches_per_token and dispatches_per_token (two hot-path checks' counts,
    the shorter one's taken away) match the ledger's per token on a generated run."""
    from nerva_cli.runtime.bench import decode_step_counts

    model = pull(str(tiny_models("llama")), variant="q4_0", out=tmp_path / "m")
    engine = Engine(model, precision="w4a8", ctx=64)
    book = Ledger(engine)
    generate(engine, PROMPT, Sampler(SamplingOptions(temperature=0.0), model.config.vocab_size), 5, ledger=book)
    book.close()
    kernels = {r.kernel_launches for r in book.records}
    calls = {r.dispatches for r in book.records}
    assert len(kernels) == len(calls) == 1
    assert decode_step_counts(engine, PROMPT, steps=4) == (0, kernels.pop(), calls.pop())
