"""ModelConfig: the one description of an architecture, read from HF config.json, GGUF keys or
metadata.json, and validated once."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field

from nerva_cli.errors import BadInput

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3", "olmoe", "qwen2moe", "qwen3moe")
# GeGLU, the embedding times sqrt(hidden), norms stored as 1 + w; Gemma 2 and 3 add post norms
# and windowed layers (gemma_fields), Gemma 1 neither (geglu_fields)
GEMMA = ("gemma", "gemma2", "gemma3")
# HF model_type / GGUF general.architecture -> family. Mistral and SmolLM are Llama-shaped (SmolLM3
# with no RoPE in every fourth layer: nope_layers); so is Phi-3 once its fused q/k/v and gate/up
# matrices are split (sources.fused_part).
FAMILY_OF = {"llama": "llama", "mistral": "llama", "smollm3": "llama", "granite": "llama", "qwen2": "qwen2",
             "qwen3": "qwen3", "phi3": "phi3", "gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3",
             "gemma3_text": "gemma3", "mixtral": "llama", "olmoe": "olmoe", "qwen2_moe": "qwen2moe",
             "qwen3_moe": "qwen3moe", "qwen2moe": "qwen2moe", "qwen3moe": "qwen3moe"}  # the last two: GGUF's
SUPPORTED_TEXT = ("llama (Llama 2/3.x, Mistral, Mixtral, SmolLM, SmolLM3, Granite 3, TinyLlama), qwen2, qwen3, "
                  "phi3 (Phi-3, Phi-3.5, Phi-4-mini), gemma (Gemma 1, CodeGemma), gemma2, "
                  "gemma3 (Gemma 3's text model), and the mixtures of experts olmoe, qwen2_moe, qwen3_moe")
# Mixture-of-experts architectures nerva does not run yet, refused by name rather than as unknown
# (DeepSeek's latent attention, gpt-oss's attention sinks and biased experts, among others)
UNBUILT_MOE = ("deepseek_v2", "deepseek_v3", "gpt_oss", "qwen3_next", "granitemoe", "granitemoehybrid", "jamba",
               "dbrx", "phimoe", "llama4", "llama4_text", "ernie4_5_moe", "glm4_moe", "hunyuan_v1_moe", "minimax",
               # their GGUF architecture names
               "deepseek2", "gpt-oss", "qwen3next", "glm4moe", "ernie4_5-moe", "hunyuan-moe", "bailingmoe",
               "grovemoe", "granitehybrid")
ACTIVATIONS = ("silu", "gelu_tanh")  # the MLP's gate: SwiGLU's, or GeGLU's (GeLU, tanh approximation)
ROPE_SCALINGS = ("linear", "llama3", "freq_factors", "longrope", "yarn")


@dataclass
class ModelConfig:
    family: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_eps: float
    rope_theta: float
    max_context: int
    tie_embeddings: bool
    # {"type": "linear"|"llama3", "factor": ..., ...}, or a GGUF's {"type": "freq_factors",
    # "factors": [head_dim / 2 divisors of the frequencies]} (its rope_freqs tensor: llama3's
    # scaling as llama.cpp's converter writes it), or Phi-3's {"type": "longrope", "short_factor":
    # [...], "long_factor": [...], "original_max_position_embeddings": n, "attention_factor": f}
    # (rotary_dim / 2 divisors each; the long ones where the context is past n, as llama.cpp
    # picks them), or YaRN's {"type": "yarn", "factor": f, "original_max_position_embeddings": n,
    # "beta_fast": 32, "beta_slow": 1, "truncate": True, "attention_factor": a}
    rope_scaling: dict | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    qkv_bias: bool = False
    qk_norm: bool = False
    # The dimensions of each head RoPE rotates (HF's partial_rotary_factor: Phi-4-mini's 96 of
    # 128), None for all. The store keeps q/k rows in an order where the rotated pairs sit where
    # a whole head's would (rope.partial_rotary_order), so the kernels rotate every pair and the
    # others' angle is 0.
    rotary_dim: int | None = None
    # Layers whose attention uses no RoPE at all (SmolLM3's every fourth): their tables are
    # cos 1, sin 0 (rope.per_layer), None for none.
    nope_layers: list[int] | None = None
    # Granite's multipliers {"embedding", "residual", "attention", "logits"}, which convert folds
    # into the stored weights (convert._folded): the engine applies nothing of them. None: all 1
    # and attention 1/sqrt(head_dim), as Llama's.
    folded_scales: dict | None = None
    # Gemma's: GeGLU's gate (gelu_tanh); the token embedding times embed_scale (sqrt(hidden),
    # which the engine applies: folded into the table it would round an exact variant's rows).
    # Gemma 2's and 3's: norms after attention and after the MLP, before each joins the residual
    # (the layer files' post_attn_norm and post_mlp_norm); attention over the last sliding_window
    # positions in sliding_layers, whose RoPE turns at local_rope_theta (Gemma 3's), unscaled.
    activation: str = "silu"
    embed_scale: float | None = None
    post_norms: bool = False
    sliding_window: int | None = None
    sliding_layers: list[int] | None = None
    local_rope_theta: float | None = None
    # Gemma 2's logit capping: attention scores (after their scale) become c tanh(s / c) with c
    # attn_softcap, the final logits the same with final_softcap; None: not capped.
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # A mixture of experts (ARCHITECTURE 15): a layer's MLP is num_experts SwiGLU experts, each
    # expert_intermediate_size wide, of which a router (softmax over all of them, in f32) picks
    # experts_per_token for each token, their outputs weighted by those probabilities (divided by
    # their sum where norm_topk_prob: Mixtral always, Qwen3-MoE's checkpoints, OLMoE's not).
    # shared_expert_intermediate_size: Qwen2-MoE's expert every token runs, scaled by
    # sigmoid(shared_gate . x); dense_layers: layers with an ordinary MLP of intermediate_size
    # (Qwen's mlp_only_layers and decoder_sparse_step). num_experts 0: a dense model.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    dense_layers: list[int] | None = None
    # OLMoE's q/k norms, over the whole q and k projections rather than each head
    qk_norm_whole: bool = False

    def __post_init__(self):
        if self.family not in SUPPORTED_FAMILIES:
            raise BadInput(f"family '{self.family}' is not supported (supported: {SUPPORTED_TEXT})")
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "vocab_size", "max_context"):
            if int(getattr(self, name)) <= 0:
                raise BadInput(f"config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise BadInput(f"config: num_heads {self.num_heads} is not a multiple of "
                           f"num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise BadInput(f"config: head_dim {self.head_dim} must be even for RoPE")
        if self.nope_layers is not None and not all(0 <= i < int(self.num_layers) for i in self.nope_layers):
            raise BadInput(f"config: layers without RoPE {self.nope_layers} must be below num_layers {self.num_layers}")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise BadInput(f"config: the rotary dimensions ({self.rotary_dim}) must be even and at most "
                           f"head_dim ({self.head_dim})")
        if self.activation not in ACTIVATIONS:
            raise BadInput(f"config: activation '{self.activation}' is not supported (supported: {', '.join(ACTIVATIONS)})")
        if self.sliding_layers is not None:
            if not all(0 <= i < int(self.num_layers) for i in self.sliding_layers):
                raise BadInput(f"config: sliding-window layers {self.sliding_layers} must be below num_layers "
                               f"{self.num_layers}")
            if not (self.sliding_window or 0) > 0:
                raise BadInput(f"config: sliding-window layers need a positive sliding_window, got {self.sliding_window}")
        for name in ("attn_softcap", "final_softcap"):
            cap = getattr(self, name)
            if cap is not None and not (math.isfinite(cap) and cap > 0):
                raise BadInput(f"config: {name} must be a positive number, got {cap}")
        if self.num_experts:
            if not 0 < self.experts_per_token <= self.num_experts:
                raise BadInput(f"config: experts per token ({self.experts_per_token}) must be between 1 and the "
                               f"number of experts ({self.num_experts})")
            if self.expert_intermediate_size <= 0:
                raise BadInput(f"config: the experts' intermediate size must be positive, got "
                               f"{self.expert_intermediate_size}")
            if self.dense_layers is not None and not all(0 <= i < int(self.num_layers) for i in self.dense_layers):
                raise BadInput(f"config: dense layers {self.dense_layers} must be below num_layers {self.num_layers}")
        if self.rope_scaling and self.rope_scaling.get("type") not in ROPE_SCALINGS:
            raise BadInput(f"config: rope scaling '{self.rope_scaling.get('type')}' is not supported "
                           f"(supported: {', '.join(ROPE_SCALINGS)})")
        if self.rope_scaling and self.rope_scaling.get("type") == "longrope":
            rs, pairs = self.rope_scaling, self.rotation // 2
            for name in ("short_factor", "long_factor"):
                factors = rs.get(name) or []
                if len(factors) != pairs or not all(math.isfinite(f) and f > 0 for f in factors):
                    raise BadInput(f"config: longrope's {name} must be {pairs} positive numbers (the rotary "
                                   f"dimensions / 2), got {len(factors)}")
        if self.rope_scaling and self.rope_scaling.get("type") == "yarn":
            rs = self.rope_scaling
            if not (rs.get("factor", 0) >= 1 and rs.get("original_max_position_embeddings", 0) > 0
                    and rs.get("beta_fast", 0) > 0 and rs.get("beta_slow", 0) > 0):
                raise BadInput(f"config: YaRN needs a factor >= 1, the original context and positive betas, got {rs}")
        if self.rope_scaling and self.rope_scaling.get("type") == "freq_factors":
            factors = self.rope_scaling.get("factors") or []
            if len(factors) != self.head_dim // 2 or not all(math.isfinite(f) and f > 0 for f in factors):
                raise BadInput(f"config: RoPE frequency factors must be {self.head_dim // 2} positive numbers "
                               f"(head_dim / 2), got {len(factors)}")

    @property
    def rotation(self) -> int:
        """The dimensions of a head RoPE rotates."""
        return self.rotary_dim or self.head_dim

    @property
    def windows(self) -> list[int]:
        """Each layer's attention window: the positions a query sees back, itself included (0: all)."""
        return [self.sliding_window if i in (self.sliding_layers or ()) else 0 for i in range(self.num_layers)]

    @property
    def moe_layers(self) -> list[int]:
        """The layers whose MLP is a mixture of experts (none for a dense model)."""
        if not self.num_experts:
            return []
        return [i for i in range(self.num_layers) if i not in (self.dense_layers or ())]

    @property
    def widest_mlp(self) -> int:
        """The widest MLP any layer runs (a dense layer's, an expert's or the shared expert's):
        what the decode and prefill buffers of the MLP are sized for."""
        moe = (self.expert_intermediate_size, self.shared_expert_intermediate_size) if self.num_experts else ()
        dense = (self.intermediate_size,) if not self.num_experts or self.dense_layers else ()
        return max((*moe, *dense))

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def arch_hash(self) -> str:
        """Identifies the architecture (not the weights): profiles are keyed by it."""
        keys = ("family", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "vocab_size", "qkv_bias", "qk_norm", "tie_embeddings")
        arch = {k: getattr(self, k) for k in keys}
        # only where set: the hashes (and shipped profiles) before stand
        for key in ("rotary_dim", "nope_layers", "embed_scale", "sliding_window", "sliding_layers", "attn_softcap",
                    "final_softcap"):
            if getattr(self, key) is not None:
                arch[key] = getattr(self, key)
        if self.activation != "silu" or self.post_norms:
            arch.update(activation=self.activation, post_norms=self.post_norms)
        if self.num_experts:
            arch.update({k: getattr(self, k) for k in ("num_experts", "experts_per_token", "expert_intermediate_size",
                                                       "norm_topk_prob", "shared_expert_intermediate_size",
                                                       "dense_layers", "qk_norm_whole")})
        blob = json.dumps(arch, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _eos_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def _hf_rope_scaling(cfg: dict) -> dict | None:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or None
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type")
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return {"type": "linear", "factor": float(rs["factor"])}
    if kind == "llama3":
        return {"type": "llama3", "factor": float(rs["factor"]),
                "low_freq_factor": float(rs["low_freq_factor"]),
                "high_freq_factor": float(rs["high_freq_factor"]),
                "original_max_position_embeddings": int(rs["original_max_position_embeddings"])}
    if kind == "yarn":
        original = _original_context(cfg, rs)
        factor = float(rs.get("factor") or int(cfg["max_position_embeddings"]) / original)
        return yarn_scaling(factor, original, rs.get("beta_fast"), rs.get("beta_slow"), rs.get("truncate", True),
                            rs.get("attention_factor"), rs.get("mscale"), rs.get("mscale_all_dim"))
    if kind in ("longrope", "su"):  # "su": Phi-3's first configs' name for it
        original = _original_context(cfg, rs)
        factor = rs.get("factor") or int(cfg.get("max_position_embeddings", original)) / original
        return longrope_scaling(rs["short_factor"], rs["long_factor"], original, factor, rs.get("attention_factor"))
    return {"type": kind}  # refused by __post_init__ with its name


def _original_context(cfg: dict, rs: dict) -> int:
    """The pretraining context a scaling starts from: transformers takes a top-level
    original_max_position_embeddings (Phi-3's place for it) before the scaling's own."""
    return int(cfg.get("original_max_position_embeddings") or rs.get("original_max_position_embeddings")
               or cfg["max_position_embeddings"])


def longrope_scaling(short, long, original: int, factor: float, attention_factor=None) -> dict:
    """LongRoPE's rope_scaling, its attention factor derived as transformers and llama.cpp's
    converter do where not given: sqrt(1 + ln(factor) / ln(original)), factor the longest context
    over the original one."""
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"type": "longrope", "short_factor": [float(f) for f in short], "long_factor": [float(f) for f in long],
            "original_max_position_embeddings": int(original), "attention_factor": float(attention_factor)}


