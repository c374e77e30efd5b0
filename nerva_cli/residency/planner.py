"""Where every block lives (ARCHITECTURE 8): ResidentBlock, its state machine, and the planner
that fits blocks into tier budgets. Tier-generic: on a machine without a GPU the tiers are
`host` (RAM, hot) and `disk` (the layer files, cold); the CUDA plane adds `gpu` above them."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum

from nerva_cli.errors import NervaError, UsageError


class State(str, Enum):
    UNMAPPED = "Unmapped"
    ALLOCATED = "Allocated"
    PREFETCHING = "Prefetching"
    READY = "Ready"
    IN_USE = "InUse"
    EVICTING = "Evicting"


# Unmapped -> Allocated -> Prefetching -> Ready -> InUse -> Ready -> Evicting -> Unmapped
TRANSITIONS = {
    State.UNMAPPED: {State.ALLOCATED},
    State.ALLOCATED: {State.PREFETCHING, State.UNMAPPED},
    State.PREFETCHING: {State.READY},
    State.READY: {State.IN_USE, State.EVICTING},
    State.IN_USE: {State.READY},
    State.EVICTING: {State.UNMAPPED, State.ALLOCATED},
}


class IllegalTransition(NervaError):
    pass


@dataclass
class ResidentBlock:
    kind: str  # layer / embed / lm_head / norms / kv_cache / workspace / slot
    name: str
    nbytes: int
    tier: str  # gpu / host / disk
    state: State = State.UNMAPPED
    version: int = 0  # bumps each time the block's bytes are (re)loaded
    importance: float = 0.0
    next_use: int = -1  # position in the decode cycle, -1 when not scheduled

    def move(self, to: State) -> None:
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"block {self.name}: {self.state.value} -> {to.value} is not allowed")
        if to is State.READY and self.state is State.PREFETCHING:
            self.version += 1
        self.state = to

    def require_ready(self) -> None:
        """Nothing computes on a block that is not Ready."""
        if self.state is not State.READY:
            raise IllegalTransition(f"block {self.name} is {self.state.value}, not Ready: cannot compute on it")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)


def parse_budget(text: str | None, what: str) -> int | None:
    """'512M', '2G', '1.5GiB', '123456' -> bytes; 'auto' -> MemAvailable less 10%; None -> None."""
    if text is None:
        return None
    if text.strip().lower() == "auto":
        return int(available_ram() * 0.9)
    m = _SIZE.match(text)
    if not m:
        raise UsageError(f"--{what} {text!r}: expected a size like 512M, 4G or auto")
    unit = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * unit)


def available_ram() -> int:
    from nerva_cli.hardware.machine import proc_kb

    avail = proc_kb("/proc/meminfo", "MemAvailable")
    if avail is not None:
        return avail
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclass
class Plan:
    """What goes where: fixed blocks first, then layers by importance, the rest through slots."""

    budget: int | None
    fixed: list[ResidentBlock]
    resident_layers: list[int]
    paged_layers: list[int]  # in decode order
    slots: int
    slot_bytes: int
    layer_bytes: dict[int, int] = field(default_factory=dict)
    table_aside: bool = False  # the token table is not among `fixed`: plan_table_aside put it elsewhere
    # a mixture whose experts do not all fit: each MoE layer's dense part is resident (its
    # layer_bytes), and `expert_slots` of its routed experts (`expert_bytes` each) are cached in RAM
    expert_slots: int = 0
    expert_bytes: int = 0
    expert_layers: list[int] = field(default_factory=list)

    @property
    def used_bytes(self) -> int:
        return (sum(b.nbytes for b in self.fixed) + sum(self.layer_bytes[i] for i in self.resident_layers)
                + self.slots * self.slot_bytes + len(self.expert_layers) * self.expert_slots * self.expert_bytes)

    @property
    def paged_bytes_per_token(self) -> int:
        return sum(self.layer_bytes[i] for i in self.paged_layers)

    def to_dict(self) -> dict:
        return {"budget": self.budget, "used_bytes": self.used_bytes,
                "fixed": {b.name: b.nbytes for b in self.fixed},
                "resident_layers": self.resident_layers, "paged_layers": self.paged_layers,
                "slots": self.slots, "slot_bytes": self.slot_bytes,
                "paged_bytes_per_token": self.paged_bytes_per_token, "token_table_aside": self.table_aside,
                **({"expert_cache": {"layers": len(self.expert_layers), "slots_per_layer": self.expert_slots,
                                     "expert_bytes": self.expert_bytes}} if self.expert_layers else {})}


MIN_SLOTS = 2
FIXED_NAMES = {"kv_cache": "KV cache", "workspace": "workspaces", "embed": "token table", "lm_head": "lm_head",
               "norms": "norms"}  # kind -> what the budget errors call it


class BudgetTooSmall(NervaError):
    """The budget cannot hold the fixed blocks and the staging slots (`slots_bytes` of them)."""

    def __init__(self, message: str, slots_bytes: int):
        super().__init__(message)
        self.slots_bytes = slots_bytes


def fitting_ctx(fixed_bytes_at, budget: int, ctx: int, step: int = 256) -> int | None:
    """The longest context under `ctx`, a multiple of `step`, whose fixed part (fixed_bytes_at(n):
    the KV cache and the workspaces grow with the context) fits `budget`; None if not even `step`."""
    lo, hi = 1, (ctx - 1) // step  # in steps: lo fits, nothing past hi is under ctx
    if hi < 1 or fixed_bytes_at(step) > budget:
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fixed_bytes_at(mid * step) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo * step


def plan_model(model, ctx: int, budget: int | None, importance: dict[int, float] | None,
               active_layers: list[int] | None, workspace_at, budget_name: str = "RAM budget") -> Plan:
    """The residency plan of a stored model, from sizes alone, for either plane: workspace_at(n)
    gives the plane's KV cache and workspaces at a context of n positions (name -> (kind,
    bytes)); the token table, final norm and an untied lm_head are fixed beside them, and the
    active layers go resident most important first (plan_table_aside). A budget too small is
    refused naming `budget_name`, the context and the longest one that fits."""
    from nerva_cli.model.layout import layer_file

    cfg, files = model.config, model.meta["files"]
    untied = "lm_head.bin" in files  # else the token table is the lm_head, read whole every token

    def fixed_at(n: int, with_table: bool = True) -> dict:
        fixed = {**workspace_at(n), **({"embed": ("embed", files["embed.bin"]["size"])} if with_table else {}),
                 "norms": ("norms", files["final_norm.bin"]["size"])}
        if untied:
            fixed["lm_head"] = ("lm_head", files["lm_head.bin"]["size"])
        return fixed

    def error(e: BudgetTooSmall, with_table: bool) -> NervaError:
        return NervaError(str(e).replace("RAM budget", budget_name)
                          + ctx_hint(lambda n: fixed_at(n, with_table), budget, e.slots_bytes, ctx))

    active = range(cfg.num_layers) if active_layers is None else sorted(set(active_layers))
    layer_bytes = {i: files[layer_file(i)]["size"] for i in active}
    if cfg.num_experts and budget is not None and sum(b for _, b in fixed_at(ctx).values()) \
            + sum(layer_bytes.values()) > budget:
        try:
            return plan_experts(model, fixed_at(ctx), layer_bytes, budget)
        except BudgetTooSmall as e:
            raise error(e, True) from None
    return plan_table_aside(lambda with_table: fixed_at(ctx, with_table), layer_bytes, budget, importance, untied,
                            error)


def ctx_hint(fixed_at, budget: int, slots_bytes: int, ctx: int) -> str:
    """What a budget error adds: the context it was for and, where a shorter one's fixed part
    (fixed_at(n): name -> (kind, bytes)) and the staging slots fit the budget, the longest such."""
    from nerva_cli.units import human_bytes

    fits = fitting_ctx(lambda n: sum(b for _, b in fixed_at(n).values()), budget - slots_bytes, ctx)
    return f" at --ctx {ctx}" + ("" if fits is None else f"; --ctx {fits} fits {human_bytes(budget)}")


def plan_table_aside(fixed_at, layer_bytes: dict[int, int], budget: int | None, importance: dict[int, float] | None,
                     untied: bool, error) -> Plan:
    """plan() over fixed_at(with_table) (name -> (kind, bytes)), and, where the token table is
    untied (a token reads one row of it; tied, it is the lm_head, read whole), without it too, when
    the plan with it pages layers or does not fit: the table can stay where its rows are read in
    place (the file on a CPU, pinned RAM for a GPU), leaving its bytes to layers that would
    otherwise be copied every token. The plan that pages fewer bytes, its `table_aside` saying
    which; error(e, with_table) makes the NervaError for a BudgetTooSmall e."""
    def attempt(with_table: bool) -> Plan:
        try:
            return plan(fixed_at(with_table), layer_bytes, budget, importance)
        except BudgetTooSmall as e:
            raise error(e, with_table) from None

    try:
        with_table = attempt(True)
    except NervaError:
        if not untied:
            raise
        with_table = None  # the error without the table is the one to report, if it comes
    if untied and (with_table is None or with_table.paged_layers):
        without = attempt(False)
        if with_table is None or without.paged_bytes_per_token < with_table.paged_bytes_per_token:
            without.table_aside = True
            return without
    return with_table


def plan(fixed: dict[str, tuple[str, int]], layer_bytes: dict[int, int], budget: int | None,
         importance: dict[int, float] | None = None, slots: int = MIN_SLOTS) -> Plan:
    """fixed: name -> (kind, bytes) that must be resident; layer_bytes: layer -> bytes in RAM.

    Layers go resident most important first (layer order while there is no profile); what does
    not fit streams through `slots` staging slots, each as large as the largest paged layer.
    """
    blocks = [ResidentBlock(kind, name, n, "host", State.ALLOCATED) for name, (kind, n) in fixed.items()]
    fixed_bytes = sum(b.nbytes for b in blocks)
    if budget is None or fixed_bytes + sum(layer_bytes.values()) <= budget:
        return Plan(budget, blocks, sorted(layer_bytes), [], 0, 0, dict(layer_bytes))
    slot = max(layer_bytes.values())
    minimum = fixed_bytes + slots * slot
    if budget < minimum:
        from nerva_cli.units import human_bytes

        by_kind: dict[str, int] = {}
        for b in blocks:
            by_kind[b.kind] = by_kind.get(b.kind, 0) + b.nbytes
        parts = ", ".join(f"{FIXED_NAMES.get(k, k)} {human_bytes(n)}" for k, n in by_kind.items())
        holds = f"the fixed part ({parts}: {human_bytes(fixed_bytes)}) plus " if blocks else ""
        raise BudgetTooSmall(f"RAM budget {human_bytes(budget)} cannot hold {holds}{slots} staging slots of "
                             f"{human_bytes(slot)}; the smallest budget that works is {human_bytes(minimum)} "
                             f"({minimum} bytes)", slots * slot)
    order = sorted(layer_bytes, key=lambda i: (-(importance or {}).get(i, 0.0), i))
    room = budget - minimum
    resident = []
    for i in order:
        if layer_bytes[i] <= room:
            resident.append(i)
            room -= layer_bytes[i]
    paged = [i for i in sorted(layer_bytes) if i not in resident]
    if not paged:  # everything fitted once the slots' room was counted: no slots needed
        return Plan(budget, blocks, sorted(layer_bytes), [], 0, 0, dict(layer_bytes))
    return Plan(budget, blocks, sorted(resident), paged, slots, slot, dict(layer_bytes))


def plan_experts(model, fixed: dict[str, tuple[str, int]], layer_bytes: dict[int, int], budget: int) -> Plan:
    """A mixture that does not fit the budget whole: the fixed blocks, every layer's dense part
    (attention, router, shared expert: what every token reads) and a staging buffer resident,
    and in what is left, as many slots for routed experts as fit in each MoE layer alike (at least
    the experts a token chooses, at most all of them); the rest are read from their files on a
    miss (residency/expert_cache.py)."""
    from nerva_cli.model.layout import expert_bytes, expert_span, layer_file
    from nerva_cli.store.catalog import ALIGN
    from nerva_cli.units import human_bytes

    cfg, files = model.config, model.meta["files"]
    span = expert_bytes(cfg, files)
    moe = [i for i in sorted(layer_bytes) if i in cfg.moe_layers]
    dense = {i: expert_span(files[layer_file(i)]["tensors"], 0)[0] if i in moe else n for i, n in layer_bytes.items()}
    blocks = [ResidentBlock(kind, name, n, "host", State.ALLOCATED) for name, (kind, n) in fixed.items()]
    blocks.append(ResidentBlock("workspace", "expert staging", -(-span // ALIGN) * ALIGN, "host", State.ALLOCATED))
    fixed_bytes = sum(b.nbytes for b in blocks)
    least = cfg.experts_per_token * span * len(moe)
    minimum = fixed_bytes + sum(dense.values()) + least
    if budget < minimum:
        raise BudgetTooSmall(
            f"RAM budget {human_bytes(budget)} cannot hold the fixed part ({human_bytes(fixed_bytes)}), every "
            f"layer's dense part ({human_bytes(sum(dense.values()))}: attention, the router and any shared expert, which "
            f"every token reads) and {cfg.experts_per_token} experts a MoE layer ({human_bytes(least)}); the "
            f"smallest budget that works is {human_bytes(minimum)} ({minimum} bytes)",
            minimum - fixed_bytes + blocks[-1].nbytes)
    slots = min(cfg.num_experts, (budget - fixed_bytes - sum(dense.values())) // (span * len(moe)))
    return Plan(budget, blocks, sorted(dense), [], 0, 0, dense, expert_slots=slots, expert_bytes=span,
                expert_layers=moe)
