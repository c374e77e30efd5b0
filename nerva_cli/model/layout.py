"""Which canonical tensors a model of a given config has, and their shapes (ARCHITECTURE 5)."""

from __future__ import annotations

import math

from nerva_cli.model.config import ModelConfig
from nerva_cli.model.quant import Q4_KINDS, QK, TABLE_KIND

MATRICES = ("q", "k", "v", "o", "gate", "up", "down")  # Q4_0 or Q4_1 in the q4_0 and q4_1 variants
TABLES = ("embed", "lm_head")  # Q8_0 in those variants (quant.TABLE_KIND)


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, q, kv, f = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"attn_norm": (h,), "q": (q, h), "k": (kv, h), "v": (kv, h)}
    if cfg.qkv_bias:
        shapes.update(q_bias=(q,), k_bias=(kv,), v_bias=(kv,))
    if cfg.qk_norm:
        shapes.update(q_norm=(cfg.head_dim,), k_norm=(cfg.head_dim,))
    shapes["o"] = (h, q)
    if cfg.post_norms:
        shapes["post_attn_norm"] = (h,)
    shapes.update(mlp_norm=(h,), gate=(f, h), up=(f, h), down=(h, f))
    if cfg.post_norms:
        shapes["post_mlp_norm"] = (h,)
    return shapes


def global_files(cfg: ModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """File name -> {tensor name: shape} for the non-layer files."""
    files = {"embed.bin": {"embed": (cfg.vocab_size, cfg.hidden_size)},
             "final_norm.bin": {"final_norm": (cfg.hidden_size,)}}
    if not cfg.tie_embeddings:
        files["lm_head.bin"] = {"lm_head": (cfg.vocab_size, cfg.hidden_size)}
    return files


def layer_file(i: int) -> str:
    return f"layer_{i:03d}.bin"


def quantised(name: str) -> bool:
    return name in MATRICES or name in TABLES


def parameter_count(cfg: ModelConfig) -> int:
    """The model's weights, counted as its source has them (a tied token table once)."""
    per_layer = sum(math.prod(s) for s in layer_shapes(cfg).values())
    rest = sum(math.prod(s) for tensors in global_files(cfg).values() for s in tensors.values())
    return cfg.num_layers * per_layer + rest


def parameter_size(n: int) -> str:
    """As ollama writes it: 135M, 1.7B."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}".removesuffix(".0") + unit
    return str(n)


def stored_format(name: str, cols: int, variant: str) -> str:
    """The format a variant stores tensor `name`, whose rows are `cols` wide, in: norms and biases
    f32; matrices f16 or bf16 in those variants; in the Q4 ones the variant's blocks (the token
    table Q8_0), except a matrix whose rows are not whole blocks of QK, which stays f16, as
    llama.cpp's quantiser falls back to F16 for it (Q8_0's blocks are QK wide too). The format is
    per tensor, not per layer: a layer may hold both, and each plane runs each matrix by its own."""
    if not quantised(name):
        return "f32"
    if variant not in Q4_KINDS:
        return variant
    if cols % QK:
        return "f16"
    return TABLE_KIND if name in TABLES else variant

