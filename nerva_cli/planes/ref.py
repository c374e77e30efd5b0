"""The NumPy reference backend: the readable definition of every kernel (ARCHITECTURE section 7).

Every function writes its result into `out` (or updates its argument in place) and returns
nothing, exactly like the `cpu` backend; this one may allocate temporaries. All arithmetic is
float32 unless a comment says otherwise, because that is what the fast backends do and what
HF `transformers` does in float32.
"""

from __future__ import annotations

import numpy as np

from nerva_cli.model.quant import QK
from nerva_cli.model.quant import dequantize_q4 as dequantize_planes
from nerva_cli.model.quant import dequantize_q8 as dequantize_q8_planes

F32 = np.float32

# the kernels every backend implements and an engine dispatches (each call counts as one kernel
# run: planes/base.py's Counters); the other functions here are sizes and helpers
KERNELS = ("rmsnorm", "add_rmsnorm", "add_rows", "rope", "quantize_act_q8", "quantize_act_q16", "fake_quantize_q8",
           "matvec_q4_w4a16", "matmul_q4_w4a16", "matvec_q4_w4a8", "matmul_q4_w4a8", "matvec_q4_experts_w4a8",
           "matvec_q4_experts_w4a16", "route_experts", "matvec_q8_w8a8",
           "matmul_q8_w8a8", "matvec_q8_w8a16", "matmul_q8_w8a16", "matvec_exact", "matmul_exact", "widen_exact", "silu_mul", "gelu_mul",
           "attention_decode", "attention_decode_rows", "attention_prefill", "dequantize_q4", "dequantize_q8", "embed_q4", "embed_q8",
           "embed_exact", "gemm_q4", "gemm_q8", "gemm_exact")


def set_threads(n: int) -> None:
    """NumPy decides its own threading; accepted so that backends are interchangeable."""


def rmsnorm(x, w, eps, out):
    """out = x / sqrt(mean(x^2) + eps) * w over each run of len(w) consecutive values: the last
    axis (x [n], [T, n], [T, heads, n] with w [n]), or several (OLMoE's q/k norms, over a token's
    whole projection: x [T, heads, head_dim] with w [heads * head_dim]). x and out contiguous."""
    n = w.shape[0]
    x2 = x.reshape(-1, n)
    ms = np.mean(x2 * x2, axis=-1, keepdims=True, dtype=F32)
    out.reshape(-1, n)[...] = x2 * (F32(1.0) / np.sqrt(ms + F32(eps))) * w


def add_rmsnorm(x, residual, w, eps, out):
    """residual += x in place, then out = rmsnorm(residual)."""
    residual += x
    rmsnorm(residual, w, eps, out)


def add_rows(x, b):
    """x [..., n] += b [n] on every row (a projection's bias)."""
    x += b


def rope(x, pos, cos, sin):
    """Rotates x [T, heads, head_dim] in place, NeoX "rotate_half" pairing (i, i + half), with
    cos/sin [max_pos, head_dim/2] at rows pos [T]. Any C-contiguous x holding T * heads *
    head_dim values works (e.g. [heads * head_dim] when T = 1)."""
    half = cos.shape[1]
    x = x.reshape(pos.shape[0], -1, 2 * half)
    c = cos[pos][:, None, :]
    s = sin[pos][:, None, :]
    x1 = x[..., :half].copy()
    x2 = x[..., half:].copy()
    x[..., :half] = x1 * c - x2 * s
    x[..., half:] = x2 * c + x1 * s


def matvec_q4_w4a16(qs, d, m, x, out):
    """out = dequant(qs, d, m) @ x with f32 accumulation (m None: Q4_0, else Q4_1's offsets)."""
    out[...] = dequantize_planes(qs, d, m) @ x


def matmul_q4_w4a16(qs, d, m, x, out):
    """out[t] = matvec_q4_w4a16 of activation t, the rows of x [T, cols] (a short prompt's W4A16
    GEMM; out [T, rows] may be a column slice of a wider array)."""
    for t in range(x.shape[0]):
        matvec_q4_w4a16(qs, d, m, x[t], out[t])


def round_half_away(v):
    """C's roundf (halves away from zero), which llama.cpp's quantisers use; np.round rounds
    halves to even. v - trunc(v) is exact in float, so the tie test is exact."""
    t = np.trunc(v)
    return t + np.where(np.abs(v - t) >= 0.5, np.sign(v), 0)


