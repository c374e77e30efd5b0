#!/usr/bin/env python3
"""A random-weight Q4_0 (or Q4_1) model in nerva's store format, with the shapes of a real one: decode
speed depends on shapes and bytes, not on weight values, so this is what the GPU benchmarks run
where a real 8B checkpoint cannot be downloaded. Written by nerva's own converter (aligned layer
files, sha256, metadata.json); the tokenizer is a small BPE trained here.

    python3 scripts/synthetic_model.py llama3-8b OUT_DIR     (4.5 GB)
    python3 scripts/synthetic_model.py smollm2-135m OUT_DIR [--quant q4_1]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, head dim, vocab, rope theta, tied
    "llama3-8b": (4096, 14336, 32, 32, 8, 128, 128256, 500000.0, False),
    "smollm2-135m": (576, 1536, 30, 9, 3, 64, 49152, 100000.0, True),
}


def tokenizer_files() -> dict[str, str]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ("The history of computing is a story of memory as much as of arithmetic. " * 50).split(". ")
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
              "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(config)}


def source(shape: str, seed: int = 0, kind: str = "q4_0"):
    from nerva_cli.config import ModelConfig
    from nerva_cli.sources import Source, SourceTensor

    h, f, n, heads, kvh, hd, vocab, theta, tied = SHAPES[shape]
    cfg = ModelConfig(family="llama", hidden_size=h, intermediate_size=f, num_layers=n, num_heads=heads,
                      num_kv_heads=kvh, head_dim=hd, vocab_size=vocab, rms_eps=1e-5, rope_theta=theta,
                      max_context=8192, tie_embeddings=tied, bos_token_id=0, eos_token_ids=[1])
    rng = np.random.default_rng(seed)

    def tensor(name: str) -> SourceTensor:
        from nerva_cli.layout import global_files, layer_shapes

        base = name.rsplit(".", 1)[-1]
        shapes = {**{k: v for g in global_files(cfg).values() for k, v in g.items()}, **layer_shapes(cfg)}
        shape = shapes[base]
        if len(shape) == 1:  # norms near 1
            return SourceTensor(shape, lambda: (1 + 0.05 * rng.standard_normal(shape)).astype(np.float32))

        rows, cols = shape
        if base in ("embed", "lm_head"):  # the Q4 variants' token table is Q8_0 (quant.TABLE_KIND)
            def table():
                q8 = rng.integers(-127, 128, (rows, cols), dtype=np.int8)
                d = (rng.uniform(0.5, 1.5, (rows, cols // 32)) * 0.02 / 16 / np.sqrt(cols / 1024)).astype(np.float16)
                return q8, d, None

            return SourceTensor(shape, lambda: None, read_planes=table, stored_dtype="q8_0")

        def planes():
            qs = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
            d = (rng.uniform(0.5, 1.5, (rows, cols // 32)) * 0.02 / np.sqrt(cols / 1024)).astype(np.float16)
            # Q4_1's offset, the block's minimum: about -7.5 d for weights centred on 0
            m = (-d.astype(np.float32) * rng.uniform(7, 8, d.shape)).astype(np.float16) if kind == "q4_1" else None
            return qs, d, m

        return SourceTensor(shape, lambda: None, read_planes=planes, stored_dtype=kind)

    return Source(config=cfg, origin={"kind": "synthetic", "id": shape}, fingerprint=f"synthetic-{shape}-{seed}",
                  tensors=tensor, tokenizer_files=tokenizer_files(), default_name=f"synthetic-{shape}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path, help="model directory to write (the store's <name>/<variant> layout)")
    ap.add_argument("--quant", choices=("q4_0", "q4_1"), default="q4_0")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from nerva_cli.convert import convert

    def progress(what, done, total):
        print(f"\r{args.shape}: {done}/{total} {what}   ", end="", file=sys.stderr, flush=True)

    convert(source(args.shape, kind=args.quant), args.quant, args.out, force=True, progress=progress)
    print(file=sys.stderr)
    print(args.out)


if __name__ == "__main__":
    main()
