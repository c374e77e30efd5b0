"""scripts/paged_bench.py's RAM budget: the plan's fixed part (the token table included, which
must stay in RAM) plus a fraction of the layers, so the engine accepts it and pages the rest."""

from __future__ import annotations

import pytest

from conftest import load_script
from nerva_cli.planes.cpu.engine import Engine
from nerva_cli.store.pull import pull


@pytest.fixture(scope="module")
def paged_bench():
    return load_script("paged_bench")


@pytest.mark.parametrize("variant", ["q4_0", "q4_1"])
def test_the_budget_is_the_fixed_part_and_a_fraction_of_the_layers(paged_bench, tiny_models, tmp_path, variant):
    model = pull(str(tiny_models("llama")), variant=variant, out=tmp_path / "m")
    whole = Engine(model, ctx=64, precision="w4a16").plan
    fixed, layers = sum(b.nbytes for b in whole.fixed), sum(whole.layer_bytes.values())
    budget = paged_bench.ram_budget(model, 64, 0.7)
    assert budget == fixed + int(0.7 * layers)
    # the engine takes it (the token table counted) and pages what 70% of the layers cannot hold:
    # here all three, 70% of three layers holding the two staging slots but not a third layer
    p = Engine(model, ctx=64, ram_budget=budget, precision="w4a16").plan
    assert p.used_bytes <= budget and p.paged_layers == [0, 1, 2] and p.slots == 2
    assert not Engine(model, ctx=64, ram_budget=paged_bench.ram_budget(model, 64, 1.0)).plan.paged_layers
