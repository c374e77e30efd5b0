"""The forward pass: batched prefill and one-token decode over a preallocated KV cache.

The model is defined by ModelConfig (family flags: qkv bias, q/k norm, tied lm_head); how each
op runs is the backend's business (planes/ref.py is the definition); where the weights live
is the residency plan's (all in RAM, or paged through staging slots by residency/pager.py). Decode
allocates nothing: every buffer it writes is made in `Arena` before the first token; prefill's
come from a `PrefillWorkspace` made with them (arena.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import gcd
from time import perf_counter_ns

import numpy as np

from nerva_cli.residency.arena import Arena, PrefillWorkspace
from nerva_cli.residency.expert_cache import DEFAULT_EXPERT_POLICY
from nerva_cli.model.layer_spec import layer_specs
from nerva_cli.model.layout import MATRICES, ROUTER, layer_file
from nerva_cli.model.quant import QK
from nerva_cli.errors import NervaError, UsageError
from nerva_cli.planes.base import Counters, EngineBase, context_length
from nerva_cli.planes.cpu.batch_decode import BatchDecode
from nerva_cli.planes.cpu.experts import Experts, MixtureMLP
from nerva_cli.store.catalog import StoredModel

PHASES = ("embed", "attention", "mlp", "lm_head")
PREFILL_CHUNK = 256


class CountedKernels:
    """A backend module whose kernels (ref.KERNELS) count each call into the engine's counters;
    everything else in the module is reached as it is."""

    def __init__(self, backend, counters: Counters):
        from nerva_cli.planes.ref import KERNELS

        self.module = backend
        for name in KERNELS:  # every backend has them all: a missing one fails here, not uncounted
            setattr(self, name, _counted(getattr(backend, name), counters))

    def __getattr__(self, name: str):
        return getattr(self.module, name)


def _counted(kernel, counters: Counters):
    def counted(*args, **kwargs):
        counters.kernels += 1
        counters.dispatches += 1
        return kernel(*args, **kwargs)

    return counted


@dataclass
class Linear:
    """One weight matrix: Q4_0 planes (qs, d), Q4_1 planes (qs, d, m), Q8_0 planes (q8, d: the Q4
    variants' token table) or an exact variant's matrix as stored (w: float16, or uint16 holding
    bf16 bits), widened to f32 only in the kernels' registers or prefill's scratch."""

    rows: int
    cols: int
    qs: np.ndarray | None = None
    d: np.ndarray | None = None
    w: np.ndarray | None = None
    m: np.ndarray | None = None  # Q4_1's block offsets
    q8: np.ndarray | None = None  # Q8_0's int8 codes

    @classmethod
    def from_stored(cls, tensors: dict, name: str) -> "Linear":
        if f"{name}.qs" in tensors:
            qs = tensors[f"{name}.qs"]
            return cls(qs.shape[0], qs.shape[1] * 2, qs=qs, d=tensors[f"{name}.d"], m=tensors.get(f"{name}.m"))
        if f"{name}.q8" in tensors:
            q8 = tensors[f"{name}.q8"]
            return cls(*q8.shape, q8=q8, d=tensors[f"{name}.d"])
        return cls(*tensors[name].shape, w=tensors[name])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.w, self.qs, self.q8, self.d, self.m) if a is not None)

    @classmethod
    def owned(cls, t: dict, names: tuple[str, ...]) -> "Linear":
        """The named matrices stacked by rows into arrays of its own (fused QKV, fused gate/up:
        one kernel call sharing the activation reads), so the file buffer can be dropped. Exact
        matrices that lie back to back in the file's buffer are one view of it instead, and the
        layer keeps the buffer: the converter writes q, k, v and gate, up in that order, each
        4 KB aligned, and most shapes leave no padding between (docs/perf/code_figures.md)."""
        if f"{names[0]}.qs" in t:
            qs = np.concatenate([t[f"{n}.qs"] for n in names])
            m = np.concatenate([t[f"{n}.m"] for n in names]) if f"{names[0]}.m" in t else None
            return cls(qs.shape[0], qs.shape[1] * 2, qs=qs, d=np.concatenate([t[f"{n}.d"] for n in names]), m=m)
        mats = [t[n] for n in names]
        w = back_to_back(mats)
        if w is None:
            w = np.concatenate(mats)
        return cls(*w.shape, w=w)


def back_to_back(mats: list[np.ndarray]) -> np.ndarray | None:
    """Row-major matrices of one dtype and width that follow one another in one buffer, as a
    single view of all their rows; None where anything lies between them."""
    first = mats[0]
    if first.base is None:  # an array of its own: no buffer to view
        return None
    end = first.ctypes.data + first.nbytes
    for a in mats:
        if a.base is not first.base or a.dtype != first.dtype or a.shape[1:] != first.shape[1:] or \
                not a.flags.c_contiguous:
            return None
        if a is not first:
            if a.ctypes.data != end:
                return None
            end += a.nbytes
    rows = sum(a.shape[0] for a in mats)
    return np.ndarray((rows, *first.shape[1:]), first.dtype, buffer=first.base,
                      offset=first.ctypes.data - first.base.ctypes.data)


def as_f32(a: np.ndarray) -> np.ndarray:
    """A stored f32 tensor (norms, biases) as an array of its own, so the file buffer can go."""
    return np.array(a, dtype=np.float32)


@dataclass
class Layer:
    index: int
    attn_norm: np.ndarray
    mlp_norm: np.ndarray
    mats: dict[str, Linear]  # qkv (fused), o, gate_up (fused), down (a mixture of experts' layer: qkv, o)
    qkv_bias: np.ndarray | None  # Qwen2
    q_norm: np.ndarray | None  # Qwen3, Gemma 3
    k_norm: np.ndarray | None
    precision: str  # exact / w4a16 / w4a8
    post_attn_norm: np.ndarray | None = None  # Gemma 3: on attention's and the MLP's outputs
    post_mlp_norm: np.ndarray | None = None
    slot_halves: dict | None = None  # a staging slot's: layer index -> its compiled decode halves
    seq_halves: dict = field(default_factory=dict)  # a staging slot's: sequence slot -> its slot_halves
    moe: Experts | None = None  # a mixture of experts' layer: its router and experts (planes/cpu/experts.py)

    @classmethod
    def from_stored(cls, index: int, t: dict, precision: str, cached: tuple | None = None) -> "Layer":
        """cached: (expert 0's tensors' metadata, slots) for a MoE layer whose experts are cached,
        t holding its dense part alone (Experts.cached)."""
        mats = {"qkv": Linear.owned(t, ("q", "k", "v")), "o": Linear.owned(t, ("o",))}
        moe = None if ROUTER not in t else Experts.from_stored(t) if cached is None else Experts.cached(t, *cached)
        if moe is None:
            mats.update(gate_up=Linear.owned(t, ("gate", "up")), down=Linear.owned(t, ("down",)))
        bias = np.concatenate([as_f32(t[f"{m}_bias"]) for m in ("q", "k", "v")]) if "q_bias" in t else None
        return cls(index, as_f32(t["attn_norm"]), as_f32(t["mlp_norm"]), mats, bias,
                   *(as_f32(t[n]) if n in t else None for n in ("q_norm", "k_norm")), precision,
                   *(as_f32(t[n]) if n in t else None for n in ("post_attn_norm", "post_mlp_norm")), moe=moe)

    @classmethod
    def viewing(cls, t: dict, precision: str):
        """A Layer over a staging slot's tensors, unfused and without copies of the matrices
        (fusing would copy per read). -> (layer, refresh): refresh() re-derives, in place, what
        is kept beside the views (the fused bias)."""
        mats = {m: Linear.from_stored(t, m) for m in MATRICES}
        biases = [t[f"{m}_bias"] for m in ("q", "k", "v") if f"{m}_bias" in t]
        bias = np.empty(sum(b.size for b in biases), dtype=np.float32) if biases else None

        def refresh() -> None:
            if bias is not None:
                np.concatenate(biases, out=bias)

        layer = cls(-1, t["attn_norm"], t["mlp_norm"], mats, bias, t.get("q_norm"), t.get("k_norm"), precision,
                    t.get("post_attn_norm"), t.get("post_mlp_norm"))
        return layer, refresh

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.mats.values()) + (0 if self.moe is None else self.moe.nbytes)

    def codes_in(self, *names: str) -> bool:
        """Whether the first of `names` the layer has (its group: fused qkv, else q, k and v)
        takes W4A8's int8 activation codes: a Q4 matrix of a W4A8 layer does; an exact one (a Q4
        variant's matrix kept f16 for its width, layout.stored_format) takes the floats."""
        lin = next(self.mats[n] for n in names if n in self.mats)
        return self.precision == "w4a8" and lin.qs is not None


class ResidentWeights:
    """Every layer in RAM: a pass is the list itself."""

    def __init__(self, layers: list):
        self._layers = layers
        self.stats = None
        self.direct_io = None

    def layers(self):
        return self._layers

    def close(self) -> None:
        pass


def residency_plan(model: StoredModel, ctx: int | None, ram_budget: int | None,
                   importance: dict[int, float] | None = None, active_layers: list[int] | None = None,
                   kv_cache: str = "f16", prefill_rows: int = PREFILL_CHUNK, seq_slots: int = 1):
    """The residency plan that Engine uses, computed from sizes alone: nothing is allocated or
    read, so `nerva topology --model` shows exactly what `run` will do. An untied token table
    left out of RAM is mapped from its file: a token's row is read in place. seq_slots: the
    sequences the engine holds at once, each its own KV cache (all of them in the plan)."""
    from nerva_cli.residency.planner import plan_model

    cfg = model.config

    def workspace_at(n: int) -> dict:
        kv, arena = Arena.sizes(cfg, n, kv_cache, min(prefill_rows, n), seq_slots)
        prefill = PrefillWorkspace.size(cfg, min(prefill_rows, n), n, seq_slots)
        return {"kv_cache": ("kv_cache", kv), "workspace": ("workspace", arena - kv + prefill)}

    return plan_model(model, context_length(cfg, ctx), ram_budget, importance, active_layers, workspace_at)


class Engine(BatchDecode, MixtureMLP, EngineBase):
    def __init__(self, model: StoredModel, backend: str = "cpu", precision: str | None = None,
                 ctx: int | None = None, layer_precisions: list[str] | None = None,
                 active_layers: list[int] | None = None, ram_budget: int | None = None,
                 policy: str = "ring", importance: dict[int, float] | None = None, kv_cache: str = "f16",
                 prefill_rows: int = PREFILL_CHUNK, seq_slots: int = 1, expert_policy: str = DEFAULT_EXPERT_POLICY):
        """layer_precisions: per-layer w4a16/w4a8 (MCAP's mixed dispatch) for a q4_0 or q4_1 model;
        active_layers: the layers that run (hot-only mode), the others pass the residual on;
        kv_cache: f16 or f32 (exact: what the tests against transformers hold to float32's noise);
        prefill_rows: the prompt tokens a prefill pass takes (its workspace's size); seq_slots:
        the sequences it holds at once, each with its own KV cache and position (select,
        decode_batch); expert_policy: which cached expert a mixture's miss evicts, where its
        experts do not all fit the RAM budget (residency/expert_cache.py)."""
        from nerva_cli.planes import get_backend

        if seq_slots < 1:
            raise NervaError(f"sequence slots must be >= 1, got {seq_slots}")
        self.seq_slots, self.slot = seq_slots, 0
        self.slot_n_past = [0] * seq_slots
        self.model = model
        self.cfg = cfg = model.config
        self.counters = Counters()
        self.k = CountedKernels(get_backend(backend), self.counters)
        self.backend = backend
        self.set_precisions(model, precision, layer_precisions, active_layers)
        self.ctx = context_length(cfg, ctx)
        self.specs = layer_specs(cfg, self.ctx)  # each layer's RoPE tables, window, score cap and GLU
        self.embed_scale = None if cfg.embed_scale is None else np.float32(cfg.embed_scale)
        self.plan = residency_plan(model, self.ctx, ram_budget, importance, self.active, kv_cache, prefill_rows,
                                   seq_slots)
        g = {}
        for fname in ("embed.bin", "final_norm.bin", "lm_head.bin"):
            if fname == "embed.bin" and self.plan.table_aside:
                g.update(model.map_file(fname))  # the RAM budget left it out: rows come from the page cache
            elif fname in model.meta["files"]:
                g.update(model.read_file(fname))
        self.embed = Linear.from_stored(g, "embed")
        self.final_norm = as_f32(g["final_norm"])
        self.lm_head = Linear.from_stored(g, "lm_head") if any(n.startswith("lm_head") for n in g) else self.embed
        self.kv_cache = kv_cache
        # refuses an unknown kv_cache in one line
        self.a = Arena(cfg, self.ctx, kv_cache, min(prefill_rows, self.ctx), seq_slots)
        self.pw = PrefillWorkspace(cfg, min(prefill_rows, self.ctx), self.ctx, seq_slots)
        # the sliding-window layers whose caches hold fewer rows than the context (arena.cache_rows):
        # row r holds position kv_base + r
        self.ring = [i for i, c in enumerate(self.a.k_cache) if c.shape[0] < self.ctx]
        self.n_past = 0
        self.phase_ns = dict.fromkeys(PHASES, 0)
        self.policy, self.expert_policy = policy, expert_policy
        resident = {i: Layer.from_stored(i, model.read_file(layer_file(i)), self.layer_precision[i])
                    for i in self.plan.resident_layers if i not in self.plan.expert_layers}
        if self.plan.expert_layers:
            self.weights = self._cached_experts(resident, expert_policy)
        elif self.plan.paged_layers:
            from nerva_cli.residency.pager import PagedWeights

            self.weights = PagedWeights(model, resident, self.plan.paged_layers, self.layer_precision,
                                        self.plan.slots, self.plan.slot_bytes, policy,
                                        lambda t: Layer.viewing(t, self.precision))
        else:
            self.weights = ResidentWeights([resident[i] for i in self.active])
        # the cpu backend's decode layer: each layer's step in a few compiled calls bound once
        # (decode_layer_halves), a resident layer's by its index, a staging slot's for every
        # layer the slot may hold; the ref backend runs the layer kernel by kernel. They are bound
        # to one sequence slot's KV cache: slot 0's here, another's when select() first takes it.
        self.compiled_layers = {}
        self.slot_compiled = {0: self.compiled_layers}  # sequence slot -> its compiled_layers
        self._bind_halves()

    def _cached_experts(self, resident: dict, policy: str):
        """The weights where a mixture's experts do not all fit the RAM budget: every layer
        resident but its routed experts, of which each MoE layer caches plan.expert_slots."""
        from nerva_cli.residency.expert_cache import (EXPERT_POLICIES, CachedExperts, ExpertCache, ExpertReader,
                                                      Prefetcher)
        from nerva_cli.residency.pager import PagerStats

        if policy not in EXPERT_POLICIES:
            raise UsageError(f"--expert-policy {policy}: choose one of {', '.join(EXPERT_POLICIES)}")
        p, files = self.plan, self.model.meta["files"]
        reader = ExpertReader(self.model, p.expert_bytes, PagerStats())
        self.lookahead = policy.endswith("+lookahead")
        prefetcher = Prefetcher(reader) if self.lookahead else None
        for i in p.expert_layers:
            fname = layer_file(i)
            table = {n: t for n, t in files[fname]["tensors"].items() if n.startswith("experts.0.")}
            layer = Layer.from_stored(i, self.model.read_head(fname, p.layer_bytes[i]), self.layer_precision[i],
                                      (table, p.expert_slots))
            layer.moe.cache = ExpertCache(self.model, i, layer.moe, p.expert_slots, policy, reader, prefetcher)
            resident[i] = layer
        return CachedExperts([resident[i] for i in self.active], reader, policy, prefetcher)

    def _bind_halves(self) -> None:
        """Binds the compiled decode halves to the selected sequence slot's KV cache: a resident
        layer's into compiled_layers, a staging slot's (for each paged layer it may hold) into
        its view's seq_halves[slot], which becomes its slot_halves."""
        if not hasattr(self.k, "decode_layer_halves"):
            return
        for layer in self._resident_layers():
            self._compile_layer(layer, layer.index, self.compiled_layers)
        for view in self._views():
            held = view.index, view.precision  # the pager sets them at each acquire; kept all the same
            view.slot_halves = view.seq_halves[self.slot] = {}
            for i in self.plan.paged_layers:
                view.index, view.precision = i, self.layer_precision[i]
                self._compile_layer(view, i, view.slot_halves)
            view.index, view.precision = held

    def _views(self) -> list:
        """The staging slots' Layers (none where every layer is resident)."""
        return self.weights.views() if self.plan.paged_layers else []

    # -- sequence slots ----------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        """The selected sequence slot's position count."""
        return self.slot_n_past[self.slot]

    @n_past.setter
    def n_past(self, n: int) -> None:
        self.slot_n_past[self.slot] = n

    def select(self, slot: int) -> None:
        """Makes sequence slot `slot` the one prefill, decode, reset and truncate act on (its KV
        cache, sliding-window base and position); slot 0 at first."""
        if slot == self.slot:
            return
        if not 0 <= slot < self.seq_slots:
            raise NervaError(f"sequence slot {slot} does not exist (this engine holds {self.seq_slots})")
        self.slot = slot
        self.a.select(slot)
        if slot in self.slot_compiled:
            self.compiled_layers = self.slot_compiled[slot]
            for view in self._views():
                view.slot_halves = view.seq_halves.get(slot, {})
        else:  # the first time: bind its halves (a few tuples a layer; nothing compiles)
            self.compiled_layers = self.slot_compiled[slot] = {}
            self._bind_halves()

    def _compile_layer(self, layer: Layer, i: int, into: dict) -> None:
        halves = self.k.decode_layer_halves(layer, self.specs[i], self.a, self.cfg,
                                            self.a.kv_base if i in self.ring else None)
        if halves is not None:
            into[i] = (*halves, sum(self._fused_kernels(layer)))

    def _halves(self, layer: Layer):
        """The compiled decode halves (attention, mlp, kernels) of the layer `layer` holds now, or
        None (the ref backend's layers run kernel by kernel)."""
        return (self.compiled_layers if layer.slot_halves is None else layer.slot_halves).get(layer.index)

    def _fused_kernels(self, layer: Layer) -> tuple[int, int]:
        """The kernels of the contract that a layer's compiled halves run, one for each that
        _decode_attention and _decode_mlp would dispatch for it (the tests hold the two equal):
        a staging slot's q, k, v and gate, up are three and two matrices where a resident
        layer's are one each."""
        codes, apart = layer.codes_in, int("qkv" not in layer.mats)  # codes: a quantize_act_q8 before the group
        # norm, qkv, 2 ropes, attention, o
        attention = (6 + codes("qkv", "q") + codes("o") + 2 * apart + (layer.qkv_bias is not None)
                     + 2 * (layer.q_norm is not None) + (layer.post_attn_norm is not None))
        if layer.moe is not None:  # its MLP runs as the engine's, its kernels counted as they run
            return attention, 0
        # add+norm, gate_up, glu, down
        mlp = 4 + codes("gate_up", "gate") + codes("down") + apart + (layer.post_mlp_norm is not None)
        return attention, mlp

    # -- building blocks ---------------------------------------------------------------------
    def _quantize_input(self, x: np.ndarray) -> None:
        self.k.quantize_act_q8(x, *self.a.act_q8[x.shape[0]])

    def _matvec(self, lin: Linear, x: np.ndarray, out: np.ndarray, precision: str) -> None:
        """x must already be quantised into the arena when precision is w4a8."""
        if lin.w is not None:
            self.k.matvec_exact(lin.w, x, out)
        elif lin.q8 is not None:
            if precision == "w4a8":
                xq, xd, _ = self.a.act_q8[lin.cols]  # no code sums: signed codes have no bias to correct
                self.k.matvec_q8_w8a8(lin.q8, lin.d, xq, xd, out)
            else:  # A16 as int16 per 32-group: an integer kernel, where floats were bound by conversions
                xq, xd = self.a.act_q16[lin.cols]
                self.k.quantize_act_q16(x, xq, xd)
                self.k.matvec_q8_w8a16(lin.q8, lin.d, xq, xd, out)
        elif precision == "w4a8":
            self.k.matvec_q4_w4a8(lin.qs, lin.d, lin.m, *self.a.act_q8[lin.cols], out)
        else:
            self.k.matvec_q4_w4a16(lin.qs, lin.d, lin.m, x, out)

    def _embed_row(self, token: int, out: np.ndarray) -> None:
        if self.embed.w is not None:
            self.k.embed_exact(self.embed.w, token, out)
        elif self.embed.q8 is not None:
            self.k.embed_q8(self.embed.q8, self.embed.d, token, out)
        else:
            self.k.embed_q4(self.embed.qs, self.embed.d, self.embed.m, token, out)
        if self.embed_scale is not None:
            out *= self.embed_scale

    # -- the sliding-window layers' caches ---------------------------------------------------
    def reset(self) -> None:
        self.n_past = 0
        self.a.kv_base[0] = 0

    @property
    def kv_base(self) -> int:
        """The position a sliding-window layer's first cache row holds (the arena keeps it, for
        the compiled decode halves)."""
        return int(self.a.kv_base[0])

    def truncate(self, n: int) -> int:
        """EngineBase.truncate; where a sliding layer's cache no longer holds the window before
        position n (a rollback past arena.ROLLBACK positions), everything: a prompt then runs
        from its start."""
        n = min(self.n_past, n)
        if self.ring and max(0, n + 1 - self.cfg.sliding_window) < self.kv_base:
            self.reset()
            return 0
        self.n_past = n
        return n

    def copy_prefix(self, src: int, n: int) -> int:
        """The selected slot's cache becomes sequence slot `src`'s first n positions, every layer's
        K and V rows copied (a prompt start another request prefilled: a prefix shared between
        slots), the slot then n positions on. -> the positions copied: 0 where a sliding layer's
        cache in `src` has moved past its start (those rows are gone)."""
        a = self.a
        n = min(n, self.slot_n_past[src])
        if src == self.slot or n <= 0 or (self.ring and a.kv_bases[src] != 0):
            return 0
        for k, v in zip(a.k_all, a.v_all):  # a sliding layer's rows start at position 0 too (base 0)
            k[self.slot, :n] = k[src, :n]
            v[self.slot, :n] = v[src, :n]
        a.kv_base[0] = 0
        self.n_past = n
        return n

    @property
    def kv_rows_movable(self) -> bool:
        """Whether kv_rows and set_kv_rows work here: not where a sliding layer's cache is a ring
        (its rows for a position move as the window does)."""
        return not self.ring

    def kv_rows(self, start: int, n: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Copies of the selected slot's K and V rows of positions start .. start + n - 1, an
        array [n, kv_heads, head_dim] a layer each (a prompt cache's entry)."""
        if not self.kv_rows_movable or not 0 <= start <= start + n <= self.n_past:
            raise NervaError(f"kv_rows({start}, {n}): the slot holds {self.n_past} positions"
                             + ("" if self.kv_rows_movable else " in sliding-window rings"))
        a = self.a
        return ([k[self.slot, start:start + n].copy() for k in a.k_all],
                [v[self.slot, start:start + n].copy() for v in a.v_all])

    def set_kv_rows(self, start: int, k_rows: list[np.ndarray], v_rows: list[np.ndarray]) -> None:
        """The selected slot's positions from `start` (its length now) written from kv_rows'
        copies, the slot then past them."""
        n = k_rows[0].shape[0]
        if not self.kv_rows_movable or start != self.n_past or start + n > self.ctx:
            raise NervaError(f"set_kv_rows({start}, {n} rows): the slot holds {self.n_past} of {self.ctx} positions")
        a = self.a
        for k, v, kr, vr in zip(a.k_all, a.v_all, k_rows, v_rows):
            k[self.slot, start:start + n] = kr
            v[self.slot, start:start + n] = vr
        self.n_past = start + n

    def _make_room(self, end: int) -> None:
        """Positions up to `end` (exclusive) about to be written: where they pass a sliding
        layer's last row, the positions still attended over (the window before n_past) and
        arena.ROLLBACK more move to the front of its cache, a block at a time (blocks that do not
        overlap: NumPy would copy overlapping ones through a temporary)."""
        if not self.ring:
            return
        rows = self.a.k_cache[self.ring[0]].shape[0]
        if end - self.kv_base <= rows:
            return
        from nerva_cli.residency.arena import ROLLBACK

        keep = max(self.kv_base, self.n_past + 1 - self.cfg.sliding_window - ROLLBACK)
        shift, count = keep - self.kv_base, self.n_past - keep
        for i in self.ring:
            for cache in (self.a.k_cache[i], self.a.v_cache[i]):
                for lo in range(0, count, shift):
                    hi = min(count, lo + shift)
                    cache[lo:hi] = cache[shift + lo:shift + hi]
        self.a.kv_base[0] = keep

    # -- what callers show, and what runs before an answer --------------------------------------
    def residency_lines(self) -> list[str]:
        p = self.plan
        from nerva_cli.units import human_bytes

        if p.expert_layers:
            n, every = len(p.expert_layers), p.expert_slots == self.cfg.num_experts
            kept = (f"has a slot for each of its {p.expert_slots} experts, filled from disk as each is first chosen "
                    "(their layer files whole do not fit)" if every else
                    f"keeps {p.expert_slots} of its {self.cfg.num_experts} experts in RAM and reads a chosen one that "
                    "is not there from disk")
            return [f"residency: within {human_bytes(p.budget)}, each of the {n} MoE layers {kept} "
                    f"({human_bytes(p.expert_bytes)} an expert; policy {self.expert_policy}); the rest of every "
                    "layer is in RAM"]
        if not p.paged_layers:
            return []

        return [f"residency: {len(p.resident_layers)} layers resident, {len(p.paged_layers)} stream from "
                f"disk through {p.slots} slots ({human_bytes(p.paged_bytes_per_token)} a token, "
                f"policy {self.policy})" + ("; the token table stays in its file, a row read a token"
                                            if p.table_aside else "")]

    def prepare(self, threads: int, decodes: bool, say=None, working=None) -> None:
        """numba's threads, then a decode step's kernels compiled before an answer starts (warm_up),
        once for each kind of model on this machine (kernel_kinds), so that the answer does not
        stall after its first token. `decodes`: whether the caller will decode (not a `-n 1` run)."""
        self.k.set_threads(threads)
        if self.backend != "cpu":  # the reference backend compiles nothing
            return
        from contextlib import nullcontext

        from nerva_cli.runtime import sampling

        say = say or (lambda text: None)
        working = working or (lambda title: nullcontext(lambda detail: None))
        first = not self.k.compiled_before(decodes)
        if not decodes:  # a prefill's kernels compile in the prefill itself, before any text
            if first:
                say("compiling the CPU kernels for this machine before the first token: once, later runs "
                    "reuse them")
            return
        marker = self.k.warm_marker(self.kernel_kinds())
        if marker.exists():
            return
        started = perf_counter_ns()
        aside = self.compile_aside()  # before the spinner starts its thread: the fork copies this one
        compiled = [0]

        def tell(n: int) -> None:
            compiled[0] = n
            if n:
                status(f"{n} kernel{'s' if n != 1 else ''} compiled")

        try:
            # the progress is the kernels compiled so far, both processes' (no total is known
            # before: it depends on the model's kinds and the CPU's features), with the time
            with working("compiling the CPU kernels for this machine, once" if first else
                         "compiling the CPU kernels this model needs, once") as status, \
                    self.k.counting_compiles(tell) as poll:
                self.warm_up(aside, also=lambda: sampling.warm_kernels(self.cfg.vocab_size), progress=poll)
        finally:
            if aside is not None:
                aside.close()
        took = (perf_counter_ns() - started) / 1e9
        if first or took > 0.5:
            n = compiled[0]  # 0 where the cache directory could not be read: no count to give
            say(f"compiled {f'{n} CPU kernel' + ('s' if n != 1 else '') if n else 'the CPU kernels'} in {took:.1f} s; "
                "later runs reuse them")
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        except OSError:  # a cache directory nerva cannot write: the warm-up runs again next time
            pass

    def load_kernels_aside(self, threads: int, also=lambda: None):
        """Loads on a thread what a first answer would load on the way: numba's cached kernels for
        a short prompt, a decode step and sampling (warm_up), then `also()`. Only where the warm
        marker says a decode step's kernels are on disk (compiling them would hold a first
        message for seconds) and every layer is resident (a paged one's reads are its answers').
        -> None, or ready(quiet=False), which waits for it and, the first time, raises what it
        raised (quiet: never)."""
        if self.backend != "cpu" or self.plan.paged_layers or \
                not self.k.warm_marker(self.kernel_kinds()).exists():
            return None
        import threading

        from nerva_cli.runtime import sampling

        failed = []

        def work():
            try:
                self.k.set_threads(threads)  # numba's count is per thread
                self.warm_up(also=lambda: sampling.warm_kernels(self.cfg.vocab_size))
                also()
            except BaseException as e:  # noqa: BLE001  (raised in the caller's thread, by ready())
                failed.append(e)

        thread = threading.Thread(target=work, name="nerva-warm-up", daemon=True)
        thread.start()

        def ready(quiet: bool = False) -> None:
            thread.join()
            if failed and not quiet:
                raise failed.pop()

        return ready

    # -- decode ------------------------------------------------------------------------------
    def kernel_kinds(self) -> str:
        """What picks the compiled kernels a decode step calls (numba compiles per type and, for
        attention, per head grouping, not per size): the architecture, the variant and token
        table, the layers' precisions, paging and the KV cache's type."""
        return "|".join(map(str, (self.backend, self.model.meta["arch_hash"], self.model.variant,
                                  self.model.q4_token_table, sorted(set(self.layer_precision.values())),
                                  bool(self.plan.paged_layers), self.kv_cache)))

    def warm_up(self, aside=None, also=lambda: None, progress=lambda: None) -> None:
        """Two tokens prefilled and one decoded, then forgotten, so that the decode kernels a run
        needs compile before its answer starts (prepare does it once for each kernel_kinds): an
        answer stalled after its first token while they compiled. `aside`, from
        compile_aside (made before any thread of the caller's starts), compiles the attention
        halves meanwhile; this process compiles the MLP halves after its prefill, then the
        kernels of a longer prompt (_longer_prompt_dense), calls `also` (the caller's own
        kernels' first calls), then waits for it, calling progress() each time it says it
        compiled a kernel. Where the kernels are on disk already (the chat's warm-up while the
        user types), all this loads them."""
        token = self.cfg.bos_token_id or 0
        # two tokens where the context has room to decode after them: a prompt of several slices
        # the outputs of a paged layer's unfused q/k/v (a layout of its own, compiled apart),
        # which one token leaves contiguous (a paged SmolLM2's first prompt compiled 1.3 s more)
        prompt = [token] * (2 if self.ctx > 2 else 1)
        try:
            self.prefill(prompt)
            if self.ctx > len(prompt):  # --ctx 1 holds no second position (and no answer either)
                if hasattr(self.k, "compile_only"):
                    with self.k.compile_only():
                        if aside is not None:  # else the decode below compiles them, in this process
                            for layer in self.weights.layers():
                                self._decode_halves(layer)[1]()
                        self._longer_prompt_dense()
                also()
                if aside is not None:
                    aside.wait(progress=progress)
                self.decode(token)
        finally:
            if aside is not None:
                aside.close()
        self.reset()
        self.phase_ns = dict.fromkeys(PHASES, 0)

    def _resident_layers(self):
        """The layers in RAM, taken without the pager (a paged engine's resident ones)."""
        return self.weights.resident.values() if getattr(self.weights, "paged", []) else self.weights.layers()

    def _longer_prompt_dense(self) -> None:
        """A layer's q/k/v and o products, for each precision the layers run at, at a chunk length
        whose kernels the warm-up's two tokens do not reach: past the backend's short bound, the
        GEMM (dequantise + sgemm, or widen for exact); where W4A8 has no bound (AVX-512BW), 16
        tokens for its lane kernel (matmul_q4_w4a8 from a dozen). Left to the first prompt they
        compiled after the answer began.
        q/k/v as prefill_layer multiplies them: a resident layer's fused, a paged layer's apart,
        into column slices of its output, which numba types apart from a whole array. Under
        compile_only nothing runs: a resident layer's matrices, and a staging slot's (whatever
        it holds) where layers of that precision are paged, so the pager reads nothing."""
        cfg, ws, paged = self.cfg, self.pw, getattr(self.weights, "paged", [])
        resident = {self.layer_precision[L.index]: L for L in self._resident_layers()}
        slot = self.weights.views()[0] if paged else None
        layers = list(resident.items()) + [(p, slot) for p in {self.layer_precision[i] for i in paged}]
        for precision, layer in sorted(layers, key=lambda pl: pl[0]):
            m = layer.mats
            qkv = [m["qkv"]] if "qkv" in m else [m["q"], m["k"], m["v"]]
            for mats, x, out, part_rows in ((qkv, ("xn", cfg.hidden_size), ("qkv", cfg.q_dim + 2 * cfg.kv_dim),
                                             gcd(cfg.q_dim, cfg.kv_dim)),
                                            ([m["o"]], ("attn", cfg.q_dim), ("proj", cfg.hidden_size), None)):
                # each its own bound: a Q4 variant may keep one of them exact (layout.stored_format)
                short = self.k.short_prefill_rows("exact" if mats[0].w is not None else precision)
                T = short + 1 if short < ws.rows else min(16, ws.rows)
                self._dense(mats, ws.take(x[0], T, x[1]), precision, ws.take(out[0], T, out[1]), part_rows)

    def compile_aside(self):
        """For warm_up: a forked process compiling, without running them, the attention halves of
        a decode step's kernels, or None where that cannot help (the backend compiles nothing, a
        single CPU). A paged layer's come from a slot's Layer, whatever it holds: the child
        takes no lock of the pager's, whose thread the fork does not copy. The fork is made
        here, so call it before starting a thread."""
        if self.ctx < 2 or not hasattr(self.k, "compile_aside"):
            return None
        paged = getattr(self.weights, "paged", [])

        def attention_halves():
            # first prefill's attention, which the parent's warm-up reaches a few kernels in (the
            # parent loads it from the disk cache once this is done, else compiles it too)
            cfg, ws, first, T = self.cfg, self.pw, self.active[0], min(2, self.pw.rows)
            q, attn = ws.take("q", T, cfg.num_heads, cfg.head_dim), ws.take("attn", T, cfg.num_heads, cfg.head_dim)
            self.k.attention_prefill(q, self.a.k_cache[first][:T], self.a.v_cache[first][:T], 0, attn,
                                     ws.bufs["attention"])
            for layer in self._resident_layers():
                self._decode_halves(layer)[0](0)
            view = self.weights.views()[0] if paged else None
            for precision in sorted({self.layer_precision[i] for i in paged}):
                view.index = next(i for i in paged if self.layer_precision[i] == precision)
                view.precision = precision
                self._decode_halves(view)[0](0)

        return self.k.compile_aside(attention_halves, threads=[getattr(self.weights, "thread", None)])

    def _decode_halves(self, layer: Layer):
        """(attention(pos), mlp()): a layer's decode step in the two parts _decode_layer times."""
        halves = self._halves(layer)
        if halves is not None:
            attention, mlp, _ = halves
            return (lambda pos: attention(pos + 1)), mlp or (lambda: self._decode_mlp(layer))
        return (lambda pos: self._decode_attention(layer, pos)), (lambda: self._decode_mlp(layer))

    def decode(self, token: int) -> np.ndarray:
        """One token through every layer; returns the logits (a view into the arena)."""
        cfg, a, k = self.cfg, self.a, self.k
        self.check_decode(token)
        pos = self.n_past
        a.pos[0] = pos
        self._make_room(pos + 1)
        t0 = perf_counter_ns()
        self._embed_row(token, a.x)
        self.phase_ns["embed"] += perf_counter_ns() - t0
        for layer in self.weights.layers():
            self._decode_layer(layer, pos)
        t1 = perf_counter_ns()
        k.rmsnorm(a.x, self.final_norm, cfg.rms_eps, a.xn)
        self._lm_head(a.xn, a.logits)
        self.phase_ns["lm_head"] += perf_counter_ns() - t1
        self.n_past = pos + 1
        return a.logits

    def _lm_head(self, x: np.ndarray, out: np.ndarray) -> None:
        precision = self.head_precision
        if precision == "w4a8" and self.lm_head.w is None:
            self._quantize_input(x)
        self._matvec(self.lm_head, x, out, precision)
        self._cap_logits(out)

    def _cap_logits(self, logits: np.ndarray) -> None:
        """Gemma 2's final logit capping, cap tanh(logits / cap), in place (NumPy's in-place ufuncs
        allocate nothing); no change where the model has none."""
        cap = self.cfg.final_softcap
        if cap:
            logits *= np.float32(1 / cap)
            np.tanh(logits, out=logits)
            logits *= np.float32(cap)

    def _decode_layer(self, layer: Layer, pos: int) -> None:
        halves = self._halves(layer)
        if halves is not None:  # the same kernels on the same buffers, in a few calls
            attention, mlp, kernels = halves
            t0 = perf_counter_ns()
            attention(pos + 1)
            t1 = perf_counter_ns()
            if mlp is None:  # a mixture's: the engine's, counting its own kernels
                self._decode_mlp(layer)
            else:
                mlp()
            self.counters.kernels += kernels
            self.counters.dispatches += 1 + (mlp is not None)
            self.phase_ns["attention"] += t1 - t0
            self.phase_ns["mlp"] += perf_counter_ns() - t1
            return
        t0 = perf_counter_ns()
        self._decode_attention(layer, pos)
        t1 = perf_counter_ns()
        self._decode_mlp(layer)
        self.phase_ns["attention"] += t1 - t0
        self.phase_ns["mlp"] += perf_counter_ns() - t1

    def _decode_attention(self, layer: Layer, pos: int) -> None:
        """Norm, q/k/v, RoPE, the KV cache's new row, attention and o, for any layer."""
        cfg, a, k, m = self.cfg, self.a, self.k, layer.mats
        k.rmsnorm(a.x, layer.attn_norm, cfg.rms_eps, a.xn)
        if layer.codes_in("qkv", "q"):
            self._quantize_input(a.xn)
        if "qkv" in m:
            self._matvec(m["qkv"], a.xn, a.qkv, layer.precision)
        else:  # a paged layer views its file: q, k, v stay separate
            self._matvec(m["q"], a.xn, a.q_flat, layer.precision)
            self._matvec(m["k"], a.xn, a.k_flat, layer.precision)
            self._matvec(m["v"], a.xn, a.v_flat, layer.precision)
        if layer.qkv_bias is not None:
            k.add_rows(a.qkv, layer.qkv_bias)
        if layer.q_norm is not None:
            k.rmsnorm(a.q, layer.q_norm, cfg.rms_eps, a.q)
            k.rmsnorm(a.k, layer.k_norm, cfg.rms_eps, a.k)
        spec = self.specs[layer.index]
        k.rope(a.q_rows, a.pos, spec.cos, spec.sin)
        k.rope(a.k_rows, a.pos, spec.cos, spec.sin)
        row = pos - (self.kv_base if layer.index in self.ring else 0)  # the cache row of position pos
        a.k_cache[layer.index][row] = a.k
        a.v_cache[layer.index][row] = a.v
        window = spec.window
        first = max(0, row + 1 - window) if window else 0
        slots, firsts, counts = a.att_one
        slots[0], firsts[0], counts[0] = self.slot, first, row + 1 - first
        k.attention_decode_rows(a.q_rows, a.k_all[layer.index], a.v_all[layer.index], slots, firsts, counts,
                                a.attn_rows, a.att_part, spec.softcap)
        if layer.codes_in("o"):
            self._quantize_input(a.attn_flat)
        self._matvec(m["o"], a.attn_flat, a.o, layer.precision)
        if layer.post_attn_norm is not None:
            k.rmsnorm(a.o, layer.post_attn_norm, cfg.rms_eps, a.o)

    def _decode_mlp(self, layer: Layer) -> None:
        """The residual add and norm, gate/up, SiLU (GeLU) * up, down and its residual add, for any
        layer."""
        a, k, m = self.a, self.k, layer.mats
        k.add_rmsnorm(a.o, a.x, layer.mlp_norm, self.cfg.rms_eps, a.xn)
        if layer.moe is not None:
            if self.lookahead or self.expert_predicted is not None:
                self.look_ahead(layer, a.x)
            self._moe_rows(layer, a.xn_row, a.down_row, self._rows_dense)
            a.x += a.down
            return
        if layer.codes_in("gate_up", "gate"):
            self._quantize_input(a.xn)
        if "gate_up" in m:
            self._matvec(m["gate_up"], a.xn, a.gate_up, layer.precision)
        else:
            self._matvec(m["gate"], a.xn, a.gate, layer.precision)
            self._matvec(m["up"], a.xn, a.up, layer.precision)
        (k.gelu_mul if self.specs[layer.index].gelu else k.silu_mul)(a.gate_up, a.act)
        if layer.codes_in("down"):
            self._quantize_input(a.act)
        self._matvec(m["down"], a.act, a.down, layer.precision)
        if layer.post_mlp_norm is not None:
            k.rmsnorm(a.down, layer.post_mlp_norm, self.cfg.rms_eps, a.down)
        a.x += a.down

    # -- prefill (EngineBase.prefill chunks the prompt) ------------------------------------------
    # Every intermediate lives in the PrefillWorkspace (self.pw): a chunk allocates only the
    # logits it returns.
    def _dense(self, mats: list[Linear], x: np.ndarray, precision: str, out: np.ndarray,
               part_rows: int | None = None) -> None:
        """out [T, rows] = x [T, cols] times the matrices `mats`, stacked by rows, transposed: the
        backend's GEMMs, which dequantise (or widen) a slice of rows at a time into the
        workspace's scratch (scratch_elements), slices whose heights divide part_rows (by
        default the matrices' heights; a fused matrix's caller gives its parts'), so a paged
        layer's unfused q/k/v and gate/up run the very GEMMs a resident layer's fused ones do,
        and paging changes no bit. W4A8 quantises the activations per 32-group first, which
        gives the same products as the integer kernel. A short chunk takes the matvecs' batch
        kernels instead (_short_dense)."""
        short = self.k.short_prefill_rows("exact" if mats[0].w is not None else precision)
        if x.shape[0] <= short and all(lin.q8 is None for lin in mats):  # no batch kernel for a Q8_0 table
            self._short_dense(mats, x, precision, out)
            return
        if mats[0].w is None and precision == "w4a8":
            x = self._fake_quant(x)
        scratch, lo = self.pw.bufs["dequant"], 0
        align = part_rows or gcd(*[lin.rows for lin in mats])
        for lin in mats:
            if lin.w is not None:
                self.k.gemm_exact(lin.w, x, out, lo, scratch, align)
            elif lin.q8 is not None:
                self.k.gemm_q8(lin.q8, lin.d, x, out, lo, scratch, align)
            else:
                self.k.gemm_q4(lin.qs, lin.d, lin.m, x, out, lo, scratch, align)
            lo += lin.rows

    def _short_dense(self, mats: list[Linear], x: np.ndarray, precision: str, out: np.ndarray) -> None:
        """_dense for a short chunk (the backend's short_prefill_rows) through Q4 or exact
        matrices: the matvecs' batch forms (the Q4 ones' rows equal decode's matvecs bit for bit,
        fused or not); W4A8's input quantised as decode quantises it. The GEMM's way dequantised
        every weight for a few tokens."""
        x = np.ascontiguousarray(x)
        if precision == "w4a8" and mats[0].w is None:
            T, cols = x.shape
            xq = self.pw.take("codes", T, cols)
            xd, xs = self.pw.take("code_scales", T, cols // QK), self.pw.take("code_sums", T, cols // QK)
            self.k.quantize_act_q8(x.reshape(-1), xq.reshape(-1), xd.reshape(-1), xs.reshape(-1))
        lo = 0
        for lin in mats:
            part = out[:, lo:lo + lin.rows]
            if lin.w is not None:
                self.k.matmul_exact(lin.w, x, part)
            elif precision == "w4a8":
                self.k.matmul_q4_w4a8(lin.qs, lin.d, lin.m, xq, xd, xs, part)
            else:
                self.k.matmul_q4_w4a16(lin.qs, lin.d, lin.m, x, part)
            lo += lin.rows

    def _fake_quant(self, x: np.ndarray) -> np.ndarray:
        out = self.pw.take("xq", *x.shape)
        self.k.fake_quantize_q8(np.ascontiguousarray(x), out)
        return out

    def _prefill_chunk(self, tokens: list[int]) -> np.ndarray:
        start = self.n_past
        self._make_room(start + len(tokens))
        x = self.embed_rows(tokens, self.pw.take("x", len(tokens), self.cfg.hidden_size))
        for layer in self.weights.layers():
            self.prefill_layer(layer, x, start)
        self.n_past = start + len(tokens)
        return x

    def embed_rows(self, tokens: list[int], out: np.ndarray | None = None) -> np.ndarray:
        x = np.empty((len(tokens), self.cfg.hidden_size), dtype=np.float32) if out is None else out
        for t, tok in enumerate(tokens):
            self._embed_row(tok, x[t])
        return x

    def prefill_layer(self, layer: Layer, x: np.ndarray, start: int, taps: dict | None = None,
                      slot: int | None = None) -> None:
        """One layer over a chunk x [T, hidden] (T at most the workspace's rows) at positions
        start.., in place, writing K/V rows into the cache of layer `slot` (by default its own:
        MCAP's pass lends every layer the first's). `taps`, when given, receives copies of the
        fused q/k/v projection output ("qkv", before RoPE) and of the MLP output ("mlp", before a
        post norm) that MCAP scores are made of."""
        cfg, k, ws = self.cfg, self.k, self.pw
        T, p, m = x.shape[0], layer.precision, layer.mats
        h, f, qd, kvd = cfg.hidden_size, cfg.intermediate_size, cfg.q_dim, cfg.kv_dim
        pos = ws.take("pos", T)
        np.add(ws.iota[:T], start, out=pos)
        xn = ws.take("xn", T, h)
        k.rmsnorm(x, layer.attn_norm, cfg.rms_eps, xn)
        qkv = ws.take("qkv", T, qd + 2 * kvd)
        self._dense([m["qkv"]] if "qkv" in m else [m["q"], m["k"], m["v"]], xn, p, qkv, gcd(qd, kvd))
        if layer.qkv_bias is not None:
            k.add_rows(qkv, layer.qkv_bias)
        if taps is not None:
            taps["qkv"] = qkv.copy()
        q = ws.take("q", T, cfg.num_heads, cfg.head_dim)
        kk = ws.take("k", T, cfg.num_kv_heads, cfg.head_dim)
        np.copyto(q, qkv[:, :qd].reshape(q.shape))
        np.copyto(kk, qkv[:, qd:qd + kvd].reshape(kk.shape))
        if layer.q_norm is not None:
            k.rmsnorm(q, layer.q_norm, cfg.rms_eps, q)
            k.rmsnorm(kk, layer.k_norm, cfg.rms_eps, kk)
        spec = self.specs[layer.index]
        k.rope(q, pos, spec.cos, spec.sin)
        k.rope(kk, pos, spec.cos, spec.sin)
        slot = layer.index if slot is None else slot
        kc, vc = self.a.k_cache[slot], self.a.v_cache[slot]
        row = start - (self.kv_base if slot in self.ring else 0)  # the cache row of position start
        kc[row:row + T] = kk
        vc[row:row + T] = qkv[:, qd + kvd:].reshape(kk.shape)
        attn = ws.take("attn", T, cfg.num_heads, cfg.head_dim)
        window = spec.window
        first = max(0, row + 1 - window) if window else 0  # the row of the first position any query sees
        k.attention_prefill(q, kc[first: row + T], vc[first: row + T], row - first, attn, ws.bufs["attention"],
                            window, spec.softcap)
        proj = ws.take("proj", T, h)
        self._dense([m["o"]], attn.reshape(T, -1), p, proj)
        if layer.post_attn_norm is not None:
            k.rmsnorm(proj, layer.post_attn_norm, cfg.rms_eps, proj)
        x += proj
        k.rmsnorm(x, layer.mlp_norm, cfg.rms_eps, xn)
        if layer.moe is not None:
            self._moe_rows(layer, xn, proj, self._dense)
        else:
            gate_up, act = ws.take("gate_up", T, 2 * f), ws.take("act", T, f)
            self._dense([m["gate_up"]] if "gate_up" in m else [m["gate"], m["up"]], xn, p, gate_up, f)
            (k.gelu_mul if spec.gelu else k.silu_mul)(gate_up, act)
            self._dense([m["down"]], act, p, proj)
        if taps is not None:
            taps["mlp"] = proj.copy()
        if layer.post_mlp_norm is not None:
            k.rmsnorm(proj, layer.post_mlp_norm, cfg.rms_eps, proj)
        x += proj

    def _last_logits(self, x: np.ndarray) -> np.ndarray:
        """Final norm + lm_head for the prompt's last row, by decode's matvec, into a new array:
        a GEMM's way dequantised the whole table for one row."""
        a = self.a
        self.k.rmsnorm(x, self.final_norm, self.cfg.rms_eps, a.xn)
        self._lm_head(a.xn, a.logits)
        return a.logits.copy()

    def _logits_rows(self, x: np.ndarray) -> np.ndarray:
        """Final norm + lm_head for a few rows (prefill), into a new [rows, vocab] array."""
        xn = self.pw.take("xn", *x.shape)
        self.k.rmsnorm(np.ascontiguousarray(x), self.final_norm, self.cfg.rms_eps, xn)
        out = np.empty((x.shape[0], self.lm_head.rows), dtype=np.float32)
        self._dense([self.lm_head], xn, self.head_precision, out)
        self._cap_logits(out)
        return out

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens a prefill pass takes."""
        return self.pw.rows
