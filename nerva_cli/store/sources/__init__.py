"""Model sources: what `pull` and `convert` read. Each yields canonical tensors one at a time."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from nerva_cli.model.config import ModelConfig
from nerva_cli.errors import BadInput


@dataclass
class SourceTensor:
    """One canonical tensor of a source, read only when asked (convert streams)."""

    shape: tuple[int, ...]
    read_f32: Callable[[], np.ndarray]
    # For a GGUF Q4_0, Q4_1 or Q8_0 tensor (stored_dtype says which): its (qs, d, m) planes as
    # stored (m None but for Q4_1), so an import to the same format is bit-exact.
    read_planes: Callable[[], tuple] | None = None
    stored_dtype: str = "f32"  # f32 / f16 / bf16 / a GGUF quant type name
    where: str = ""  # the file it comes from, for error messages
    # For a matrix: rows r0..r1 as f32 [r1 - r0, cols], read apart from the rest, so a token table
    # converts a slice at a time (an 8B model's is 2.1 GB in f32); None where a row's place in the
    # source is not its place in the model (a GGUF's permuted q/k rows).
    read_f32_rows: Callable[[int, int], np.ndarray] | None = None
    # For a block-format tensor: the planes of rows r0..r1 alone (one expert of a GGUF's stacked
    # experts, without reading the other experts' bytes); None: read_planes' whole, then sliced.
    read_planes_rows: Callable[[int, int], tuple] | None = None


@dataclass
class Source:
    config: ModelConfig
    origin: dict  # kind, id or path, revision; recorded in metadata.json
    fingerprint: str
    tensors: Callable[[str], SourceTensor]  # canonical name ("embed", "layers.3.q") -> tensor
    tokenizer_files: dict[str, str]
    default_name: str
    close: Callable[[], None] = lambda: None


def fused_part(cfg: ModelConfig, canon: str) -> tuple[str, int, int, int] | None:
    """(fused tensor, first row, end row, the fused tensor's rows) that holds `canon` where a
    checkpoint fuses it with its neighbours (Phi-3: q/k/v in one qkv matrix, gate/up in one
    gate_up, in that order), else None."""
    prefix, _, name = canon.rpartition(".")
    parts = {"q": ("qkv", 0, cfg.q_dim), "k": ("qkv", cfg.q_dim, cfg.q_dim + cfg.kv_dim),
             "v": ("qkv", cfg.q_dim + cfg.kv_dim, cfg.q_dim + 2 * cfg.kv_dim),
             "gate": ("gate_up", 0, cfg.intermediate_size),
             "up": ("gate_up", cfg.intermediate_size, 2 * cfg.intermediate_size)}
    if not prefix.startswith("layers.") or name not in parts:
        return None
    fused, r0, r1 = parts[name]
    return f"{prefix}.{fused}", r0, r1, parts["v" if fused == "qkv" else "up"][2]


_EXPERT = re.compile(r"^(layers\.\d+)\.experts\.(\d+)\.(gate|up|down)$")


def expert_part(cfg: ModelConfig, canon: str, have) -> SourceTensor | None:
    """Routed expert e's gate, up or down ("layers.3.experts.5.up") where the checkpoint stacks
    every expert's in one 3-D tensor [experts, rows, cols]: a GGUF's ffn_{gate,up,down}_exps
    ("layers.3.experts.up"), or a checkpoint's fused gate_up [experts, 2 f, hidden] and down, as
    transformers 5 holds them in memory ("layers.3.experts.gate_up"). have(name) -> the source's
    tensor of that name or None. None where canon is no expert's or no stacked tensor holds it."""
    m = _EXPERT.match(canon)
    if not m:
        return None
    prefix, e, name = m.group(1), int(m.group(2)), m.group(3)
    f = cfg.expert_intermediate_size
    stacked, r0, r1 = f"{prefix}.experts.{name}", 0, None
    t = have(stacked)
    if t is None and name != "down":
        stacked, r0, r1 = f"{prefix}.experts.gate_up", (0 if name == "gate" else f), (f if name == "gate" else 2 * f)
        t = have(stacked)
    if t is None:
        return None
    if len(t.shape) != 3 or t.shape[0] != cfg.num_experts:
        raise BadInput(f"{t.where}: the stacked expert tensor '{stacked}' has shape {list(t.shape)}, the config "
                       f"says {cfg.num_experts} experts")
    rows = t.shape[1]
    r1 = rows if r1 is None else r1
    return row_range(_flattened(t), e * rows + r0, e * rows + r1, cfg.num_experts * rows, canon)


def _flattened(t: SourceTensor) -> SourceTensor:
    """A 3-D tensor [n, rows, cols] as the matrix [n * rows, cols] (the same bytes)."""
    n, rows, cols = t.shape
    return SourceTensor(
        shape=(n * rows, cols), stored_dtype=t.stored_dtype, where=t.where,
        read_f32=lambda: t.read_f32().reshape(n * rows, cols), read_f32_rows=t.read_f32_rows,
        read_planes=None if t.read_planes is None else
        (lambda: tuple(None if p is None else p.reshape(n * rows, -1) for p in t.read_planes())),
        read_planes_rows=t.read_planes_rows)


def row_range(t: SourceTensor, r0: int, r1: int, rows: int, name: str) -> SourceTensor:
    """Rows r0..r1 of fused matrix t, which must have `rows` rows, as the tensor `name`."""
    if len(t.shape) != 2 or t.shape[0] != rows:
        raise BadInput(f"{t.where}: the fused matrix holding '{name}' has shape {list(t.shape)}, "
                       f"the config says {rows} rows")
    read_rows, planes_rows = t.read_f32_rows, t.read_planes_rows
    if t.read_planes is None:
        planes = None
    elif planes_rows is not None:
        planes = lambda: planes_rows(r0, r1)  # noqa: E731
    else:
        planes = lambda: tuple(None if p is None else p[r0:r1] for p in t.read_planes())  # noqa: E731
    return SourceTensor(
        shape=(r1 - r0, t.shape[1]), stored_dtype=t.stored_dtype, where=t.where,
        read_f32=(lambda: read_rows(r0, r1)) if read_rows is not None else (lambda: t.read_f32()[r0:r1]),
        read_planes=planes,
        read_f32_rows=None if read_rows is None else (lambda a, b: read_rows(r0 + a, r0 + b)),
        read_planes_rows=None if planes_rows is None else (lambda a, b: planes_rows(r0 + a, r0 + b)))


def row_order(t: SourceTensor, order: np.ndarray) -> SourceTensor:
    """t with its rows (a 1-D tensor's values) in `order`: every row read, where it lands apart."""
    return SourceTensor(
        shape=t.shape, stored_dtype=t.stored_dtype, where=t.where,
        read_f32=lambda: np.ascontiguousarray(t.read_f32()[order]),
        read_planes=None if t.read_planes is None else
        (lambda: tuple(None if p is None else np.ascontiguousarray(p[order]) for p in t.read_planes())))


def scaled(t: SourceTensor, factor: float) -> SourceTensor:
    """t times factor: f32 values, or a block format's scales (and Q4_1's offsets), rounded to f16."""
    def planes():
        qs, d, m = t.read_planes()
        times = lambda p: None if p is None else (p.astype(np.float32) * np.float32(factor)).astype(p.dtype)
        return qs, times(d), times(m)

    rows = t.read_f32_rows
    return SourceTensor(
        shape=t.shape, stored_dtype=t.stored_dtype, where=t.where,
        read_f32=lambda: t.read_f32() * np.float32(factor),
        read_planes=None if t.read_planes is None else planes,
        read_f32_rows=None if rows is None else (lambda a, b: rows(a, b) * np.float32(factor)))


def offset(t: SourceTensor, amount: float) -> SourceTensor:
    """A 1-D f32 tensor t plus amount (Gemma's norm weights, which multiply by 1 + w)."""
    return SourceTensor(shape=t.shape, stored_dtype=t.stored_dtype, where=t.where,
                        read_f32=lambda: t.read_f32() + np.float32(amount))