def quantize_act_q8(x, xq, xd, xs):
    """x f32 [cols] -> xq int8 codes, xd f32 scale and xs int32 code sum per 32-group."""
    g = x.reshape(-1, QK)
    d = np.abs(g).max(axis=1) / F32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, F32(1.0) / d, F32(0.0))
    q = np.clip(round_half_away(g * inv[:, None]), -127, 127).astype(np.int8)
    xq[...] = q.reshape(-1)
    xd[...] = d
    xs[...] = q.sum(axis=1, dtype=np.int32)


def quantize_act_q16(x, xq, xd):
    """x f32 [cols] -> xq int16 codes and xd f32 scale per 32-group, as quantize_act_q8 with
    32767 for 127: the W8A16 lm_head's activation, within 2^-16 of each group's largest value."""
    g = x.reshape(-1, QK)
    d = np.abs(g).max(axis=1) / F32(32767)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, F32(1.0) / d, F32(0.0))
    xq[...] = np.clip(round_half_away(g * inv[:, None]), -32767, 32767).astype(np.int16).reshape(-1)
    xd[...] = d


def fake_quantize_q8(x, out):
    """Rows of x [T, cols] quantised per 32-group as quantize_act_q8 does, then scaled back:
    a GEMM over them gives the W4A8 kernel's products (prefill's W4A8)."""
    g = x.reshape(x.shape[0], -1, QK)
    d = np.abs(g).max(axis=2, keepdims=True) / F32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, F32(1.0) / d, F32(0.0))
    q = np.clip(round_half_away(g * inv), -127, 127)
    out[...] = (q * d).reshape(x.shape)


