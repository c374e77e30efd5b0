"""Q4_0, Q4_1 and Q8_0 in nerva's plane layout (ARCHITECTURE section 6).

A GGUF Q4_0 block is 18 bytes: an f16 scale `d` then 16 bytes of codes, byte j holding element j
(low nibble) and element j + 16 (high nibble); the weight is d (q - 8). A Q4_1 block (20 bytes)
adds an f16 offset `m` after `d`, and its weight is d q + m. nerva keeps the same codes but
splits the blocks into planes per matrix, `qs` uint8 [out, in/2], `d` f16 [out, in/32] and for
Q4_1 `m` f16 [out, in/32], so a kernel streams codes without stepping over scales. Q4_1 is there
so that a Q4_1 GGUF (the bundled SmolLM2 is one) runs as it was made: requantised to Q4_0 its
perplexity rose by a third. Quantising goes through the `gguf` package's implementation of
llama.cpp's reference quantisers; a GGUF import of either type copies the planes bit for bit.

Q8_0 (34 bytes: d, then 32 int8 codes q; weight d q) holds the token table, and with it a tied
lm_head, in the Q4 variants, as llama.cpp's quantiser leaves it where its Q6_K does not fit the
row (the bundled SmolLM2's, 576 wide, is Q8_0): requantised to Q4_1, that table made the bundled
model's perplexity 5.9% higher than llama.cpp's on the same file (docs/perf/mcap_smollm2.md).
Its planes are `q8` int8 [out, in] and `d` f16 [out, in/32].
"""

from __future__ import annotations

import numpy as np

QK = 32  # weights per block
Q4_KINDS = ("q4_0", "q4_1")
TABLE_KIND = "q8_0"  # the token table's (and an lm_head's) format in the Q4 variants
BLOCK_BYTES = {"q4_0": 2 + QK // 2, "q4_1": 4 + QK // 2, "q8_0": 2 + QK}

Planes = tuple  # (qs, d, m): m is None for Q4_0


def split_blocks(raw: np.ndarray, cols: int, kind: str = "q4_0") -> Planes:
    """GGUF Q4_0/Q4_1/Q8_0 bytes [rows, cols/32*block] -> (qs uint8 [rows, cols/2], d f16
    [rows, cols/32], m f16 [rows, cols/32] for Q4_1 else None); for Q8_0 the codes are int8
    [rows, cols]."""
    rows = raw.shape[0]
    code_bytes = QK if kind == "q8_0" else QK // 2
    scales = BLOCK_BYTES[kind] - code_bytes  # bytes of d (and m) a block
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // QK, BLOCK_BYTES[kind])
    d = blocks[:, :, :2].copy().view(np.float16).reshape(rows, cols // QK)
    m = blocks[:, :, 2:4].copy().view(np.float16).reshape(rows, cols // QK) if kind == "q4_1" else None
    qs = np.ascontiguousarray(blocks[:, :, scales:]).reshape(rows, cols * code_bytes // QK)
    return (qs.view(np.int8) if kind == "q8_0" else qs), d, m


def join_blocks(qs: np.ndarray, d: np.ndarray, m: np.ndarray | None = None) -> np.ndarray:
    """Inverse of split_blocks: the GGUF Q4_0 (m None), Q4_1 or Q8_0 (int8 codes) byte layout
    [rows, cols/32*block]."""
    rows, nb = d.shape
    planes = [d] if m is None else [d, m]
    code_bytes = QK if qs.dtype == np.int8 else QK // 2
    out = np.empty((rows, nb, 2 * len(planes) + code_bytes), dtype=np.uint8)
    for i, p in enumerate(planes):
        out[:, :, 2 * i:2 * i + 2] = np.ascontiguousarray(p, dtype=np.float16).view(np.uint8).reshape(rows, nb, 2)
    out[:, :, 2 * len(planes):] = np.ascontiguousarray(qs).view(np.uint8).reshape(rows, nb, code_bytes)
    return out.reshape(rows, -1)


def quantize_blocks(w: np.ndarray, kind: str = "q4_0") -> Planes:
    """f32 [rows, cols] -> (qs, d, m) with llama.cpp's reference Q4_0, Q4_1 or Q8_0 rounding."""
    from gguf import GGMLQuantizationType, quants

    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % QK:
        raise ValueError(f"{kind.upper()} needs a matrix whose row length is a multiple of {QK}, got {w.shape}")
    raw = quants.quantize(w, GGMLQuantizationType[kind.upper()])
    return split_blocks(raw, w.shape[1], kind)


def dequantize_q4(qs: np.ndarray, d: np.ndarray, m: np.ndarray | None = None,
                  out: np.ndarray | None = None) -> np.ndarray:
    """(qs, d[, m]) -> f32 [rows, cols]: w = d (q - 8) for Q4_0, d q + m for Q4_1."""
    rows, half = qs.shape
    blocks = qs.reshape(rows, half // (QK // 2), QK // 2)
    codes = np.empty((rows, blocks.shape[1], QK), dtype=np.float32)
    codes[:, :, : QK // 2] = blocks & 0x0F
    codes[:, :, QK // 2 :] = blocks >> 4
    if m is None:
        codes -= 8.0
    codes *= d.astype(np.float32)[:, :, None]
    if m is not None:
        codes += m.astype(np.float32)[:, :, None]
    w = codes.reshape(rows, half * 2)
    if out is not None:
        out[...] = w
        return out
    return w


def dequantize_q8(q8: np.ndarray, d: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """(q8, d) -> f32 [rows, cols]: w = d q."""
    rows, cols = q8.shape
    w = (q8.reshape(rows, cols // QK, QK).astype(np.float32) * d.astype(np.float32)[:, :, None]).reshape(rows, cols)
    if out is not None:
        out[...] = w
        return out
    return w
