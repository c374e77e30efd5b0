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
    """A layer's router (f32 [experts, hidden]), each routed expert's gate and up (one matrix)
    and down, and Qwen2-MoE's shared expert with its gate vector."""

    router: np.ndarray
    gate_up: list  # expert -> [Linear]: its gate's rows then its up's
    down: list  # expert -> Linear
    shared: tuple | None  # ([gate/up Linear], down Linear)
    shared_gate: np.ndarray | None  # f32 [hidden]
    # every expert's gate/up, and every down, stacked by rows in one matrix each (the experts'
    # Linears are views of them), which a decode step's chosen experts are multiplied from in one
    # call (matvec_q4_experts_*)
    gate_up_stack: object
    down_stack: object
    # where the layer's experts do not all fit the RAM budget: the stacks hold `capacity` experts,
    # slot by slot, and the cache says which expert each slot holds (residency/expert_cache.py)
    cache: object = None

    @classmethod
    def from_stored(cls, t: dict) -> "Experts":
        """From a resident layer file's tensors (layout.layer_shapes' names), in arrays of their
        own: the experts stacked, the router and shared gate f32."""
        from nerva_cli.planes.cpu.engine import Linear, as_f32

        count = t[ROUTER].shape[0]
        shared = None
        if "shared_gate" in t:
            shared = ([Linear.owned(t, ("shared.gate", "shared.up"))], Linear.owned(t, ("shared.down",)))
        gate_up = Linear.owned(t, tuple(f"experts.{e}.{p}" for e in range(count) for p in ("gate", "up")))
        down = Linear.owned(t, tuple(f"experts.{e}.down" for e in range(count)))
        up_rows, down_rows = gate_up.rows // count, down.rows // count
        return cls(as_f32(t[ROUTER]), [[_rows_of(gate_up, e * up_rows, (e + 1) * up_rows)] for e in range(count)],
                   [_rows_of(down, e * down_rows, (e + 1) * down_rows) for e in range(count)], shared,
                   as_f32(t["shared_gate"]) if shared else None, gate_up, down)

    @classmethod
    def cached(cls, t: dict, table: dict, capacity: int) -> "Experts":
        """From a layer's dense part (t: its router and shared expert) and its expert 0's tensors'
        metadata (table: "experts.0.gate.qs" -> entry), with empty stacks of `capacity` experts
        for an ExpertCache to fill."""
        from nerva_cli.planes.cpu.engine import Linear, as_f32

        shared = None
        if "shared_gate" in t:
            shared = ([Linear.owned(t, ("shared.gate", "shared.up"))], Linear.owned(t, ("shared.down",)))
        gate_up, down = _empty_stack(table, ("gate", "up"), capacity), _empty_stack(table, ("down",), capacity)
        up_rows, down_rows = gate_up.rows // capacity, down.rows // capacity
        return cls(as_f32(t[ROUTER]), [[_rows_of(gate_up, s * up_rows, (s + 1) * up_rows)] for s in range(capacity)],
                   [_rows_of(down, s * down_rows, (s + 1) * down_rows) for s in range(capacity)], shared,
                   as_f32(t["shared_gate"]) if shared else None, gate_up, down)

    @property
    def count(self) -> int:
        return self.router.shape[0]

    @property
    def nbytes(self) -> int:
        shared = 0 if self.shared is None else sum(m.nbytes for m in self.shared[0]) + self.shared[1].nbytes
        return self.router.nbytes + shared + self.gate_up_stack.nbytes + self.down_stack.nbytes

    def grouped(self, precision: str) -> bool:
        """Whether a decode step multiplies its chosen experts in one call each for gate/up and
        down (Q4 experts at W4A8 or W4A16); else an expert at a time."""
        return self.gate_up_stack.qs is not None and self.down_stack.qs is not None and \
            precision in ("w4a8", "w4a16")


