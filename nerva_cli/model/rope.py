"""RoPE frequency tables: plain, linear, llama3, longrope and YaRN scaling, as HF computes them (in
float32), and a GGUF's per-frequency factors, as llama.cpp applies them; partial rotation
(rotary_dim) through the store's q/k row order (partial_rotary_order)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from nerva_cli.model.config import ModelConfig


def inv_freq(cfg: ModelConfig, max_pos: int | None = None) -> np.ndarray:
    """f32 [head_dim / 2]: the frequency of each rotated pair, 0 for the pairs a partial rotation
    leaves alone. `max_pos`, the context, picks longrope's long factors where it is past the
    original one (llama.cpp's choice, by the context; transformers' by the sequence so far)."""
    dim = cfg.rotation
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    rs = cfg.rope_scaling or {}
    if rs.get("type") == "longrope":
        long = max_pos is not None and max_pos > rs["original_max_position_embeddings"]
        ext = np.asarray(rs["long_factor" if long else "short_factor"], dtype=np.float32)
        freqs = (np.float32(1.0) / (ext * np.float32(cfg.rope_theta) ** exponents)).astype(np.float32)
    else:
        freqs = (1.0 / (np.float32(cfg.rope_theta) ** exponents)).astype(np.float32)
    if rs.get("type") == "linear":
        freqs = freqs / np.float32(rs["factor"])
    elif rs.get("type") == "llama3":
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / freqs
        scaled = np.where(wavelen > old / low, freqs / factor, freqs)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        freqs = np.where(medium, smoothed, scaled).astype(np.float32)
    elif rs.get("type") == "freq_factors":  # a GGUF's rope_freqs: llama.cpp divides each frequency by its factor
        freqs = (freqs / np.asarray(rs["factors"], dtype=np.float32)).astype(np.float32)
    elif rs.get("type") == "yarn":
        freqs = _yarn(freqs, cfg, rs)
    return np.concatenate([freqs, np.zeros((cfg.head_dim - dim) // 2, dtype=np.float32)])


def _yarn(freqs: np.ndarray, cfg: ModelConfig, rs: dict) -> np.ndarray:
    """YaRN: each frequency between itself (extrapolated) and itself / factor (interpolated),
    the blend a ramp over the pairs between the ones that turn beta_fast and beta_slow times
    over the original context (floored and ceiled unless truncate is off), in f32 as
    transformers computes it."""
    dim, base, original = cfg.rotation, cfg.rope_theta, rs["original_max_position_embeddings"]

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rs["beta_fast"]), correction_dim(rs["beta_slow"])
    if rs["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolated = (np.float32(1) - ramp).astype(np.float32)
    periods = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))  # 1 / freqs
    interpolated = (np.float32(1) / (np.float32(rs["factor"]) * periods)).astype(np.float32)
    return (interpolated * (np.float32(1) - extrapolated) + freqs * extrapolated).astype(np.float32)


def tables(cfg: ModelConfig, max_pos: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin f32 [max_pos, head_dim/2]; longrope's and YaRN's attention factor scales the
    rotated pairs' (transformers multiplies its cos and sin, llama.cpp its rotation), the others
    stay 1 and 0."""
    angles = np.arange(max_pos, dtype=np.float32)[:, None] * inv_freq(cfg, max_pos)[None, :]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    rs = cfg.rope_scaling or {}
    if rs.get("type") in ("longrope", "yarn"):
        rotated = cfg.rotation // 2
        cos[:, :rotated] *= np.float32(rs["attention_factor"])
        sin[:, :rotated] *= np.float32(rs["attention_factor"])
    return cos, sin


def partial_rotary_order(head_dim: int, rotary_dim: int) -> np.ndarray:
    """Where each of a head's stored rows comes from, for a rotation of its first rotary_dim
    dimensions: HF rotates the pairs (i, i + rotary_dim/2) and passes the rest through; nerva's
    kernels rotate (i, i + head_dim/2). Stored row i < r (r = rotary_dim/2) is row i, row
    head_dim/2 + i is r + i, and the pass-through rows fill the pairs above r in order (their
    frequency is 0). The same order for q and k leaves every q.k product as it was."""
    half, r = head_dim // 2, rotary_dim // 2
    passed = np.arange(rotary_dim, head_dim)
    first = np.concatenate([np.arange(r), passed[:half - r]])
    second = np.concatenate([r + np.arange(r), passed[half - r:]])
    return np.concatenate([first, second])


def per_layer(cfg: ModelConfig, cos: np.ndarray, sin: np.ndarray, put=lambda t: t) -> list[tuple]:
    """Each layer's (cos, sin), as `put` makes them of host tables (the cuda engine's: uploaded):
    the model's, or for a layer without RoPE (nope_layers) tables of the same shape that rotate by
    nothing (cos 1, sin 0), or for a sliding-window layer where the model gives those their own
    base (Gemma 3's local_rope_theta) that base's, unscaled, so that every layer's kernels are the
    same. Made once, shared."""
    rotated = (put(cos), put(sin))
    still = (put(np.ones_like(cos)), put(np.zeros_like(cos))) if cfg.nope_layers else None
    local = None
    if cfg.sliding_layers and cfg.local_rope_theta is not None:
        local = tuple(map(put, tables(dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=None),
                                      cos.shape[0])))
    return [still if i in (cfg.nope_layers or ()) else local if local and i in cfg.sliding_layers else rotated
            for i in range(cfg.num_layers)]
