"""Model sources: what `pull` and `convert` read. Each yields canonical tensors one at a time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from nerva_cli.config import ModelConfig


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


@dataclass
class Source:
    config: ModelConfig
    origin: dict  # kind, id or path, revision; recorded in metadata.json
    fingerprint: str
    tensors: Callable[[str], SourceTensor]  # canonical name ("embed", "layers.3.q") -> tensor
    tokenizer_files: dict[str, str]
    default_name: str
    close: Callable[[], None] = lambda: None
