"""The cpu and ref Engine's batched decode step: B sequences, each in a sequence slot of its own
(its KV cache and position), advanced one token each in one pass over the weights.

A row of the batch computes what Engine.decode computes for its sequence alone, bit for bit, so a
sequence's logits do not depend on what it is batched with: the norms, RoPE, biases, the GLU and
the activations' quantisation loop over rows with the one-row arithmetic; the dense products
take the matvecs' batch kernels (each weight block read once for the B rows) only where the
backend says each of their rows is the matvec's (batch_matches_matvec), else a matvec a row; and
attention takes every row in one call of decode's kernel (attention_decode_rows), each row over
its own slot's cache with the splits and arithmetic it has alone. The buffers are
the prefill workspace's (the two never run at once) and the arena's batch logits.
"""

from __future__ import annotations

from time import perf_counter_ns

import numpy as np

from nerva_cli.errors import NervaError
from nerva_cli.model.quant import QK


class BatchDecode:
    """Engine's decode_batch (a mixin: it reads the engine's kernels `k`, arena `a`, prefill
    workspace `pw`, weights and slots)."""

    def decode_batch(self, tokens: list[int], slots: list[int]) -> np.ndarray:
        """tokens[b] decoded into sequence slot slots[b], every slot one position on; -> logits
        [B, vocab], row b slot slots[b]'s, a view into the arena that the caller may keep until
        the next call. The slots must differ; the last of them is left selected."""
        B = len(tokens)
        if B != len(slots) or not 1 <= B <= self.seq_slots:
            raise NervaError(f"decode_batch takes 1 to {self.seq_slots} tokens, one a slot "
                             f"(got {B} tokens for {len(slots)} slots)")
        if B == 1:  # decode's compiled step: the same logits, fewer calls
            self.select(slots[0])
            return self.decode(tokens[0]).reshape(1, -1)
        if len(set(slots)) != B:
            raise NervaError(f"decode_batch: a sequence slot appears twice in {list(slots)}")
        for b in range(B):  # every check before any slot moves
            self.select(slots[b])
            self.check_decode(tokens[b])
        a, pw, cfg = self.a, self.pw, self.cfg
        pos, x = a.batch_pos[:B], pw.take("x", B, cfg.hidden_size)
        slot_rows = pw.take("pos", B)  # the prefill workspace's positions, free during a batched step
        t0 = perf_counter_ns()
        for b in range(B):
            self.select(slots[b])
            pos[b] = self.n_past
            slot_rows[b] = slots[b]
            self._make_room(self.n_past + 1)
            self._embed_row(tokens[b], x[b])
        self.phase_ns["embed"] += perf_counter_ns() - t0
        self._att_layout = None  # a step's rows: the attention's index arrays are written afresh
        for layer in self.weights.layers():
            self._batch_layer(layer, x, pos, slots)
        t1 = perf_counter_ns()
        xn = pw.take("xn", B, cfg.hidden_size)
        self.k.rmsnorm(x, self.final_norm, cfg.rms_eps, xn)
        logits = a.batch_logits[:B]
        self._rows_dense([self.lm_head], xn, self.head_precision, logits)
        self._cap_logits(logits)
        self.phase_ns["lm_head"] += perf_counter_ns() - t1
        for s in slots:
            self.slot_n_past[s] += 1
        return logits

    def _fused_calls(self, layer, rows: int):
        """The compiled batch calls of the layer's step for `rows` rows, their arguments bound once
        (kernels.layer.batch_layer_planes's matrices, the workspace's views for that many rows):
        (attention inputs, attention, o, mlp: argument tuples; kernels they count), or None where
        this step runs the layer kernel by kernel (the ref backend, a staging slot's layer, and
        see batch_layer_planes and batch_rows_fused). Made per call, those views and argument
        lists were a fifth of a B = 4 step's attention half (docs/performance.md)."""
        if self.backend != "cpu" or layer.moe is not None:
            return None
        from nerva_cli.planes.cpu.kernels import layer as fused

        made = self.__dict__.setdefault("_batch_calls", {})
        key = (layer.index, rows)
        if key not in made or made[key][0] is not layer:
            planes = fused.batch_layer_planes(layer)
            made[key] = (layer, None if planes is None else self._bind_fused(layer, planes, rows))
        calls = made[key][1]
        return calls if calls is not None and fused.batch_rows_fused(rows) else None

    def _bind_fused(self, layer, planes, B: int):
        """_fused_calls' tuple for a resident layer's matrices `planes` and B rows."""
        from nerva_cli.planes.cpu.kernels.decode_attention import _cache_operand, attention_kernel
        from nerva_cli.planes.cpu.kernels.q4 import _pair_scratch

        cfg, a, pw = self.cfg, self.a, self.pw
        i, spec = layer.index, self.specs[layer.index]
        qd, h = cfg.q_dim, cfg.hidden_size
        qkv_planes, o_planes, gate_up_planes, down_planes = planes
        w4a8 = layer.precision == "w4a8"
        codes, scales, sums = pw.bufs["codes"], pw.bufs["code_scales"], pw.bufs["code_sums"]
        pairs = _pair_scratch(codes.shape[0])
        k_cache, v_cache = _cache_operand(a.k_all[i]), _cache_operand(a.v_all[i])
        x, xn, o = pw.take("x", B, h), pw.take("xn", B, h), pw.take("proj", B, h)
        q, kk = pw.take("q", B, cfg.num_heads, cfg.head_dim), pw.take("k", B, cfg.num_kv_heads, cfg.head_dim)
        attn = pw.take("attn", B, cfg.num_heads, cfg.head_dim)
        inputs = (x, layer.attn_norm, cfg.rms_eps, xn, codes, scales, sums, pairs, w4a8, *qkv_planes, layer.qkv_bias,
                  layer.q_norm, layer.k_norm, pw.take("qkv", B, qd + 2 * cfg.kv_dim), q, kk, a.batch_pos[:B],
                  spec.cos, spec.sin, k_cache, v_cache, pw.take("pos", B), a.kv_bases, i in self.ring)
        attention = (attention_kernel(cfg.num_heads, cfg.num_kv_heads),
                     (q, k_cache, v_cache, a.att_slots, a.att_firsts, a.att_rows, attn, a.att_part),
                     np.float32(spec.softcap))
        o_call = (attn.reshape(B, qd), *o_planes, codes, scales, sums, pairs, w4a8, o, layer.post_attn_norm,
                  cfg.rms_eps)
        mlp = (o, x, layer.mlp_norm, cfg.rms_eps, xn, codes, scales, sums, pairs, w4a8, *gate_up_planes,
               pw.take("gate_up", B, 2 * cfg.intermediate_size), pw.take("act", B, cfg.intermediate_size),
               *down_planes, spec.gelu, layer.post_mlp_norm)
        return inputs, attention, o_call, mlp, sum(self._fused_kernels(layer))

    def _batch_layer_fused(self, layer, calls, pos: np.ndarray, slots: list[int]) -> None:
        """_batch_layer in four compiled calls (kernels.layer's batch calls and the rows'
        attention: the same kernels on the same buffers, so the same rows to the bit)."""
        from nerva_cli.planes.cpu.kernels import layer as fused
        from nerva_cli.planes.cpu.kernels.numba_setup import _threads

        inputs, (attend, attention, softcap), o, mlp, kernels = calls
        t0 = perf_counter_ns()
        fused._batch_attention_inputs(*inputs)
        self._attention_index(layer.index, pos, slots)
        attend(*attention, _threads[0], softcap)
        fused._batch_o(*o)
        t1 = perf_counter_ns()
        fused._batch_mlp(*mlp)
        self.counters.kernels += kernels
        self.counters.dispatches += 4
        self.phase_ns["attention"] += t1 - t0
        self.phase_ns["mlp"] += perf_counter_ns() - t1

    def _batch_layer(self, layer, x: np.ndarray, pos: np.ndarray, slots: list[int]) -> None:
        """One layer of a batched step over x [B, hidden] at positions pos [B], in place: decode's
        _decode_attention and _decode_mlp, a row each, the dense products over all rows (in a
        few compiled calls where _fused_calls gives them)."""
        calls = self._fused_calls(layer, x.shape[0])
        if calls is not None:
            self._batch_layer_fused(layer, calls, pos, slots)
            return
        cfg, a, k, pw, m, p = self.cfg, self.a, self.k, self.pw, layer.mats, layer.precision
        B, i, spec = x.shape[0], layer.index, self.specs[layer.index]
        qd, kvd, h, f = cfg.q_dim, cfg.kv_dim, cfg.hidden_size, cfg.intermediate_size
        t0 = perf_counter_ns()
        xn = pw.take("xn", B, h)
        k.rmsnorm(x, layer.attn_norm, cfg.rms_eps, xn)
        qkv = pw.take("qkv", B, qd + 2 * kvd)
        self._rows_dense([m["qkv"]] if "qkv" in m else [m["q"], m["k"], m["v"]], xn, p, qkv)
        if layer.qkv_bias is not None:
            k.add_rows(qkv, layer.qkv_bias)
        q, kk = pw.take("q", B, cfg.num_heads, cfg.head_dim), pw.take("k", B, cfg.num_kv_heads, cfg.head_dim)
        np.copyto(q, qkv[:, :qd].reshape(q.shape))
        np.copyto(kk, qkv[:, qd:qd + kvd].reshape(kk.shape))
        if layer.q_norm is not None:
            k.rmsnorm(q, layer.q_norm, cfg.rms_eps, q)
            k.rmsnorm(kk, layer.k_norm, cfg.rms_eps, kk)
        k.rope(q, pos, spec.cos, spec.sin)
        k.rope(kk, pos, spec.cos, spec.sin)
        attn, ring = pw.take("attn", B, cfg.num_heads, cfg.head_dim), i in self.ring
        for b in range(B):
            s = slots[b]
            row = int(pos[b] - a.kv_bases[s]) if ring else int(pos[b])  # the cache row of this position
            a.k_slots[s][i][row] = kk[b]
            a.v_slots[s][i][row] = qkv[b, qd + kvd:].reshape(kk.shape[1:])
        self._attention_rows(i, q, attn, pos, slots)
        o = pw.take("proj", B, h)
        self._rows_dense([m["o"]], attn.reshape(B, -1), p, o)
        if layer.post_attn_norm is not None:
            k.rmsnorm(o, layer.post_attn_norm, cfg.rms_eps, o)
        t1 = perf_counter_ns()
        k.add_rmsnorm(o, x, layer.mlp_norm, cfg.rms_eps, xn)
        down = o  # o is in x now
        if layer.moe is not None:
            self._moe_rows(layer, xn, down, self._rows_dense)
        else:
            gate_up, act = pw.take("gate_up", B, 2 * f), pw.take("act", B, f)
            self._rows_dense([m["gate_up"]] if "gate_up" in m else [m["gate"], m["up"]], xn, p, gate_up)
            (k.gelu_mul if spec.gelu else k.silu_mul)(gate_up, act)
            self._rows_dense([m["down"]], act, p, down)
        if layer.post_mlp_norm is not None:
            k.rmsnorm(down, layer.post_mlp_norm, cfg.rms_eps, down)
        x += down
        self.phase_ns["attention"] += t1 - t0
        self.phase_ns["mlp"] += perf_counter_ns() - t1

    def _attention_rows(self, i: int, q: np.ndarray, attn: np.ndarray, pos: np.ndarray, slots: list[int]) -> None:
        """Layer i's decode attention for every row in one call (attention_decode_rows): row b's
        query q[b] over its slot's cache up to position pos[b], within the layer's window."""
        a = self.a
        self._attention_index(i, pos, slots)
        self.k.attention_decode_rows(q, a.k_all[i], a.v_all[i], a.att_slots, a.att_firsts, a.att_rows, attn,
                                     a.att_part, self.specs[i].softcap)

    def _attention_index(self, i: int, pos: np.ndarray, slots: list[int]) -> None:
        """The arena's att_slots, att_firsts and att_rows for layer i's attention rows: row b's
        slot, first cache row and row count (up to position pos[b], within the layer's window),
        written again only where layer i's window or ring differs from the layer's before it
        (the step begins with _att_layout None)."""
        a, window, ring = self.a, self.specs[i].window, i in self.ring
        if self._att_layout == (window, ring):
            return
        self._att_layout = (window, ring)
        for b, s in enumerate(slots):
            row = int(pos[b] - a.kv_bases[s]) if ring else int(pos[b])  # the cache row of this position
            first = max(0, row + 1 - window) if window else 0
            a.att_slots[b], a.att_firsts[b], a.att_rows[b] = s, first, row + 1 - first

    def _rows_dense(self, mats: list, x: np.ndarray, precision: str, out: np.ndarray) -> None:
        """out [B, rows] = x [B, cols] times the matrices `mats` stacked by rows, each row what
        decode's _matvec gives for that row of x: W4A8 (and a Q8_0 table's W8A8) on the rows'
        Q8 codes, a Q8_0 table at W4A16 on Q16 codes, as decode quantises them; the batch
        kernels where batch_matches_matvec, else a matvec a row."""
        k, pw = self.k, self.pw
        B, cols = x.shape
        first = mats[0]
        matrix = "exact" if first.w is not None else "q8" if first.q8 is not None else "q4"
        integer = precision == "w4a8" and matrix != "exact"
        if integer:
            xq, xd = pw.take("codes", B, cols), pw.take("code_scales", B, cols // QK)
            xs = pw.take("code_sums", B, cols // QK)
            k.quantize_act_q8(x.reshape(-1), xq.reshape(-1), xd.reshape(-1), xs.reshape(-1))
        elif matrix == "q8":
            xq, xd = pw.take("codes16", B, cols), pw.take("code16_scales", B, cols // QK)
            k.quantize_act_q16(x.reshape(-1), xq.reshape(-1), xd.reshape(-1))
        batched = k.batch_matches_matvec(matrix, precision)
        lo = 0
        for lin in mats:
            hi = lo + lin.rows
            if not batched:
                for b in range(B):
                    if matrix == "exact":
                        k.matvec_exact(lin.w, x[b], out[b, lo:hi])
                    elif matrix == "q8":
                        (k.matvec_q8_w8a8 if integer else k.matvec_q8_w8a16)(lin.q8, lin.d, xq[b], xd[b], out[b, lo:hi])
                    elif integer:
                        k.matvec_q4_w4a8(lin.qs, lin.d, lin.m, xq[b], xd[b], xs[b], out[b, lo:hi])
                    else:
                        k.matvec_q4_w4a16(lin.qs, lin.d, lin.m, x[b], out[b, lo:hi])
            elif matrix == "exact":
                k.matmul_exact(lin.w, x, out[:, lo:hi])
            elif matrix == "q8":
                (k.matmul_q8_w8a8 if integer else k.matmul_q8_w8a16)(lin.q8, lin.d, xq, xd, out[:, lo:hi])
            elif integer:
                k.matmul_q4_w4a8(lin.qs, lin.d, lin.m, xq, xd, xs, out[:, lo:hi])
            else:
                k.matmul_q4_w4a16(lin.qs, lin.d, lin.m, x, out[:, lo:hi])
            lo = hi
