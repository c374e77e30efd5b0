"""EngineOptions: what `run`, `bench`, `topology --model` (and a server) ask of an engine, checked
once, whatever the plan turns out to need, each error naming its flag (a UsageError: exit 2)."""

from __future__ import annotations

from dataclasses import dataclass

from nerva_cli.errors import UsageError
from nerva_cli.residency.expert_cache import DEFAULT_EXPERT_POLICY, EXPERT_POLICIES

BACKENDS = ("auto", "cpu", "cuda", "ref")
PRECISIONS = ("mixed", "w4a16", "w4a8", "exact")
MODES = ("full", "hot-only")
POLICIES = ("ring", "lru")
KV_CACHES = ("f16", "f32")


def _one_of(flag: str, value, choices) -> None:
    if value not in choices:
        raise UsageError(f"{flag} {value}: choose one of {', '.join(choices)}")


@dataclass
class EngineOptions:
    backend: str = "auto"  # auto: cuda where CuPy finds a GPU, else cpu
    precision: str | None = None  # None: mixed where the model is Q4, exact where it is f16/bf16
    tau: float = 0.7  # mixed: the normalised MCAP score from which a layer runs W4A16
    use_profile: bool = True  # False: no MCAP profile, W4A16 on every layer
    mode: str = "full"  # hot-only: only the top active_fraction of layers run
    active_fraction: float = 0.75
    ctx: int | None = None  # None: min(the model's, 4096)
    ctx_given: bool = True  # whether ctx is the user's (a note when past the model's), not one chosen for them
    threads: int = 1  # resolved by hardware.machine.configure_threads
    ram_budget: str | None = None  # 512M, 4G, auto; None: everything in RAM where it fits
    vram_budget: str | None = None  # the same for the GPU; None: auto
    policy: str = "ring"
    expert_policy: str = DEFAULT_EXPERT_POLICY  # a mixture whose experts do not all fit: which cached expert a miss replaces
    kv_cache: str = "f16"
    decodes: bool = True  # whether the caller will decode (not a one-token run): what compiles ahead
    seq_slots: int = 1  # sequences the engine holds at once, each its own KV cache (bench --concurrency)

    def __post_init__(self) -> None:
        from nerva_cli.residency.planner import parse_budget
        from nerva_cli.runtime.mcap import check_fraction, check_tau

        _one_of("--backend", self.backend, BACKENDS)
        if self.precision not in (None, *PRECISIONS):
            raise UsageError(f"--precision {self.precision}: choose mixed, w4a16 or w4a8 (q4_0 and q4_1 models)")
        check_tau(self.tau)
        if self.mode not in MODES:
            raise UsageError(f"--mode {self.mode}: choose full or hot-only")
        check_fraction(self.active_fraction)
        if self.mode == "hot-only" and not self.use_profile:  # before the model is read, not after
            raise UsageError("--mode hot-only picks layers by their MCAP score: drop --no-profile")
        if self.ctx is not None and self.ctx < 1:
            raise UsageError(f"--ctx must be >= 1 (tokens), got {self.ctx}")
        if self.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {self.threads}")
        self.ram_bytes = parse_budget(self.ram_budget, "ram-budget")
        self.vram_bytes = None if self.vram_budget in (None, "auto") else parse_budget(self.vram_budget,
                                                                                        "vram-budget")
        _one_of("--policy", self.policy, POLICIES)
        _one_of("--expert-policy", self.expert_policy, EXPERT_POLICIES)
        _one_of("--kv-cache", self.kv_cache, KV_CACHES)
        if self.seq_slots < 1:
            raise UsageError(f"--concurrency must be >= 1 (sequences), got {self.seq_slots}")