def attended_context(longest: int, window) -> int:
    """The longest context, or a sliding attention window where one is set and smaller (see
    _hf_max_context)."""
    return min(int(longest), int(window)) if window else int(longest)


def yarn_scaling(factor: float, original: int, beta_fast=None, beta_slow=None, truncate=True,
                 attention_factor=None, mscale=None, mscale_all_dim=None) -> dict:
    """YaRN's rope_scaling, its attention factor derived as transformers does where not given:
    0.1 ln(factor) + 1 (DeepSeek's mscale / mscale_all_dim form where both are set)."""
    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        attention_factor = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else get_mscale(factor))
    return {"type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original),
            "beta_fast": float(beta_fast or 32), "beta_slow": float(beta_slow or 1), "truncate": bool(truncate),
            "attention_factor": float(attention_factor)}


def _hf_rotary_dim(cfg: dict, head_dim: int) -> int | None:
    fraction = cfg.get("partial_rotary_factor") or (cfg.get("rope_parameters") or {}).get("partial_rotary_factor")
    if fraction is None or int(head_dim * float(fraction)) == head_dim:
        return None
    return int(head_dim * float(fraction))  # as transformers rounds it


def granite_scales(embedding=None, residual=None, attention=None, logits=None) -> dict:
    """Granite's multipliers, transformers' defaults (1) for those not given: the token
    embedding's, the residual branches' (after attention, after the MLP), the attention scores'
    (in place of 1/sqrt(head_dim)) and the logits' divisor."""
    values = {"embedding": embedding, "residual": residual, "attention": attention, "logits": logits}
    scales = {k: 1.0 if v is None else float(v) for k, v in values.items()}
    if not all(math.isfinite(v) and v > 0 for v in scales.values()):
        raise BadInput(f"Granite's multipliers must be positive numbers, got {scales}")
    return scales


