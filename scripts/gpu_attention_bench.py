#!/usr/bin/env python3
"""Prefill attention on a CUDA device: nerva's attention_prefill kernel (kernels/attention.cu,
launched by planes/cuda/launch.py as the engine launches it) against PyTorch's
scaled_dot_product_attention on the same shapes, measured in the same run, as ms a launch and
their ratio. The peer gets f16 q, K and V (nerva reads q in f32, K and V from its f16 cache),
causal with the queries at the end of the context (torch's causal_lower_right), GQA native.
Without a CUDA torch only nerva's figures are printed.

    python3 scripts/gpu_attention_bench.py [--json FILE]

Shapes: Llama-3-8B's heads (32, 8 kv, head dim 128) for a 512-token prompt, for the last 512
tokens of a 4096-token one, and for a 32-token chat turn after 4064 tokens of history (32
blocks of rows, whose positions prefill_splits divides between 9 blocks each on an H100's 132
SMs); SmolLM2-135M's (9, 3 kv, 64) for a 512-token prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
# label: (heads, kv heads, head dim, prompt tokens this pass, positions cached before it)
SHAPES = {"8b T512": (32, 8, 128, 512, 0), "8b T512 at 3584": (32, 8, 128, 512, 3584),
          "8b T32 at 4064": (32, 8, 128, 32, 4064), "135m T512": (9, 3, 64, 512, 0)}


def nerva_ms(dev, k, shape, rng) -> tuple[float, int]:
    """(ms a launch, splits), launched as the engine launches it."""
    from nerva_cli.planes.cuda.launch import prefill_partials, prefill_row_blocks, prefill_splits

    heads, kvh, hd, T, start = shape
    stride = (heads + 2 * kvh) * hd  # the q/k/v rows the engine passes, q first
    q = dev.upload(rng.standard_normal((T, stride)).astype(np.float32))
    kc, vc = (dev.upload(rng.standard_normal((start + T, kvh, hd)).astype(np.float16)) for _ in range(2))
    pos0 = dev.upload(np.array([start], np.int32))
    out = dev.zeros((T, heads, hd), np.float32)
    splits = prefill_splits(T, heads, kvh, hd, start + T, dev.sms)
    part = dev.zeros(prefill_partials(T, heads, kvh, hd, splits), np.float32)
    done = dev.zeros(prefill_row_blocks(T, heads, kvh, hd), np.int32)
    run = lambda: k.attention_prefill(q, stride, kc, vc, pos0, out, T, heads, splits, part, done)  # noqa: E731
    run()
    return float(np.median(dev.times_ms(run, rounds=20))), splits


def torch_ms(shape) -> float | None:
    try:
        import torch
        from torch.nn.attention.bias import causal_lower_right
        from torch.nn.functional import scaled_dot_product_attention
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    heads, kvh, hd, T, start = shape
    n = start + T
    q = torch.randn(1, heads, T, hd, device="cuda", dtype=torch.float16)
    kk, vv = (torch.randn(1, kvh, n, hd, device="cuda", dtype=torch.float16) for _ in range(2))
    mask = causal_lower_right(T, n)
    run = lambda: scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=True)  # noqa: E731
    run()
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start_ev.record()
        run()
        end_ev.record()
        end_ev.synchronize()
        times.append(start_ev.elapsed_time(end_ev))
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from nerva_cli.planes.cuda import launch as cuda

    dev = cuda.CupyDevice()
    k, rng = cuda.Kernels(dev), np.random.default_rng()
    rows = []
    for label, shape in SHAPES.items():
        (ours, splits), peer = nerva_ms(dev, k, shape, rng), torch_ms(shape)
        rows.append({"shape": label, "heads": shape[0], "kv_heads": shape[1], "head_dim": shape[2],
                     "tokens": shape[3], "cached_before": shape[4], "splits": splits, "nerva_ms": round(ours, 4),
                     "torch_sdpa_ms": None if peer is None else round(peer, 4),
                     "nerva_over_torch_time": None if peer is None else round(ours / peer, 2)})
        print(f"{label:<18} nerva {ours:8.3f} ms ({splits} split{'s' if splits > 1 else ''})   torch sdpa "
              + ("(no CUDA torch)" if peer is None else f"{peer:8.3f} ms   nerva/torch time {ours / peer:.2f}"))
    result = {"what": "prefill attention, one launch: nerva attention_prefill vs torch scaled_dot_product_attention",
              "device": dev.name, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
