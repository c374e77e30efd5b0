#!/usr/bin/env python3
"""Would a profile's expert frequencies help the expert cache? Two expert traces of one mixture
under a RAM budget (greedy from bench's prompt, and a text fed token by token), each replayed
through lru, lfu and Belady's bound (residency/expert_cache.py), and through caches that evict by
a fixed frequency per expert instead of the counts so far: the trace's own final counts (an
oracle no run has) and the other trace's (what a profile of another text would give).

    python3 scripts/expert_trace_study.py synthetic-qwen3-30b-a3b --ram-budget 8G [--text FILE]

Disk bytes a decoded token over Belady's, per trace, as one JSON line. The fixed-frequency caches
are simulated here (they are not policies nerva runs); the simulation is checked against the
engine's own replay of lfu on the same steps, and stops if they differ.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from nerva_cli.hardware.machine import cpu_name
from nerva_cli.residency import expert_cache
from nerva_cli.runtime import bench
from nerva_cli.runtime.open_engine import open_engine
from nerva_cli.runtime.options import EngineOptions


def capture(engine, prompt: list[int], tokens: int, forced: list[int] | None) -> tuple:
    """bench's traced run from empty caches -> (trace, experts, capacity, measure_from)."""
    got = {}
    real = expert_cache.replay_policies

    def keep(trace, experts, capacity, predicted=None, measure_from=0):
        got["run"] = (trace, experts, capacity, measure_from)
        return real(trace, experts, capacity, predicted, measure_from)

    expert_cache.replay_policies = keep
    try:
        bench.expert_cache_figures(engine, prompt, tokens, lambda s: None, forced)
    finally:
        expert_cache.replay_policies = real
    return got["run"]


def evict_by(steps: list, measured: list, capacity: int, key, counts: np.ndarray | None = None) -> int:
    """Loads of a cache of `capacity` slots that fills the first empty slot, else evicts the
    expert (not chosen in this step) with the lowest key(e), then the least recently used, then
    the lowest slot (ExpertSlots' order); counted where `measured`. `counts`, where given, gains
    each step's experts before its evictions (a key reading it is lfu)."""
    held, last, loads = [-1] * capacity, {}, 0
    for n, ids in enumerate(steps):
        ids = [int(e) for e in ids]
        if counts is not None:
            np.add.at(counts, ids, 1)
        for e in ids:
            if e not in held:
                free = [s for s in range(capacity) if held[s] < 0]
                s = free[0] if free else min((s for s in range(capacity) if held[s] not in ids),
                                             key=lambda s: (key(held[s]), last[held[s]], s))
                held[s] = e
                loads += measured[n]
            last[e] = n
    return loads


def frequencies(trace: list, layer: int, experts: int) -> np.ndarray:
    f = np.zeros(experts)
    for i, ids in trace:
        if i == layer:
            np.add.at(f, np.unique(ids), 1)
    return f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--ram-budget", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64, help="tokens a trace decodes")
    ap.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses/Apache-2.0"))
    a = ap.parse_args()
    engine, tokenizer = open_engine(a.model, EngineOptions(ctx=512, threads=a.threads, ram_budget=a.ram_budget,
                                                           precision="w4a8"))
    try:
        if not engine.plan.expert_layers:
            raise SystemExit(f"{a.model} fits --ram-budget {a.ram_budget} whole: no expert cache to study")
        text = tokenizer.encode(a.text.read_text()[:20000], add_special=False)
        traces = {"greedy": capture(engine, bench.synthetic_prompt(tokenizer, a.prompt_tokens), a.tokens, None),
                  "text": capture(engine, text[:a.prompt_tokens], a.tokens,
                                  text[a.prompt_tokens:a.prompt_tokens + a.tokens])}
    finally:
        engine.close()
    out = {}
    for name, (trace, experts, capacity, start) in traces.items():
        other = traces["text" if name == "greedy" else "greedy"][0]
        layers = expert_cache.trace_steps(trace, capacity, None, start)
        runs = expert_cache.replay_policies(trace, experts, capacity, None, start)
        own = prior = lfu = 0
        for layer, (steps, _, measured) in layers.items():
            uses = np.zeros(experts)
            lfu += evict_by(steps, measured, capacity, lambda e: uses[e], uses)
            mine, theirs = frequencies(trace, layer, experts), frequencies(other, layer, experts)
            own += evict_by(steps, measured, capacity, lambda e: mine[e])
            prior += evict_by(steps, measured, capacity, lambda e: theirs[e])
        if lfu != runs["lfu"]["loads"]:
            raise SystemExit(f"the simulation's lfu read {lfu} experts, the engine's replay {runs['lfu']['loads']}")
        belady = runs["belady"]["loads"]
        out[name] = {"lru": round(runs["lru"]["loads"] / belady, 3), "lfu": round(runs["lfu"]["loads"] / belady, 3),
                     "fixed_own_final_counts": round(own / belady, 3),
                     "fixed_other_trace_counts": round(prior / belady, 3), "belady_loads": belady}
    print(json.dumps({"what": "expert cache loads over Belady's (scripts/expert_trace_study.py)", "cpu": cpu_name(),
                      "model": a.model, "ram_budget": a.ram_budget, "slots_per_layer": traces["greedy"][2],
                      "tokens": a.tokens, "text": str(a.text), "traces": out, "date": time.strftime("%Y-%m-%d")}))


if __name__ == "__main__":
    main()
