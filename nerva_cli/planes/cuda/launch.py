"""The cuda backend: the kernel contract of planes/ref.py over device arrays, launched from
kernels/*.cu, and the one place that talks to CuPy.

`Kernels` computes every launch's grid, block and typed arguments; `CupyDevice` is what it runs
on: arrays, streams, events, graphs and copies. The tests drive the same `Kernels` through a CPU
emulation of the same CUDA sources (tests/cuda_emu), so launch shapes, argument order and types
are checked without a GPU. Scalars go to kernels as numpy int32/float32: CuPy passes a Python
int as 64 bits and a float as a double, which a kernel taking `int`/`float` would misread.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import numpy as np

from nerva_cli.planes.cuda import nvrtc as kernels
from nerva_cli.planes.cuda.dependent_launch import dependent_launcher
from nerva_cli.errors import NervaError
from nerva_cli.model.quant import QK

I32, F32 = np.int32, np.float32
THREADS = 256  # elementwise and norm blocks
MV_THREADS, MV_ROWS = 128, 8  # matvecs: most threads splitting K, rows per block (matvec.cu)
GROUPS_PER_BLOCK = THREADS // 32  # prefill's activation quantiser: one warp per 32-group
ATT_THREADS = 128  # attention: 4 warps (ATT_WARPS in attention.cu)
ATT_BLOCKS_PER_SM = 5  # attention.cu's launch bounds
ATT_LONG_CHUNK = 16  # ATT_LONG_CHUNK in attention.cu
ATT_GROUP = 4  # ATT_GROUP in attention.cu: query heads a decode block takes at most
PF_MAX_SPLITS = 32  # prefill attention: blocks dividing a row block's positions (combine_splits merges a warp's worth)
PF_MIN_SPLIT_TILES = 4  # prefill attention: fewest 32-position tiles a split takes
SAMPLE_THREADS = 1024
NORM_VEC = 4  # float4s a norm thread holds (norm.cu)
EXACT_PER_LOAD = 8  # f16 or bf16 weights an exact matvec reads a 16-byte load (matvec.cu)
MAX_HEAD_DIM = 256  # MAX_HEAD_DIM in common.cuh
RECENT = 64  # tokens the repetition penalty looks back on (the CPU sampler's repeat_last_n)


def _attention_kernel(name: str, window: int, softcap: float) -> str:
    """attention.cu's kernel for a layer: its _gemma one where the layer has a window (whose cache
    may be a ring of rows) or capped scores, else the plain one, compiled without either."""
    return f"{name}_gemma" if window > 0 or softcap > 0 else name


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _weights(m: dict):
    """A matrix's weight array: Q4_0/Q4_1/Q8_0 codes or exact f16/bf16 values."""
    return m["w"] if "w" in m else m["q8"] if "q8" in m else m["qs"]


def _cols(m: dict) -> int:
    """A matrix's row length: Q4 codes hold two weights a byte."""
    return _weights(m).shape[1] * (2 if "qs" in m else 1)


def _quant_kernel(m: dict) -> str:
    """The stem of a quantised matrix's kernels: q4 (Q4_0: {"qs", "d"}), q4_1 (with offsets "m")
    or q8_0 ({"q8", "d"}: the Q4 variants' token table)."""
    return "q8_0" if "q8" in m else "q4_1" if "m" in m else "q4"


def _planes(m: dict) -> tuple:
    """A quantised matrix's planes in its kernels' parameter order: codes, scales, offsets."""
    return (_weights(m), m["d"], *((m["m"],) if "m" in m else ()))


def unsupported_shapes(cfg) -> str | None:
    """Why kernels/*.cu cannot run a model of cfg's shapes, or None. Matvec rows are whole Q4
    blocks of 32 (a Q4 variant keeps a matrix whose rows are not f16, layout.stored_format) or f16
    or bf16 weights read EXACT_PER_LOAD to a 16-byte load, so every width is a multiple of that.
    Attention holds at most MAX_HEAD_DIM elements of a head, ceil(head_dim / 32) a lane, and loads
    a lane's elements as one word when they are 2, 4 or 8: rows start head_dim elements apart, so
    that word is aligned to its size (a misaligned load faults on a GPU) only when the count
    divides head_dim, as it does for every head dim of the supported families."""
    hd, widths = cfg.head_dim, (cfg.hidden_size, cfg.intermediate_size, cfg.q_dim)
    if any(w % EXACT_PER_LOAD for w in widths):
        return (f"the cuda kernels need widths that are multiples of {EXACT_PER_LOAD} (hidden, intermediate, "
                f"q: {widths})")
    if hd > MAX_HEAD_DIM:
        return f"head_dim {hd}: the cuda attention kernels hold at most {MAX_HEAD_DIM}"
    per_lane = _cdiv(hd, 32)
    if per_lane in (2, 4, 8) and hd % per_lane:
        return (f"head_dim {hd}: the cuda attention kernels need a multiple of {per_lane} for head dims "
                f"{32 * per_lane - 31} to {32 * per_lane}")
    return None