def _hf_nope_layers(cfg: dict) -> list[int] | None:
    """SmolLM3's layers without RoPE: its no_rope_layers (1 where a layer uses RoPE), else every
    no_rope_layer_interval-th, as transformers fills it in."""
    if cfg.get("model_type") != "smollm3":
        return None
    layers = int(cfg["num_hidden_layers"])
    uses = cfg.get("no_rope_layers") or [int((i + 1) % int(cfg.get("no_rope_layer_interval", 4)) != 0)
                                         for i in range(layers)]
    if len(uses) != layers:
        raise BadInput(f"no_rope_layers has {len(uses)} entries for {layers} layers")
    return [i for i, rope in enumerate(uses) if not rope] or None


def _hf_max_context(cfg: dict) -> int:
    """max_position_embeddings, or the attention window where one is smaller: a model trained
    with sliding-window attention (Phi-3-mini-4k's 2047 tokens, Mistral 7B v0.1's 4096) attends
    as transformers does while the context fits in the window, which nerva's attention (all of
    the context) does not model past it. Qwen2's configs name a window they do not use."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    return attended_context(cfg.get("max_position_embeddings", 4096), window)


def _hf_rope_theta(cfg: dict) -> float:
    if "rope_theta" in cfg:
        return float(cfg["rope_theta"])
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


# Gemma3TextConfig's defaults, which a Gemma 3 checkpoint's config.json leaves out (the 4B's
# text_config names little more than its sizes)
GEMMA3_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                   "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                   "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
                   "rms_norm_eps": 1e-6, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True,
                   "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 1_000_000.0,
                   "rope_local_base_freq": 10_000.0}
HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


# Gemma2Config's defaults for what changes the model's output, where a config.json leaves them out
# (google/gemma-2-2b-it's names no tie_word_embeddings, and has no lm_head)
GEMMA2_DEFAULTS = {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "sliding_window": 4096,
                   "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "tie_word_embeddings": True}


# GemmaConfig's, likewise (google/gemma-2b's names no tie_word_embeddings, and has no lm_head)
GEMMA_DEFAULTS = {"hidden_act": "gelu_pytorch_tanh", "head_dim": 256, "tie_word_embeddings": True}


def _text_config(cfg: dict) -> dict:
    """A multimodal Gemma 3's text_config (its language model, with its defaults) merged over the
    top level's ids; a Gemma 1's or 2's with its defaults; any other config as it is."""
    if cfg.get("model_type") == "gemma2":
        return {**GEMMA2_DEFAULTS, **cfg}
    if cfg.get("model_type") == "gemma":
        merged = {**GEMMA_DEFAULTS, **cfg}
        if merged["hidden_act"] == "gelu":  # the first releases' name for the tanh form, as transformers reads it
            merged["hidden_act"] = "gelu_pytorch_tanh"
        return merged
    if cfg.get("model_type") not in ("gemma3", "gemma3_text"):
        return cfg
    text = cfg.get("text_config") or {}
    top = {k: cfg[k] for k in ("eos_token_id", "bos_token_id") if cfg.get(k) is not None}
    merged = {**GEMMA3_DEFAULTS, **{k: v for k, v in cfg.items() if k != "text_config"}, **top, **text,
              "model_type": "gemma3"}
    params = merged.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5's form: one entry per kind of layer
        full, local = params["full_attention"] or {}, params.get("sliding_attention") or {}
        merged.update(rope_parameters=full, rope_theta=full.get("rope_theta", merged["rope_theta"]),
                      rope_local_base_freq=local.get("rope_theta", merged["rope_local_base_freq"]))
    return merged


