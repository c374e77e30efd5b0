"""A local .gguf file: its header read by sources.gguf_header, its tensor bytes read by offset, so
a conversion holds about one layer in memory."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np

from nerva_cli.model.config import (FAMILY_OF, SUPPORTED_TEXT, UNBUILT_MOE, ModelConfig, attended_context,
                                    gemma_attention, gemma_fields, geglu_fields, granite_scales, in_file,
                                    longrope_scaling, yarn_scaling)
from nerva_cli.errors import BadInput
from nerva_cli.model.quant import BLOCK_BYTES, split_blocks
from nerva_cli.store.sources import Source, SourceTensor, expert_part, fused_part, row_range
from nerva_cli.store.sources.gguf_header import GGUFHeader, read_header

# Every type gguf-py (0.10 on) dequantises in NumPy: the K-quant files llama.cpp writes hold Q5_0,
# Q5_1 or Q8_0 where a row is not a multiple of 256 wide (SmolLM2's 576: most of a Q4_K_M), and
# the i-quants (IQ*) come from the same quantiser. Q4_0 and Q4_1 import as they are.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS")

_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "q", "attn_k.weight": "k", "attn_v.weight": "v",
    "attn_output.weight": "o", "attn_q.bias": "q_bias", "attn_k.bias": "k_bias", "attn_v.bias": "v_bias",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm", "ffn_norm.weight": "mlp_norm",
    "ffn_gate.weight": "gate", "ffn_up.weight": "up", "ffn_down.weight": "down",
    "attn_qkv.weight": "qkv",  # Phi-3's fused q/k/v (and its gate/up, fused under ffn_up: open_gguf)
    "post_attention_norm.weight": "post_attn_norm", "post_ffw_norm.weight": "post_mlp_norm",  # Gemma 3's
    # a mixture of experts': the router, every expert's gate, up and down stacked [experts, rows,
    # cols] (sources.expert_part reads one), a shared expert and its gate
    "ffn_gate_inp.weight": "router", "ffn_gate_exps.weight": "experts.gate", "ffn_up_exps.weight": "experts.up",
    "ffn_down_exps.weight": "experts.down", "ffn_gate_shexp.weight": "shared.gate", "ffn_up_shexp.weight": "shared.up",
    "ffn_down_shexp.weight": "shared.down", "ffn_gate_inp_shexp.weight": "shared_gate",
}
# the first Mixtral GGUFs' experts, a tensor each: blk.N.ffn_gate.E.weight
_EXPERT_RE = re.compile(r"^ffn_(gate|up|down)\.(\d+)\.weight$")
# Tensors that configure RoPE rather than hold weights: Llama 3.1's per-frequency divisors,
# Phi-3's LongRoPE factors
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_GLOBAL_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_QUANT_SUFFIX = re.compile(r"[.\-_](i?q\d[\w]*|f16|f32|bf16|fp16|fp32)$", re.IGNORECASE)  # fp16: Microsoft's names
# llama.cpp's gguf-split names: Model-Q6_K-00001-of-00003.gguf; part 1 holds the metadata
SPLIT_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


def canonical_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"layers.{int(m.group(1))}.{_LAYER_NAMES[m.group(2)]}"
    expert = _EXPERT_RE.match(m.group(2)) if m else None
    if expert:
        return f"layers.{int(m.group(1))}.experts.{int(expert.group(2))}.{expert.group(1)}"
    return None


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert permutation of Llama q/k rows (it interleaves the two rotary
    halves of each head for GGML's rope); nerva, like HF, rotates halves (NeoX order)."""
    rows = w.shape[0]
    return np.ascontiguousarray(
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _config(header: GGUFHeader, path: Path, embed_shape, rope: dict[str, list[float]]) -> ModelConfig:
    """The config from the keys; `rope`: the values of the _ROPE_TENSORS the file holds."""
    fields = header.fields
    arch = fields.get("general.architecture")
    if arch in UNBUILT_MOE:
        raise BadInput(f"{path}: the mixture-of-experts architecture '{arch}' is not supported yet "
                       "(mixtures nerva runs: olmoe, qwen2moe, qwen3moe, and Mixtral as llama)")
    if arch not in FAMILY_OF:
        raise BadInput(f"{path}: architecture '{arch}' is not supported (supported: {SUPPORTED_TEXT})")
    family = FAMILY_OF[arch]

    def key(name, default=None):
        value = fields.get(f"{arch}.{name}", default)
        if value is None:
            raise BadInput(f"{path}: missing GGUF key '{arch}.{name}'")
        return value

    heads, hidden = int(key("attention.head_count")), int(key("embedding_length"))
    head_dim = int(key("attention.key_length", hidden // heads))
    longest = int(key("context_length", 4096))
    scaling = None
    kind = fields.get(f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", "linear", "yarn", "longrope"):
        raise BadInput(f"{path}: RoPE scaling '{kind}' is not supported (supported: linear, yarn, longrope)")
    linear = float(key("rope.scaling.factor")) if kind == "linear" else None
    if "rope_freqs.weight" in rope:  # llama.cpp divides each frequency by its factor, then by a linear one
        scaling = {"type": "freq_factors", "factors": [f * (linear or 1.0) for f in rope["rope_freqs.weight"]]}
    elif "rope_factors_long.weight" in rope or "rope_factors_short.weight" in rope:
        if len(rope) != 2:
            raise BadInput(f"{path}: LongRoPE needs both rope_factors_long and rope_factors_short")
        original = int(key("rope.scaling.original_context_length"))
        scaling = longrope_scaling(rope["rope_factors_short.weight"], rope["rope_factors_long.weight"], original,
                                   longest / original, fields.get(f"{arch}.rope.scaling.attn_factor"))
    elif linear is not None:
        scaling = {"type": "linear", "factor": linear}
    elif kind == "yarn":
        odd = [k for k in ("yarn_ext_factor", "yarn_attn_factor", "yarn_log_multiplier")
               if f"{arch}.rope.scaling.{k}" in fields]
        if odd:
            raise BadInput(f"{path}: YaRN with {', '.join(odd)} (DeepSeek's form) is not supported")
        factor = float(key("rope.scaling.factor"))
        attention = fields.get(f"{arch}.rope.scaling.attn_factor")  # llama.cpp multiplies its own by it
        scaling = yarn_scaling(factor, int(key("rope.scaling.original_context_length")),
                               fields.get(f"{arch}.rope.scaling.yarn_beta_fast"),
                               fields.get(f"{arch}.rope.scaling.yarn_beta_slow"),
                               attention_factor=None if attention is None else
                               float(attention) * yarn_scaling(factor, 1)["attention_factor"])
    rotary = int(key("rope.dimension_count", head_dim))
    if rotary != head_dim and family == "llama":  # its q/k rows are interleaved over the whole head
        raise BadInput(f"{path}: a Llama GGUF rotating {rotary} of {head_dim} head dimensions is not supported")
    eos = fields.get("tokenizer.ggml.eos_token_id")
    names = {t.name for t in header.tensors}
    layers = int(key("block_count"))
    window = fields.get(f"{arch}.attention.sliding_window")
    gemma = {}
    if arch == "gemma3":  # as llama.cpp runs it: every sixth layer full, the others windowed at base 10000
        gemma = {**gemma_fields(hidden, layers, int(key("attention.sliding_window")), 6, local_rope_theta=10_000.0),
                 # the 27B's 1/sqrt(hidden / heads), which llama.cpp knows by its 62 layers
                 "folded_scales": gemma_attention(hidden // heads if layers == 62 else head_dim, head_dim)}
    elif arch == "gemma":  # Gemma 1: no windows, no post norms, no caps
        gemma = geglu_fields(hidden)
    elif arch == "gemma2":  # llama.cpp's: every other layer windowed (4096 unless named), caps 50 and 30 unless named
        gemma = {**gemma_fields(hidden, layers, int(key("attention.sliding_window", 4096)), 2),
                 "attn_softcap": float(key("attn_logit_softcapping", 50.0)),
                 "final_softcap": float(key("final_logit_softcapping", 30.0)),
                 "folded_scales": gemma_attention(hidden // heads if layers == 46 else head_dim, head_dim)}  # its 27B
    try:
        return ModelConfig(
            family=family, hidden_size=hidden, intermediate_size=int(key("feed_forward_length")),
            num_layers=layers, num_heads=heads,
            num_kv_heads=int(key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            vocab_size=int(embed_shape[0]), rms_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            max_context=longest if gemma else attended_context(longest, window),
            tie_embeddings="output.weight" not in names, rope_scaling=scaling,
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[] if eos is None else [int(eos)],
            qkv_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names,
            rotary_dim=None if rotary == head_dim else rotary,
            # llama.cpp's SmolLM3: no RoPE in every fourth layer (its step is fixed, not a key)
            nope_layers=[i for i in range(3, int(key("block_count")), 4)] or None if arch == "smollm3" else None,
            folded_scales=granite_scales(*(fields.get(f"{arch}.{k}") for k in ("embedding_scale", "residual_scale",
                                                                              "attention.scale", "logit_scale")))
            if arch == "granite" else gemma.pop("folded_scales", None),
            **gemma,
            **_moe_fields(fields, arch, names, layers, key),
        )
    except BadInput as e:  # its checks, said of the file
        raise in_file(e, path) from None


def _moe_fields(fields: dict, arch: str, names: set[str], layers: int, key) -> dict:
    """ModelConfig's mixture-of-experts fields from a GGUF's keys ({} without expert_count): the
    experts' width (expert_feed_forward_length, else feed_forward_length: OLMoE's and Mixtral's),
    the shared expert's, the layers without a router (dense). A GGUF keeps no norm_topk_prob:
    the experts' weights are renormalised as llama.cpp does for the architecture (qwen3moe and
    llama, Mixtral's, always; olmoe and qwen2moe never)."""
    experts = int(fields.get(f"{arch}.expert_count") or 0)
    if not experts:
        return {}
    return {"num_experts": experts, "experts_per_token": int(key("expert_used_count")),
            "expert_intermediate_size": int(fields.get(f"{arch}.expert_feed_forward_length")
                                            or key("feed_forward_length")),
            "norm_topk_prob": arch in ("qwen3moe", "llama"),
            "shared_expert_intermediate_size": int(fields.get(f"{arch}.expert_shared_feed_forward_length") or 0),
            "dense_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names] or None,
            "qk_norm_whole": arch == "olmoe"}


def split_part_names(name: str) -> list[str]:
    """The file names of the GGUF that `name` is, or is a gguf-split part of, in order."""
    m = SPLIT_PART.search(name)
    if m is None:
        return [name]
    count = int(m.group(2))
    return [f"{name[:m.start()]}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def split_parts(path: Path) -> list[Path]:
    """The files of a GGUF: itself, or all parts of a gguf-split one (named by its first part)."""
    m = SPLIT_PART.search(path.name)
    if m is not None and int(m.group(1)) != 1:
        part, count = int(m.group(1)), int(m.group(2))
        raise BadInput(f"{path}: part {part} of {count} of a split GGUF: give its first part, -00001-of-{count:05d}")
    parts = [path.with_name(name) for name in split_part_names(path.name)]
    for p in parts:
        if not p.exists():
            raise BadInput(f"{p}: missing (part of the split GGUF {path.name})")
    return parts


def fingerprint(path: Path) -> str:
    """A GGUF's source fingerprint (metadata.json's source.fingerprint): its name, its parts' sizes
    and its first MB, without parsing it, so that `run PATH` can tell a changed file cheaply."""
    sizes = [p.stat().st_size for p in split_parts(path)]
    fp = hashlib.sha256(f"{path.name}:{sizes[0] if len(sizes) == 1 else sizes}".encode())  # one file: as before
    with open(path, "rb") as f:
        fp.update(f.read(1 << 20))
    return fp.hexdigest()[:32]


def open_gguf(path: Path) -> Source:
    """A GGUF file, or a split one through its first part (-00001-of-0000N.gguf): the metadata
    from the first part, the tensors from whichever part holds each."""
    from gguf import GGMLQuantizationType, quants

    from nerva_cli.store.gguf_tokenizer import tokenizer_files_from_gguf

    path = Path(path)
    parts = split_parts(path)
    header = read_header(path)
    if len(parts) != int(header.fields.get("split.count", 1)):
        raise BadInput(f"{path}: its name says {len(parts)} parts, its split.count "
                       f"{header.fields.get('split.count', 1)}")
    tensors, rope_tensors = {}, {}
    for part in parts:
        size = part.stat().st_size
        for t in (header if part == path else read_header(part)).tensors:
            if t.data_offset + t.n_bytes > size:
                raise BadInput(f"{part}: tensor '{t.name}' runs past the end of the file: cut short?")
            if t.name in _ROPE_TENSORS:
                rope_tensors[t.name] = (part, t)
                continue
            canon = canonical_name(t.name)
            if canon is None:
                raise BadInput(f"{part}: unexpected tensor '{t.name}'")
            qtype = t.type.name
            if qtype not in SUPPORTED_TYPES:
                raise BadInput(f"{part}: tensor '{t.name}' has type {qtype} (supported: {', '.join(SUPPORTED_TYPES)})")
            tensors[canon] = (part, t)
    if "embed" not in tensors:
        raise BadInput(f"{path}: no token_embd.weight tensor")

    def read_raw(where: Path, t, skip: int = 0, n: int | None = None) -> np.ndarray:
        """n bytes (all) of tensor t's data from byte `skip` of it."""
        buf = np.empty(t.n_bytes - skip if n is None else n, dtype=np.uint8)
        with open(where, "rb") as f:
            f.seek(t.data_offset + skip)
            if f.readinto(memoryview(buf)) != buf.size:
                raise BadInput(f"{where}: cut short while reading '{t.name}'")
        return buf

    rope = {}  # a divisor per frequency each
    for name, (where, t) in rope_tensors.items():
        if t.type.name != "F32" or len(t.shape) != 1:
            raise BadInput(f"{where}: {name} must be one row of F32, got {t.type.name} {list(t.shape)}")
        rope[name] = read_raw(where, t).view(np.float32).tolist()
    cfg = _config(header, path, tensors["embed"][1].shape, rope)
    if cfg.family == "llama" and any(c.endswith(".qkv") for c in tensors):  # rows permuted per q and k apart
        raise BadInput(f"{path}: a Llama GGUF with a fused attn_qkv is not supported")
    if cfg.family == "phi3":  # llama.cpp's converter keeps Phi-3's gate/up matrix whole, as ffn_up
        for canon in [c for c in tensors if c.endswith(".up") and c.removesuffix(".up") + ".gate" not in tensors]:
            tensors[canon.removesuffix(".up") + ".gate_up"] = tensors.pop(canon)
    tokenizer_files = tokenizer_files_from_gguf(header.fields, path=str(path))

    def permuted(canon: str) -> bool:
        """Rows llama.cpp's converter reordered (a Llama's q and k)."""
        return cfg.family == "llama" and canon.rsplit(".", 1)[-1] in ("q", "k")

    def unpermute(canon: str, w: np.ndarray) -> np.ndarray:
        if permuted(canon):
            return _unpermute_rows(w, cfg.num_heads if canon.endswith(".q") else cfg.num_kv_heads)
        return w

    def tensor(canon: str) -> SourceTensor:
        part = fused_part(cfg, canon)
        if canon not in tensors and part is not None and part[0] in tensors:
            return row_range(tensor(part[0]), *part[1:], canon)
        expert = None if canon in tensors else expert_part(cfg, canon, lambda n: tensor(n) if n in tensors else None)
        if expert is not None:
            return expert
        if canon not in tensors:
            raise BadInput(f"{path}: tensor for '{canon}' not found")
        where, t = tensors[canon]
        shape = t.shape
        qtype = t.type
        if canon.endswith("shared_gate"):  # one row: the vector (llama.cpp's converter writes it 1-D)
            shape = shape[-1:]
        rows_of = int(np.prod(shape[:-1], dtype=np.int64))  # a 3-D tensor's as the matrix [n * rows, cols]

        def decode(raw: np.ndarray, rows: int) -> np.ndarray:
            if qtype == GGMLQuantizationType.F32:
                w = raw.view(np.float32)
            elif qtype == GGMLQuantizationType.F16:
                w = raw.view(np.float16).astype(np.float32)
            elif qtype == GGMLQuantizationType.BF16:
                w = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            else:
                w = quants.dequantize(raw.reshape(rows, -1), qtype)
            return np.ascontiguousarray(w, dtype=np.float32)

        def read_f32():
            return unpermute(canon, decode(read_raw(where, t), int(np.prod(shape[:-1], dtype=np.int64))).reshape(shape))

        def read_f32_rows(r0: int, r1: int) -> np.ndarray:
            row_bytes = t.n_bytes // rows_of
            return decode(read_raw(where, t, r0 * row_bytes, (r1 - r0) * row_bytes), r1 - r0).reshape(r1 - r0, shape[-1])

        def read_planes():
            planes = split_blocks(read_raw(where, t).reshape(rows_of, -1), shape[-1], qtype.name.lower())
            return tuple(None if p is None else unpermute(canon, p.reshape(*shape[:-1], -1)) for p in planes)

        def read_planes_rows(r0: int, r1: int):
            row_bytes = t.n_bytes // rows_of
            raw = read_raw(where, t, r0 * row_bytes, (r1 - r0) * row_bytes)
            return split_blocks(raw.reshape(r1 - r0, -1), shape[-1], qtype.name.lower())

        blocks = qtype.name.lower() in BLOCK_BYTES
        apart = len(shape) >= 2 and not permuted(canon)
        return SourceTensor(shape=shape, read_f32=read_f32, stored_dtype=qtype.name.lower(), where=str(where),
                            read_planes=read_planes if blocks else None,
                            read_f32_rows=read_f32_rows if apart else None,
                            read_planes_rows=read_planes_rows if blocks and apart else None)

    name = _QUANT_SUFFIX.sub("", SPLIT_PART.sub("", path.name).removesuffix(".gguf") if len(parts) > 1
                             else path.stem).lower()
    return Source(config=cfg, origin={"kind": "gguf", "id": str(path.resolve()), "revision": None},
                  fingerprint=fingerprint(path), tensors=tensor, tokenizer_files=tokenizer_files,
                  default_name=name)
