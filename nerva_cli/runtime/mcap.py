"""MCAP: per-layer importance from calibration prompts (seed 002, 3.1; ARCHITECTURE 10).

Score of layer i: the mean over every calibration token of ||[Q x, V x]|| + ||FFN(x')||, with x
the attention-norm output and x' the MLP-norm output. Streaming: all prompts pass layer 0, then
layer 1..., so one layer's weights are in memory at a time. The profile is cached per
architecture with the weights' fingerprint and a hash of the prompts' token ids; it drives mixed precision
(score >= tau runs W4A16, the rest W4A8) and hot-only mode (only the top layers run).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nerva_cli.errors import BadInput, UsageError
from nerva_cli.store.catalog import StoredModel, home, store_dir

FORMAT = "nerva-profile/1"
DEFAULT_TAU = 0.7
MAX_PROMPT_TOKENS = 512  # activations grow with prompt length; the score is a per-token mean
SHIPPED_DIR = Path(__file__).resolve().parents[2] / "profiles"

# Two halves (0-5, 6-11) of the same mix of tasks, so the split-half check compares like with like.
PROMPTS = [
    "Question: Why does the Moon show phases over a month, and why do we always see the same side of it? "
    "Answer:",
    "A farmer has 17 sheep. All but 9 run away, then he buys twice as many as he has left. How many "
    "sheep does he have now? Let's think step by step.",
    "def merge_intervals(intervals):\n    \"\"\"Merge overlapping [start, end] intervals and return them "
    "sorted.\"\"\"\n    intervals = sorted(intervals)\n    merged = []\n    for start, end in intervals:\n",
    "Summarise in one sentence: The city council voted on Tuesday to turn the old rail yard into a park "
    "with a community garden, a playground and a bike path. Construction starts next spring and is "
    "paid for by a state grant and private donations. Summary:",
    "Traduisez en anglais : « Le train de huit heures est parti en retard à cause de la neige, mais "
    "tous les voyageurs sont arrivés à temps pour la réunion. »",
    "SELECT customers.name, COUNT(orders.id) AS order_count\nFROM customers\nLEFT JOIN orders ON "
    "orders.customer_id = customers.id\nWHERE orders.created_at >= '2024-01-01'\n",
    "Q: What is the difference between weather and climate? Give one example of each.\nA:",
    "If every bloop is a razzie and some razzies are lazzies, does it follow that some bloops are "
    "lazzies? Explain the reasoning before giving the answer.",
    "function debounce(fn, ms) {\n  // Return a function that runs fn only after ms milliseconds "
    "without another call.\n  let timer;\n  return function (...args) {\n",
    "Article: Researchers tracked 2,000 commuters for a year and found that people who cycled to work "
    "took fewer sick days and reported better sleep than those who drove, even after accounting for "
    "age and income.\nTL;DR:",
    "Explica en español por qué el cielo es azul durante el día y rojizo al atardecer, en dos o tres "
    "frases sencillas.",
    "Beantworte kurz auf Deutsch: Welche drei Vorteile hat es, Wasser zu sparen, und wie kann man im "
    "Haushalt damit anfangen?",
]


def calibration_ids(model: StoredModel, prompts: list[str]) -> list[list[int]]:
    from nerva_cli.store.tokenizer import open_tokenizer

    tok = open_tokenizer(model.path)
    ids = [tok.encode(p, add_special=True)[:MAX_PROMPT_TOKENS] for p in prompts]
    if any(len(t) == 0 for t in ids):
        raise BadInput("a calibration prompt encodes to no tokens")
    return ids


def prompts_hash(ids: list[list[int]]) -> str:
    """Of the token ids, not the texts: a changed tokenizer changes the profile too."""
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def read_prompts(path: Path) -> list[str]:
    """A JSON array of strings, or one prompt per non-empty line."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise BadInput(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: cannot read it ({e})") from None
    if text.lstrip().startswith("["):
        try:
            prompts = json.loads(text)
        except json.JSONDecodeError as e:
            raise BadInput(f"{path}: not a valid JSON array of prompts ({e})") from None
        if not all(isinstance(p, str) for p in prompts):
            raise BadInput(f"{path}: the JSON array must hold strings")
    else:
        prompts = text.splitlines()
    prompts = [p for p in prompts if p.strip()]
    if len(prompts) < 2:
        raise BadInput(f"{path}: {len(prompts)} prompt(s); need at least 2 (one per line, or a JSON "
                       "array) for the split-half check")
    return prompts


