"""The frame every engine shares (cpu and ref in planes/cpu/engine.py, cuda in planes/cuda/engine.py).

EngineBase owns what does not depend on where the kernels run: the options' checks, the per-layer
precisions, the prompt's and the step's checks, prefill's chunking, the lm_head's precision, the
weight bytes, the counters the ledger and bench read, and the description of where the weights
live. A plane fills in its steps (`_prefill_chunk`, `_last_logits`, `_logits_rows`, `decode`)
and its own preparation (`prepare`); callers use these names and never ask which plane they hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nerva_cli.errors import NervaError, UsageError
from nerva_cli.model.config import ModelConfig
from nerva_cli.model.layout import layer_file
from nerva_cli.store.catalog import StoredModel

PRECISIONS = ("w4a8", "w4a16", "exact")


def context_length(cfg: ModelConfig, ctx: int | None) -> int:
    """--ctx, or min(model max, 4096) when not given; never past the model's max."""
    if ctx is not None and ctx < 1:
        raise UsageError(f"--ctx must be >= 1 (tokens), got {ctx}")
    return min(ctx or min(cfg.max_context, 4096), cfg.max_context)


def default_precision(model: StoredModel, precision: str | None) -> str:
    if model.variant in ("f16", "bf16"):
        if precision not in (None, "exact"):
            raise NervaError(f"{model.name}:{model.variant} is an exact variant; --precision {precision} "
                             "needs a q4_0 or q4_1 variant (nerva pull SOURCE --quant q4_0)")
        return "exact"
    if precision in (None, "mixed"):
        return "w4a16"  # per-layer mixed dispatch needs an MCAP profile; until then W4A16
    if precision not in ("w4a16", "w4a8"):
        raise NervaError(f"--precision {precision}: {model.variant} models run at w4a16 or w4a8")
    return precision


@dataclass
class Counters:
    """Work the engine did, counted where it happens: `kernels`, the kernels it ran (a fused call
    or a replayed graph counts each kernel inside it); `dispatches`, the calls the host made to
    run them (a fused call or a graph replay counts once); `syncs`, host waits for a device, by
    kind."""

    kernels: int = 0
    dispatches: int = 0
    syncs: dict = field(default_factory=dict)

    def snapshot(self) -> tuple[int, int, dict]:
        return self.kernels, self.dispatches, dict(self.syncs)


