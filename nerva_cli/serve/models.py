"""The store's models as the APIs name and describe them."""

from __future__ import annotations

import hashlib
import time
from datetime import datetime, timezone

from nerva_cli.errors import BadInput
from nerva_cli.model.layout import parameter_count, parameter_size
from nerva_cli.serve.errors import ApiError


def not_found(ref: str) -> ApiError:
    return ApiError(404, f"model '{ref}' not found: `nerva list` shows the store, `nerva pull` adds to it",
                    code="model_not_found", param="model")


def resolve(ref) -> tuple[str, object]:
    """A client's model name -> (name:variant, the stored model). Only the store's names: never a
    path or a source to pull, so a client cannot make the server read a file or fetch from the
    Hub. ollama's clients add `:latest` to a bare name; it means the one `run` would pick."""
    from nerva_cli.store import catalog

    if not isinstance(ref, str) or not ref.strip():
        raise ApiError(400, "'model' must name a model (a string such as smollm2-135m:q4_0)", param="model")
    try:
        name, variant = catalog.parse_ref(ref)  # name:latest is the bare name
    except BadInput:
        raise not_found(ref) from None
    have = catalog.variants_of(name)
    if not have:
        raise not_found(ref)
    variant = variant or catalog.default_variant(have)
    if variant not in have:
        raise not_found(ref)
    try:  # a directory, so that find_model never takes the name for a path of the server's
        return f"{name}:{variant}", catalog.find_model(str(catalog.models_root() / name / variant))
    except BadInput as e:
        raise ApiError(500, f"the store's entry for {name}:{variant} is broken: {e}") from None


def stored_models() -> list:
    from nerva_cli.store import catalog

    return catalog.list_models()


def key_of(model) -> str:
    return f"{model.name}:{model.variant}"


def digest(model) -> str:
    """sha256 of metadata.json, which names every file's sha256: it changes when any file does."""
    return hashlib.sha256((model.path / "metadata.json").read_bytes()).hexdigest()


def modified(model) -> float:
    return (model.path / "metadata.json").stat().st_mtime


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


_this_second = (0, "")  # (a second, its ISO text): now_iso runs once a streamed token


def now_iso() -> str:
    """The time as ollama writes created_at (UTC, microseconds), the date's text made once a second."""
    global _this_second
    t = time.time()
    second = int(t)
    if second != _this_second[0]:
        _this_second = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
    return f"{_this_second[1]}.{int((t - second) * 1e6):06d}Z"


def details(model) -> dict:
    cfg = model.config
    return {"parent_model": "", "format": "nerva", "family": cfg.family, "families": [cfg.family],
            "parameter_size": parameter_size(parameter_count(cfg)), "quantization_level": model.variant.upper()}


def ollama_entry(model) -> dict:
    """A model as /api/tags lists it."""
    key = key_of(model)
    return {"name": key, "model": key, "modified_at": iso(modified(model)), "size": model.size,
            "digest": digest(model), "details": details(model)}


def openai_entry(model) -> dict:
    return {"id": key_of(model), "object": "model", "created": int(modified(model)), "owned_by": "nerva"}


def model_info(model) -> dict:
    """/api/show's model_info, with the GGUF-style keys ollama uses."""
    cfg = model.config
    arch = cfg.family
    return {"general.architecture": arch, "general.parameter_count": parameter_count(cfg),
            f"{arch}.context_length": cfg.max_context, f"{arch}.embedding_length": cfg.hidden_size,
            f"{arch}.block_count": cfg.num_layers, f"{arch}.feed_forward_length": cfg.intermediate_size,
            f"{arch}.attention.head_count": cfg.num_heads, f"{arch}.attention.head_count_kv": cfg.num_kv_heads,
            f"{arch}.rope.freq_base": cfg.rope_theta, f"{arch}.vocab_size": cfg.vocab_size}