def check_tau(tau: float) -> float:
    if not 0.0 <= tau <= 1.0:
        raise UsageError(f"--tau must be between 0 and 1 (a normalised score), got {tau}")
    return tau


def check_fraction(fraction: float) -> float:
    if not 0.0 < fraction <= 1.0:
        raise UsageError(f"--active-fraction must be in (0, 1], got {fraction}")
    return fraction


# -- measuring ---------------------------------------------------------------------------------

@dataclass
class Measurement:
    sums: np.ndarray  # [layers, prompts]: per-token magnitudes summed over each prompt
    tokens: np.ndarray  # [prompts]
    seconds: float
    peak_rss_bytes: int  # the process's, numba's runtime included
    # a mixture's: per MoE layer, the experts each calibration token chose, prompt by prompt
    # ([tokens, k] each), the trace expert_statistics is made of; None for a dense model
    routes: dict[int, list[np.ndarray]] | None = None

    def scores(self, prompts: slice = slice(None)) -> np.ndarray:
        return self.sums[:, prompts].sum(axis=1) / self.tokens[prompts].sum()


def profiling_precision(model: StoredModel) -> str:
    return "exact" if model.variant in ("f16", "bf16") else "w4a16"


def measure(model: StoredModel, prompts: list[str], backend: str = "cpu", progress=None) -> Measurement:
    """Runs every prompt through the model one layer at a time; see the module doc."""
    from nerva_cli.runtime.bench import peak_rss_bytes
    from nerva_cli.planes.cpu.engine import Engine, Layer
    from nerva_cli.model.layout import layer_file

    t0 = time.perf_counter()
    cfg = model.config
    if progress:  # before the engine, whose first build compiles the prefill kernels
        progress("starting", 0, cfg.num_layers)
    ids = calibration_ids(model, prompts)
    precision = profiling_precision(model)
    # the f32 KV cache: a profile is computed once and cached, so it takes the exact arithmetic
    longest = max(map(len, ids))  # a prompt goes through a layer in one pass
    engine = Engine(model, backend=backend, precision=precision, ctx=longest, active_layers=[],
                    kv_cache="f32", prefill_rows=longest)
    xs = [engine.embed_rows(t[: engine.ctx]) for t in ids]
    sums = np.zeros((cfg.num_layers, len(prompts)))
    qd, vd = cfg.q_dim, cfg.q_dim + cfg.kv_dim
    routes: dict[int, list[np.ndarray]] | None = {i: [] for i in cfg.moe_layers} if cfg.num_experts else None
    for i in range(cfg.num_layers):
        if progress:
            progress(f"layer {i}", i, cfg.num_layers)
        # Every layer borrows KV cache slot 0 and every prompt starts at position 0: a prompt
        # reads only the rows it has just written, so one layer's KV rows are held, not all. Its
        # RoPE tables and window are its own (SmolLM3's NoPE layers, Gemma 3's full ones).
        layer = Layer.from_stored(i, model.read_file(layer_file(i)), precision)
        for j, x in enumerate(xs):
            taps: dict = {}
            engine.expert_trace = [] if layer.moe is not None else None
            engine.prefill_layer(layer, x, start=0, taps=taps, slot=0)
            if engine.expert_trace:
                routes[i].append(np.concatenate([ids for _, ids in engine.expert_trace]))
            qkv = taps["qkv"].astype(np.float64)
            attn = np.sqrt((qkv[:, :qd] ** 2).sum(1) + (qkv[:, vd:] ** 2).sum(1))
            ffn = np.linalg.norm(taps["mlp"].astype(np.float64), axis=1)
            sums[i, j] = (attn + ffn).sum()
        del layer, taps  # before the next layer loads: one layer in memory
    if progress:
        progress("done", cfg.num_layers, cfg.num_layers)
    return Measurement(sums, np.array([x.shape[0] for x in xs], dtype=np.float64),
                       time.perf_counter() - t0, peak_rss_bytes(), routes)


