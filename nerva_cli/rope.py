"""RoPE frequency tables: plain, linear and llama3 scaling, as HF computes them (in float32), and
a GGUF's per-frequency factors, as llama.cpp applies them."""

from __future__ import annotations

import math

import numpy as np

from nerva_cli.config import ModelConfig


def inv_freq(cfg: ModelConfig) -> np.ndarray:
    dim = cfg.head_dim
    freqs = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))))
    freqs = freqs.astype(np.float32)
    rs = cfg.rope_scaling or {}
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
    return freqs


def tables(cfg: ModelConfig, max_pos: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin f32 [max_pos, head_dim/2]."""
    angles = np.arange(max_pos, dtype=np.float32)[:, None] * inv_freq(cfg)[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
