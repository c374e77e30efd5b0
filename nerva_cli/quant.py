"""Q4_0 in nerva's two-plane layout (ARCHITECTURE section 6).

A GGUF Q4_0 block is 18 bytes: an f16 scale `d` then 16 bytes of codes, byte j holding element j
(low nibble) and element j + 16 (high nibble). nerva keeps the same codes but splits the blocks
into two planes per matrix, `qs` uint8 [out, in/2] and `d` f16 [out, in/32], so a kernel streams
codes without stepping over scales. Quantising goes through the `gguf` package's implementation
of llama.cpp's reference quantiser, which is what makes a GGUF Q4_0 import bit-exact.
"""

from __future__ import annotations

import numpy as np

QK = 32  # weights per block
BLOCK_BYTES = 2 + QK // 2


def split_blocks(raw: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q4_0 bytes [rows, cols/32*18] -> (qs uint8 [rows, cols/2], d f16 [rows, cols/32])."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // QK, BLOCK_BYTES)
    d = blocks[:, :, :2].copy().view(np.float16).reshape(rows, cols // QK)
    qs = np.ascontiguousarray(blocks[:, :, 2:]).reshape(rows, cols // 2)
    return qs, d


def join_blocks(qs: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Inverse of split_blocks: the GGUF Q4_0 byte layout [rows, cols/32*18]."""
    rows, nb = d.shape
    out = np.empty((rows, nb, BLOCK_BYTES), dtype=np.uint8)
    out[:, :, :2] = np.ascontiguousarray(d, dtype=np.float16).view(np.uint8).reshape(rows, nb, 2)
    out[:, :, 2:] = qs.reshape(rows, nb, QK // 2)
    return out.reshape(rows, nb * BLOCK_BYTES)


def quantize_q4_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """f32 [rows, cols] -> (qs, d) with llama.cpp's reference Q4_0 rounding."""
    from gguf import GGMLQuantizationType, quants

    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % QK:
        raise ValueError(f"Q4_0 needs a matrix whose row length is a multiple of {QK}, got {w.shape}")
    raw = quants.quantize(w, GGMLQuantizationType.Q4_0)
    return split_blocks(raw, w.shape[1])


def dequantize_q4_0(qs: np.ndarray, d: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """(qs, d) -> f32 [rows, cols]: w = d * (q - 8)."""
    rows, half = qs.shape
    blocks = qs.reshape(rows, half // (QK // 2), QK // 2)
    codes = np.empty((rows, blocks.shape[1], QK), dtype=np.float32)
    codes[:, :, : QK // 2] = blocks & 0x0F
    codes[:, :, QK // 2 :] = blocks >> 4
    codes -= 8.0
    codes *= d.astype(np.float32)[:, :, None]
    w = codes.reshape(rows, half * 2)
    if out is not None:
        out[...] = w
        return out
    return w