def _gemma_fields(cfg: dict, family: str, layers: int) -> dict:
    """Gemma's ModelConfig fields from its config.json (as _text_config merged it): the layers
    with a sliding window (its layer_types, else gemma_fields' pattern for the family), Gemma 3's
    local RoPE base, and the logit caps (Gemma 2's); its attention scale is gemma_attention's.
    Gemma 1's: geglu_fields alone."""
    if family == "gemma":
        return geglu_fields(int(cfg["hidden_size"]))
    gemma3 = family == "gemma3"
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or (6 if gemma3 else 2))
    types = cfg.get("layer_types")
    if types is not None and (len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}):
        raise BadInput(f"layer_types must be {layers} of sliding_attention / full_attention, got {types}")
    sliding = None if types is None else [i for i, t in enumerate(types) if t == "sliding_attention"]
    caps = {name: float(cfg[key]) for name, key in (("attn_softcap", "attn_logit_softcapping"),
                                                      ("final_softcap", "final_logit_softcapping"))
            if cfg.get(key) is not None}
    return {**gemma_fields(int(cfg["hidden_size"]), layers, int(cfg["sliding_window"]), pattern, sliding,
                           float(cfg["rope_local_base_freq"]) if gemma3 else None), **caps}


def gemma_fields(hidden: int, layers: int, window: int, pattern: int, sliding: list[int] | None = None,
                 local_rope_theta: float | None = None) -> dict:
    """Gemma 2's and 3's ModelConfig fields: geglu_fields, post norms, and a window in the
    `sliding` layers (by default all but every pattern-th: transformers' default and llama.cpp's
    fixed step, Gemma 2's 2 and Gemma 3's 6), whose RoPE turns at local_rope_theta where that is
    given (Gemma 3's 10000)."""
    if sliding is None:
        sliding = [i for i in range(layers) if (i + 1) % pattern]
    return {**geglu_fields(hidden), "post_norms": True, "sliding_window": window, "sliding_layers": sliding or None,
            "local_rope_theta": local_rope_theta}


