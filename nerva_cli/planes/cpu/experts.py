"""A mixture of experts' MLP on the cpu and ref planes (ARCHITECTURE 15): a router picks each
token's experts, and each chosen expert runs once over all the rows that chose it (a prompt
chunk's tokens, a batched step's sequences, or decode's one row), through the engine's own dense
products. A row's arithmetic does not depend on the other rows: its router logits are a matvec
of their own, its experts' products the batch kernels' rows (each equal to the row's matvec),
and its sum runs over its experts in ascending order, so a sequence's tokens do not depend on
what it is batched with."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nerva_cli.model.layout import ROUTER

F32 = np.float32


@dataclass
class Experts:
    """A layer's router (f32 [experts, hidden]), each routed expert's gate and up (one fused
    matrix, or two apart) and down, and Qwen2-MoE's shared expert with its gate vector."""

    router: np.ndarray
    gate_up: list  # expert -> [Linear, ...] stacked by rows: gate's then up's
    down: list  # expert -> Linear
    shared: tuple | None = None  # ([gate/up Linear, ...], down Linear)
    shared_gate: np.ndarray | None = None  # f32 [hidden]

    @classmethod
    def from_stored(cls, t: dict, fuse: bool = True) -> "Experts":
        """From a layer file's tensors (layout.layer_shapes' names); fuse: each expert's gate and
        up as one matrix of its own (a resident layer's), else views of the file (a staging
        slot's)."""
        from nerva_cli.planes.cpu.engine import Linear, as_f32

        def mlp(prefix: str) -> tuple[list, object]:
            names = (f"{prefix}.gate", f"{prefix}.up")
            gate_up = [Linear.owned(t, names)] if fuse else [Linear.from_stored(t, n) for n in names]
            down = Linear.owned(t, (f"{prefix}.down",)) if fuse else Linear.from_stored(t, f"{prefix}.down")
            return gate_up, down

        count = t[ROUTER].shape[0]
        experts = [mlp(f"experts.{e}") for e in range(count)]
        keep = as_f32 if fuse else (lambda a: a)
        return cls(keep(t[ROUTER]), [g for g, _ in experts], [d for _, d in experts],
                   mlp("shared") if "shared_gate" in t else None,
                   keep(t["shared_gate"]) if "shared_gate" in t else None)

    @property
    def count(self) -> int:
        return self.router.shape[0]

    def expert_nbytes(self, e: int) -> int:
        return sum(m.nbytes for m in self.gate_up[e]) + self.down[e].nbytes

    @property
    def nbytes(self) -> int:
        shared = 0 if self.shared is None else sum(m.nbytes for m in self.shared[0]) + self.shared[1].nbytes
        return self.router.nbytes + shared + sum(self.expert_nbytes(e) for e in range(self.count))


def route(logits: np.ndarray, k: int, renormalise: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each row of router logits [rows, experts] -> (its k experts [rows, k], largest probability
    first, ties to the lower index; their weights [rows, k] f32): the softmax over all experts in
    f32, the k largest, divided by their sum where `renormalise` (transformers' routers and
    llama.cpp's)."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(shifted, dtype=F32)
    p /= p.sum(axis=1, keepdims=True, dtype=F32)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :k]
    weights = np.take_along_axis(p, ids, axis=1)
    if renormalise:
        weights = weights / weights.sum(axis=1, keepdims=True, dtype=F32)
    return ids, weights.astype(F32, copy=False)


class MixtureMLP:
    """The Engine's mixture-of-experts MLP (a mixin: it reads the engine's kernels `k`, prefill
    workspace `pw`, config and counters). `dense(mats, x, precision, out)` is the caller's
    product: prefill's _dense, or decode's and a batched step's _rows_dense."""

    # where a list: each MoE layer's choices as it runs them, (layer, expert ids [rows, k]) (the
    # tests compare them with transformers'; a profile's expert statistics read them)
    expert_trace: list | None = None

    def _moe_rows(self, layer, xn: np.ndarray, out: np.ndarray, dense) -> np.ndarray:
        """out [rows, hidden] = layer's mixture of experts on xn [rows, hidden]; -> the experts
        each row chose [rows, k] (the trace bench and the ledger count)."""
        moe, pw, cfg = layer.moe, self.pw, self.cfg
        rows, h = xn.shape
        logits = pw.take("router", rows, moe.count)
        for r in range(rows):  # a matvec a row: a GEMM's rounding would depend on the batch
            np.dot(moe.router, xn[r], out=logits[r])
        ids, weights = route(logits, cfg.experts_per_token, cfg.norm_topk_prob)
        if self.expert_trace is not None:
            self.expert_trace.append((layer.index, ids))
        if moe.shared is not None:  # Qwen2-MoE: sigmoid(shared_gate . x) times the shared expert
            self._expert(moe.shared[0], moe.shared[1], xn, out, dense, layer.precision)
            for r in range(rows):
                out[r] *= F32(1) / (F32(1) + np.exp(-np.dot(xn[r], moe.shared_gate), dtype=F32))
        else:
            out[...] = 0
        y_all = pw.take("moe_y", rows, h)
        for e in np.unique(ids):  # ascending: each row sums its experts in the same order
            r, c = np.nonzero(ids == e)
            x = pw.take("moe_x", len(r), h)
            np.take(xn, r, axis=0, out=x)
            y = y_all[:len(r)]
            self._expert(moe.gate_up[e], moe.down[e], x, y, dense, layer.precision)
            y *= weights[r, c][:, None]
            out[r] += y
        return ids

    def _expert(self, gate_up: list, down, x: np.ndarray, out: np.ndarray, dense, precision: str) -> None:
        """out = one SwiGLU expert on the rows x: gate/up, SiLU(gate) * up, down."""
        n, f = x.shape[0], down.cols
        gu, act = self.pw.take("gate_up", n, 2 * f), self.pw.take("act", n, f)
        dense(gate_up, x, precision, gu)
        self.k.silu_mul(gu, act)
        dense([down], act, precision, out)