def unpack_q4_codes(qs):
    """qs [rows, cols/2] -> the 0..15 codes as int32 [rows, cols/32, 32] in element order."""
    rows, half = qs.shape
    b = qs.reshape(rows, half // (QK // 2), QK // 2)
    return np.concatenate([b & 0x0F, b >> 4], axis=2).astype(np.int32)


def matvec_q4_w4a8(qs, d, m, xq, xd, xs, out):
    """Per block: d_w * d_x * (sum_j q_w[j] q_x[j] - 8 * sum_j q_x[j]), summed over blocks; for
    Q4_1, d_w * d_x * sum_j q_w[j] q_x[j] + m_w * d_x * sum_j q_x[j].

    The Q4_0 weight is d_w * (q_w - 8), the Q4_1 one d_w * q_w + m_w; the -8 of every code, or the
    block's offset, is applied once per block through the activation code sum xs (the deferred
    bias correction), so the inner product is over the raw 0..15 codes. Integer part in int32
    (exact), the combine in f32.
    """
    codes = unpack_q4_codes(qs)
    isum = np.einsum("rbj,bj->rb", codes, xq.reshape(-1, QK).astype(np.int32))
    if m is None:
        terms = (d.astype(F32) * xd) * (isum - 8 * xs).astype(F32)
    else:
        terms = (d.astype(F32) * xd) * isum.astype(F32) + m.astype(F32) * (xd * xs.astype(F32))
    out[...] = terms.sum(axis=1, dtype=F32)


def short_prefill_rows(precision: str) -> int:
    """The longest prompt chunk at `precision` that prefill sends through the matmul_* batch
    kernels below rather than dequantise + GEMM; 0 for none. Here a fixed choice (the cpu's on
    one thread of an AVX-512 host), so that ref's engine runs both paths on the tiny models."""
    return {"w4a8": 32, "w4a16": 16, "exact": 16}.get(precision, 0)


def matmul_q4_w4a8(qs, d, m, xq, xd, xs, out):
    """out[t] = matvec_q4_w4a8 of activation t: the rows of xq [T, cols], xd and xs [T, cols / 32]
    (a short prompt's W4A8 GEMM; out [T, rows] may be a column slice of a wider array)."""
    for t in range(xq.shape[0]):
        matvec_q4_w4a8(qs, d, m, xq[t], xd[t], xs[t], out[t])


def route_experts(logits, renormalise, ids, weights):
    """A mixture's router: each row of logits [rows, experts] -> its k = ids.shape[1] experts in
    ascending order (ids, int64) and their weights (f32, in the same order): the softmax over
    every expert in f32, the k largest probabilities (ties to the lower index), divided by their
    sum where `renormalise` (transformers' routers and llama.cpp's)."""
    k = ids.shape[1]
    p = np.exp(logits - logits.max(axis=1, keepdims=True), dtype=F32)
    p /= p.sum(axis=1, keepdims=True, dtype=F32)
    top = np.sort(np.argsort(-p, axis=1, kind="stable")[:, :k], axis=1)
    w = np.take_along_axis(p, top, axis=1)
    if renormalise:
        w = w / w.sum(axis=1, keepdims=True, dtype=F32)
    ids[...] = top
    weights[...] = w


def matvec_q4_experts_w4a8(qs, d, m, experts, x, out):
    """A mixture's decode step: out[j] = matvec_q4_w4a8 of expert experts[j]'s matrix, rows
    experts[j] * R.. (experts[j] + 1) * R of the stacked Q4 planes (a layer's experts' gate/up,
    or down, back to back; R = out.shape[1]), and x[j] quantised by quantize_act_q8 (x[0] for
    every j where x has one row: gate/up's input)."""
    rows = out.shape[1]
    for j, e in enumerate(experts):
        a = x[0 if x.shape[0] == 1 else j]
        xq, xd, xs = np.empty(a.shape, np.int8), np.empty(a.shape[0] // QK, F32), np.empty(a.shape[0] // QK, np.int32)
        quantize_act_q8(a, xq, xd, xs)
        part = slice(e * rows, (e + 1) * rows)
        matvec_q4_w4a8(qs[part], d[part], None if m is None else m[part], xq, xd, xs, out[j])


def matvec_q4_experts_w4a16(qs, d, m, experts, x, out):
    """matvec_q4_experts_w4a8 at W4A16: each expert's matvec_q4_w4a16 of x[j] (x[0] where x has
    one row)."""
    rows = out.shape[1]
    for j, e in enumerate(experts):
        part = slice(e * rows, (e + 1) * rows)
        matvec_q4_w4a16(qs[part], d[part], None if m is None else m[part], x[0 if x.shape[0] == 1 else j], out[j])


def matvec_q8_w8a8(q8, d, xq, xd, out):
    """Per block: d_w * d_x * sum_j q_w[j] q_x[j] (int32, exact), summed over blocks in f32."""
    isum = np.einsum("rbj,bj->rb", q8.reshape(q8.shape[0], -1, QK).astype(np.int32),
                     xq.reshape(-1, QK).astype(np.int32))
    out[...] = ((d.astype(F32) * xd) * isum.astype(F32)).sum(axis=1, dtype=F32)


def matvec_q8_w8a16(q8, d, xq, xd, out):
    """W8A8's sum with the Q16 activation of quantize_act_q16 (xq int16): per block, the integer
    dot (at most 32 * 128 * 32767, exact in int32) times d_w d_x, summed over blocks in f32."""
    matvec_q8_w8a8(q8, d, xq, xd, out)


def matmul_q8_w8a8(q8, d, xq, xd, out):
    """out[t] = matvec_q8_w8a8 of activation t, the rows of xq [T, cols] and xd [T, cols / 32]
    (a batched decode step's Q8_0 lm_head; out [T, rows] may be a column slice)."""
    for t in range(xq.shape[0]):
        matvec_q8_w8a8(q8, d, xq[t], xd[t], out[t])


def matmul_q8_w8a16(q8, d, xq, xd, out):
    """out[t] = matvec_q8_w8a16 of activation t (xq int16 [T, cols]), as matmul_q8_w8a8."""
    for t in range(xq.shape[0]):
        matvec_q8_w8a16(q8, d, xq[t], xd[t], out[t])


def batch_matches_matvec(matrix: str, precision: str) -> bool:
    """Whether the batch kernel (matmul_*) for a `matrix` ("q4", "q8" or "exact") at `precision`
    gives each activation's output row bit for bit as its matvec does, so that a batched decode
    step may take it (else it runs a matvec a row). Here always: each loops over the matvec."""
    return True


def matmul_exact(w, x, out):
    """out[t] = matvec_exact of activation t, the rows of x [T, cols] (a short prompt's exact
    GEMM; out [T, rows] may be a column slice of a wider array)."""
    for t in range(x.shape[0]):
        matvec_exact(w, x[t], out[t])


def widen_exact(w, out):
    """out f32 [rows, cols] = w, an exact variant's matrix as stored: float16, or uint16 holding
    bf16 bits (a float32's upper half)."""
    if w.dtype == np.float16:
        out[...] = w
    else:
        out.view(np.uint32)[...] = w.astype(np.uint32) << 16


def matvec_exact(w, x, out):
    """out = w @ x, w an exact variant's matrix as stored (widen_exact's)."""
    wide = np.empty(w.shape, F32)
    widen_exact(w, wide)
    np.dot(wide, x, out=out)


def silu_mul(gate_up, out):
    """out [..., f] = silu(gate) * up = gate * sigmoid(gate) * up, where gate_up [..., 2f] holds
    each row's gate in its first half and up in its second (the fused projection's output)."""
    f = out.shape[-1]
    gate, up = gate_up[..., :f], gate_up[..., f:]
    with np.errstate(over="ignore"):  # exp(-gate) -> inf for gate < -88 gives the right 0
        out[...] = gate / (F32(1.0) + np.exp(-gate)) * up


def gelu_mul(gate_up, out):
    """out [..., f] = gelu(gate) * up (GeGLU), GeLU by its tanh approximation (Gemma's
    gelu_pytorch_tanh): 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))); gate_up as silu_mul's."""
    f = out.shape[-1]
    gate, up = gate_up[..., :f], gate_up[..., f:]
    inner = F32(np.sqrt(2 / np.pi)) * (gate + F32(0.044715) * gate * gate * gate)
    out[...] = F32(0.5) * gate * (F32(1) + np.tanh(inner)) * up


ATT_SPLIT_MIN = 64  # positions a split of decode attention covers at least
SHORT_PREFILL_MOST = 64  # prompt tokens a chunk may send through the matvecs' batch kernels, at most


def attention_decode_partials(ctx, heads, head_dim):
    """Shape of attention_decode's `part` for a cache of ctx positions: room for the most splits
    of the positions (one every ATT_SPLIT_MIN), each leaving per head its weighted value sums,
    max score and weight total. The cpu backend merges splits through it; ref needs none."""
    return (ctx + ATT_SPLIT_MIN - 1) // ATT_SPLIT_MIN, heads, head_dim + 2


def capped(s, softcap):
    """Scores s as Gemma 2 caps them, softcap tanh(s / softcap), where softcap > 0; else s."""
    return s if not softcap else F32(softcap) * np.tanh(s / F32(softcap))


def attention_decode(q, k_cache, v_cache, n_ctx, out, part=None, softcap=0.0):
    """One query per head over cache positions 0..n_ctx-1; GQA: head h reads kv head h // group.
    The cache may be f16 or f32: NumPy widens f16 exactly when it meets the f32 query. softcap > 0
    caps the scaled scores (capped). part: see attention_decode_partials (unused here)."""
    heads, head_dim = q.shape
    group = heads // k_cache.shape[1]
    scale = F32(1.0 / np.sqrt(head_dim))
    for h in range(heads):
        k = k_cache[:n_ctx, h // group]
        v = v_cache[:n_ctx, h // group]
        s = capped((k @ q[h]) * scale, softcap)
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ v


def attention_decode_rows(q, k_all, v_all, slots, firsts, n_ctx, out, part=None, softcap=0.0):
    """attention_decode for each row b of q [B, heads, head_dim]: over n_ctx[b] rows of sequence
    slot slots[b]'s cache (k_all, v_all [slots, ctx, kv_heads, head_dim]) from row firsts[b],
    into out[b]. part: unused here."""
    for b in range(q.shape[0]):
        s, first = slots[b], firsts[b]
        attention_decode(q[b], k_all[s, first:], v_all[s, first:], n_ctx[b], out[b], softcap=softcap)


def attention_prefill_work(T, n, heads, kv_heads, head_dim):
    """Float32 elements attention_prefill's `work` holds for T queries over up to n cache
    positions: for a kv head's group of query heads, their queries [group, T, head_dim], scores
    [group, T, n], outputs [group, T, head_dim] and a weight total a row, and K and V widened from
    an f16 cache. The cpu backend computes in it (its threads' jobs in parts of it, T queries
    together at most); ref allocates its own."""
    group = heads // kv_heads
    return group * T * (n + 2 * head_dim + 1) + 2 * n * kv_heads * head_dim


def attention_prefill(q, k, v, start, out, work=None, window=0, softcap=0.0):
    """Causal attention for a chunk: query t (position start + t) sees positions 0..start + t, or
    with a window (> 0) the last `window` of them, itself included (a sliding-window layer's);
    softcap > 0 caps the scaled scores (capped).

    q [T, heads, head_dim], k/v [start + T, kv_heads, head_dim], out [T, heads, head_dim];
    work: see attention_prefill_work (unused here).
    """
    T, heads, head_dim = q.shape
    n = k.shape[0]
    group = heads // k.shape[1]
    scale = F32(1.0 / np.sqrt(head_dim))
    seen = np.arange(n)[None, :]
    query = (start + np.arange(T))[:, None]
    future = (seen > query) | ((seen <= query - window) if window else False)
    for h in range(heads):
        s = capped((q[:, h] @ k[:, h // group].T) * scale, softcap)
        s[future] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h] = (p / p.sum(axis=1, keepdims=True)) @ v[:, h // group]


def dequantize_q4(qs, d, m, out):
    """out f32 [rows, cols] = d * (q - 8), or d * q + m for Q4_1 (prefill dequantises, then runs
    a GEMM)."""
    dequantize_planes(qs, d, m, out=out)


def embed_q4(qs, d, m, token, out):
    """out = row `token` of a Q4_0 or Q4_1 table."""
    rows = slice(token, token + 1)
    dequantize_planes(qs[rows], d[rows], None if m is None else m[rows], out=out.reshape(1, -1))


def dequantize_q8(q8, d, out):
    """out f32 [rows, cols] = d * q (a Q8_0 table; prefill's lm_head)."""
    dequantize_q8_planes(q8, d, out=out)


def embed_q8(q8, d, token, out):
    """out = row `token` of a Q8_0 table."""
    dequantize_q8_planes(q8[token:token + 1], d[token:token + 1], out=out.reshape(1, -1))


def embed_exact(table, token, out):
    """out = row `token` of an exact variant's table as stored."""
    widen_exact(table[token:token + 1], out.reshape(1, -1))


def gemm_q4(qs, d, m, x, out, col, scratch=None, align=None):
    """out[:, col:col + rows] = x [T, cols] times the dequantised Q4 matrix's transpose: prefill's
    GEMM (the cpu backend dequantises into `scratch` slices of rows that divide `align`; both
    unused here)."""
    wide = np.empty((qs.shape[0], x.shape[1]), F32)
    dequantize_q4(qs, d, m, wide)
    np.matmul(x, wide.T, out=out[:, col:col + wide.shape[0]])


def gemm_q8(q8, d, x, out, col, scratch=None, align=None):
    """gemm_q4 for a Q8_0 matrix."""
    wide = np.empty(q8.shape, F32)
    dequantize_q8(q8, d, wide)
    np.matmul(x, wide.T, out=out[:, col:col + wide.shape[0]])


def gemm_exact(w, x, out, col, scratch=None, align=None):
    """gemm_q4 for an exact variant's matrix as stored."""
    wide = np.empty(w.shape, F32)
    widen_exact(w, wide)
    np.matmul(x, wide.T, out=out[:, col:col + wide.shape[0]])


def sampling_candidates(logits, temperature, top_k, top_p, min_p=0.0):
    """The tokens a draw chooses among, best first (larger logit, then lower index), and their
    weights exp((logit - max) / temperature) in float64: the top_k largest logits with every tie
    of the k-th kept (top_k 0 or >= vocab: all of them), then, when top_p < 1, the fewest of those
    whose running weight reaches top_p of their sum, ties of the last one again kept whole, then,
    when min_p > 0, those whose weight is at least min_p (of the largest's, which is 1): ollama's
    order, temperature first. A draw with u uniform in [0, 1) takes the first token whose running
    weight exceeds u times the kept sum, walking them in this order when top_p < 1 and in token
    order otherwise. A logit of -inf (a token structured output's mask forbids) is never a
    candidate."""
    order = np.argsort(-logits, kind="stable")
    kth = logits[order[top_k - 1]] if 0 < top_k < len(logits) else -np.inf
    top = order[(logits[order] >= kth) & (logits[order] > -np.inf)]
    w = np.exp((logits[top].astype(np.float64) - logits[top[0]]) / temperature)
    keep = w >= min_p
    if top_p < 1:
        reached = np.searchsorted(np.cumsum(w), top_p * w.sum())
        cut = logits[top[min(reached, len(top) - 1)]]  # a sum rounded below top_p of itself keeps all
        keep &= logits[top] >= cut
    return top[keep], w[keep]