def geglu_fields(hidden: int) -> dict:
    """ModelConfig's fields every Gemma has: GeGLU, and the embedding times sqrt(hidden)."""
    return {"activation": "gelu_tanh", "embed_scale": float(hidden) ** 0.5}


def gemma_attention(query_pre_attn_scalar, head_dim: int) -> dict | None:
    """Gemma's attention scale 1/sqrt(query_pre_attn_scalar) as folded_scales (convert folds it
    into the q norm, or Gemma 2's q), None where it is Llama's 1/sqrt(head_dim) (all but the 27Bs)."""
    attention = float(query_pre_attn_scalar or head_dim) ** -0.5
    return None if abs(attention * head_dim ** 0.5 - 1) < 1e-9 else granite_scales(attention=attention)


def _hf_moe_fields(cfg: dict, path: str) -> dict:
    """ModelConfig's mixture-of-experts fields from a config.json ({} for a dense model): the
    expert counts (Mixtral's num_local_experts, the others' num_experts), the experts' width
    (moe_intermediate_size, else intermediate_size: OLMoE's and Mixtral's), Qwen's dense layers
    (mlp_only_layers, and all but every decoder_sparse_step-th) and shared expert."""
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if not experts:
        return {}
    model_type, layers = cfg["model_type"], int(cfg["num_hidden_layers"])
    if model_type == "olmoe" and cfg.get("clip_qkv") is not None:
        raise BadInput(f"{path}: OLMoE's clip_qkv is not supported (got {cfg['clip_qkv']})")
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = [i for i in range(layers) if i in (cfg.get("mlp_only_layers") or []) or (i + 1) % step]
    return {"num_experts": experts, "experts_per_token": int(cfg["num_experts_per_tok"]),
            "expert_intermediate_size": int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
            # Mixtral's router always renormalises (its config has no such key)
            "norm_topk_prob": True if model_type == "mixtral" else bool(cfg.get("norm_topk_prob", False)),
            "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0)
            if model_type == "qwen2_moe" else 0,
            "dense_layers": dense or None, "qk_norm_whole": model_type == "olmoe"}


