#!/usr/bin/env python3
"""A random-weight Q4_0 (or Q4_1, or F16) model in nerva's store format, with the shapes of a real
one: decode speed depends on shapes and bytes, not on weight values, so this is what the GPU
benchmarks run where a real 8B checkpoint cannot be downloaded. Written by nerva's own converter
(aligned layer files, sha256, metadata.json); the tokenizer is a small BPE trained here.

    python3 scripts/synthetic_model.py llama3-8b OUT_DIR     (4.5 GB)
    python3 scripts/synthetic_model.py smollm2-135m OUT_DIR [--quant q4_1]

With --gguf it writes the same kind of weights as a GGUF file instead, which both nerva (`pull`)
and llama.cpp read, for the CPU comparison at a bigger size (scripts/compare_llamacpp.py --gguf).
The file carries a real tokenizer: by default the bundled SmolLM2 GGUF's (the shapes with its
49152-token vocabulary), or with --vocab that of any GGUF holding one of the shape's size, such
as llama.cpp's vocabulary files (`models/ggml-vocab-*.gguf` in llama-cpp-python's sdist:
llama-bpe for the llama3* shapes, qwen2 for qwen2.5-*):

    python3 scripts/synthetic_model.py smollm2-1.7b /tmp/smollm2-1.7b.gguf --gguf --quant q4_1
    python3 scripts/synthetic_model.py llama3-8b /tmp/llama3-8b.gguf --gguf --vocab ggml-vocab-llama-bpe.gguf

gemma3-* shapes are Gemma 3's (GeGLU, post norms, q/k norms, 512-token windows in five layers of
six); gemma3-1b-v49k is the 1B's layers under that 49152-token vocabulary, which --gguf writes.
gemma2-* shapes are Gemma 2's (no q/k norms, 4096-token windows in every other layer, scores
capped at 50 and logits at 30); gemma2-2b-v49k likewise. gemma-* shapes are Gemma 1's (GeGLU and
the embedding's scale in Llama's layer; the 2B's one kv head); gemma-2b-v49k likewise.

--quant f16 writes every matrix, the token table too, in f16 (normal, of the Q4 weights' spread),
as llama.cpp's F16 files hold them: an exact variant to compare with llama.cpp's f16 path.
--quant bf16 likewise in bf16, in the store format only (issue 53's half-in-VRAM bf16 8B).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, head dim, vocab, rope theta, tied
    "llama3-8b": (4096, 14336, 32, 32, 8, 128, 128256, 500000.0, False),
    "llama3.2-3b": (3072, 8192, 28, 24, 8, 128, 128256, 500000.0, True),
    "qwen2.5-3b": (2048, 11008, 36, 16, 2, 128, 151936, 1e6, True),  # q/k/v biases (qwen2)
    "smollm2-135m": (576, 1536, 30, 9, 3, 64, 49152, 100000.0, True),
    "smollm2-360m": (960, 2560, 32, 15, 5, 64, 49152, 100000.0, True),
    "smollm2-1.7b": (2048, 8192, 24, 32, 32, 64, 49152, 130000.0, True),
    "gemma3-1b": (1152, 6912, 26, 4, 1, 256, 262144, 1e6, True),
    "gemma3-1b-v49k": (1152, 6912, 26, 4, 1, 256, 49152, 1e6, True),
    "gemma-2b": (2048, 16384, 18, 8, 1, 256, 256000, 1e4, True),
    "gemma-2b-v49k": (2048, 16384, 18, 8, 1, 256, 49152, 1e4, True),
    "gemma2-2b": (2304, 9216, 26, 8, 4, 256, 256000, 1e4, True),
    "gemma2-2b-v49k": (2304, 9216, 26, 8, 4, 256, 49152, 1e4, True),
    # mixtures of experts (MOE below): OLMoE-1B-7B's, under SmolLM2's 49152-token vocabulary (its
    # own is 50304); Qwen3-30B-A3B's (its 151936 tokens: --vocab ggml-vocab-qwen2.gguf)
    "olmoe-1b-7b-v49k": (2048, 1024, 16, 16, 16, 128, 49152, 10000.0, False),
    "qwen3-30b-a3b": (2048, 6144, 48, 32, 4, 128, 151936, 1e6, False),
}
# a mixture's experts a layer, a token, and each expert's width
MOE = {"olmoe-1b-7b-v49k": (64, 8, 1024), "qwen3-30b-a3b": (128, 8, 768)}
GGUF_NAMES = {"attn_norm": "attn_norm", "mlp_norm": "ffn_norm", "q": "attn_q", "k": "attn_k", "v": "attn_v",
              "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down",
              "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "post_attn_norm": "post_attention_norm",
              "post_mlp_norm": "post_ffw_norm"}
GEMMA3_WINDOW, GEMMA2_WINDOW, GEMMA2_CAPS = 512, 4096, (50.0, 30.0)


def family_fields(shape: str, hidden: int, layers: int) -> dict:
    """ModelConfig's family fields of a shape: Gemma 3's, 2's or 1's as their config.json gives
    them, else Llama's."""
    from nerva_cli.model.config import geglu_fields, gemma_fields

    if shape.startswith("gemma3"):
        return {"family": "gemma3", "qk_norm": True,
                **gemma_fields(hidden, layers, GEMMA3_WINDOW, 6, local_rope_theta=10_000.0)}
    if shape.startswith("gemma2"):
        return {"family": "gemma2", **gemma_fields(hidden, layers, GEMMA2_WINDOW, 2),
                "attn_softcap": GEMMA2_CAPS[0], "final_softcap": GEMMA2_CAPS[1]}
    if shape.startswith("gemma-"):
        return {"family": "gemma", **geglu_fields(hidden)}
    if shape.startswith("qwen2"):
        return {"family": "qwen2", "qkv_bias": True}
    if shape in MOE:
        experts, per_token, width = MOE[shape]
        moe = {"num_experts": experts, "experts_per_token": per_token, "expert_intermediate_size": width,
               "qk_norm": True}
        if shape.startswith("olmoe"):  # q/k norms over the whole projection, weights not renormalised
            return {"family": "olmoe", "qk_norm_whole": True, **moe}
        return {"family": "qwen3moe", "norm_topk_prob": True, **moe}
    return {"family": "llama"}


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
    from nerva_cli.model.config import ModelConfig
    from nerva_cli.store.convert import to_bf16
    from nerva_cli.store.sources import Source, SourceTensor

    h, f, n, heads, kvh, hd, vocab, theta, tied = SHAPES[shape]
    cfg = ModelConfig(hidden_size=h, intermediate_size=f, num_layers=n, num_heads=heads,
                      num_kv_heads=kvh, head_dim=hd, vocab_size=vocab, rms_eps=1e-5, rope_theta=theta,
                      max_context=8192, tie_embeddings=tied, bos_token_id=0, eos_token_ids=[1],
                      **family_fields(shape, h, n))
    rng = np.random.default_rng(seed)

    def tensor(name: str) -> SourceTensor:
        from nerva_cli.model.layout import ROUTER, global_files, layer_shapes

        layer = int(name.split(".")[1]) if name.startswith("layers.") else 0
        inner = name.split(".", 2)[2] if name.startswith("layers.") else name  # "q", "experts.5.up"
        base = inner.rsplit(".", 1)[-1]
        shapes = {**{k: v for g in global_files(cfg).values() for k, v in g.items()}, **layer_shapes(cfg, layer)}
        shape = shapes[inner]
        if len(shape) == 1:  # norms near 1, biases near 0
            centre = 0.0 if base.endswith("_bias") else 1.0
            return SourceTensor(shape, lambda: (centre + 0.05 * rng.standard_normal(shape)).astype(np.float32))
        if inner == ROUTER:  # f32, as llama.cpp keeps it; spread so that every expert gets chosen
            return SourceTensor(shape, lambda: (0.05 * rng.standard_normal(shape)).astype(np.float32))

        rows, cols = shape
        if kind in ("f16", "bf16"):  # values the variant holds exactly
            std = 0.02 / np.sqrt(cols / 1024)

            def exact() -> np.ndarray:
                w = std * rng.standard_normal(shape, dtype=np.float32)
                return w.astype(np.float16).astype(np.float32) if kind == "f16" else \
                    (to_bf16(w).astype(np.uint32) << 16).view(np.float32)

            return SourceTensor(shape, exact, stored_dtype=kind)
        if base in ("embed", "lm_head"):  # the Q4 variants' token table is Q8_0 (quant.TABLE_KIND)
            def table():
                q8 = rng.integers(-127, 128, (rows, cols), dtype=np.int8)
                d = (rng.uniform(0.5, 1.5, (rows, cols // 32)) * 0.02 / 16 / np.sqrt(cols / 1024)).astype(np.float16)
                return q8, d, None

            return SourceTensor(shape, lambda: None, read_planes=table, stored_dtype="q8_0")

        def planes():
            qs = centred_codes(rng, (rows, cols // 2)) if kind == "q4_0" else \
                rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
            d = (rng.uniform(0.5, 1.5, (rows, cols // 32)) * 0.02 / np.sqrt(cols / 1024)).astype(np.float16)
            # Q4_1's offset, the block's minimum: about -7.5 d for weights centred on 0
            m = (-d.astype(np.float32) * rng.uniform(7, 8, d.shape)).astype(np.float16) if kind == "q4_1" else None
            return qs, d, m

        return SourceTensor(shape, lambda: None, read_planes=planes, stored_dtype=kind)

    return Source(config=cfg, origin={"kind": "synthetic", "id": shape}, fingerprint=f"synthetic-{shape}-{seed}",
                  tensors=tensor, tokenizer_files=tokenizer_files(), default_name=f"synthetic-{shape}")


def centred_codes(rng, shape) -> np.ndarray:
    """Packed Q4_0 codes whose weights centre on 0, as trained ones do: each nibble 1..15 (-7..7
    times the scale). Nibbles of 0..15 gave every weight a mean of -d/2, a part shared by all of
    a matrix's rows that grew through the layers until every token chose the same experts, which
    left an expert cache nothing to do (docs/residency.md)."""
    lo, hi = rng.integers(1, 16, shape, dtype=np.uint8), rng.integers(1, 16, shape, dtype=np.uint8)
    return lo | (hi << 4)


def gguf_blocks(qs, d, m) -> np.ndarray:
    """nerva's planes of a Q4_0, Q4_1 (m) or Q8_0 (int8 qs) matrix -> GGUF's [rows, blocks x block
    bytes]: each block's f16 scale (and Q4_1 offset) then its codes, byte for byte as the planes
    hold them (nerva's Q4 nibble order is GGUF's)."""
    rows, blocks = d.shape
    codes = qs.view(np.uint8).reshape(rows, blocks, -1)
    parts = [d.view(np.uint8).reshape(rows, blocks, 2)]
    if m is not None:
        parts.append(m.view(np.uint8).reshape(rows, blocks, 2))
    return np.concatenate([*parts, codes], axis=2).reshape(rows, -1)


def write_gguf(shape: str, out: Path, kind: str, vocab_file: Path | None = None) -> None:
    """source(shape)'s weights as a llama (or qwen2, gemma, gemma2, gemma3) GGUF with the tokenizer
    of vocab_file (a GGUF; by default the bundled SmolLM2's), written to a temporary name, then
    renamed."""
    import gguf
    from nerva_cli.store.sources.resolve import bundled_gguf

    h, f, n, heads, kvh, hd, vocab, theta, tied = SHAPES[shape]
    vocab_from = gguf.GGUFReader(str(vocab_file or bundled_gguf("smollm2-135m")))
    if "tokenizer.ggml.tokens" not in vocab_from.fields:
        sys.exit(f"--vocab {vocab_file}: holds no tokenizer (no tokenizer.ggml.tokens)")
    tokens = len(vocab_from.fields["tokenizer.ggml.tokens"].data)
    if tokens != vocab:
        where = f"--vocab {vocab_file}" if vocab_file else "SmolLM2's tokenizer (the default; see --vocab)"
        sys.exit(f"{shape}: {where} has {tokens} tokens, the shape {vocab}")
    tmp = out.with_name(out.name + ".tmp")
    src = source(shape, kind=kind)
    family = src.config.family
    w = gguf.GGUFWriter(str(tmp), family)
    if family in ("gemma2", "gemma3"):
        w.add_sliding_window(src.config.sliding_window)
    if family in ("gemma", "gemma2", "gemma3") or hd != h // heads:  # as llama.cpp's converter: where not h / heads
        w.add_key_length(hd)
        w.add_value_length(hd)
    if family == "gemma2":
        w.add_attn_logit_softcapping(GEMMA2_CAPS[0])
        w.add_final_logit_softcapping(GEMMA2_CAPS[1])
    w.add_name(f"random-{shape}-shape")
    w.add_context_length(8192)
    w.add_embedding_length(h)
    w.add_block_count(n)
    w.add_feed_forward_length(f)
    w.add_head_count(heads)
    w.add_head_count_kv(kvh)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type({"q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
                     "f16": gguf.LlamaFileType.MOSTLY_F16}[kind])
    w.add_vocab_size(vocab)
    if shape in MOE:
        w.add_expert_count(MOE[shape][0])
        w.add_expert_used_count(MOE[shape][1])
        if family != "olmoe":  # OLMoE's experts are feed_forward_length wide
            w.add_expert_feed_forward_length(MOE[shape][2])
    for name, field in vocab_from.fields.items():
        if name.startswith("tokenizer."):
            kind_of = field.types[0]
            if kind_of == gguf.GGUFValueType.ARRAY:
                sub = field.types[1]
                values = [bytes(field.parts[i]).decode("utf-8", "replace") if sub == gguf.GGUFValueType.STRING
                          else field.parts[i].tolist()[0] for i in field.data]
                w.add_key_value(name, values, kind_of, sub_type=sub)
            elif kind_of == gguf.GGUFValueType.STRING:
                w.add_key_value(name, bytes(field.parts[field.data[0]]).decode(), kind_of)
            else:
                w.add_key_value(name, field.parts[field.data[0]].tolist()[0], kind_of)
    qtype = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
             "q8_0": gguf.GGMLQuantizationType.Q8_0}

    from gguf import GGML_QUANT_SIZES

    # streamed: each tensor's shape first (the header's table), its bytes made and written one at
    # a time after it, so a 17 GB file is never held in memory (GGUFWriter.add_tensor would)
    pending = []  # (make bytes, their dtype and shape) in the header's order

    def stored(t) -> tuple[np.dtype, tuple, object]:
        """(array dtype, array shape, GGUF type or None) of tensor t as the file holds it."""
        if t.read_planes is None:  # norms in f32, an F16 file's matrices in f16
            return np.dtype(np.float16 if t.stored_dtype == "f16" else np.float32), tuple(t.shape), None
        kind = qtype[t.stored_dtype]
        block, size = GGML_QUANT_SIZES[kind]
        return np.dtype(np.uint8), (t.shape[0], t.shape[1] // block * size), kind

    def as_stored(t, dtype) -> np.ndarray:
        return t.read_f32().astype(dtype) if t.read_planes is None else gguf_blocks(*t.read_planes())

    def announce(gguf_name: str, dtype, shape, kind, make) -> None:
        w.add_tensor_info(gguf_name, shape, dtype, int(np.prod(shape)) * dtype.itemsize, raw_dtype=kind)
        pending.append(make)

    def add(gguf_name: str, nerva_name: str) -> None:
        t = src.tensors(nerva_name)
        dtype, shape, kind = stored(t)
        announce(gguf_name, dtype, shape, kind, lambda: as_stored(t, dtype))

    def add_experts(i: int, part: str) -> None:
        """Every expert's `part` of layer i stacked [experts, rows, ...], as ffn_{part}_exps."""
        experts = [src.tensors(f"layers.{i}.experts.{e}.{part}") for e in range(src.config.num_experts)]
        dtype, shape, kind = stored(experts[0])
        announce(f"blk.{i}.ffn_{part}_exps.weight", dtype, (len(experts), *shape), kind,
                 lambda: np.stack([as_stored(t, dtype) for t in experts]))

    add("token_embd.weight", "embed")
    add("output_norm.weight", "final_norm")
    if not tied:
        add("output.weight", "lm_head")
    from nerva_cli.model.layout import layer_shapes

    for i in range(n):
        for base in layer_shapes(src.config, i):
            if base.startswith("experts."):
                if base.startswith("experts.0."):
                    add_experts(i, base.rsplit(".", 1)[-1])
            elif base == "router":
                add(f"blk.{i}.ffn_gate_inp.weight", f"layers.{i}.router")
            elif base.endswith("_bias"):
                add(f"blk.{i}.{GGUF_NAMES[base[:-len('_bias')]]}.bias", f"layers.{i}.{base}")
            else:
                add(f"blk.{i}.{GGUF_NAMES[base]}.weight", f"layers.{i}.{base}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for make in pending:
        w.write_tensor_data(make())
    w.close()
    tmp.replace(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path, help="model directory to write (the store's <name>/<variant> layout), "
                                            "or with --gguf the .gguf file")
    ap.add_argument("--quant", choices=("q4_0", "q4_1", "f16", "bf16"), default="q4_0",
                    help="bf16: the store format only (the exact variant's other half, for the GPU's paged runs)")
    ap.add_argument("--gguf", action="store_true", help="write a GGUF file instead")
    ap.add_argument("--vocab", type=Path, help="with --gguf: the GGUF whose tokenizer the file carries (default: "
                                               "the bundled SmolLM2's, 49152 tokens)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if args.vocab is not None and not args.gguf:
        ap.error("--vocab goes with --gguf (the store format carries a small BPE trained here)")
    if args.gguf and args.quant == "bf16":
        ap.error("--quant bf16 writes the store format only (drop --gguf)")
    if args.vocab is not None and not args.vocab.is_file():
        ap.error(f"--vocab {args.vocab}: no such file")
    if args.gguf:
        write_gguf(args.shape, args.out, args.quant, args.vocab)
        print(args.out)
        return
    from nerva_cli.store.convert import convert

    def progress(what, done, total):
        print(f"\r{args.shape}: {done}/{total} {what}   ", end="", file=sys.stderr, flush=True)

    convert(source(args.shape, kind=args.quant), args.quant, args.out, force=True, progress=progress)
    print(file=sys.stderr)
    print(args.out)


if __name__ == "__main__":
    main()
