"""The CUDA plane's engine: prefill and decode on the GPU over the kernels of planes/cuda/launch.py.

Where weights live (ARCHITECTURE 8): the planner puts the fixed part (KV cache, workspaces,
embeddings, norms) and then layers by MCAP importance into VRAM (--vram-budget), except that an
untied token table (a row read a token) stays in pinned RAM, read in place by the embedding
kernel, where that lets more layers into VRAM; the rest stream
through a ring of VRAM slots, filled on a copy stream and ordered with events, from pinned host
memory (layers that fit --ram-budget stay there: warm) or from their files (cold: the pager's
reader fills page-locked staging buffers with O_DIRECT). Every layer file keeps its 4 KB layout
on the device, and a layer's tensors are views into it, so a slot holds whichever paged layer
the cycle puts there.

Decode: the kernels of a step are captured once as CUDA graphs (the whole step as one graph
when every layer is resident; per paged layer and slot otherwise) and replayed per token. The
position and the token to embed are read from device memory (`state`), so a replay takes no
arguments. With device sampling the sampled token is written where the next step reads it and
copied to pinned host memory asynchronously: the host waits only for tokens it has to print.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from time import perf_counter_ns

import numpy as np

from nerva_cli.model.layer_spec import layer_specs
from nerva_cli.residency.arena import cache_rows
from nerva_cli.planes.cuda.launch import (RECENT, Kernels, attention_splits, decode_blocks, most_prefill_partials,
                                          prefill_splits, unsupported_shapes)
from nerva_cli.planes.base import Counters, EngineBase, context_length
from nerva_cli.errors import NervaError
from nerva_cli.model.layout import layer_file
from nerva_cli.units import human_bytes
from nerva_cli.residency.pager import LayerFileReader, PagedWeights, PagerStats
from nerva_cli.residency.planner import Plan, ResidentBlock, plan, plan_model
from nerva_cli.store.catalog import StoredModel, tensors_in

SCRATCH_BYTES = 64 << 20  # prefill's dequantised weight rows (f16), a slice of a matrix at a time
HOST_SLOTS = 2  # staging buffers between the disk reader and the copy stream


# -- sizes and the plan ----------------------------------------------------------------------
# Prompt tokens a prefill pass takes (the cpu plane's is 256): every pass dequantises every
# weight matrix once, so on the GPU, where that costs as much as the GEMMs, fewer passes pay.
PREFILL_CHUNK = 512

def decode_splits(cfg, ctx: int, sms: int) -> tuple[int, int]:
    """attention_splits for cfg's decode attention blocks (decode_blocks: its head sets)."""
    return attention_splits(decode_blocks(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), ctx, sms)


def arena_sizes(cfg, ctx: int, most_splits: int, sms: int) -> tuple[int, int]:
    """(kv_bytes, total bytes) of DeviceArena: decode buffers, f16 KV cache, prefill workspace."""
    h, f, qd, kvd, T = cfg.hidden_size, cfg.intermediate_size, cfg.q_dim, cfg.kv_dim, PREFILL_CHUNK
    decode = 4 * (2 * h + 2 * qd + 2 * kvd + f + cfg.vocab_size
                  + cfg.num_heads * (most_splits * (cfg.head_dim + 2) + 1) + 5 + RECENT)
    prefill = 4 * T * (2 * h + 2 * qd + 2 * kvd + 3 * f) + 2 * T * max(h, qd, f)
    prefill += 4 * sum(most_prefill_partials(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, sms, T))
    kv = 2 * kvd * 2 * sum(cache_rows(cfg, ctx, PREFILL_CHUNK))
    return kv, kv + decode + prefill + min(SCRATCH_BYTES, 2 * _widest_matrix(cfg))


def _widest_matrix(cfg) -> int:
    return max(cfg.vocab_size, 2 * cfg.intermediate_size, cfg.q_dim + 2 * cfg.kv_dim) * max(
        cfg.hidden_size, cfg.intermediate_size)


@dataclass
class GpuPlan:
    vram: Plan  # resident_layers in VRAM; paged_layers stream through its VRAM slots
    warm: list[int]  # paged layers kept in pinned RAM
    cold: list[int]  # paged layers read from their files every pass
    ram_budget: int | None = None
    host_fixed: list[ResidentBlock] = field(default_factory=list)  # in pinned RAM, read in place by kernels

    def to_dict(self) -> dict:
        return {**self.vram.to_dict(), "tier": "gpu", "warm_layers": self.warm, "cold_layers": self.cold,
                "host_fixed": {b.name: b.nbytes for b in self.host_fixed}}