def from_hf_config(cfg: dict, path: str) -> ModelConfig:
    """HF config.json -> ModelConfig; `path` names the file in errors."""
    cfg = _text_config(cfg)
    model_type = cfg.get("model_type")
    if model_type in UNBUILT_MOE:
        raise BadInput(f"{path}: the mixture-of-experts architecture '{model_type}' is not supported yet "
                       "(mixtures nerva runs: olmoe, qwen2_moe, qwen3_moe, mixtral)")
    if model_type not in FAMILY_OF:
        raise BadInput(f"{path}: architecture '{model_type}' is not supported (supported: {SUPPORTED_TEXT})")
    family = FAMILY_OF[model_type]
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"  # Gemma's name first, as transformers
    if act not in HF_ACTIVATIONS or (act != "silu") != (family in GEMMA):
        raise BadInput(f"{path}: activation '{act}' is not supported for {family} (nerva's MLP is SwiGLU: silu; "
                       "Gemma's GeGLU: gelu_pytorch_tanh)")
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        gemma = _gemma_fields(cfg, family, int(cfg["num_hidden_layers"])) if family in GEMMA else {}
        return ModelConfig(
            family=family,
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            vocab_size=int(cfg["vocab_size"]),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=_hf_rope_theta(cfg),
            max_context=_hf_max_context(cfg) if not gemma else int(cfg["max_position_embeddings"]),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=_hf_rope_scaling(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_list(cfg.get("eos_token_id")),
            qkv_bias=family in ("qwen2", "qwen2moe") or bool(cfg.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "gemma3", "olmoe", "qwen3moe"),
            rotary_dim=_hf_rotary_dim(cfg, head_dim),
            nope_layers=_hf_nope_layers(cfg),
            folded_scales=granite_scales(cfg.get("embedding_multiplier"), cfg.get("residual_multiplier"),
                                         cfg.get("attention_multiplier"), cfg.get("logits_scaling"))
            if model_type == "granite" else
            gemma_attention(cfg.get("query_pre_attn_scalar"), head_dim) if gemma else None,
            **gemma,
            **_hf_moe_fields(cfg, path),
        )
    except KeyError as e:
        raise BadInput(f"{path}: missing key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise BadInput(f"{path}: {e}") from None
    except BadInput as e:  # ModelConfig's checks, said of the file
        raise in_file(e, path) from None


def in_file(e: BadInput, path) -> BadInput:
    """ModelConfig's "config: ..." error (or another of reading a config) as one about the file
    it was read from, where it does not name it already."""
    message = str(e)
    return e if message.startswith(f"{path}:") else BadInput(f"{path}: {message.removeprefix('config: ')}")