def _empty_stack(table: dict, parts: tuple[str, ...], capacity: int):
    """A Linear of zeros holding `capacity` experts' matrices `parts` stacked by rows, in the
    format expert 0's are stored in (table: its tensors' metadata)."""
    from nerva_cli.planes.cpu.engine import Linear
    from nerva_cli.store.catalog import DTYPES

    planes, rows, cols = {}, 0, 0
    for field, suffix in (("qs", ".qs"), ("d", ".d"), ("m", ".m"), ("q8", ".q8"), ("w", "")):
        t = table.get(f"experts.0.{parts[0]}{suffix}")
        if t is not None:
            rows = capacity * len(parts) * t["shape"][0]
            planes[field] = _page_aligned_zeros((rows, *t["shape"][1:]), DTYPES[t["dtype"]])
            cols = cols or t["shape"][1] * (2 if field == "qs" else 1)
    return Linear(rows, cols, **planes)


def _page_aligned_zeros(shape: tuple, dtype) -> np.ndarray:
    """Zeros in an anonymous mapping: page-aligned, so that an O_DIRECT read may land in a
    slot's rows (ExpertCache's scatter reads) where their sizes are whole pages."""
    import mmap

    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)[:nbytes].view(dtype).reshape(shape)


def _rows_of(lin, lo: int, hi: int):
    """Rows lo..hi of a Linear, as a Linear viewing its arrays."""
    from nerva_cli.planes.cpu.engine import Linear

    part = lambda a: None if a is None else a[lo:hi]  # noqa: E731
    return Linear(hi - lo, lin.cols, qs=part(lin.qs), d=part(lin.d), w=part(lin.w), m=part(lin.m), q8=part(lin.q8))