def gpu_residency_plan(model: StoredModel, ctx: int | None, vram_budget: int | None, ram_budget: int | None,
                       importance: dict[int, float] | None = None, active_layers: list[int] | None = None,
                       sms: int = 132) -> GpuPlan:
    """From sizes alone: nothing is allocated or read (topology --model shows the same plan)."""
    cfg, files = model.config, model.meta["files"]
    ctx = context_length(cfg, ctx)
    # all-position logits rows and their normed input (perplexity), or q/k norms' copies, come
    # from CuPy's pool as prefill runs: room is kept for them
    temporaries = 4 * PREFILL_CHUNK * (cfg.vocab_size + max(cfg.hidden_size, cfg.q_dim))

    embed = ("embed", files["embed.bin"]["size"])

    def workspace_at(n: int) -> dict:
        kv, arena = arena_sizes(cfg, n, decode_splits(cfg, n, sms)[1], sms)
        return {"kv_cache": ("kv_cache", kv), "workspace": ("workspace", arena - kv),
                "prefill_temporaries": ("workspace", temporaries)}

    # an untied token table that stays out of VRAM stays in pinned RAM, which kernels read in
    # place (unified addressing): the embedding kernel reads its row there
    vram = plan_model(model, ctx, vram_budget, importance, active_layers, workspace_at,
                      "VRAM budget (--vram-budget)")
    for b in vram.fixed:
        b.tier = "gpu"
    host_fixed = {"embed": embed} if vram.table_aside else {}
    paged = {i: vram.layer_bytes[i] for i in vram.paged_layers}
    if not paged or ram_budget is None:
        return GpuPlan(vram, list(vram.paged_layers), [], ram_budget, plan(host_fixed, {}, None).fixed)
    try:
        host = plan(host_fixed, paged, ram_budget, importance, slots=HOST_SLOTS)
    except NervaError as e:
        raise NervaError(f"{e} (on the cuda backend the RAM budget holds pinned copies of the layers "
                         "that do not fit VRAM, or staging buffers for reading them"
                         + (", and the token table" if host_fixed else "") + ")") from None
    return GpuPlan(vram, host.resident_layers, host.paged_layers, ram_budget, host.fixed)


def auto_vram_budget(dev) -> int:
    """--vram-budget auto (and unset): 90% of what the device has free now."""
    return int(dev.free_bytes() * 0.9)


