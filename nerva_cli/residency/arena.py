"""The engine's buffers, made once: Arena holds what decode touches, PrefillWorkspace what a
prompt chunk does. Each says its size without allocating, so the residency plan (and `nerva
topology --model`) counts exactly the bytes `run` will make."""

from __future__ import annotations

from math import prod

import numpy as np

from nerva_cli.planes.ref import attention_decode_partials, attention_prefill_work
from nerva_cli.model.config import ModelConfig
from nerva_cli.errors import UsageError
from nerva_cli.model.quant import QK

KV_CACHE_TYPES = {"f16": np.float16, "f32": np.float32}
# Positions a sliding-window layer's cache keeps beyond its window and a prompt chunk, so that a
# chat can take back this many of its latest positions (a turn's re-rendered end) and keep the rest
ROLLBACK = 64


def cache_rows(cfg: ModelConfig, ctx: int, chunk: int) -> list[int]:
    """Each layer's KV cache rows: the context, or for a sliding-window layer whose window, a
    prompt chunk and ROLLBACK positions are fewer, those. The cpu engine keeps the positions it
    attends over at the front, moving them down when the rows run out (Engine._make_room), so
    its attention reads one run of rows; the cuda plane's kernels put position p in row p % rows,
    as a replayed decode graph, which reads the position on the device, cannot stop for a host
    move. Gemma 3 1B at 32768 tokens: 22 of its 26 layers hold 832 rows on the cpu (chunks of
    256), 1088 on the GPU (512)."""
    if not cfg.sliding_layers:
        return [ctx] * cfg.num_layers
    ring = cfg.sliding_window + ROLLBACK + chunk
    return [ring if i in cfg.sliding_layers and ring < ctx else ctx for i in range(cfg.num_layers)]


def kv_cache_type(kv_cache: str):
    """--kv-cache's dtype, or the one-line error that names the choices."""
    if kv_cache not in KV_CACHE_TYPES:
        raise UsageError(f"--kv-cache {kv_cache}: choose one of {', '.join(KV_CACHE_TYPES)}")
    return KV_CACHE_TYPES[kv_cache]