class MixtureMLP:
    """The Engine's mixture-of-experts MLP (a mixin: it reads the engine's kernels `k`, prefill
    workspace `pw`, config and counters). `dense(mats, x, precision, out)` is the caller's
    product: prefill's _dense, or decode's and a batched step's _rows_dense."""

    # where a list: each MoE layer's choices as it runs them, (layer, expert ids [rows, k]) (the
    # tests compare them with transformers'; a profile's expert statistics read them)
    expert_trace: list | None = None
    # where a list too (bench's expert cache figures): beside each trace entry, the experts a
    # look-ahead predicted for it (decode steps after the first MoE layer), else None
    expert_predicted: list | None = None
    lookahead = False  # whether decode prefetches the next MoE layer's predicted experts (its cache's policy)
    _predicted: dict | None = None  # MoE layer -> the experts the look-ahead predicted for its next step
    _next_moe: dict | None = None  # layer -> the next MoE layer after it

    def _moe_rows(self, layer, xn: np.ndarray, out: np.ndarray, dense) -> np.ndarray:
        """out [rows, hidden] = layer's mixture of experts on xn [rows, hidden]; -> the experts
        each row chose [rows, k], ascending (a view of the workspace, until the next call)."""
        moe, pw, cfg = layer.moe, self.pw, self.cfg
        rows, h = xn.shape
        logits = pw.take("router", rows, moe.count)
        for r in range(rows):  # a matvec a row: a GEMM's rounding would depend on the batch
            np.dot(moe.router, xn[r], out=logits[r])
        k = cfg.experts_per_token
        ids, weights = pw.take("expert_ids", rows, k), pw.take("expert_weights", rows, k)
        self.k.route_experts(logits, cfg.norm_topk_prob, ids, weights)  # each row's experts ascending
        if self.expert_trace is not None:
            self.expert_trace.append((layer.index, ids.copy()))
            if self.expert_predicted is not None:
                self.expert_predicted.append((self._predicted or {}).pop(layer.index, None))
        if moe.shared is not None:  # Qwen2-MoE: sigmoid(shared_gate . x) times the shared expert
            self._expert(moe.shared[0], moe.shared[1], xn, out, dense, layer.precision)
            for r in range(rows):
                out[r] *= F32(1) / (F32(1) + np.exp(-np.dot(xn[r], moe.shared_gate), dtype=F32))
        else:
            out[...] = 0
        cache = moe.cache  # where experts are cached, products take the slot each is in
        if rows == 1 and moe.grouped(layer.precision):
            self._one_row(moe, xn, ids[0] if cache is None else cache.slots_for(ids[0]), weights[0], out[0],
                          layer.precision)
            return ids
        y_all = pw.take("moe_y", rows, h)
        chosen = np.unique(ids)  # ascending: each row sums its experts in the same order
        # a cache that holds all of them loads them at once; else each as its turn comes
        at = chosen if cache is None else cache.slots_for(chosen) if len(chosen) <= cache.capacity else None
        for j, e in enumerate(chosen):
            s = at[j] if at is not None else cache.slots_for(chosen[j:j + 1])[0]
            r, c = np.nonzero(ids == e)
            x = pw.take("moe_x", len(r), h)
            np.take(xn, r, axis=0, out=x)
            y = y_all[:len(r)]
            self._expert(moe.gate_up[s], moe.down[s], x, y, dense, layer.precision)
            y *= weights[r, c][:, None]
            out[r] += y
        return ids

    def look_ahead(self, layer, h: np.ndarray) -> None:
        """Decode's look-ahead, before a MoE layer's experts run: the next MoE layer's router on
        this layer's residual after attention h [hidden], normalised by the next layer's MLP
        norm, its top k the experts that layer is predicted to choose. Where the look-ahead
        prefetches (a cache's policy), their reads start now, on the cache's reader thread,
        behind this layer's experts and the next one's attention; where the trace is on, the
        prediction goes beside the next layer's entry (bench's replay measures it)."""
        if self._next_moe is None:
            moe = [lay for lay in self.weights.layers() if lay.moe is not None]
            self._next_moe = {a.index: b for a, b in zip(moe, moe[1:])}
        nxt = self._next_moe.get(layer.index)
        if nxt is None:
            return
        # in the workspace's MoE buffers, which this layer's experts overwrite after: no allocation
        cfg, pw = self.cfg, self.pw
        xn, logits = pw.take("moe_x", 1, cfg.hidden_size), pw.take("router", 1, nxt.moe.count)
        self.k.rmsnorm(h, nxt.mlp_norm, cfg.rms_eps, xn[0])
        np.dot(nxt.moe.router, xn[0], out=logits[0])
        ids = pw.take("expert_ids", 1, cfg.experts_per_token)
        self.k.route_experts(logits, cfg.norm_topk_prob, ids, pw.take("expert_weights", 1, cfg.experts_per_token))
        guess = ids[0]
        if self.lookahead:
            nxt.moe.cache.prefetch(guess)
        if self.expert_predicted is not None:
            if self._predicted is None:
                self._predicted = {}
            self._predicted[nxt.index] = guess.copy()

    def _one_row(self, moe: Experts, xn: np.ndarray, ids: np.ndarray, weights: np.ndarray, out: np.ndarray,
                 precision: str) -> None:
        """A decode step's experts (xn [1, hidden]; ids: where each is in the stacks, its index or
        its cache slot, in ascending expert order; weights beside them): every
        chosen expert's gate/up in one call, its GLU, every down in one call, then the weighted
        sum in ascending expert order. Each product is the matvec the expert-at-a-time loop
        makes, so the step equals it bit for bit (a batched step's rows take that loop)."""
        k, f, h = len(ids), moe.down[0].cols, xn.shape[1]
        gu, act, y = self.pw.take("gate_up", k, 2 * f), self.pw.take("act", k, f), self.pw.take("moe_y", k, h)
        matvec = self.k.matvec_q4_experts_w4a8 if precision == "w4a8" else self.k.matvec_q4_experts_w4a16
        up, down = moe.gate_up_stack, moe.down_stack
        matvec(up.qs, up.d, up.m, ids, xn, gu)
        self.k.silu_mul(gu, act)
        matvec(down.qs, down.d, down.m, ids, act, y)
        for j in range(k):
            y[j] *= weights[j]
            out += y[j]

    def _expert(self, gate_up: list, down, x: np.ndarray, out: np.ndarray, dense, precision: str) -> None:
        """out = one SwiGLU expert on the rows x: gate/up, SiLU(gate) * up, down."""
        n, f = x.shape[0], down.cols
        gu, act = self.pw.take("gate_up", n, 2 * f), self.pw.take("act", n, f)
        dense(gate_up, x, precision, gu)
        self.k.silu_mul(gu, act)
        dense([down], act, precision, out)
