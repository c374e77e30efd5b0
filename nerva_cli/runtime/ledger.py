"""The per-token ledger (ARCHITECTURE 9): where each token's time and bytes went."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from time import perf_counter_ns

import numpy as np

from nerva_cli.runtime.hotpath import AllocationCounter
from nerva_cli.runtime.mcap import precision_line


@dataclass
class TokenRecord:
    index: int
    token_id: int
    piece: str
    wall_us: float
    embed_us: float | None  # None where phases run inside a CUDA graph and cannot be told apart
    attention_us: float | None
    mlp_us: float | None
    lm_head_us: float | None
    sample_us: float  # the mask included
    mask_us: float | None  # structured output's mask (None: no format)
    stall_us: float
    kernel_launches: int  # kernels run, each counted (a fused call's and a graph's too)
    dispatches: int  # calls the host made to run them (a fused call or a graph replay: one)
    syncs: dict  # kind -> host waits for the GPU during this token (state, logits, token, staging)
    disk_bytes: int
    disk_read_us: float  # inside disk reads (ring: the reader thread's, which runs ahead of compute)
    h2d_bytes: int
    d2h_bytes: int
    hits: int
    faults: int
    prefetched: int
    evicted: int
    w4a8_layers: int
    w4a16_layers: int
    exact_layers: int
    hot_path_allocations: int


class Ledger:
    def __init__(self, engine, tokenizer=None, path=None):
        self.engine, self.tok = engine, tokenizer
        self.records: list[TokenRecord] = []
        self.file = open(path, "w") if path else None
        self.allocs = AllocationCounter().__enter__()

    def _snapshot(self):
        s, phases = self.engine.weights.stats, self.engine.phase_ns
        return (None if phases is None else dict(phases), self.engine.counters.snapshot(),
                None if s is None else (s.disk_bytes, s.hits, s.faults, s.stall_ns, s.prefetched, s.evicted,
                                        s.h2d_bytes, s.d2h_bytes, s.read_ns))

    def step(self, decode, sampler, token: int):
        """Runs one decode + sample under measurement; returns the next token."""
        before = self._snapshot()
        allocs_before = self.allocs.count
        t0 = perf_counter_ns()
        with self.allocs.step():
            logits = decode(token)
            t1 = perf_counter_ns()
            nxt = sampler(logits)
        t2 = perf_counter_ns()
        phases, (kernels, dispatches, syncs), pager = self._snapshot()
        d = {k: None if phases is None else (phases[k] - before[0][k]) / 1000
             for k in ("embed", "attention", "mlp", "lm_head")}
        p = [0] * 9 if pager is None else [a - b for a, b in zip(pager, before[2])]
        counts = self.engine.precision_counts
        rec = TokenRecord(
            index=len(self.records), token_id=nxt, piece=self.tok.decode([nxt]) if self.tok else "",
            wall_us=(t2 - t0) / 1000, embed_us=d["embed"], attention_us=d["attention"], mlp_us=d["mlp"],
            lm_head_us=d["lm_head"], sample_us=(t2 - t1) / 1000, stall_us=p[3] / 1000,
            mask_us=None if sampler.constraint is None else sampler.constraint.mask_ns / 1000,
            kernel_launches=kernels - before[1][0], dispatches=dispatches - before[1][1],
            syncs={k: v - before[1][2].get(k, 0) for k, v in syncs.items() if v > before[1][2].get(k, 0)},
            disk_bytes=p[0],
            disk_read_us=p[8] / 1000, h2d_bytes=p[6],
            d2h_bytes=p[7],
            hits=p[1], faults=p[2], prefetched=p[4], evicted=p[5], w4a8_layers=counts["w4a8"],
            w4a16_layers=counts["w4a16"], exact_layers=counts["exact"],
            hot_path_allocations=self.allocs.count - allocs_before)
        self.records.append(rec)
        if self.file:
            self.file.write(json.dumps(asdict(rec)) + "\n")
        return nxt

    def close(self) -> None:
        self.allocs.__exit__(None, None, None)
        if self.file:
            self.file.close()
            self.file = None

    def summary(self) -> dict:
        if not self.records:
            return {"tokens": 0}
        col = lambda name: np.array([getattr(r, name) for r in self.records], dtype=np.float64)  # noqa: E731
        wall = col("wall_us")
        hits, faults = col("hits").sum(), col("faults").sum()
        e = self.engine
        return {
            "tokens": len(self.records), "policy": getattr(e.weights, "policy", "resident"),
            "direct_io": e.weights.direct_io, "wall_ms_total": wall.sum() / 1000,
            "wall_us_mean": wall.mean(), "wall_us_p50": float(np.percentile(wall, 50)),
            "wall_us_p99": float(np.percentile(wall, 99)),
            **{f"{k}_us_mean": self._mean(f"{k}_us") for k in ("embed", "attention", "mlp", "lm_head",
                                                               "sample", "mask", "stall")},
            "kernel_launches_per_token": col("kernel_launches").mean(),
            "dispatches_per_token": col("dispatches").mean(),
            "syncs_per_token": float(np.mean([sum(r.syncs.values()) for r in self.records])),
            "syncs_by_kind": {k: sum(r.syncs.get(k, 0) for r in self.records) for k in
                              sorted({k for r in self.records for k in r.syncs})},
            "h2d_bytes_per_token": col("h2d_bytes").mean(), "d2h_bytes_per_token": col("d2h_bytes").mean(),
            "disk_bytes_per_token": col("disk_bytes").mean(),
            "disk_read_bytes_per_s": col("disk_bytes").sum() / col("disk_read_us").sum() * 1e6
            if col("disk_read_us").sum() else None,
            "hit_rate": hits / (hits + faults) if hits + faults else 1.0,
            "resident_layers": len(e.plan.resident_layers), "paged_layers": len(e.plan.paged_layers),
            "hot_path_allocations": int(col("hot_path_allocations").sum()),
        }

    @staticmethod
    def _sync_kinds(s: dict) -> str:
        kinds = ", ".join(f"{k} {n}" for k, n in s["syncs_by_kind"].items())
        return f" ({kinds})" if kinds else ""

    def _mean(self, name: str) -> float | None:
        values = [getattr(r, name) for r in self.records]
        return None if None in values else float(np.mean(values))

    COLUMNS = ("#", "token", "piece", "wall", "embed", "attn", "mlp", "lm_head", "sample", "mask", "stall",
               "launches", "syncs", "disk", "h2d", "hits/faults", "prefetched", "w4a8/w4a16/exact", "allocs")
    ALWAYS = {"#", "token", "piece", "wall", "attn", "mlp", "lm_head"}  # shown even when constant
    # the first to go where space is short
    MINOR = {"embed", "sample", "launches", "syncs", "allocs", "h2d", "prefetched"}

    def _cells(self, r: TokenRecord) -> list[str]:
        from nerva_cli.units import human_bytes

        us = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
        return [str(r.index), str(r.token_id), repr(r.piece)[1:-1][:12], f"{r.wall_us:.0f}",
                us(r.embed_us), us(r.attention_us), us(r.mlp_us), us(r.lm_head_us),
                f"{r.sample_us:.0f}", us(r.mask_us), f"{r.stall_us:.0f}", str(r.kernel_launches), str(sum(r.syncs.values())),
                human_bytes(r.disk_bytes), human_bytes(r.h2d_bytes), f"{r.hits}/{r.faults}", str(r.prefetched),
                f"{r.w4a8_layers}/{r.w4a16_layers}/{r.exact_layers}", str(r.hot_path_allocations)]

    @staticmethod
    def _table(cols, rows):
        from rich.table import Table

        table = Table(title="ledger (per decoded token, times in µs)", header_style="bold", box=None,
                      pad_edge=False)
        for c in cols:
            table.add_column(c, justify="left" if c == "piece" else "right")
        for row in rows:
            table.add_row(*row)
        return table

    @staticmethod
    def _width(console, table) -> int:
        from rich.measure import Measurement

        return Measurement.get(console, console.options.update(max_width=10**4), table).maximum

    def print_table(self, console, every: int = 1) -> None:
        """The table, a token a row; on a terminal too narrow for all of it, the columns that hold
        one value on every row shown are said once under it instead (an 80-column terminal
        squeezed all seventeen into ellipses)."""
        shown = self.records[::max(1, every)]
        cols = self.COLUMNS
        rows = [self._cells(r) for r in shown]
        if all(r.mask_us is None for r in shown):  # no format: no mask column
            at = cols.index("mask")
            cols, rows = cols[:at] + cols[at + 1:], [r[:at] + r[at + 1:] for r in rows]
        table, same = self._table(cols, rows), ""
        narrow = console.width
        if not console.is_terminal:
            console.width = max(narrow, 200)  # piped: one line per token, not a squeezed table
        elif rows and self._width(console, table) > narrow:
            keep = [i for i, c in enumerate(cols) if c in self.ALWAYS or len({r[i] for r in rows}) > 1]
            same = "the same on every token: " + ", ".join(
                f"{c} {rows[0][i]}" for i, c in enumerate(cols) if i not in keep)
            table = self._table([cols[i] for i in keep], [[r[i] for i in keep] for r in rows])
            if self._width(console, table) > narrow:  # still too wide (a paged run's): the minor ones go
                left = [cols[i] for i in keep if cols[i] in self.MINOR]
                keep = [i for i in keep if cols[i] not in self.MINOR]
                same += f"; not shown at this width: {', '.join(left)} (--ledger-file has every column)"
                table = self._table([cols[i] for i in keep], [[r[i] for i in keep] for r in rows])
        try:
            self._print(console, table, same)
        finally:
            console.width = narrow

    def _print(self, console, table, same: str = "") -> None:
        from nerva_cli.units import human_bytes

        console.print(table)
        if same:
            console.print(same)
        s = self.summary()
        if s["tokens"]:
            direct = {True: "O_DIRECT", False: "buffered (page cache hits are not disk reads)",
                      None: "no reads"}[s["direct_io"]]
            rate = "" if s["disk_read_bytes_per_s"] is None else \
                f", {human_bytes(s['disk_read_bytes_per_s'])}/s while reading"
            phases = ("per phase: inside CUDA graphs" if s["attention_us_mean"] is None else
                      f"attention {s['attention_us_mean']:.0f}, mlp {s['mlp_us_mean']:.0f}, "
                      f"lm_head {s['lm_head_us_mean']:.0f}")
            mask = "" if s["mask_us_mean"] is None else f" (the format's mask {s['mask_us_mean']:.0f})"
            console.print(
                f"[bold]summary[/bold] {s['tokens']} tokens, {s['wall_ms_total']:.1f} ms; wall p50 "
                f"{s['wall_us_p50']:.0f} µs, p99 {s['wall_us_p99']:.0f} µs; {phases}, sample "
                f"{s['sample_us_mean']:.0f}{mask}, stall {s['stall_us_mean']:.0f} µs/token; "
                f"{s['kernel_launches_per_token']:.0f} kernels in {s['dispatches_per_token']:.0f} calls (fused "
                f"calls and graph replays count once) and {s['syncs_per_token']:.1f} syncs/token"
                f"{self._sync_kinds(s)}\n"
                f"residency: policy {s['policy']}, {s['resident_layers']} layers resident, {s['paged_layers']} paged "
                f"through slots; disk {human_bytes(s['disk_bytes_per_token'])}/token ({direct}{rate}), host->GPU "
                f"{human_bytes(s['h2d_bytes_per_token'])}/token; hit rate "
                f"{s['hit_rate']:.2%}; hot-path allocations {s['hot_path_allocations']} (the first step's "
                "one-time work included)")
        layers = precision_line(self.engine.layer_precision)
        if layers:
            console.print(layers, markup=False)
