#!/usr/bin/env python3
"""A batched decode step with a resident layer's compiled batch calls (batch_decode's
_batch_layer_fused) against the same step kernel by kernel (the fused calls turned off in the
same process), alternated, for B = 1, 4 and 8 sequence slots after 256-token prompts, SmolLM2
q4_0 at W4A8 on every layer: the median step time of each, in ms, as one JSON line.

    python3 scripts/batch_fused_ab.py THREADS
"""

import json
import statistics
import sys
import time

from nerva_cli.hardware.machine import configure_threads
T = int(sys.argv[1]); configure_threads(T)
from nerva_cli.runtime.open_engine import open_engine
from nerva_cli.runtime.options import EngineOptions
from nerva_cli.runtime.bench import concurrent_prompts
from nerva_cli.planes.cpu.batch_decode import BatchDecode
e, tok = open_engine("smollm2-135m:q4_0", EngineOptions(backend="cpu", ctx=512, threads=T, seq_slots=8, use_profile=False, precision="w4a8"))
prompts = concurrent_prompts(tok, 256, 8)
fused_planes = BatchDecode._fused_planes
def step_ms(B, fused, n=24):
    BatchDecode._fused_planes = fused_planes if fused else (lambda self, layer, rows: None)
    for s in range(B):
        e.select(s); e.reset(); e.prefill(prompts[s])
    toks, slots = [7] * B, list(range(B))
    for _ in range(3): e.decode_batch(toks, slots)
    t = []
    for _ in range(n):
        t0 = time.perf_counter(); e.decode_batch(toks, slots); t.append(time.perf_counter() - t0)
    return statistics.median(t) * 1e3
res = {(B, f): [] for B in (1, 4, 8) for f in (False, True)}
for r in range(4):
    for B in (1, 4, 8):
        for f in ((False, True) if r % 2 == 0 else (True, False)):
            res[(B, f)].append(step_ms(B, f))
out = {f"{B} {'fused' if f else 'kernel by kernel'}": round(statistics.median(v), 2) for (B, f), v in res.items()}
print(json.dumps(out))