class Arena:
    """Every buffer decode touches, allocated once (llama2.c's RunState). The KV cache is f16 by
    default, as llama.cpp's and the GPU plane's: half the bytes that long-context decode streams
    and that a RAM budget must hold, for one rounding (2^-11 relative) of each cached value.

    `seq_slots` sequences each have a KV cache of their own: a layer's caches are one array
    [seq_slots, rows, kv_heads, head_dim], slot s's its [s] (contiguous, as one sequence's was),
    with its own sliding-window base (kv_bases[s]). k_cache, v_cache and kv_base are the selected
    slot's (select), which decode and prefill read; a batched decode step reads each row's own.
    With more than one slot the arena also holds the batch's logits and positions."""

    def __init__(self, cfg: ModelConfig, ctx: int, kv_cache: str = "f16", chunk: int = 0, seq_slots: int = 1):
        h, f = cfg.hidden_size, cfg.intermediate_size
        z = lambda *shape: np.zeros(shape, dtype=np.float32)  # noqa: E731
        self.x, self.xn = z(h), z(h)
        q, kv = cfg.q_dim, cfg.kv_dim
        self.qkv = z(q + 2 * kv)  # the fused projection's output; q, k, v are views into it
        self.q = self.qkv[:q].reshape(cfg.num_heads, cfg.head_dim)
        self.k = self.qkv[q:q + kv].reshape(cfg.num_kv_heads, cfg.head_dim)
        self.v = self.qkv[q + kv:].reshape(cfg.num_kv_heads, cfg.head_dim)
        self.attn, self.o = z(cfg.num_heads, cfg.head_dim), z(h)
        self.gate_up, self.act, self.down = z(2 * f), z(f), z(h)
        self.gate, self.up = self.gate_up[:f], self.gate_up[f:]
        self.q_flat, self.k_flat, self.v_flat = self.qkv[:q], self.qkv[q:q + kv], self.qkv[q + kv:]
        self.logits = z(cfg.vocab_size)
        widest = max(h, f, cfg.q_dim)
        self.xq = np.zeros(widest, dtype=np.int8)
        self.xd = z(widest // QK)
        self.xs = np.zeros(widest // QK, dtype=np.int32)
        self.pos = np.zeros(1, dtype=np.int64)
        # per slot, the position in the first row of a sliding layer's cache; views made once
        self.kv_bases = np.zeros(seq_slots, dtype=np.int64)
        self.kv_base_slots = [self.kv_bases[s:s + 1] for s in range(seq_slots)]
        # views made once: a view made per call is a Python object per call on the hot path
        self.attn_flat = self.attn.reshape(-1)
        self.q_rows = self.q.reshape(1, cfg.num_heads, cfg.head_dim)
        self.k_rows = self.k.reshape(1, cfg.num_kv_heads, cfg.head_dim)
        self.xn_row, self.down_row = self.xn.reshape(1, h), self.down.reshape(1, h)  # a mixture's MLP takes rows
        self.act_q8 = {n: (self.xq[:n], self.xd[: n // QK], self.xs[: n // QK])
                       for n in {h, f, cfg.q_dim}}
        # Q16 codes: the W8A16 lm_head's activation (hidden wide, its scales xd16) and, where the
        # cpu's W4A16 takes Q16 codes, every layer matvec's (their scales and sums in xd, xs)
        self.xq16, self.xd16 = np.zeros(widest, dtype=np.int16), z(h // QK)
        self.act_q16 = {h: (self.xq16[:h], self.xd16)}
        # decode attention's split partials, a sequence's each (a batched step's rows in one call),
        # and its rows' slots, first cache rows and row counts (row 0's for decode alone)
        self.att_part = z(seq_slots, *attention_decode_partials(ctx, cfg.num_heads, cfg.head_dim))
        self.att_slots, self.att_firsts, self.att_rows = (np.zeros(seq_slots, dtype=np.int64) for _ in range(3))
        self.att_one = (self.att_slots[:1], self.att_firsts[:1], self.att_rows[:1])
        self.attn_rows = self.attn.reshape(1, cfg.num_heads, cfg.head_dim)
        kv_type = kv_cache_type(kv_cache)
        rows = cache_rows(cfg, ctx, chunk)
        self.k_all = [np.zeros((seq_slots, n, cfg.num_kv_heads, cfg.head_dim), kv_type) for n in rows]
        self.v_all = [np.zeros((seq_slots, n, cfg.num_kv_heads, cfg.head_dim), kv_type) for n in rows]
        self.k_slots = [[c[s] for c in self.k_all] for s in range(seq_slots)]  # slot -> layer -> its cache
        self.v_slots = [[c[s] for c in self.v_all] for s in range(seq_slots)]
        if seq_slots > 1:  # a batched decode step's (its other buffers are the prefill workspace's)
            self.batch_logits = z(seq_slots, cfg.vocab_size)
            self.batch_pos = np.zeros(seq_slots, dtype=np.int64)
        self.select(0)

    def select(self, slot: int) -> None:
        """Makes slot `slot`'s KV cache and base the ones k_cache, v_cache and kv_base name."""
        self.slot = slot
        self.k_cache, self.v_cache = self.k_slots[slot], self.v_slots[slot]
        self.kv_base = self.kv_base_slots[slot]

    @property
    def seq_slots(self) -> int:
        return self.kv_bases.shape[0]

    @property
    def kv_bytes(self) -> int:
        return sum(a.nbytes for a in self.k_all + self.v_all)

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in vars(self).values() if isinstance(v, np.ndarray) and v.base is None) \
            + self.kv_bytes

    @staticmethod
    def sizes(cfg: ModelConfig, ctx: int, kv_cache: str = "f16", chunk: int = 0, seq_slots: int = 1) -> tuple[int, int]:
        """(kv_bytes, nbytes) of the arena __init__ would make, without making it."""
        h, f = cfg.hidden_size, cfg.intermediate_size
        widest = max(h, f, cfg.q_dim)
        f32 = (2 * h + cfg.q_dim + 2 * cfg.kv_dim + cfg.num_heads * cfg.head_dim + h + 3 * f + h
               + cfg.vocab_size + widest // QK + h // QK)  # ... xd, xd16
        kv = seq_slots * sum(cache_rows(cfg, ctx, chunk)) * 2 * cfg.num_kv_heads * cfg.head_dim * \
            np.dtype(kv_cache_type(kv_cache)).itemsize
        f32 += seq_slots * prod(attention_decode_partials(ctx, cfg.num_heads, cfg.head_dim))
        batch = seq_slots * (4 * cfg.vocab_size + 8) if seq_slots > 1 else 0  # batch_logits, batch_pos
        # + xq (int8), xs (int32), xq16 (int16), pos, kv_bases and the attention's rows (int64)
        return kv, 4 * f32 + widest + 4 * (widest // QK) + 2 * widest + 8 + 4 * 8 * seq_slots + batch + kv


# Prefill's GEMMs dequantise weight rows into f32 in this scratch, a slice a thread (at most the
# cpu backend's GEMM_SLICE_BYTES each, or its GEMM_MIN_ROWS rows of a wide matrix: 4 MB at
# 16384 columns), each slice's GEMM following while it is still in cache
# (a whole 8B-class gate/up matrix is 470 MB). When one GEMM took a whole slice on OpenBLAS's
# threads, 8 MB slices were the fastest of those tried (docs/perf/code_figures.md).
DEQUANT_SLICE_BYTES = 8 << 20


def scratch_elements(cfg: ModelConfig) -> int:
    """Prefill's dequantisation scratch in f32 elements: DEQUANT_SLICE_BYTES, or the largest
    matrix (lm_head and the fused ones included) when that is smaller."""
    h, f = cfg.hidden_size, cfg.widest_mlp
    largest = max(cfg.vocab_size * h, (cfg.q_dim + 2 * cfg.kv_dim) * h, 2 * f * h, h * cfg.q_dim)
    return min(largest, max(DEQUANT_SLICE_BYTES // 4, f, cfg.q_dim))  # a row of any matrix fits


class PrefillWorkspace:
    """Every buffer prefill writes for a chunk of up to `rows` prompt tokens over a cache of
    `ctx` positions: the chunk's hidden states and each projection's output, W4A8's
    fake-quantised activations (or, for a short chunk, their codes), attention_prefill's work,
    and the slice of weight rows each GEMM reads, dequantised (scratch_elements). A prompt then
    allocates nothing per layer, and its memory is in the plan; pages a short prompt never
    reaches are never touched. A batched decode step of up to `batch` sequences takes its rows'
    hidden states, projections and activation codes from the same buffers (the two never run at
    once), so they hold max(rows, batch) rows, and with batch > 1 the int16 codes of the W8A16
    lm_head's activations too."""

    def __init__(self, cfg: ModelConfig, rows: int, ctx: int, batch: int = 1):
        self.rows = rows
        self.bufs = {name: np.empty(n, dtype) for name, (n, dtype) in self.layout(cfg, rows, ctx, batch).items()}
        self.iota = self.bufs["iota"]  # 0..rows-1: a chunk's positions are start + these
        self.iota[:] = np.arange(rows)

    @staticmethod
    def layout(cfg: ModelConfig, rows: int, ctx: int, batch: int = 1) -> dict[str, tuple[int, type]]:
        h, f, q, kv, R = cfg.hidden_size, cfg.widest_mlp, cfg.q_dim, cfg.kv_dim, max(rows, batch)
        # a mixture of experts' MLP, a token's rows gathered an expert at a time (planes/cpu/experts.py)
        moe = {"router": R * cfg.num_experts, "moe_x": R * h, "moe_y": R * h,
               "expert_weights": R * cfg.experts_per_token} if cfg.num_experts else {}
        f32 = {"x": R * h, "xn": R * h, "qkv": R * (q + 2 * kv), "q": R * q, "k": R * kv, "attn": R * q,
               "proj": R * h,  # o's and down's outputs, before the residual add
               "gate_up": 2 * R * f, "act": R * f, **moe,
               "xq": rows * max(h, q, f),
               "attention": attention_prefill_work(rows, ctx, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
               "dequant": scratch_elements(cfg)}
        widest = max(h, q, f)  # the integer kernels' activations (W4A8 takes them for a whole chunk)
        codes16 = {"codes16": (batch * h, np.int16), "code16_scales": (batch * h // QK, np.float32)} if batch > 1 else {}
        return {**{k: (n, np.float32) for k, n in f32.items()}, "pos": (R, np.int64), "iota": (rows, np.int64),
                "codes": (R * widest, np.int8), "code_scales": (R * widest // QK, np.float32),
                "code_sums": (R * widest // QK, np.int32), **codes16,
                **({"expert_ids": (R * cfg.experts_per_token, np.int64)} if cfg.num_experts else {})}

    @classmethod
    def size(cls, cfg: ModelConfig, rows: int, ctx: int, batch: int = 1) -> int:
        return sum(n * np.dtype(t).itemsize for n, t in cls.layout(cfg, rows, ctx, batch).values())

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.bufs.values())

    def take(self, name: str, *shape: int) -> np.ndarray:
        """The front of buffer `name` as a contiguous array of `shape`."""
        buf = self.bufs[name]
        if prod(shape) > buf.size:
            raise ValueError(f"prefill workspace: {name} holds {buf.size} elements, {shape} asked")
        return buf[: prod(shape)].reshape(shape)
