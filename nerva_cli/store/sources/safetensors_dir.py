"""A local directory of HF safetensors (one file or sharded with an index) plus config and
tokenizer. The header is parsed here, not by the safetensors package, so that every malformed
file gets a precise one-line error before any conversion starts."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np

from nerva_cli.model.config import GEMMA, from_hf_config
from nerva_cli.errors import BadInput, read_json
from nerva_cli.store.sources import Source, SourceTensor, expert_part, fused_part, offset, row_range

DTYPES = {"F32": (np.float32, 4), "F16": (np.float16, 2), "BF16": (np.uint16, 2)}
MAX_HEADER = 100 * 1024 * 1024

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o",
    "self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias", "self_attn.v_proj.bias": "v_bias",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
    # Phi-3's fused matrices, read a part at a time (sources.fused_part)
    "self_attn.qkv_proj.weight": "qkv", "mlp.gate_up_proj.weight": "gate_up",
}
# Gemma 2's and 3's norms: post_attention_layernorm is the one after attention,
# pre_feedforward_layernorm the MLP's input norm (Llama's and Gemma 1's post_attention_layernorm)
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_layernorm.weight": "post_attn_norm",
                      "pre_feedforward_layernorm.weight": "mlp_norm",
                      "post_feedforward_layernorm.weight": "post_mlp_norm"}
# A mixture of experts' MLP (num_experts > 0): the router, each routed expert's matrices (Mixtral's
# w1 gate, w3 up, w2 down), Qwen2-MoE's shared expert and its gate, or every expert's in fused 3-D
# tensors (expert_part reads an expert out of them)
_MOE_NAMES = [
    (re.compile(r"^(?:mlp|block_sparse_moe)\.gate\.weight$"), lambda m: "router"),
    (re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$"), lambda m: f"experts.{m[1]}.{m[2]}"),
    (re.compile(r"^block_sparse_moe\.experts\.(\d+)\.w([123])\.weight$"),
     lambda m: f"experts.{m[1]}.{ {'1': 'gate', '2': 'down', '3': 'up'}[m[2]] }"),
    (re.compile(r"^mlp\.shared_expert\.(gate|up|down)_proj\.weight$"), lambda m: f"shared.{m[1]}"),
    (re.compile(r"^mlp\.shared_expert_gate\.weight$"), lambda m: "shared_gate"),
    (re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(gate_up|down)_proj$"), lambda m: f"experts.{m[1]}"),
]
_GLOBAL_NAMES = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm",
                 "lm_head.weight": "lm_head"}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# A multimodal Gemma 3's language model, under the prefix its checkpoint gives it (transformers 5
# saves model.language_model., the Hub's first uploads language_model.model.)
_LANGUAGE_MODEL = re.compile(r"^(model\.language_model\.|language_model\.model\.)")
# Tensors a checkpoint may carry that inference does not use: a multimodal model's vision tower
# and projector among them (nerva runs text).
_IGNORED = re.compile(r"rotary_emb\.inv_freq$|^(model\.)?(vision_tower|multi_modal_projector)\.")


def canonical_name(hf_name: str, family: str = "llama", moe: bool = False) -> str | None:
    hf_name = _LANGUAGE_MODEL.sub("model.", hf_name).removeprefix("language_model.")  # its lm_head, if saved
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    m = _LAYER_RE.match(hf_name)
    names = _GEMMA_LAYER_NAMES if family in ("gemma2", "gemma3") else _LAYER_NAMES
    if m and m.group(2) in names:
        return f"layers.{int(m.group(1))}.{names[m.group(2)]}"
    for pattern, name in _MOE_NAMES if m and moe else ():
        found = pattern.match(m.group(2))
        if found:
            return f"layers.{int(m.group(1))}.{name(found)}"
    return None


def read_header(path: Path) -> tuple[int, dict]:
    """-> (data start, {name: (dtype, shape, begin, end)}) with every offset checked."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise BadInput(f"{path}: truncated safetensors file ({size} bytes, no header)")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER or 8 + n > size:
            raise BadInput(f"{path}: header length {n} runs past the end of the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadInput(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise BadInput(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)
    start, data_len = 8 + n, size - 8 - n
    tensors, spans = {}, []
    for name, info in header.items():
        try:
            dtype, shape, (b, e) = info["dtype"], [int(s) for s in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise BadInput(f"{path}: tensor '{name}' has a malformed header entry") from None
        if dtype not in DTYPES:
            raise BadInput(f"{path}: tensor '{name}' has unsupported dtype {dtype} "
                           f"(supported: {', '.join(DTYPES)})")
        want = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype][1]
        if not (0 <= b <= e) or e - b != want:
            raise BadInput(f"{path}: tensor '{name}' offsets [{b}, {e}] do not hold {want} bytes "
                           f"for shape {shape} {dtype}")
        if e > data_len:
            raise BadInput(f"{path}: tensor '{name}' runs past the end of the file "
                           f"(needs {start + e} bytes, file has {size}): truncated?")
        tensors[name] = (dtype, tuple(shape), b, e)
        spans.append((b, e, name))
    spans.sort()
    for (b1, e1, n1), (b2, e2, n2) in zip(spans, spans[1:]):
        if b2 < e1:
            raise BadInput(f"{path}: tensors '{n1}' and '{n2}' overlap in the file")
    return start, tensors


def _read_tensor(path: Path, start: int, dtype: str, shape, b: int, e: int) -> np.ndarray:
    """The tensor at bytes b..e of the data (which starts at `start`) as f32 of `shape`; a row
    slice where b, e and shape say one."""
    np_dtype, _ = DTYPES[dtype]
    with open(path, "rb") as f:
        f.seek(start + b)
        buf = np.empty(int(np.prod(shape, dtype=np.int64)), dtype=np_dtype)
        got = f.readinto(memoryview(buf).cast("B"))
    if got != e - b:
        raise BadInput(f"{path}: truncated while reading ({got} of {e - b} bytes)")
    if dtype == "BF16":
        return (buf.astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return buf.astype(np.float32, copy=False).reshape(shape)


def _weight_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise BadInput(f"{index}: no weight_map")
        files = sorted({root / f for f in weight_map.values()})
        for f in files:
            if not f.exists():
                raise BadInput(f"{f}: listed in {index.name} but missing")
        return files
    single = root / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(root.glob("*.safetensors"))
    if not found:
        raise BadInput(f"{root}: no safetensors weights (model.safetensors or an index)")
    return found


def open_safetensors_dir(root: Path, display_id: str | None = None, revision: str | None = None) -> Source:
    root = Path(root)
    cfg = from_hf_config(read_json(root / "config.json"), str(root / "config.json"))
    tok_path = root / "tokenizer.json"
    if not tok_path.exists():
        raise BadInput(f"{tok_path}: missing (nerva needs the fast tokenizer file)")
    tokenizer_files = {"tokenizer.json": tok_path.read_text()}
    tcfg = root / "tokenizer_config.json"
    tokenizer_files["tokenizer_config.json"] = tcfg.read_text() if tcfg.exists() else "{}"
    gen = root / "generation_config.json"
    if gen.exists():
        tokenizer_files["generation_config.json"] = gen.read_text()
    else:
        tokenizer_files["generation_config.json"] = json.dumps(
            {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids})
    template = root / "chat_template.jinja"
    if template.exists():  # newer checkpoints keep the template beside the config
        tc = json.loads(tokenizer_files["tokenizer_config.json"])
        tc.setdefault("chat_template", template.read_text())
        tokenizer_files["tokenizer_config.json"] = json.dumps(tc)

    where: dict[str, tuple[Path, int, tuple]] = {}
    fp = hashlib.sha256()
    for f in _weight_files(root):
        start, tensors = read_header(f)
        fp.update(f.name.encode() + str(f.stat().st_size).encode())
        fp.update(json.dumps(sorted((k, v[1], v[0]) for k, v in tensors.items())).encode())
        for hf_name, info in tensors.items():
            canon = canonical_name(hf_name, cfg.family, cfg.num_experts > 0)
            if canon is None:
                if _IGNORED.search(hf_name):
                    continue
                raise BadInput(f"{f}: unexpected tensor '{hf_name}' for a {cfg.family} model")
            where[canon] = (f, start, info)

    def tensor(name: str) -> SourceTensor:
        part = fused_part(cfg, name)
        if name not in where and part is not None and part[0] in where:
            return row_range(tensor(part[0]), *part[1:], name)
        expert = None if name in where else expert_part(cfg, name, lambda n: tensor(n) if n in where else None)
        if expert is not None:
            return expert
        if name not in where:
            raise BadInput(f"{root}: tensor for '{name}' not found in the safetensors files")
        f, start, (dtype, shape, b, e) = where[name]
        if name.endswith("shared_gate"):  # a Linear to one output: its single row is the vector
            shape = shape[-1:]

        def rows(r0: int, r1: int) -> np.ndarray:  # rows of a matrix, or of a 3-D tensor's [n * rows, cols]
            row = (e - b) // int(np.prod(shape[:-1]))
            return _read_tensor(f, start, dtype, (r1 - r0, shape[-1]), b + r0 * row, b + r1 * row)

        t = SourceTensor(shape=shape, stored_dtype=dtype.lower(), where=str(f),
                         read_f32=lambda: _read_tensor(f, start, dtype, shape, b, e),
                         read_f32_rows=rows if len(shape) >= 2 else None)
        # Gemma's norms multiply by 1 + weight: stored as that, as a GGUF of it holds them
        return offset(t, 1.0) if cfg.family in GEMMA and name.endswith("norm") else t

    name = (display_id or root.resolve().name).split("/")[-1].lower()
    origin = {"kind": "hf-repo" if display_id else "hf-dir", "id": display_id or str(root.resolve()),
              "revision": revision}
    return Source(config=cfg, origin=origin, fingerprint=fp.hexdigest()[:32], tensors=tensor,
                  tokenizer_files=tokenizer_files, default_name=name)
