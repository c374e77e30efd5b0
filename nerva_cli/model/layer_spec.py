"""LayerSpec: what one layer is, as every forward pass reads it, derived once from ModelConfig.

The planes' decode and prefill layers take a layer's RoPE tables, attention window, score cap
and GLU from here, never from family names or the config's lists; what a layer's weights hold
(biases, q/k norms, post norms) its tensors say."""

from __future__ import annotations

from dataclasses import dataclass

from nerva_cli.model import rope
from nerva_cli.model.config import ModelConfig


@dataclass(frozen=True)
class LayerSpec:
    index: int
    cos: object  # RoPE tables at this layer's base over the context (a NoPE layer's rotate by nothing)
    sin: object
    window: int  # the positions a query sees back, itself included; 0: all
    softcap: float  # attention scores capped at softcap * tanh(s / softcap) (Gemma 2); 0: not
    gelu: bool  # GeGLU (the Gemmas), else SwiGLU


def layer_specs(cfg: ModelConfig, ctx: int, put=lambda table: table) -> list[LayerSpec]:
    """Every layer's spec for a context of `ctx` positions; `put` makes the RoPE tables where the
    plane reads them (the cuda plane's: uploaded), each distinct table once."""
    tables = rope.per_layer(cfg, *rope.tables(cfg, ctx), put=put)
    windows, softcap, gelu = cfg.windows, float(cfg.attn_softcap or 0.0), cfg.activation == "gelu_tanh"
    return [LayerSpec(i, *tables[i], windows[i], softcap, gelu) for i in range(cfg.num_layers)]