# -- device state ----------------------------------------------------------------------------
class DeviceArena:
    """Every buffer decode and prefill touch, allocated once (the planner counted them)."""

    def __init__(self, dev, cfg, ctx: int, most_splits: int):
        h, f, qd, kvd, T = cfg.hidden_size, cfg.intermediate_size, cfg.q_dim, cfg.kv_dim, PREFILL_CHUNK
        f32 = lambda *s: dev.zeros(s, np.float32)  # noqa: E731
        self.x, self.xn = f32(h), f32(h)
        self.qkv = f32(qd + 2 * kvd)
        self.q, self.k, self.v = self.qkv[:qd], self.qkv[qd:qd + kvd], self.qkv[qd + kvd:]
        self.attn = f32(qd)
        self.act = f32(f)  # silu(gate) * up, straight from the glu launch
        self.logits = f32(cfg.vocab_size)
        self.part = f32(cfg.num_heads * most_splits * (cfg.head_dim + 2))  # attention_decode's partials
        self.done = dev.zeros(cfg.num_heads, np.int32)  # attention_decode's split counts (a head set's: <= heads)
        self.norm_done = dev.zeros(1, np.int32)  # blocks of a matvec that adds, then normalises
        self.state = dev.zeros(4, np.int32)  # position, token, draws, sampled (sample.cu)
        self.recent = dev.zeros(RECENT, np.int32)
        self.pos = self.state[0:1]
        self.token = self.state[1:2]
        # each layer's K and V caches [rows, kv_heads, hd] in one allocation: the context's rows, or
        # a sliding-window layer's fewer (arena.cache_rows), position p in row p % rows
        rows = cache_rows(cfg, ctx, T)
        self.kv_all = dev.zeros(2 * sum(rows) * kvd, np.float16)
        self.kv, at = [], 0
        for n in rows:
            k, v = (self.kv_all[at + i * n * kvd: at + (i + 1) * n * kvd].reshape(n, cfg.num_kv_heads, cfg.head_dim)
                    for i in (0, 1))
            self.kv.append((k, v))
            at += 2 * n * kvd
        # prefill, one chunk of up to T tokens
        self.px, self.pxn, self.pqkv = f32(T, h), f32(T, h), f32(T, qd + 2 * kvd)
        self.pattn, self.pgate_up, self.pact = f32(T, qd), f32(T, 2 * f), f32(T, f)
        self.phalf = dev.zeros((T, max(h, qd, f)), np.float16)  # a GEMM's activations in f16
        # attention_prefill's partials and counts, for a pass whose row blocks alone underfill the GPU
        floats, counts = most_prefill_partials(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dev.sms, T)
        self.ppart, self.pdone = f32(floats), dev.zeros(counts, np.int32)
        self.scratch = dev.zeros(min(SCRATCH_BYTES, 2 * _widest_matrix(cfg)) // 2, np.float16)

    @property
    def kv_bytes(self) -> int:
        return int(self.kv_all.nbytes)


@dataclass
class DeviceLayer:
    """One layer's tensors on the device (views into its file's bytes) and its precision."""

    index: int
    t: dict
    precision: str

    def mat(self, name: str) -> dict:
        return matrix(self.t, name)


def matrix(t: dict, name: str) -> dict:
    """Matrix `name` of tensors t as the kernels take it: {"qs", "d"} (Q4_0), {"qs", "d", "m"}
    (Q4_1, its offsets), {"q8", "d"} (Q8_0, a token table) or {"w"} (exact)."""
    if f"{name}.q8" in t:
        return {"q8": t[f"{name}.q8"], "d": t[f"{name}.d"]}
    if f"{name}.qs" not in t:
        return {"w": t[name]}
    return {"qs": t[f"{name}.qs"], "d": t[f"{name}.d"], **({"m": t[f"{name}.m"]} if f"{name}.m" in t else {})}


class GpuWeights:
    """The ledger's and bench's view of where layers came from: pager counters, O_DIRECT."""

    def __init__(self, cold: PagedWeights | None, dev, gds: bool = False):
        self.cold, self.dev, self.gds = cold, dev, gds
        self.stats = cold.stats if cold is not None else PagerStats()
        self.policy = "ring"

    @property
    def direct_io(self):
        """True/False: cold reads bypass the page cache or not; None: nothing is read from disk."""
        return True if self.gds else (self.cold.direct_io if self.cold is not None else None)

    def close(self) -> None:
        if self.cold is not None:
            self.cold.close()
            for slot in self.cold.slots:
                self.dev.unpin(slot.buf)
            self.cold = None


class _HostView:
    """What a cold staging slot yields: its buffer and which layer it holds now."""

    def __init__(self, buf):
        self.buf, self.index, self.precision = buf, -1, None


# -- the engine ------------------------------------------------------------------------------
SYNC_KINDS = ("state", "logits", "token", "staging", "drain")


class CudaEngine(EngineBase):
    kv_cache = "f16"  # ARCHITECTURE 6: the GPU's KV cache is f16
    backend = "cuda"
    device_sampling = True

    @property
    def prefill_chunk(self) -> int:
        return PREFILL_CHUNK

    def __init__(self, model: StoredModel, precision: str | None = None, ctx: int | None = None,
                 layer_precisions: list[str] | None = None, active_layers: list[int] | None = None,
                 vram_budget: int | None = None, ram_budget: int | None = None, policy: str = "ring",
                 importance: dict[int, float] | None = None, device=None, gds: dict | None = None):
        """vram_budget None: auto_vram_budget; ram_budget None: every paged layer pinned in RAM;
        gds None: GPUDirect Storage for cold layers where `nerva topology` finds it working."""
        if policy != "ring":
            raise NervaError(f"--policy {policy}: the cuda backend pages through the ring only "
                             "(lru is measured on the cpu backend)")
        if device is None:
            from nerva_cli.planes.cuda.launch import CupyDevice

            device = CupyDevice()
        self.dev = dev = device
        self.model, self.cfg = model, model.config
        cfg = self.cfg
        if cfg.num_experts:
            raise NervaError(f"{model.name} is a mixture of experts, which the cuda backend does not run yet: "
                             "--backend cpu")
        if problem := unsupported_shapes(cfg):
            raise NervaError(f"{model.path}: {problem}")
        self.set_precisions(model, precision, layer_precisions, active_layers)
        self.ctx = context_length(cfg, ctx)
        self.policy = policy
        self.phase_ns = None  # phases run inside graphs: the ledger shows wall time per token
        self.splits = decode_splits(cfg, self.ctx, dev.sms)
        if vram_budget is None:
            vram_budget = auto_vram_budget(dev)
        if gds is None:
            from nerva_cli.residency import gds as gds_module

            gds = gds_module.status()
        self.gds = gds  # {"used", "reason"}: GPUDirect Storage for the cold tier, reported either way
        self.gpu_plan = gpu_residency_plan(model, self.ctx, vram_budget, ram_budget, importance, self.active,
                                           dev.sms)
        self.plan = self.gpu_plan.vram
        self.counters = Counters()
        self.k = Kernels(dev, self.counters)
        try:
            self._load()
        except Exception as e:
            if not dev.is_out_of_memory(e):
                raise
            raise NervaError(f"out of GPU memory loading {model.name}:{model.variant}: the plan needs "
                             f"{human_bytes(self.plan.used_bytes)}; {human_bytes(dev.free_bytes())} is free "
                             f"now: try --vram-budget {human_bytes(int(dev.free_bytes() * 0.9))}") from None
        self.n_past = 0
        self.draws = self.sampled = 0  # host mirrors of state[2], state[3]
        # times the host waited for the GPU, by why: writing the state, reading logits, a token,
        # handing a staging buffer back to the disk reader, draining the queue after a stream
        self.counters.syncs.update(dict.fromkeys(SYNC_KINDS, 0))
        self._graphs: dict = {}
        self._sample_opts = None
        self.peak_vram_bytes = dev.used_bytes()

    @property
    def device_name(self) -> str:
        return self.dev.name

    @property
    def budgets(self) -> dict:
        return {"ram_budget": self.gpu_plan.ram_budget, "vram_budget": self.plan.budget}

    def plane_facts(self) -> dict:
        return {"gpudirect_storage": self.gds, "dependent_launch": self.dev.dependent_launch}

    def runtime_line(self, threads: int) -> str:
        return f"cuda on {self.dev.name}"

    def residency_lines(self) -> list[str]:
        gp, lines = self.gpu_plan, []
        if gp.vram.paged_layers:
            lines.append(f"residency on {self.dev.name}: {len(gp.vram.resident_layers)} layers in VRAM, "
                         f"{len(gp.vram.paged_layers)} stream through {gp.vram.slots} VRAM slots "
                         f"({human_bytes(gp.vram.paged_bytes_per_token)} a token) from pinned RAM "
                         f"({len(gp.warm)} layers) and disk ({len(gp.cold)})"
                         + ("; the token table stays in pinned RAM, a row read in place a token"
                            if gp.host_fixed else ""))
        if gp.cold:
            lines.append("GPUDirect Storage: " + ("used for the layers read from disk" if self.gds["used"]
                                                  else f"not used ({self.gds['reason']}); disk reads are "
                                                       "staged through pinned RAM"))
        return lines

    def truncate(self, n: int) -> int:
        """EngineBase.truncate; where a sliding-window layer's cache (a ring of rows) no longer
        holds the window before position n, everything: a prompt then runs from its start. Its
        rows hold the last `rows` positions written, one of them maybe a dropped step's (stream's
        queued token), so a rollback of up to rows - window positions keeps what n needs."""
        n = min(self.n_past, n)
        rings = [kc.shape[0] for kc, _ in self.a.kv if kc.shape[0] < self.ctx]
        if rings and self.n_past - n > min(rings) - self.cfg.sliding_window:
            self.reset()
            return 0
        self.n_past = n
        return n

    @property
    def kv_rows_movable(self) -> bool:
        """Whether kv_rows and set_kv_rows work here: not where a sliding layer's cache is a ring."""
        return all(kc.shape[0] >= self.ctx for kc, _ in self.a.kv)

    def kv_rows(self, start: int, n: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Host copies of positions start .. start + n - 1's K and V rows, an array [n, kv_heads,
        head_dim] a layer each (a prompt cache's entry: RAM behind VRAM), once the queued work
        that writes them is done."""
        if not self.kv_rows_movable or not 0 <= start <= start + n <= self.n_past:
            raise NervaError(f"kv_rows({start}, {n}): the engine holds {self.n_past} positions"
                             + ("" if self.kv_rows_movable else " in sliding-window rings"))
        self.dev.synchronize()
        return ([self.dev.download(k[start:start + n]) for k, _ in self.a.kv],
                [self.dev.download(v[start:start + n]) for _, v in self.a.kv])

    def set_kv_rows(self, start: int, k_rows: list[np.ndarray], v_rows: list[np.ndarray]) -> None:
        """Positions from `start` (the engine's length now) written from kv_rows' copies, the
        engine then past them; done before it returns (the compute stream does not wait on the
        copies' stream)."""
        n = k_rows[0].shape[0]
        if not self.kv_rows_movable or start != self.n_past or start + n > self.ctx:
            raise NervaError(f"set_kv_rows({start}, {n} rows): the engine holds {self.n_past} of {self.ctx} positions")
        self.dev.synchronize()
        for (k, v), kr, vr in zip(self.a.kv, k_rows, v_rows):
            k[start:start + n] = self.dev.upload(kr)
            v[start:start + n] = self.dev.upload(vr)
        self.dev.synchronize()
        self.n_past = start + n

    # -- loading -------------------------------------------------------------------------------
    def _upload_file(self, fname: str) -> dict:
        """A file's bytes (size and sha256 checked) in one device buffer; -> its tensors."""
        buf = self.dev.upload(self.model.read_bytes(fname))
        return tensors_in(buf, self.model.meta["files"][fname]["tensors"])

    def _load(self) -> None:
        dev, cfg, model, gp = self.dev, self.cfg, self.model, self.gpu_plan
        g = {}
        for fname in ("embed.bin", "final_norm.bin", "lm_head.bin"):
            if fname == "embed.bin" and gp.vram.table_aside:  # read straight into the pinned memory
                info = model.meta["files"][fname]
                host, table = dev.mapped(info["size"])
                model.read_bytes(fname, out=host)
                g.update(tensors_in(table, info["tensors"]))
            elif fname in model.meta["files"]:
                g.update(self._upload_file(fname))
        self.embed_t = matrix(g, "embed")
        self.final_norm = g["final_norm"]
        self.head_t = matrix(g, "lm_head") if any(n.startswith("lm_head") for n in g) else self.embed_t
        self.specs = layer_specs(cfg, self.ctx, put=dev.upload)  # RoPE tables, window, score cap, GLU
        self.a = DeviceArena(dev, cfg, self.ctx, self.splits[1])
        self.layers: dict[int, DeviceLayer] = {}
        for i in gp.vram.resident_layers:
            self.layers[i] = DeviceLayer(i, self._upload_file(layer_file(i)), self.layer_precision[i])
        self.paged = list(gp.vram.paged_layers)
        self.slots, self.slot_views, self.warm = [], [], {}
        cold, self.gds_reader = None, None
        if self.paged:
            table = model.meta["files"][layer_file(self.paged[0])]["tensors"]
            if any(model.meta["files"][layer_file(i)]["tensors"] != table for i in self.paged):
                raise NervaError(f"{model.path}: layer files differ in layout; they cannot share slots")
            self.slots = [dev.zeros(gp.vram.slot_bytes, np.uint8) for _ in range(gp.vram.slots)]
            self.slot_views = [tensors_in(s, table) for s in self.slots]
            reader = LayerFileReader(model)
            for i in gp.warm:
                size = model.meta["files"][layer_file(i)]["size"]
                buf = dev.pinned(size)
                reader.read(layer_file(i), [memoryview(buf)])
                self.warm[i] = buf
            if gp.cold and self.gds["used"]:
                from nerva_cli.residency.gds import GdsReader

                self.gds_reader = GdsReader(model, [layer_file(i) for i in gp.cold])
            elif gp.cold:
                cold = PagedWeights(model, {}, gp.cold, {i: self.layer_precision[i] for i in gp.cold},
                                    HOST_SLOTS, max(model.meta["files"][layer_file(i)]["size"] for i in gp.cold),
                                    "ring", None, view_buffer=lambda buf: (_HostView(buf), lambda: None))
                for s in cold.slots:
                    dev.pin(s.buf)
            self.ready = [dev.event() for _ in self.slots]
            self.free = [dev.event() for _ in self.slots]
            self.stall_marks = [(dev.timing_event(), dev.timing_event()) for _ in range(2 * len(self.paged))]
        self.stall_next = self.stall_read = 0  # timing marks recorded, read
        self._layer_graphs = {i: [None] * (len(self.slots) + 1) for i in self.active}  # [-1]: resident
        self.weights = GpuWeights(cold, dev, self.gds_reader is not None)
        self._plan_norms()
        self._primed = False  # the ring's first copies are queued on first use
        self._cold_pass = iter(())
        self._cold_copy = None  # the event of the last copy out of a cold staging buffer
        self.visits = 0  # paged visits issued to compute
        self.token_host = dev.pinned(4 * RECENT).view(np.int32)  # the host side of the token ring
        self.state_host = dev.pinned(16).view(np.int32)
        self.token_events = [dev.event() for _ in range(RECENT)]
        self.logits_host = dev.pinned(4 * cfg.vocab_size).view(np.float32)
        dev.settle()

    # -- the decode step, as recorded into graphs ----------------------------------------------
    def _plan_norms(self) -> None:
        """Which matvec does each norm: the norm after a residual add runs in the last block of
        the matvec that adds (matvec.cu's ADD_NORM), which needs the norm's weights where every
        graph can reach them. A layer's mlp_norm always is (its own file); the attention norm of
        the next active layer is when that layer is resident, the final norm always. A layer
        whose input arrives unnormalised (the first, or one behind a paged layer's down) starts
        with its own rmsnorm. Where a norm follows o and down before their residual adds (Gemma
        3's post norms), every norm is a launch of its own."""
        if self.cfg.post_norms:
            self._down_norm, self._input_normed = dict.fromkeys(self.active), set()
            return
        nxt = dict(zip(self.active, self.active[1:]))
        self._down_norm = {i: self.final_norm if i not in nxt else
                           self.layers[nxt[i]].t["attn_norm"] if nxt[i] in self.layers else None
                           for i in self.active}
        self._input_normed = {nxt[i] for i in self.active if i in nxt and self._down_norm[i] is not None}

    def _record_layer(self, L: DeviceLayer) -> None:
        cfg, a, k, p, t = self.cfg, self.a, self.k, L.precision, L.t
        eps = cfg.rms_eps
        if L.index not in self._input_normed:
            k.rmsnorm(a.x, t["attn_norm"], eps, a.xn)
        k.matvecs([L.mat("q"), L.mat("k"), L.mat("v")], a.xn, [a.q, a.k, a.v], p)
        for name, out in (("q", a.q), ("k", a.k), ("v", a.v)):
            if f"{name}_bias" in t:
                k.add_rows(out, t[f"{name}_bias"], 1)
        if "q_norm" in t:
            k.rmsnorm(a.q, t["q_norm"], eps, a.q)
            k.rmsnorm(a.k, t["k_norm"], eps, a.k)
        kc, vc, spec = *a.kv[L.index], self.specs[L.index]
        k.attention_decode(a.q, a.k, a.v, spec.cos, spec.sin, kc, vc, a.pos, a.part, a.done, a.attn,
                           cfg.num_heads, self.splits, spec.window, spec.softcap)
        if "post_attn_norm" in t:  # o's and down's products normed before their adds, through xn (free then)
            k.matvec(L.mat("o"), a.attn, a.xn, p)
            k.rmsnorm(a.xn, t["post_attn_norm"], eps, a.xn)
            k.add_rows(a.x, a.xn, 1)
            k.rmsnorm(a.x, t["mlp_norm"], eps, a.xn)
        else:
            k.matvec(L.mat("o"), a.attn, a.x, p, add=True, norm=(t["mlp_norm"], a.xn, eps, a.norm_done))
        k.glu(L.mat("gate"), L.mat("up"), a.xn, a.act, p, gelu=spec.gelu)
        if "post_mlp_norm" in t:
            k.matvec(L.mat("down"), a.act, a.xn, p)
            k.rmsnorm(a.xn, t["post_mlp_norm"], eps, a.xn)
            k.add_rows(a.x, a.xn, 1)
            return
        after = self._down_norm[L.index]
        k.matvec(L.mat("down"), a.act, a.x, p, add=True,
                 norm=None if after is None else (after, a.xn, eps, a.norm_done))

    def _record_head(self) -> None:
        self.k.embed(self.embed_t, self.a.token, self.a.x)
        if self.cfg.embed_scale is not None:
            self.k.scale(self.a.x, self.cfg.embed_scale)

    def _record_tail(self) -> None:
        a = self.a
        if not self.active or self.cfg.post_norms:  # else the last layer's down matvec did the final norm
            self.k.rmsnorm(a.x, self.final_norm, self.cfg.rms_eps, a.xn)
        p = "w4a8" if self.precision == "w4a8" and "w" not in self.head_t else "w4a16"
        self.k.matvec(self.head_t, a.xn, a.logits, p)
        self._cap_logits(a.logits)

    def _cap_logits(self, logits) -> None:
        """Gemma 2's final logit capping, in place; nothing where the model has none."""
        if self.cfg.final_softcap:
            self.k.softcap(logits, self.cfg.final_softcap)

    def _record_sample_first(self) -> None:
        """The token after a prefill: nothing has been fed at its position yet."""
        self.k.sample(self.a.logits, self.a.state, self.a.recent, self._sample_opts, False)

    def _record_sample_step(self) -> None:
        """The token after a decode step, which fed the one at state[0]: move on by one."""
        self.k.sample(self.a.logits, self.a.state, self.a.recent, self._sample_opts, True)

    def _graph(self, name: str):
        """The graph of `_record_<name>`, captured on first use."""
        g = self._graphs.get(name)
        if g is None:
            g = self._graphs[name] = self.k.capture(self.dev.compute, getattr(self, f"_record_{name}"))
        return g

    def _layer_graph(self, i: int, slot: int):
        """Layer i's decode graph (slot -1: resident), captured on first use; the lookup makes no
        objects, which keeps the per-token host path allocation-free."""
        graphs = self._layer_graphs[i]
        g = graphs[slot]
        if g is None:
            layer = self.layers[i] if slot < 0 else DeviceLayer(i, self.slot_views[slot], self.layer_precision[i])
            g = graphs[slot] = self.k.capture(self.dev.compute, lambda: self._record_layer(layer))
        return g

    def _forward(self) -> None:
        """One token's forward pass on the compute stream: embed state[1] at state[0] -> logits."""
        s = self.dev.compute
        if not self.paged:
            self.k.replay(self._graph("step"), s)
            return
        self.k.replay(self._graph("head"), s)
        for i in self.active:
            if i in self.layers:
                self.k.replay(self._layer_graph(i, -1), s)
            else:
                slot = self._acquire(i)
                self.k.replay(self._layer_graph(i, slot), s)
                self._release(slot)
        self.k.replay(self._graph("tail"), s)
        self._collect_stall()

    def _record_step(self) -> None:
        self._record_head()
        for i in self.active:
            self._record_layer(self.layers[i])
        self._record_tail()

    def _run_layer(self, i: int, run) -> None:
        """run(layer) on layer i, resident or in its slot (prefill)."""
        if i in self.layers:
            run(self.layers[i])
            return
        slot = self._acquire(i)
        run(DeviceLayer(i, self.slot_views[slot], self.layer_precision[i]))
        self._release(slot)

    # -- paging: visit n of the paged cycle uses slot n % slots --------------------------------
    def _acquire(self, i: int) -> int:
        """The slot holding paged layer i for this visit; the compute stream waits until the copy
        stream has filled it (timed with events: the stall)."""
        if not self._primed:
            for v in range(self.visits, self.visits + len(self.slots)):
                self._issue_copy(v)
            self._primed = True
        slot = self.visits % len(self.slots)
        if self.paged[self.visits % len(self.paged)] != i:
            raise NervaError(f"paging out of step: layer {i} at visit {self.visits}")
        stats, s = self.weights.stats, self.dev.compute
        if self.ready[slot].done:
            stats.hits += 1
        else:
            stats.faults += 1
        before, after = self.stall_marks[self.stall_next % len(self.stall_marks)]
        before.record(s)
        s.wait_event(self.ready[slot])
        after.record(s)
        self.stall_next += 1
        return slot

    def _release(self, slot: int) -> None:
        """Hands the slot back and queues the copy for the visit that owns it next: decode visits
        layers in a fixed cycle, so the lookahead is exact."""
        self.free[slot].record(self.dev.compute)
        self._issue_copy(self.visits + len(self.slots))
        self.visits += 1

    def _collect_stall(self) -> None:
        """Adds the compute stream's waits for copies whose timing marks have completed."""
        n = len(self.stall_marks)
        self.stall_read = max(self.stall_read, self.stall_next - n)  # older marks were reused
        while self.stall_read < self.stall_next:
            before, after = self.stall_marks[self.stall_read % n]
            if not after.done:
                break
            self.weights.stats.stall_ns += int(self.dev.elapsed_ms(before, after) * 1e6)
            self.stall_read += 1

    def _issue_copy(self, visit: int) -> None:
        """Queues on the copy stream: wait until compute has released the slot of `visit`, fill it
        with that visit's layer, mark it ready."""
        dev, c = self.dev, self.dev.copy
        slot = visit % len(self.slots)
        layer = self.paged[visit % len(self.paged)]
        stats = self.weights.stats
        stats.prefetched += 1
        if layer not in self.warm and self.gds_reader is not None:
            # kvikio reads outside stream order: the host waits for the slot to be free, reads
            # into it, then marks it ready (the GPU idles for that read: the cold tier is
            # disk-bound, and overlapping it needs a reader thread)
            if visit >= len(self.slots):
                self._sync("staging", self.free[slot])
            t = perf_counter_ns()
            stats.disk_bytes += self.gds_reader.read(layer_file(layer), self.slots[slot])
            stats.read_ns += perf_counter_ns() - t
            stats.reads += 1
            self.ready[slot].record(c)
            return
        if visit >= len(self.slots):
            c.wait_event(self.free[slot])
        src = self.warm.get(layer)
        if src is None:
            src = self._next_cold(layer)
        dev.copy_async(self.slots[slot][: src.nbytes], src, c)
        self.ready[slot].record(c)
        stats.h2d_bytes += src.nbytes
        if layer not in self.warm:
            self._cold_copy = self.ready[slot]

    def _next_cold(self, layer: int) -> np.ndarray:
        """The next cold layer's staging buffer, filled by the pager's reader in cycle order. The
        previous buffer goes back to the reader only once its copy has finished."""
        if self._cold_copy is not None:
            self._sync("staging", self._cold_copy)
        view = next(self._cold_pass, None)
        if view is None:
            self._cold_pass = self.weights.cold.layers()
            view = next(self._cold_pass)
        if view.index != layer:
            raise NervaError(f"pager out of step: expected layer {layer}, got {view.index}")
        return view.buf[: self.model.meta["files"][layer_file(layer)]["size"]]

    # -- the host side -------------------------------------------------------------------------
    def _sync(self, kind: str, waitable) -> None:
        """Waits for a stream or an event; counted by kind (the ledger shows them)."""
        self.counters.syncs[kind] += 1
        waitable.synchronize()

    def _write_state(self, token: int) -> None:
        """state = (n_past, token, draws, sampled) from the host mirrors. The compute stream is
        drained first: the pinned source must not change under a copy still queued."""
        self._sync("state", self.dev.compute)
        self.state_host[:] = (self.n_past, token, self.draws, self.sampled)
        self.dev.copy_async(self.a.state, self.state_host, self.dev.compute)

    def decode(self, token: int) -> np.ndarray:
        """One token through every layer; -> the logits on the host (a pinned buffer, reused).
        The host-sampling path (--ledger, the tests): it syncs once per token."""
        self.check_decode(token)
        self._write_state(token)
        self._forward()
        self.dev.copy_to_host_async(self.logits_host, self.a.logits, self.dev.compute)
        self.weights.stats.d2h_bytes += self.logits_host.nbytes
        self._sync("logits", self.dev.compute)
        self.n_past += 1
        return self.logits_host

    def stream(self, prompt_ids: list[int], opts, max_tokens: int):
        """Prefill, then sample on the device: yields each token as its copy lands in pinned host
        memory, the next step already queued behind it, so the GPU computes while the caller
        prints (the host waits for a token, never for a step before queuing the next). When the
        caller stops early (EOS, a stop string) the step queued ahead is dropped: n_past counts
        the tokens that really ran. (That step's token stays in the device's penalty ring until
        the next sample overwrites it.)"""
        self._use_sampling(opts)
        t0 = perf_counter_ns()
        self.prefill(prompt_ids)
        self.last_prefill_s = (perf_counter_ns() - t0) / 1e9
        if self.n_past + max_tokens > self.ctx:
            max_tokens = self.ctx - self.n_past + 1  # the last token sampled is never fed
        s = self.dev.compute
        self.k.replay(self._graph("sample_first"), s)
        self._queue_token_copy(0)
        start, made, queued = self.n_past, 0, 1
        try:
            while made < max_tokens:
                if queued < max_tokens:  # the step that feeds token queued - 1
                    self._forward()
                    self.k.replay(self._graph("sample_step"), s)
                    self._queue_token_copy(queued)
                    queued += 1
                self._sync("token", self.token_events[made % RECENT])
                token = int(self.token_host[made % RECENT])
                made += 1
                self.n_past = start + made - 1  # token k has run once token k + 1 exists
                yield token
        finally:
            self._sync("drain", s)
            self.n_past = start + max(made - 1, 0)
            self.draws += made
            self.sampled += made
            self.peak_vram_bytes = max(self.peak_vram_bytes, self.dev.used_bytes())

    def _queue_token_copy(self, n: int) -> None:
        slot = n % RECENT
        self.dev.copy_to_host_async(self.token_host[slot:slot + 1], self.a.token, self.dev.compute)
        self.token_events[slot].record(self.dev.compute)
        self.weights.stats.d2h_bytes += 4

    def _use_sampling(self, opts) -> None:
        if opts.repeat_last_n != RECENT:
            raise NervaError(f"the cuda sampler looks back {RECENT} tokens, not {opts.repeat_last_n}")
        if opts != self._sample_opts:  # the options are baked into the sampling graphs
            self._sample_opts = opts
            self._graphs.pop("sample_first", None)
            self._graphs.pop("sample_step", None)

    # -- prefill -------------------------------------------------------------------------------
    def prefill(self, tokens: list[int], all_logits: bool = False) -> np.ndarray:
        """EngineBase.prefill in chunks of PREFILL_CHUNK on the compute stream: weights dequantised
        a slice of rows at a time, cuBLAS GEMMs on f16 operands, f32 sums; out of GPU memory said
        in one line."""
        try:
            with self.dev.on(self.dev.compute):
                out = super().prefill(tokens, all_logits)
                self._write_state(0)  # state[0]: the next position; the token comes from sampling
                self._sync("logits", self.dev.compute)
        except Exception as e:
            if not self.dev.is_out_of_memory(e):
                raise
            raise NervaError(f"out of GPU memory in prefill ({human_bytes(self.dev.free_bytes())} free): "
                             f"another process may hold VRAM; try --vram-budget "
                             f"{human_bytes(int(self.plan.budget * 0.8))}") from None
        self.peak_vram_bytes = max(self.peak_vram_bytes, self.dev.used_bytes())
        return out

    def _last_logits(self, x):
        """The prompt's last row through the final norm and lm_head, by decode's matvec, copied to
        the host buffer (ready once prefill has synced)."""
        self.k.rmsnorm(x, self.final_norm, self.cfg.rms_eps, self.a.xn)
        p = self.head_precision if "w" not in self.head_t else "w4a16"
        self.k.matvec(self.head_t, self.a.xn, self.a.logits, p)
        self._cap_logits(self.a.logits)
        self.dev.copy_to_host_async(self.logits_host, self.a.logits, self.dev.compute)
        return self.logits_host

    def _prefill_chunk(self, tokens: list[int]):
        a, T = self.a, len(tokens)
        self._write_state(0)  # state[0]: the chunk's first position
        ids = self.dev.upload(np.asarray(tokens, dtype=np.int32))
        x = a.px[:T]
        self.k.embed(self.embed_t, ids, x)
        if self.cfg.embed_scale is not None:
            self.k.scale(x, self.cfg.embed_scale)
        for i in self.active:
            self._run_layer(i, lambda L: self._prefill_layer(L, x, T))
        self.n_past += T
        return x

    def _half(self, x, m: dict, precision: str):
        """x [T, cols] f32 as the f16 operand of GEMMs with m (and the other matrices of its layer):
        for W4A8 through the activations' int8 codes, so the GEMM gives the integer kernel's
        products (up to the f16 rounding of each q d)."""
        xh = self.a.phalf.reshape(-1)[: x.size].reshape(x.shape)  # contiguous: T rows of exactly cols
        if precision == "w4a8" and "w" not in m:
            self.k.fake_quantize_q8(x, xh)
        else:
            self.k.to_half(x, xh)
        return xh

    def _dense(self, m: dict, xh, out, add: bool = False) -> None:
        """out [T, rows] (rows may be a column slice) = xh [T, cols] f16 @ W.T (add: out += that),
        by cuBLAS on f16 operands with f32 sums: W as stored if f16, else dequantised to f16 a
        slice of rows at a time (half the bytes of an f32 copy, and tensor cores at f16's rate)."""
        rows, cols = (m["w"].shape if "w" in m else (m["d"].shape[0], xh.shape[1]))
        step = max(1, self.a.scratch.size // cols)
        for r in range(0, rows, step):
            n = min(step, rows - r)
            w = self.k.half_weights({k: v[r:r + n] for k, v in m.items()}, self.a.scratch)
            self.dev.gemm_t(xh, w, out[:, r:r + n], add)

    def _prefill_layer(self, L: DeviceLayer, x, T: int) -> None:
        cfg, a, k, p, t = self.cfg, self.a, self.k, L.precision, L.t
        eps, qd, kvd, f, stride = cfg.rms_eps, cfg.q_dim, cfg.kv_dim, cfg.intermediate_size, cfg.q_dim + 2 * cfg.kv_dim
        xn, qkv = a.pxn[:T], a.pqkv[:T]
        flat = qkv.reshape(-1)  # rows `stride` apart; q, k and v start at offsets 0, qd, qd + kvd
        k.rmsnorm(x, t["attn_norm"], eps, xn)
        xh = self._half(xn, L.mat("q"), p)
        for name, lo, hi in (("q", 0, qd), ("k", qd, qd + kvd), ("v", qd + kvd, stride)):
            self._dense(L.mat(name), xh, qkv[:, lo:hi])
            if f"{name}_bias" in t:
                qkv[:, lo:hi] += t[f"{name}_bias"]
        if "q_norm" in t:
            for lo, hi, w in ((0, qd, t["q_norm"]), (qd, qd + kvd, t["k_norm"])):
                part = qkv[:, lo:hi].copy()
                k.rmsnorm(part, w, eps, part)
                qkv[:, lo:hi] = part
        kc, vc, spec = *a.kv[L.index], self.specs[L.index]
        k.rope_kv_store(flat, flat[qd:], flat[qd + kvd:], stride, a.pos, spec.cos, spec.sin, T,
                        cfg.num_heads, kc, vc)
        attn = a.pattn[:T]
        window = spec.window
        seen = self.n_past + T if not window else min(self.n_past, window) + T  # positions a query block reads, at most
        splits = prefill_splits(T, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, seen, self.dev.sms)
        k.attention_prefill(flat, stride, kc, vc, a.pos, attn, T, cfg.num_heads, splits, a.ppart, a.pdone,
                            window, spec.softcap)
        self._residual(L.mat("o"), self._half(attn, L.mat("o"), p), x, xn, t.get("post_attn_norm"))
        k.rmsnorm(x, t["mlp_norm"], eps, xn)
        gu = a.pgate_up[:T]
        xh = self._half(xn, L.mat("gate"), p)
        self._dense(L.mat("gate"), xh, gu[:, :f])
        self._dense(L.mat("up"), xh, gu[:, f:])
        act = a.pact[:T]
        (k.gelu_mul if spec.gelu else k.silu_mul)(gu, act, f, T)
        self._residual(L.mat("down"), self._half(act, L.mat("down"), p), x, xn, t.get("post_mlp_norm"))

    def _residual(self, m: dict, xh, x, tmp, post_norm) -> None:
        """x += xh @ W.T (the residual add in the GEMM), or where post_norm is given (Gemma 3's)
        x += rmsnorm(xh @ W.T) * post_norm, the product made in tmp."""
        if post_norm is None:
            self._dense(m, xh, x, add=True)
            return
        self._dense(m, xh, tmp)
        self.k.rmsnorm(tmp, post_norm, self.cfg.rms_eps, tmp)
        x += tmp

    def _logits_rows(self, x) -> np.ndarray:
        xn = self.dev.empty(x.shape, np.float32)
        self.k.rmsnorm(x, self.final_norm, self.cfg.rms_eps, xn)
        p = self.head_precision
        out = self.dev.empty((x.shape[0], self.cfg.vocab_size), np.float32)
        self._dense(self.head_t, self._half(xn, self.head_t, p), out)
        self._cap_logits(out)
        return self.dev.download(out)

    def count_hot_path_allocations(self, prompt: list[int], steps: int) -> int:
        """Device allocations (the CuPy pool's malloc, counted) plus host ones (AllocationCounter)
        during `steps` streamed, graph-replayed decode steps after warm-up. Anything > 0 is a bug."""
        from nerva_cli.runtime.hotpath import AllocationCounter
        from nerva_cli.runtime.sampling import SamplingOptions

        self.reset()
        tokens = self.stream(prompt, SamplingOptions(temperature=0.0), steps + 3)
        try:
            for _ in range(3):  # warm-up: the graphs are captured on first use
                next(tokens)
            with self.dev.count_allocations() as device, AllocationCounter() as host:
                for _ in range(steps):
                    with host.step():
                        next(tokens)
        finally:
            tokens.close()
        self.reset()
        return device[0] + host.count