def expert_statistics(routes: dict[int, list[np.ndarray]], experts: int) -> dict:
    """What a cache of a mixture's experts would see in the calibration tokens, per MoE layer:
    each expert's share of the choices (frequency), the share of a token's experts the token
    before it in the same prompt chose too (reuse: what keeping the last token's experts would
    hit), and the share of the choices the most chosen eighth of the experts take."""
    layers = {}
    for i, per_prompt in routes.items():
        chosen = np.concatenate(per_prompt)
        counts = np.bincount(chosen.ravel(), minlength=experts)
        k = chosen.shape[1]
        again = [len(set(a) & set(b)) for ids in per_prompt for a, b in zip(ids[1:], ids[:-1])]
        top = np.sort(counts)[::-1][:max(1, experts // 8)].sum()
        layers[str(i)] = {"frequency": [round(float(c) / counts.sum(), 5) for c in counts],
                          "reuse": round(sum(again) / (k * len(again)), 4) if again else None,
                          "top_eighth_share": round(float(top) / counts.sum(), 4)}
    reuse = [v["reuse"] for v in layers.values() if v["reuse"] is not None]
    return {"layers": layers, "reuse": round(float(np.mean(reuse)), 4) if reuse else None,
            "top_eighth_share": round(float(np.mean([v["top_eighth_share"] for v in layers.values()])), 4)}


# -- the profile -------------------------------------------------------------------------------

def _sig(v: float, digits: int = 5) -> float:
    return float(f"{v:.{digits}g}")


def normalise(scores: np.ndarray) -> np.ndarray:
    lo, hi = float(scores.min()), float(scores.max())
    if hi - lo <= 1e-9 * max(abs(hi), 1e-30):
        return np.zeros_like(scores)  # no outlier: nothing stands out, every layer is equal
    return (scores - lo) / (hi - lo)


def top_k(scores, k: int) -> list[int]:
    """Indices of the k highest scores; ties go to the lower index (deterministic)."""
    return sorted(sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k])


def split_half_overlap(m: Measurement) -> float:
    """|top-k(first half of prompts) & top-k(second half)| / k, k = half the layers."""
    half = m.sums.shape[1] // 2
    a, b = m.scores(slice(0, half)), m.scores(slice(half, None))
    k = max(1, len(a) // 2)
    return len(set(top_k(a, k)) & set(top_k(b, k))) / k


def build_profile(model: StoredModel, prompts: list[str], m: Measurement) -> dict:
    """Everything in it follows from the weights and the prompts: no times, so the same model
    and prompts give the same bytes (timings are printed, not stored)."""
    raw = m.scores()
    return {
        "format": FORMAT, "arch_hash": model.meta["arch_hash"],
        "weights_fingerprint": model.meta["weights_fingerprint"], "variant": model.variant,
        "precision": profiling_precision(model), "prompts_hash": prompts_hash(calibration_ids(model, prompts)),
        "prompts": len(prompts), "tokens": int(m.tokens.sum()),
        "split_half_overlap": round(split_half_overlap(m), 4),
        "scores": [_sig(s) for s in raw], "normalized": [round(float(s), 4) for s in normalise(raw)],
        **({"experts": expert_statistics(m.routes, model.config.num_experts)} if m.routes else {}),
    }


def dumps(profile: dict) -> str:
    return json.dumps(profile, separators=(",", ":")) + "\n"


def cache_path(model: StoredModel) -> Path:
    return home() / "profiles" / f"{model.meta['arch_hash']}.json"


def _matching(path: Path, model: StoredModel, want_prompts: str) -> dict | None:
    try:
        p = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # missing or damaged: profile again
    ok = (p.get("format") == FORMAT and p.get("weights_fingerprint") == model.meta.get("weights_fingerprint")
          and p.get("prompts_hash") == want_prompts and len(p.get("normalized", [])) == model.config.num_layers)
    return p if ok else None


@dataclass
class ProfileResult:
    profile: dict
    path: Path
    origin: str  # shipped / cached / computed
    measurement: Measurement | None = None


def find_profile(model: StoredModel, prompts: list[str] | None = None) -> ProfileResult | None:
    """The shipped profile, else the cached one; each counts only for the same weights
    (fingerprint) and the same prompts."""
    if "weights_fingerprint" not in model.meta or "arch_hash" not in model.meta:
        raise BadInput(f"{model.path / 'metadata.json'}: no weights_fingerprint/arch_hash "
                       "(converted by an older nerva? convert it again)")
    want = prompts_hash(calibration_ids(model, prompts or PROMPTS))
    shipped = SHIPPED_DIR / f"{model.meta['arch_hash']}.json"
    for origin, path in (("shipped", shipped), ("cached", cache_path(model))):
        found = _matching(path, model, want)
        if found is not None:
            return ProfileResult(found, path, origin)
    return None


def get_profile(model: StoredModel, prompts: list[str] | None = None, backend: str = "cpu",
                progress=None) -> ProfileResult:
    """find_profile's, else a fresh one, written to the cache."""
    found = find_profile(model, prompts)
    if found is not None:
        return found
    prompts = prompts or PROMPTS
    store_dir("profiles")  # a store nerva cannot write is said before the minutes of measuring
    m = measure(model, prompts, backend=backend, progress=progress)
    profile = build_profile(model, prompts, m)
    path = cache_path(model)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(dumps(profile))
    os.replace(tmp, path)  # atomic: a reader never sees half a profile
    return ProfileResult(profile, path, "computed", m)


# -- dispatch ----------------------------------------------------------------------------------

def layer_precisions(profile: dict, tau: float) -> list[str]:
    return ["w4a16" if s >= tau else "w4a8" for s in profile["normalized"]]


def hot_layers(profile: dict, fraction: float) -> list[int]:
    """The top `fraction` of layers by score (at least one)."""
    n = len(profile["scores"])
    keep = max(1, math.ceil(fraction * n - 1e-9))  # 1e-9: 0.7 * 30 is 21.000000000000004
    return top_k(profile["scores"], keep)


def precision_line(per_layer: dict[int, str], tau: float | None = None) -> str | None:
    """Which layers run at which precision, in a line: "mixed precision (tau 0.7): W4A16 on
    layer(s) 0, 2, W4A8 on the other 1" (what --verbose, the ledger and `show` print); None for an
    exact model, whose layers have no choice."""
    if set(per_layer.values()) <= {"exact"}:
        return None
    hi = [i for i, p in sorted(per_layer.items()) if p == "w4a16"]
    head = f"mixed precision (tau {tau})" if tau is not None else "precision"
    if len(hi) in (0, len(per_layer)):
        return f"{head}: {'W4A16' if hi else 'W4A8'} on all {len(per_layer)} layers"
    return f"{head}: W4A16 on layer(s) {', '.join(map(str, hi))}, W4A8 on the other {len(per_layer) - len(hi)}"


@dataclass
class LayerPlan:
    precision: str | None  # what Engine gets
    layer_precisions: list[str] | None = None
    active_layers: list[int] | None = None
    importance: dict[int, float] | None = None  # normalised scores, for the residency planner
    mixed: str | None = None  # mixed precision's precision_line: a verbose run's to print


def plan_layers(model: StoredModel, precision: str | None, tau: float, use_profile: bool, mode: str,
                fraction: float, backend: str = "cpu", progress=None, log=lambda s: None) -> LayerPlan:
    """Turns --precision/--tau/--no-profile/--mode/--active-fraction into Engine arguments,
    profiling the model first when it has no profile yet."""
    check_tau(tau)
    check_fraction(fraction)
    if mode not in ("full", "hot-only"):
        raise UsageError(f"--mode {mode}: choose full or hot-only")
    if precision not in (None, "mixed", "w4a16", "w4a8", "exact"):
        raise UsageError(f"--precision {precision}: choose mixed, w4a16 or w4a8 (q4_0 and q4_1 models)")
    exact = model.variant in ("f16", "bf16")
    mixed = precision in (None, "mixed") and not exact
    hot = mode == "hot-only"
    if hot and model.config.num_experts:
        raise UsageError(f"--mode hot-only skips whole layers of a dense model; {model.name} is a mixture of "
                         "experts, whose experts are chosen a token at a time: use --mode full")
    if hot and not use_profile:
        raise UsageError("--mode hot-only picks layers by their MCAP score: drop --no-profile")
    if mixed and not use_profile:
        log("--no-profile: every layer runs W4A16")
        return LayerPlan("w4a16")
    plan = LayerPlan(None if precision == "mixed" else precision)
    if mixed or hot:
        result = get_profile(model, backend=backend, progress=progress)
    else:  # a forced precision needs no profile; one already at hand still guides residency
        result = find_profile(model) if use_profile else None
    if result is None:
        return plan
    if result.origin == "computed":
        log(f"MCAP profile computed in {result.measurement.seconds:.1f} s -> {result.path}")
    prof = result.profile
    plan.importance = dict(enumerate(prof["normalized"]))
    if mixed:
        plan.precision = "w4a16"
        plan.layer_precisions = layer_precisions(prof, tau)
        plan.mixed = precision_line(dict(enumerate(plan.layer_precisions)), tau)
    if hot:
        plan.active_layers = hot_layers(prof, fraction)
        n, kept = len(prof["scores"]), len(plan.active_layers)
        log(f"hot-only: {kept} of {n} layers run (the rest pass the residual through); outputs will "
            "differ from the full model" if kept < n else f"hot-only: all {n} layers run at this fraction")
    return plan