class EngineBase:
    """What every engine keeps the same way. A plane sets, in its __init__: model, cfg, backend,
    ctx (context_length), the layer precisions (set_precisions), plan (the residency plan: its
    resident_layers, paged_layers, budget, table_aside), weights (with stats and close()), a (the
    arena, with kv_bytes), kv_cache, policy, phase_ns (None where phases cannot be told apart) and
    counters."""

    backend: str
    device_sampling = False  # whether `stream` samples on the device (cuda)
    peak_vram_bytes = 0
    n_past: int
    layer_precision: dict[int, str]
    counters: Counters

    def set_precisions(self, model: StoredModel, precision: str | None, layer_precisions: list[str] | None,
                       active_layers: list[int] | None) -> None:
        """precision: --precision; layer_precisions: MCAP's per-layer w4a16/w4a8 (mixed); active
        layers: hot-only mode's (the others pass the residual on)."""
        cfg = model.config
        self.precision = default_precision(model, precision)
        if layer_precisions is not None:
            if self.precision == "exact" or len(layer_precisions) != cfg.num_layers or \
                    not set(layer_precisions) <= {"w4a16", "w4a8"}:
                raise NervaError("per-layer precisions need a q4_0 or q4_1 model and one of w4a16/w4a8 per layer")
            self.precision = "mixed"
        per_layer = layer_precisions or [self.precision] * cfg.num_layers
        self.active = sorted(set(range(cfg.num_layers) if active_layers is None else active_layers))
        self.layer_precision = {i: per_layer[i] for i in self.active}

    @property
    def head_precision(self) -> str:
        """The lm_head's: W4A8 only where every layer runs it; an exact head ignores it."""
        return "w4a8" if self.precision == "w4a8" else "w4a16"

    @property
    def precision_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(PRECISIONS, 0)
        for p in self.layer_precision.values():
            counts[p] += 1
        return counts

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights a token reads: the active layers' files, the token table's and an
        untied lm_head's (a token reads one row of the table, but it is held all the same); of a
        mixture's layer, the dense part and the experts a token runs."""
        files, cfg = self.model.meta["files"], self.cfg
        idle = {i: (cfg.num_experts - cfg.experts_per_token) * self.expert_bytes for i in cfg.moe_layers}
        return sum(files[layer_file(i)]["size"] - idle.get(i, 0) for i in self.active) + \
            sum(files[f]["size"] for f in ("embed.bin", "lm_head.bin") if f in files)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert (layout.expert_bytes); 0 for a dense model."""
        from nerva_cli.model.layout import expert_bytes

        return expert_bytes(self.cfg, self.model.meta["files"])

    # -- positions ---------------------------------------------------------------------------
    def reset(self) -> None:
        self.n_past = 0

    def truncate(self, n: int) -> int:
        """Forget positions from n on (the cache rows are simply overwritten later); -> the
        positions kept (n, or fewer where the engine no longer holds what n of them need)."""
        self.n_past = min(self.n_past, n)
        return self.n_past

    def check_token(self, token: int) -> None:
        if not 0 <= token < self.cfg.vocab_size:
            raise NervaError(f"token id {token} is outside the vocabulary (0..{self.cfg.vocab_size - 1})")

    def check_decode(self, token: int) -> None:
        self.check_token(token)
        if self.n_past >= self.ctx:
            raise NervaError(f"context is full ({self.ctx} tokens); raise --ctx")

    # -- prefill -----------------------------------------------------------------------------
    def prefill(self, tokens: list[int], all_logits: bool = False) -> np.ndarray:
        """Runs the prompt in chunks of `prefill_chunk` tokens; -> the last position's logits (an
        array the caller may keep until the next call), or [T, vocab] for all."""
        if not tokens:
            raise NervaError("empty prompt")
        if self.n_past + len(tokens) > self.ctx:
            raise NervaError(f"prompt of {len(tokens)} tokens does not fit the context "
                             f"({self.ctx - self.n_past} left); raise --ctx")
        for t in tokens:
            self.check_token(t)
        outs, x, rows = [], None, 0
        for start in range(0, len(tokens), self.prefill_chunk):
            chunk = tokens[start:start + self.prefill_chunk]
            x, rows = self._prefill_chunk(chunk), len(chunk)
            if all_logits:
                outs.append(self._logits_rows(x))
        if all_logits:
            return outs[0] if len(outs) == 1 else np.concatenate(outs)
        return self._last_logits(x[rows - 1])

    # -- what callers show -------------------------------------------------------------------
    @property
    def device_name(self) -> str:
        from nerva_cli.hardware.machine import cpu_name

        return cpu_name()

    def runtime_line(self, threads: int) -> str:
        """Where it runs, in a few words (the chat's banner)."""
        return f"{self.backend}, {threads} threads"

    @property
    def budgets(self) -> dict:
        """The budgets the plan was made for (bytes; None: none)."""
        return {"ram_budget": self.plan.budget, "vram_budget": None}

    def plane_facts(self) -> dict:
        """What bench reports of this plane beyond the shared fields."""
        return {}

    def count_hot_path_allocations(self, prompt: list[int], steps: int) -> int:
        """Decode steps after warm-up, counted by AllocationCounter (greedy sampling included);
        anything > 0 is a bug. The engine is reset before and after."""
        from nerva_cli.runtime.hotpath import AllocationCounter
        from nerva_cli.runtime.sampling import Sampler, SamplingOptions

        self.reset()
        sampler = Sampler(SamplingOptions(temperature=0.0), self.cfg.vocab_size)
        token = sampler(self.prefill(prompt))
        for _ in range(2):  # warm-up: first calls may compile or cache
            token = sampler(self.decode(token))
        with AllocationCounter() as counter:
            for _ in range(steps):
                with counter.step():
                    token = sampler(self.decode(token))
        self.reset()
        return counter.count

    def residency_lines(self) -> list[str]:
        """What a run says about where the weights live, where that is not simply "all of them
        in memory"."""
        return []

    def prepare(self, threads: int, decodes: bool, say=None, working=None) -> None:
        """What a plane does before an answer starts, once the engine is built (cpu: threads, and
        compiling the decode kernels ahead of the answer); `say(text)` reports, `working(title)`
        is a context manager shown while it works, yielding status(detail) for its progress."""

    def load_kernels_aside(self, threads: int, also=lambda: None):
        """Loads on a thread what a first answer would load on the way, then calls also(); ->
        None where there is nothing to load, else ready(quiet=False), which waits for it (see the
        cpu plane's)."""
        return None

    def close(self) -> None:
        from nerva_cli.store.locks import release

        self.weights.close()
        release(self.model)  # open_engine's hold: rm may remove the model now
