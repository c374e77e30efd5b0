"""Which canonical tensors a model of a given config has, and their shapes (ARCHITECTURE 5)."""

from __future__ import annotations

import math

from nerva_cli.model.config import ModelConfig
from nerva_cli.model.quant import Q4_KINDS, QK, TABLE_KIND

MATRICES = ("q", "k", "v", "o", "gate", "up", "down")  # Q4_0 or Q4_1 in the q4_0 and q4_1 variants
TABLES = ("embed", "lm_head")  # Q8_0 in those variants (quant.TABLE_KIND)
# A mixture-of-experts layer's file: the dense part first (norms, attention, the router, a shared
# expert's "shared.gate", "shared.up", "shared.down" and its "shared_gate" vector), then each
# routed expert's "experts.E.gate", ".up" and ".down" back to back, each tensor 4 KB aligned: one
# expert is one aligned span of the file (expert_span), which one read loads. The router and the
# shared gate stay f32 in every variant, as llama.cpp's quantiser leaves ffn_gate_inp.
ROUTER = "router"


def layer_shapes(cfg: ModelConfig, i: int = 0) -> dict[str, tuple[int, ...]]:
    """Layer i's tensors and their shapes, in the order its file holds them."""
    h, q, kv, f = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"attn_norm": (h,), "q": (q, h), "k": (kv, h), "v": (kv, h)}
    if cfg.qkv_bias:
        shapes.update(q_bias=(q,), k_bias=(kv,), v_bias=(kv,))
    if cfg.qk_norm:
        whole = cfg.qk_norm_whole  # OLMoE's: over each token's whole q and k
        shapes.update(q_norm=(q if whole else cfg.head_dim,), k_norm=(kv if whole else cfg.head_dim,))
    shapes["o"] = (h, q)
    if cfg.post_norms:
        shapes["post_attn_norm"] = (h,)
    shapes["mlp_norm"] = (h,)
    if i in cfg.moe_layers:
        shapes.update(_moe_shapes(cfg))
    else:
        shapes.update(gate=(f, h), up=(f, h), down=(h, f))
    if cfg.post_norms:
        shapes["post_mlp_norm"] = (h,)
    return shapes


def _moe_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, fe, fs = cfg.hidden_size, cfg.expert_intermediate_size, cfg.shared_expert_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {ROUTER: (cfg.num_experts, h)}
    if fs:
        shapes.update({"shared.gate": (fs, h), "shared.up": (fs, h), "shared.down": (h, fs), "shared_gate": (h,)})
    for e in range(cfg.num_experts):
        shapes.update({f"experts.{e}.gate": (fe, h), f"experts.{e}.up": (fe, h), f"experts.{e}.down": (h, fe)})
    return shapes


def expert_bytes(cfg: ModelConfig, files: dict) -> int:
    """Bytes of one routed expert (its span: every expert's is the same size) of a model whose
    metadata.json lists `files`; 0 for a dense model."""
    moe = cfg.moe_layers
    return expert_span(files[layer_file(moe[0])]["tensors"], 0)[1] if moe else 0


def expert_span(tensors: dict, e: int) -> tuple[int, int]:
    """(offset, bytes) of routed expert e's tensors in its layer file (the file's metadata
    table `tensors`): one aligned span."""
    mine = [t for name, t in tensors.items() if name.startswith(f"experts.{e}.")]
    lo = min(t["offset"] for t in mine)
    return lo, max(t["offset"] + t["nbytes"] for t in mine) - lo


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
    """Whether tensor `name` of a file is a matrix a Q4 variant quantises (an expert's and the
    shared expert's gate, up and down among them: "experts.3.up")."""
    return name.rsplit(".", 1)[-1] in MATRICES or name in TABLES


def parameter_count(cfg: ModelConfig) -> int:
    """The model's weights, counted as its source has them (a tied token table once)."""
    layers = sum(math.prod(s) for i in range(cfg.num_layers) for s in layer_shapes(cfg, i).values())
    rest = sum(math.prod(s) for tensors in global_files(cfg).values() for s in tensors.values())
    return layers + rest


def active_parameter_count(cfg: ModelConfig) -> int:
    """The weights a token multiplies by: parameter_count less the routed experts it does not
    run (a dense model's, all of them)."""
    idle = cfg.num_experts - cfg.experts_per_token
    per_expert = 3 * cfg.hidden_size * cfg.expert_intermediate_size
    return parameter_count(cfg) - len(cfg.moe_layers) * idle * per_expert


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