def prefill_block_rows(hd: int) -> int:
    """(query, head) rows a prefill attention block takes (attention.cu): 8 a warp up to 128-wide
    heads, 2 above."""
    return (ATT_THREADS // 32) * (8 if _cdiv(hd, 32) <= 4 else 2)


def prefill_row_blocks(T: int, heads: int, kv_heads: int, hd: int) -> int:
    """Prefill attention's blocks of rows for T queries, all kv heads (its grid's x times y)."""
    return _cdiv(T * (heads // kv_heads), prefill_block_rows(hd)) * kv_heads


def prefill_splits(T: int, heads: int, kv_heads: int, hd: int, n: int, sms: int) -> int:
    """Blocks that divide each prefill attention block's positions, for T queries of which the
    last sees n positions: enough to fill the GPU twice over when the row blocks alone do not (a
    32-token turn after 4064 tokens of an 8B model is 32 row blocks on an H100's 132 SMs), none
    with fewer than PF_MIN_SPLIT_TILES tiles of 32 positions."""
    blocks = prefill_row_blocks(T, heads, kv_heads, hd)
    return max(1, min(PF_MAX_SPLITS, _cdiv(2 * sms, blocks), _cdiv(n, 32) // PF_MIN_SPLIT_TILES))


def prefill_partials(T: int, heads: int, kv_heads: int, hd: int, splits: int) -> int:
    """Floats of attention_prefill's partials with `splits` splits: [m, l, acc[hd]] a row a split."""
    return prefill_row_blocks(T, heads, kv_heads, hd) * prefill_block_rows(hd) * splits * (hd + 2)


def most_prefill_partials(heads: int, kv_heads: int, hd: int, sms: int, chunk: int) -> tuple[int, int]:
    """(floats of partials, counts) enough for any pass of up to `chunk` tokens at its
    prefill_splits (taken without their cap by context length: an upper bound)."""
    floats = counts = 0
    for T in range(1, chunk + 1):
        blocks = prefill_row_blocks(T, heads, kv_heads, hd)
        splits = min(PF_MAX_SPLITS, _cdiv(2 * sms, blocks))
        if splits > 1:
            floats, counts = max(floats, prefill_partials(T, heads, kv_heads, hd, splits)), max(counts, blocks)
    return floats, counts


def mv_threads(units: int) -> int:
    """Threads of a matvec block whose rows are `units` 16-byte loads long: a warp per 32 of
    them, up to MV_THREADS, so short rows (a 576-wide model's) leave no warp idle."""
    return min(MV_THREADS, 32 * _cdiv(units, 32))


def norm_threads(n: int) -> int:
    """Threads of a norm block: each holds up to NORM_VEC float4s of the row (norm.cu)."""
    if n % 4 or n > 4 * NORM_VEC * 1024:
        raise NervaError(f"rmsnorm rows of {n} floats: the cuda kernel needs a multiple of 4, at most "
                         f"{4 * NORM_VEC * 1024}")
    return 32 * _cdiv(n, 4 * NORM_VEC * 32)


def is_bf16(a) -> bool:
    """Exact-variant tensors: f16 as float16, bf16 as its uint16 bits (store.DTYPES)."""
    return a.dtype == np.uint16


class CapturedGraph:
    """A device graph and the number of kernels captured in it."""

    __slots__ = ("graph", "kernels")

    def __init__(self, graph, kernels: int):
        self.graph, self.kernels = graph, kernels


class Kernels:
    """One method per kernel of the contract; every launch goes through device.launch."""

    def __init__(self, device, counters=None):
        """counters: the engine's (planes/base.py), into which every launch and replay counts."""
        from nerva_cli.planes.base import Counters

        self.dev = device
        self.fn = device.functions()
        self._no_count = device.zeros(1, np.int32)  # a matvec's norm counter when it has no norm
        self.counters = Counters() if counters is None else counters

    def _go(self, name: str, grid, block, args) -> None:
        self.counters.kernels += 1
        self.counters.dispatches += 1
        self.dev.launch(self.fn[name], grid, block, args)

    # -- norms, elementwise --------------------------------------------------------------------
    def rmsnorm(self, x, w, eps: float, out) -> None:
        """Rows of w.shape[0] elements; out may be x."""
        n = w.shape[0]
        self._go("rmsnorm", (x.size // n,), (norm_threads(n),), (x, w, F32(eps), out, I32(n)))

    def embed(self, table: dict, tokens, out) -> None:
        """out [T, cols] = rows tokens [T] (device int32) of table: {"qs", "d"} (Q4_0), {"qs", "d",
        "m"} (Q4_1), {"q8", "d"} (Q8_0) or {"w"}."""
        cols, grid = out.shape[-1], (_cdiv(out.shape[-1], THREADS), tokens.shape[0])
        if "w" not in table:
            self._go(f"embed_{_quant_kernel(table)}", grid, (THREADS,), (*_planes(table), tokens, out, I32(cols)))
        else:
            w = table["w"]
            self._go("embed_exact", grid, (THREADS,), (w, I32(is_bf16(w)), tokens, out, I32(cols)))

    def rope_kv_store(self, q, k, v, stride: int, pos0, cos, sin, T: int, heads: int, k_cache, v_cache) -> None:
        """Rotates q (in place) and k for tokens at positions pos0[0] + t and stores k and v in f16
        at those cache rows. q, k, v: T rows `stride` floats apart; caches [rows, kv_heads, hd],
        position p in row p % rows (every kernel's: a sliding-window layer's cache holds fewer
        rows than the context, arena.cache_rows)."""
        half, kv_heads = cos.shape[1], k_cache.shape[-2]
        self._go("rope_kv_store", (_cdiv(T * (heads + kv_heads) * half, THREADS),), (THREADS,),
                 (q, k, v, I32(stride), pos0, cos, sin, I32(T), I32(heads), I32(kv_heads), I32(half), k_cache, v_cache,
                  I32(k_cache.shape[0])))

    def silu_mul(self, gate_up, out, f: int, T: int) -> None:
        self._go("silu_mul", (_cdiv(T * f, THREADS),), (THREADS,), (gate_up, out, I32(f), I32(T)))

    def gelu_mul(self, gate_up, out, f: int, T: int) -> None:
        """silu_mul with GeLU's tanh form (GeGLU)."""
        self._go("gelu_mul", (_cdiv(T * f, THREADS),), (THREADS,), (gate_up, out, I32(f), I32(T)))

    def scale(self, x, s: float) -> None:
        """x *= s, every element."""
        self._go("scale", (_cdiv(x.size, THREADS),), (THREADS,), (x, F32(s), I32(x.size)))

    def softcap(self, x, c: float) -> None:
        """x = c tanh(x / c), every element (Gemma 2's final logits)."""
        self._go("softcap", (_cdiv(x.size, THREADS),), (THREADS,), (x, F32(c), I32(x.size)))

    def add_rows(self, x, b, T: int) -> None:
        """x [T, n] += b [n] for every row."""
        n = b.shape[0]
        self._go("add_rows", (_cdiv(T * n, THREADS),), (THREADS,), (x, b, I32(n), I32(T)))

    # -- matvecs -------------------------------------------------------------------------------
    def matvec(self, m: dict, x, out, precision: str, add: bool = False, norm=None) -> None:
        """out = W x, or out += W x with add (the residual add, fused into the store). m: {"qs",
        "d"} (Q4_0), {"qs", "d", "m"} (Q4_1), {"q8", "d"} (Q8_0) or {"w"}; x f32 at every precision
        (w4a8 quantises it in the kernel). norm = (w, xn, eps, done), with add: then xn = rmsnorm(out) * w, by the
        launch's last block (matvec.cu's ADD_NORM; done: an int32 counter, zero before and after)."""
        self.matvecs([m], x, [out], precision, add, norm)

    def matvecs(self, ms: list[dict], x, outs: list, precision: str, add: bool = False, norm=None) -> None:
        """outs[i] = W_i x (+= with add) for up to three matrices of the same width, in one launch
        (a layer's q, k and v)."""
        if not 1 <= len(ms) <= 3 or len(ms) != len(outs):
            raise ValueError(f"matvecs takes 1 to 3 matrices with an output each, got {len(ms)}, {len(outs)}")
        if norm is not None and (not add or len(ms) != 1 or _weights(ms[0]).shape[0] % 4):
            raise ValueError("matvecs: a norm follows the residual add of a single matrix of 4k rows")
        blocks = sum(_cdiv(_weights(m).shape[0], MV_ROWS) for m in ms)
        mode = 2 if norm is not None else 1 if add else 0  # ADD_NORM, ADD, STORE (matvec.cu)
        self._matvec_launch("matvec", ms, outs, x, precision, mode, norm, blocks)

    def glu(self, gate: dict, up: dict, x, out, precision: str, gelu: bool = False) -> None:
        """out = silu(gate x) * up x (gelu: GeLU's tanh form) in one launch: a block computes rows
        of both (matvec.cu)."""
        rows = _weights(gate).shape[0]
        if _weights(up).shape != _weights(gate).shape:
            raise ValueError(f"glu: gate {_weights(gate).shape} and up {_weights(up).shape} differ")
        self._matvec_launch("glu", [gate, up], [out, out], x, precision, int(gelu), None,  # GLU_GELU
                            _cdiv(rows, MV_ROWS // 2))

    def _matvec_launch(self, kind: str, ms: list[dict], outs: list, x, precision: str, mode: int, norm,
                       blocks: int) -> None:
        exact = "w" in ms[0]
        if len({_cols(m) for m in ms}) != 1:
            raise ValueError("matvecs: the matrices of one launch must have the same width")
        if len({"w" if "w" in m else _quant_kernel(m) for m in ms}) != 1:
            raise ValueError("matvecs: the matrices of one launch must be of one format")
        mats = [(_weights(m), _weights(m) if exact else m["d"], out, I32(_weights(m).shape[0]))  # exact: no scales
                for m, out in zip(ms, outs)]
        mats += [(*mats[0][:3], I32(0))] * (3 - len(mats))  # absent: 0 rows
        flat = tuple(a for mat in mats for a in mat)
        norm_w, xn, eps, done = norm if norm is not None else (outs[0], outs[0], 0.0, self._no_count)  # unused
        tail = (I32(mode), norm_w, xn, F32(eps), done)
        w = mats[0][0]
        if exact:
            cols = w.shape[1]
            self._go(f"{kind}_exact", (blocks,), (mv_threads(cols // EXACT_PER_LOAD),),
                     (*flat, I32(is_bf16(w)), x, I32(cols), *tail))
            return
        cols, stem = _cols(ms[0]), _quant_kernel(ms[0])
        if stem == "q8_0" and kind == "glu":
            raise ValueError("glu: Q8_0 matrices (token tables) have plain launches only")
        bits = "w8" if stem == "q8_0" else "w4"
        body = f"{stem}_{bits}{'a8' if precision == 'w4a8' else 'a16'}"
        offsets = [m["m"] for m in ms] + [ms[0]["m"]] * (3 - len(ms)) if "m" in ms[0] else []  # Q4_1's, last
        self._go(f"{kind}_{body}", (blocks,), (mv_threads(cols // QK),), (*flat, x, I32(cols), *tail, *offsets))

    # -- prefill's GEMM operands, in f16 (CupyDevice.gemm_t) -------------------------------------
    def to_half(self, x, out) -> None:
        """out f16 = x f32, same shape, both contiguous."""
        self._go("to_half", (_cdiv(x.size, THREADS),), (THREADS,), (x, out, np.int64(x.size)))

    def fake_quantize_q8(self, x, out) -> None:
        """out f16 = x [.., a multiple of 32] through W4A8's activation codes and scales."""
        groups = x.size // QK
        self._go("fake_quantize_q8", (_cdiv(groups, GROUPS_PER_BLOCK),), (THREADS,), (x, out, np.int64(x.size)))

    def half_weights(self, m: dict, scratch):
        """A weight matrix (or a slice of its rows) as f16 [rows, cols]: f16 weights as stored,
        bf16, Q4_0, Q4_1 and Q8_0 converted into scratch (f16, at least rows x cols). -> that array."""
        if "w" in m:
            w = m["w"]
            if not is_bf16(w):
                return w
            out = scratch[: w.size].reshape(w.shape)
            self._go("bf16_to_half", (_cdiv(w.size, THREADS),), (THREADS,), (w, out, np.int64(w.size)))
            return out
        rows, cols = _weights(m).shape[0], _cols(m)
        out = scratch[: rows * cols].reshape(rows, cols)
        blocks = rows * cols // QK  # a thread each
        kernel = f"dequantize_{_quant_kernel(m)}"
        self._go(kernel, (_cdiv(blocks, THREADS),), (THREADS,), (*_planes(m), out, I32(blocks)))
        return out

    # -- attention -----------------------------------------------------------------------------
    def attention_decode(self, q, k, v, cos, sin, k_cache, v_cache, pos, part, done, out, heads: int,
                         splits: tuple[int, int], window: int = 0, softcap: float = 0.0) -> None:
        """The new token at position pos[0]: q [heads, hd], k and v [kv_heads, hd] before RoPE
        (rotated here; k and v stored in f16 at that cache row), attending over pos[0] + 1
        positions (the last `window` of them, where not 0), its scores capped where softcap > 0
        (ref.capped). caches [rows, kv_heads, hd] f16 (as rope_kv_store's);
        splits: (least, most) blocks over the context
        for each set of query heads a block takes (attention_splits over decode_blocks); part: the
        split partials [heads, most, hd + 2]; done: int32 [decode_blocks], zero, and zero again
        after; out [heads, hd]."""
        kv_heads, hd = k_cache.shape[-2], k_cache.shape[-1]
        least, most = splits
        if not 1 <= least <= most <= 32:
            raise ValueError(f"attention_decode: splits must be 1 <= least <= most <= 32 (a warp merges them), "
                             f"got {splits}")
        self._go(_attention_kernel("attention_decode", window, softcap), (decode_blocks(heads, kv_heads, hd), most),
                 (ATT_THREADS,),
                 (q, k, v, cos, sin, k_cache, v_cache, I32(k_cache.shape[0]), pos, part, done, out, I32(heads),
                  I32(kv_heads), I32(decode_heads_per_block(heads, kv_heads, hd)), I32(hd), F32(1.0 / np.sqrt(hd)),
                  I32(least), I32(window), F32(softcap)))

    def attention_prefill(self, q, q_stride: int, k_cache, v_cache, pos0, out, T: int, heads: int, splits: int = 1,
                          part=None, done=None, window: int = 0, softcap: float = 0.0) -> None:
        """Causal: query t [T rows q_stride floats apart, heads x hd first] at position pos0[0] + t
        over the f16 caches [rows, kv_heads, hd] (as rope_kv_store's; at least window + T - 1
        rows where window > 0), the last `window` positions where not 0, scores capped where
        softcap > 0 -> out [T, heads, hd]; a block takes prefill_block_rows(hd) (query, head)
        rows of one kv group, and `splits` blocks divide its positions (prefill_splits). More
        than one needs part, room for prefill_partials floats, and done, int32 [row blocks x
        kv_heads], zero (and zero again after)."""
        kv_heads, hd = k_cache.shape[-2], k_cache.shape[-1]
        blocks, floats = prefill_row_blocks(T, heads, kv_heads, hd), prefill_partials(T, heads, kv_heads, hd, splits)
        if not 1 <= splits <= PF_MAX_SPLITS:
            raise ValueError(f"attention_prefill: splits must be 1..{PF_MAX_SPLITS} (a warp merges them), got {splits}")
        if splits > 1 and (part is None or done is None or part.size < floats or done.size < blocks):
            raise ValueError(f"attention_prefill: {splits} splits need part of {floats} floats and done of "
                             f"{blocks} counts")
        grid = (blocks // kv_heads, kv_heads, splits)
        self._go(_attention_kernel("attention_prefill", window, softcap), grid, (ATT_THREADS,),
                 (q, I32(q_stride), k_cache, v_cache, I32(k_cache.shape[0]), pos0, out, part if splits > 1 else out,
                  done if splits > 1 else pos0, I32(T), I32(heads), I32(kv_heads), I32(hd), F32(1.0 / np.sqrt(hd)),
                  I32(window), F32(softcap)))

    # -- graphs: a replay counts the kernels captured in it, as one dispatch ----------------------
    def capture(self, stream, record) -> "CapturedGraph":
        """record() captured on `stream` as a graph; its launches count when it is replayed."""
        c = self.counters
        kernels, dispatches = c.kernels, c.dispatches
        graph = self.dev.capture(stream, record)
        captured = CapturedGraph(graph, c.kernels - kernels)
        c.kernels, c.dispatches = kernels, dispatches
        return captured

    def replay(self, captured: "CapturedGraph", stream) -> None:
        self.counters.kernels += captured.kernels
        self.counters.dispatches += 1
        self.dev.replay(captured.graph, stream)

    # -- sampling ------------------------------------------------------------------------------
    def sample(self, logits, state, recent, opts, advance: bool) -> None:
        """Samples into state[1] (see sample.cu); advance moves state[0] on by one."""
        seed = np.random.SeedSequence(opts.seed).generate_state(1)[0] if opts.seed is None else opts.seed
        self._go("sample", (1,), (SAMPLE_THREADS,),
                 (logits, I32(logits.shape[0]), state, recent, I32(recent.shape[0]), F32(opts.temperature),
                  I32(opts.top_k), F32(opts.top_p), F32(opts.min_p), F32(opts.repeat_penalty),
                  np.uint32(seed & 0xFFFFFFFF), I32(advance)))


def decode_heads_per_block(heads: int, kv_heads: int, hd: int) -> int:
    """Query heads of one kv group that a decode attention block takes, reading each K and V row
    once for all of them: the group, up to ATT_GROUP where a lane holds 2 or 4 elements of a head
    (heads 33-64 or 97-128 wide), else one (over 128, the accumulators would not fit the launch
    bounds' registers; the other widths are left ungrouped for the kernel's compile time)."""
    return min(heads // kv_heads, ATT_GROUP if _cdiv(hd, 32) in (2, 4) else 1)


def decode_blocks(heads: int, kv_heads: int, hd: int) -> int:
    """Decode attention's blocks for one split of the context: each kv group's heads in sets of
    decode_heads_per_block."""
    return kv_heads * _cdiv(heads // kv_heads, decode_heads_per_block(heads, kv_heads, hd))


def attention_splits(head_sets: int, ctx: int, sms: int) -> tuple[int, int]:
    """Blocks over the context for each of decode's `head_sets` (decode_blocks), (least,
    most). least: enough blocks to fill
    the GPU twice over, none shorter than 64 positions at full context (a block reads 16 of them
    a round). A launch holds `most` (its grid is fixed, as a CUDA graph's is), and the kernel
    uses least until its blocks would take more than ATT_LONG_CHUNK positions each (one round
    of the block's loads), then more of them, up to one wave of ATT_BLOCKS_PER_SM blocks an SM:
    the rounds spread over more warps instead of lengthening, which shortened decode steps most
    at long contexts (docs/perf/code_figures.md)."""
    least = max(1, min(32, _cdiv(2 * sms, head_sets), ctx // 64))
    return least, max(least, min(32, ATT_BLOCKS_PER_SM * sms // head_sets, ctx // ATT_LONG_CHUNK))


def kernel_names() -> dict[str, str]:
    """Kernel name -> module (source file stem)."""
    return {k: mod for mod, path in kernels.sources().items() for k in kernels.declared_kernels(path)}


def import_cupy():
    """The one place CuPy is imported: its kernel cache goes under $NERVA_HOME first."""
    from nerva_cli.store.catalog import home

    os.environ.setdefault("CUPY_CACHE_DIR", str(home() / "cuda-cache"))
    import cupy

    return cupy


def cupy_or_none():
    """CuPy if it imports and a device answers, else None (with the reason in `why_no_cuda`)."""
    global why_no_cuda
    try:
        cupy = import_cupy()
    except ImportError:
        why_no_cuda = "CuPy is not installed (pip install -e '.[cuda13]' or '.[cuda12]')"
        return None
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            why_no_cuda = "no CUDA device"
            return None
    except Exception as e:  # CUDARuntimeError: no driver, no device
        why_no_cuda = f"no CUDA device answers ({e})"
        return None
    return cupy


why_no_cuda = ""


class CupyDevice:
    """Arrays, streams, events, graphs and copies on the current CUDA device."""

    def __init__(self):
        cp = cupy_or_none()
        if cp is None:
            raise NervaError(f"--backend cuda: {why_no_cuda}")
        self.cp = cp
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        self.name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.sms = int(props["multiProcessorCount"])
        self.total_bytes = int(props["totalGlobalMem"])
        self.compute = self.stream()
        self.copy = self.stream()
        self._dependent, self.dependent_launch = None, "off (no kernels loaded yet)"  # functions() decides
        self._one, self._zero = np.ones(1, np.float32), np.zeros(1, np.float32)  # gemm_t's alpha, beta

    # modules: each source compiled by nerva's own NVRTC call (kernels.compile_cubin, the one CI
    # checks) to a cubin for this GPU, cached under $NERVA_HOME, loaded as it is. CuPy's own
    # compile path would add -ftz=true, which the bit-exact activation quantiser must not get.
    def functions(self) -> dict:
        import hashlib

        from nerva_cli.store.catalog import home

        arch = f"sm_{self.cp.cuda.Device().compute_capability}"
        major = self.cp.cuda.runtime.runtimeGetVersion() // 1000  # the NVRTC of CuPy's CUDA major
        cache = home() / "cuda-cache"
        cache.mkdir(parents=True, exist_ok=True)
        mods, fns = {}, {}
        for name, mod in kernel_names().items():
            if mod not in mods:
                path = kernels.sources()[mod]
                key = hashlib.sha256((kernels.module_source(path) + repr(kernels.OPTIONS) + arch
                                      + kernels.nvrtc_version(major)).encode()).hexdigest()[:16]
                cubin = cache / f"{mod}-{arch}-{key}.cubin"
                if not cubin.exists():
                    tmp = cubin.with_name(f".{cubin.name}.tmp-{os.getpid()}")
                    tmp.write_bytes(kernels.compile_cubin(path, arch, major))
                    tmp.replace(cubin)
                mods[mod] = self.cp.RawModule(path=str(cubin))
            fns[name] = mods[mod].get_function(name)
        self._dependent, self.dependent_launch = dependent_launcher(
            self.cp.cuda.Device().compute_capability, lambda launcher: self._probe(launcher, fns["to_half"]))
        return fns

    def _probe(self, launcher, to_half) -> None:
        """Two dependent launches eagerly, then two captured in a graph and replayed, on a stream
        of its own; raises unless each wrote its value."""
        cp = self.cp
        x, out, s = cp.asarray(np.array([1.5], np.float32)), cp.zeros(4, np.float16), self.stream()
        cp.cuda.runtime.deviceSynchronize()  # both were filled on the legacy stream, which s does not wait for

        def two(first: int) -> None:
            for i in (first, first + 1):
                launcher(to_half.kernel.ptr, (1,), (32,), (x, out[i:], np.int64(1)), s.ptr)

        two(0)
        s.begin_capture()
        try:
            two(2)
        finally:
            graph = s.end_capture()
        graph.launch(s)
        s.synchronize()
        if not (out.get() == 1.5).all():
            raise RuntimeError(f"to_half wrote {out.get()}, not 1.5 each")

    def launch(self, fn, grid, block, args) -> None:
        if self._dependent is None:
            fn(grid, block, args)
        else:
            self._dependent(fn.kernel.ptr, grid, block, args, self.cp.cuda.get_current_stream().ptr)

    # arrays
    def empty(self, shape, dtype):
        return self.cp.empty(shape, dtype=dtype)

    def zeros(self, shape, dtype):
        return self.cp.zeros(shape, dtype=dtype)

    def upload(self, host: np.ndarray):
        return self.cp.asarray(host)

    def download(self, dev, out: np.ndarray | None = None) -> np.ndarray:
        """A synchronous copy to the host (into `out` when given: no allocation)."""
        if out is None:
            return self.cp.asnumpy(dev)
        dev.get(out=out)
        return out

    def pinned(self, nbytes: int) -> np.ndarray:
        """Page-locked host memory of exactly nbytes (async copies need it), page-aligned so
        O_DIRECT reads fit, outside CuPy's pinned pool (which rounds up to a power of two and
        never gives memory back); freed when the array goes."""
        cp = self.cp
        mem = cp.cuda.PinnedMemoryPointer(cp.cuda.PinnedMemory(nbytes + 4096), 0)
        raw = np.frombuffer(mem, dtype=np.uint8)
        off = -raw.ctypes.data % 4096
        return raw[off:off + nbytes]

    def mapped(self, nbytes: int):
        """(host view, device array) of nbytes of page-locked host memory, which kernels read in
        place across PCIe: with unified addressing (every 64-bit platform CUDA runs on) a pinned
        allocation is mapped at its host address. For what a step reads a little of, such as one
        row of the token table a token; the host fills it through the view."""
        cp = self.cp
        mem = cp.cuda.PinnedMemory(nbytes)
        where = cp.cuda.UnownedMemory(mem.ptr, nbytes, mem, cp.cuda.Device().id)  # owner: mem stays alive
        return (np.frombuffer(cp.cuda.PinnedMemoryPointer(mem, 0), np.uint8, nbytes),
                cp.ndarray((nbytes,), np.uint8, memptr=cp.cuda.MemoryPointer(where, 0)))

    def pin(self, host: np.ndarray) -> None:
        """Page-locks memory someone else allocated (the pager's staging slots)."""
        self.cp.cuda.runtime.hostRegister(host.ctypes.data, host.nbytes, 0)

    def unpin(self, host: np.ndarray) -> None:
        self.cp.cuda.runtime.hostUnregister(host.ctypes.data)

    def settle(self) -> None:
        """After loading: cupy.zeros fills on the legacy stream, which the engine's non-blocking
        streams do not wait for, so wait here; and give back the pinned staging of uploads."""
        self.cp.cuda.runtime.deviceSynchronize()
        self.cp.get_default_pinned_memory_pool().free_all_blocks()

    def copy_async(self, dst, src: np.ndarray, stream) -> None:
        """Host (pinned) -> device on `stream`."""
        self.cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.ctypes.data, src.nbytes,
                                         self.cp.cuda.runtime.memcpyHostToDevice, stream.ptr)

    def copy_to_host_async(self, dst: np.ndarray, src, stream) -> None:
        self.cp.cuda.runtime.memcpyAsync(dst.ctypes.data, src.data.ptr, dst.nbytes,
                                         self.cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)

    def gemm_t(self, a, b, out, accumulate: bool = False) -> None:
        """out [T, n] = a [T, k] @ b [n, k].T (accumulate: out += that) by cuBLAS (cublasGemmEx):
        f16 operands on tensor cores, f32 sums written as f32 straight into out, whose rows may be
        a column slice of a wider array (no temporary, no copy; with accumulate, cuBLAS's beta
        adds out's old values, so a residual add needs no pass of its own). Runs on the current
        stream, as CuPy sets it."""
        cp = self.cp
        cublas, rt = cp.cuda.cublas, cp.cuda.runtime
        (T, k), n = a.shape, b.shape[0]
        if (a.dtype != np.float16 or b.dtype != np.float16 or out.dtype != np.float32 or b.shape[1] != k
                or out.shape != (T, n) or not a.flags.c_contiguous or not b.flags.c_contiguous
                or out.strides[1] != 4 or out.strides[0] % 4):
            raise ValueError(f"gemm_t: f16 a {a.shape} and b {b.shape} (contiguous) into f32 out {out.shape} "
                             f"with unit column stride, got {a.dtype}, {b.dtype}, {out.dtype} strides {out.strides}")
        # cuBLAS is column-major: out, row-major with row stride ldc, is column-major outT [n, T]
        # (leading dimension ldc) = b a^T, with b's rows (row-major [n, k]) read as the columns of
        # a [k, n] column-major matrix (op T) and a's likewise as [k, T] (op N).
        cublas.gemmEx(cp.cuda.get_cublas_handle(), cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, n, T, k,
                      self._one.ctypes.data, b.data.ptr, rt.CUDA_R_16F, k, a.data.ptr, rt.CUDA_R_16F, k,
                      (self._one if accumulate else self._zero).ctypes.data, out.data.ptr, rt.CUDA_R_32F,
                      out.strides[0] // 4,
                      cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP)

    # streams, events, graphs
    def stream(self):
        return self.cp.cuda.Stream(non_blocking=True)

    def event(self):
        # block: a host waiting on it sleeps rather than spinning a core; the GPU never waits
        # for that wake-up, the next step is queued before the host waits
        return self.cp.cuda.Event(block=True, disable_timing=True)

    def timing_event(self):
        return self.cp.cuda.Event()

    def elapsed_ms(self, start, end) -> float:
        return self.cp.cuda.get_elapsed_time(start, end)

    def times_ms(self, work, rounds: int = 5) -> list[float]:
        """ms the GPU took for what work() queues on the compute stream, each of `rounds` times,
        timed with events (the benchmarks' one timer)."""
        s, start, end = self.compute, self.timing_event(), self.timing_event()
        times = []
        for _ in range(rounds):
            start.record(s)
            work()
            end.record(s)
            end.synchronize()
            times.append(self.elapsed_ms(start, end))
        return times

    @contextmanager
    def on(self, stream):
        with stream:
            yield

    def capture(self, stream, record):
        """Runs record() under stream capture; -> the graph (replayed with replay)."""
        with stream:
            stream.begin_capture()
            try:
                record()
            except BaseException:
                try:  # end the capture, but report what broke it
                    stream.end_capture()
                except Exception:  # noqa: BLE001
                    pass
                raise
            return stream.end_capture()

    def replay(self, graph, stream) -> None:
        graph.launch(stream)

    def synchronize(self) -> None:
        self.cp.cuda.runtime.deviceSynchronize()

    @contextmanager
    def count_allocations(self):
        """Counts device allocations made meanwhile (-> [count]): every CuPy allocation goes
        through the allocator set here, the default pool underneath."""
        pool = self.cp.get_default_memory_pool()
        count = [0]

        def malloc(size):
            count[0] += 1
            return pool.malloc(size)

        self.cp.cuda.set_allocator(malloc)
        try:
            yield count
        finally:
            self.cp.cuda.set_allocator(pool.malloc)

    def used_bytes(self) -> int:
        return int(self.cp.get_default_memory_pool().total_bytes())

    def free_bytes(self) -> int:
        return int(self.cp.cuda.runtime.memGetInfo()[0])

    def is_out_of_memory(self, e: BaseException) -> bool:
        """CuPy's pool raises OutOfMemoryError; a pinned allocation the runtime's error."""
        return isinstance(e, self.cp.cuda.memory.OutOfMemoryError) or (
            isinstance(e, self.cp.cuda.runtime.CUDARuntimeError) and "MemoryAllocation" in str(e))

    def bandwidths(self, nbytes: int = 1 << 30, rounds: int = 5) -> dict:
        """Measured GB/s, best of `rounds`, timed with events on one stream: pinned host -> device,
        device -> pinned host, and device -> device copy (bytes read + written: the HBM figure
        resident decode is held to)."""
        cp = self.cp
        host = self.pinned(nbytes)
        host[:] = 1
        a, b = cp.empty(nbytes, dtype=np.uint8), cp.empty(nbytes, dtype=np.uint8)
        s = self.compute

        def best(copy, moved: int) -> float:
            return round(moved / (min(self.times_ms(copy, rounds)) / 1000) / 1e9, 2)

        result = {"h2d_pinned": best(lambda: self.copy_async(a, host, s), nbytes),
                  "d2h_pinned": best(lambda: self.copy_to_host_async(host, a, s), nbytes),
                  "device_copy": best(lambda: cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, nbytes,
                                                                          cp.cuda.runtime.memcpyDeviceToDevice,
                                                                          s.ptr), 2 * nbytes)}
        return result
