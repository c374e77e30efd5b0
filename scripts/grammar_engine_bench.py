"""Per-token mask time of the constrained-sampling engines nerva could use (llguidance, xgrammar)
on a JSON Schema, for the tokenizers given: the measurement behind structured output's choice
(docs/perf/grammar_engines.md). Each engine walks the same valid document token by token,
computing the allowed-token mask before each token; the figure is the median and p95 of those.

    python3 scripts/grammar_engine_bench.py DIR [DIR ...]   # model dirs holding tokenizer.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from nerva_cli.hardware.machine import cpu_name

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "kind", "tags", "address"],
}
DOCUMENT = {"name": "Ada Lovelace, Countess of Lovelace", "age": 36, "kind": "cat",
            "tags": ["mathematician", "writer", "analyst"], "address": {"city": "London", "zip": "12345"}}


def summary(times: list[float], setup_s: float) -> dict:
    times = sorted(times)
    return {"tokens": len(times), "median_us": round(statistics.median(times) * 1e6, 1),
            "p95_us": round(times[int(0.95 * (len(times) - 1))] * 1e6, 1),
            "max_us": round(times[-1] * 1e6, 1), "setup_s": round(setup_s, 3)}


def bench_llguidance(tok_dir: Path, vocab: int, tokens: list[int]) -> dict:
    import llguidance
    import llguidance.numpy as lln
    t1 = time.perf_counter()
    lltok = llguidance.LLTokenizer((tok_dir / "tokenizer.json").read_text(), n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    matcher = llguidance.LLMatcher(lltok, grammar)
    mask = lln.allocate_token_bitmask(1, vocab)
    setup = time.perf_counter() - t1
    times = []
    for t in tokens:
        s = time.perf_counter()
        lln.fill_next_token_bitmask(matcher, mask)
        times.append(time.perf_counter() - s)
        if not (mask[0, t >> 5] >> (t & 31)) & 1 or not matcher.consume_token(t):
            raise SystemExit(f"llguidance refused token {t}: {matcher.get_error()}")
    return summary(times, setup)


def bench_xgrammar(tok_dir: Path, vocab: int, tokens: list[int]) -> dict:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast
    t1 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    setup = time.perf_counter() - t1
    times = []
    for t in tokens:
        s = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - s)
        if not (int(mask[0, t >> 5]) >> (t & 31)) & 1 or not matcher.accept_token(t):
            raise SystemExit(f"xgrammar refused token {t}")
    return summary(times, setup)


def _import_s(module: str) -> float | None:
    import subprocess
    import sys

    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return round(float(done.stdout), 3) if done.returncode == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="directories holding a tokenizer.json")
    ap.add_argument("--repeat", type=int, default=3, help="walks of the document per engine (default 3)")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    text = json.dumps(DOCUMENT)
    # each engine's import is timed from a fresh process: one's imports must not count as the other's
    imports = {m: _import_s(m) for m in ("llguidance", "xgrammar")}
    rows = []
    for d in args.dirs:
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        vocab = tok.get_vocab_size(with_added_tokens=True)
        tokens = tok.encode(text, add_special_tokens=False).ids
        for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
            try:
                runs = [fn(d, vocab, tokens) for _ in range(args.repeat)]
            except ImportError as e:
                rows.append({"tokenizer": str(d), "engine": name, "skipped": str(e)})
                continue
            best = min(runs, key=lambda r: r["median_us"])
            rows.append({"tokenizer": d.name, "vocab": vocab, "engine": name, **best,
                         "setup_s_first": runs[0]["setup_s"]})
    print(json.dumps({"cpu": cpu_name(), "document": DOCUMENT, "schema": SCHEMA, "import_s_fresh": imports, "rows": rows}))


if __name__ == "__main__":
    main()
