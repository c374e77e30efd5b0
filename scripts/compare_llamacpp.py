#!/usr/bin/env python3
"""nerva (cpu; q4_1 and q4_0; mixed precision, the default, then W4A16 and W4A8 on every layer)
against llama.cpp (llama-cpp-python) on the bundled SmolLM2 GGUF, same threads, same run: decode
tok/s over 128 tokens and prefill tok/s over ~250 tokens. The GGUF's layers are Q4_1, so nerva's
q4_1 variant (what `pull` makes) runs the same weights as llama.cpp; q4_0 is requantised from
them (fewer bytes, a third more perplexity).

    pip install llama-cpp-python   # builds llama.cpp from source, ~10 min on 2 cores
    python3 scripts/compare_llamacpp.py [--out docs/perf/cpu_vs_llamacpp.json]

On a 2-core Intel Xeon VM with AMX (2026-11-24), llama.cpp's native build faulted at its first
matmul, in its AMX path (ldtilecfg, a general protection fault), although the kernel granted the
process AMX (arch_prctl ARCH_GET_XCOMP_PERM listed the tile state): build it for the CPU's
vector extensions without AMX there, e.g. CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON
-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX_VNNI=ON". The
JSON records llama.cpp's own list of the features it was built with.

Each engine runs in its own process, one after the other, repeated and interleaved so drift on
a shared machine hits both; the ratios are what to read, not the absolute figures.

With --ppl FILE both also score FILE's text, as `nerva bench --ppl` does: nerva's token ids, in
non-overlapping windows of --ppl-ctx tokens whose first token is context only, exp(mean NLL).
llama.cpp gets the same ids (so a tokenizer difference cannot move its figure), all logits of a
window from one batch. docs/perf's figures score gpl3.txt, made by
    python3 -c "t=open('/usr/share/common-licenses/GPL-3').read(); print(' '.join(t.split(' ')[:3800]), end='')"
(4,774 tokens, 4,764 scored in 512-token windows).

With --gguf FILE it compares on that file instead, converted into the store as compare-<file stem>
(in its own format, no requantised q4_0; `nerva rm` it after; a later run on the same file
keeps that conversion) and run with --no-profile at W4A16 and at W4A8 on every layer: for a
bigger model of random weights from `scripts/synthetic_model.py SHAPE FILE --gguf [--vocab
VOCAB.gguf]`, whose MCAP profile would mean nothing (decode and prefill speed do not depend on
weight values). At 8B shapes on two cores, e.g.

    python3 scripts/compare_llamacpp.py --gguf llama3-8b.gguf --threads 2 --prompt-tokens 128 512 \
        --gen-tokens 32 --rounds 1 --repeat 1 --out docs/perf/cpu_vs_llamacpp_<cpu>_llama3_8b_shape.json An F16
or BF16 GGUF (`--quant f16` there) is pulled as that exact variant and run exact: llama.cpp's
f16 path against nerva's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

LLAMA_CPP = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama
path, threads, n_prompt, n_gen, text, repeat = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                                                sys.argv[5], int(sys.argv[6]))
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_prompt + n_gen + 64,
            n_batch=512, verbose=False)
prompt = llm.tokenize(text.encode(), add_bos=False)[:n_prompt]
def last_logits():
    # Llama.scores is only filled with logits_all; the context holds the last token's row
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
def once():
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    t1 = time.perf_counter()
    tok = int(np.argmax(last_logits()))
    steps = []
    for _ in range(n_gen):
        t = time.perf_counter()
        llm.eval([tok])
        tok = int(np.argmax(last_logits()))
        steps.append(time.perf_counter() - t)
    return len(prompt) / (t1 - t0), len(steps) / sum(steps)
once()  # warm-up
runs = [once() for _ in range(repeat)]
print(json.dumps({"prefill_tok_s": float(np.median([r[0] for r in runs])),
                  "decode_tok_s": float(np.median([r[1] for r in runs])), "prompt_tokens": len(prompt)}))
"""


VARIANTS = ("q4_1", "q4_0")


def nerva(model: str, threads: int, precision: str, n_prompt: int, n_gen: int, repeat: int,
          profile: bool = True) -> dict:
    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-m", "nerva_cli", "bench", model, "--threads", str(threads),
                          "--precision", precision, "--prompt-tokens", str(n_prompt),
                          "--gen-tokens", str(n_gen), "--repeat", str(repeat), *([] if profile else ["--no-profile"])],
                         capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(f"nerva bench failed: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout)


LLAMA_CPP_PPL = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
path, threads, window, ids_file = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ids = json.loads(open(ids_file).read())
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=window, n_batch=window,
            n_ubatch=window, logits_all=True, verbose=False)
nll, count = 0.0, 0
for start in range(0, len(ids) - 1, window):
    chunk = ids[start:start + window]
    if len(chunk) < 2:
        break
    llm.reset()
    llm.eval(chunk)
    logits = np.array(llm.scores[:len(chunk)], dtype=np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    targets = np.asarray(chunk[1:])
    nll -= logp[np.arange(len(targets)), targets].sum()
    count += len(targets)
print(json.dumps({"perplexity": float(np.exp(nll / count)), "ppl_tokens": count}))
"""


def llama_cpp_perplexity(gguf: Path, threads: int, window: int, ids: list[int]) -> dict:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(ids, f)
        f.flush()
        out = subprocess.run([sys.executable, "-c", LLAMA_CPP_PPL, str(gguf), str(threads), str(window), f.name],
                             capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"llama.cpp perplexity failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def nerva_perplexity(model: str, threads: int, precision: str, ppl: Path, window: int) -> dict:
    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-m", "nerva_cli", "bench", model, "--threads", str(threads),
                          "--precision", precision, "--ppl", str(ppl), "--ppl-ctx", str(window),
                          "--prompt-tokens", "16", "--gen-tokens", "4", "--repeat", "1"],
                         capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(f"nerva bench --ppl failed: {out.stderr.strip().splitlines()[-1]}")
    r = json.loads(out.stdout)
    return {"perplexity": r["perplexity"], "ppl_tokens": r["ppl_tokens"]}


def llama_cpp(gguf: Path, threads: int, n_prompt: int, n_gen: int, text: str, repeat: int) -> dict:
    out = subprocess.run([sys.executable, "-c", LLAMA_CPP, str(gguf), str(threads), str(n_prompt),
                          str(n_gen), text, str(repeat)], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"llama.cpp run failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from nerva_cli.hardware import topology
    from nerva_cli.runtime.bench import PROMPT_SEED_TEXT
    from nerva_cli.hardware.machine import cpu_name
    from nerva_cli.store.sources.resolve import bundled_gguf

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/perf/cpu_vs_llamacpp.json"))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[250],
                    help="prompt lengths: prefill is timed over each, decode after each")
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per configuration")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs inside each engine's process (median)")
    ap.add_argument("--ppl", type=Path, help="also score this text file's perplexity with both engines")
    ap.add_argument("--ppl-ctx", type=int, default=512, help="perplexity window, in tokens")
    ap.add_argument("--gguf", type=Path, help="compare on this GGUF (random weights: W4A16 and W4A8, or exact for "
                                              "an F16/BF16 file; no profile) instead of the bundled SmolLM2")
    args = ap.parse_args()
    if args.gguf is not None and args.ppl is not None:
        sys.exit("--ppl scores the bundled SmolLM2 only (a --gguf of random weights has no perplexity to compare)")

    import llama_cpp as lc  # fail early, with pip's message, if it is missing

    if args.gguf is None:
        gguf, name = bundled_gguf("smollm2-135m"), "smollm2-135m"
        variants, precisions = VARIANTS, ("mixed", "w4a16", "w4a8")
        for quant in variants:  # already there: pull says so and nothing changes
            subprocess.run([sys.executable, "-m", "nerva_cli", "pull", name, "--quant", quant], capture_output=True)
    else:
        from nerva_cli.store.sources.resolve import open_source

        gguf, name = args.gguf.resolve(), f"compare-{args.gguf.stem}"
        layers = open_source(str(gguf)).tensors("layers.0.q").stored_dtype
        exact = layers in ("f16", "bf16")  # `pull` would make q4_0 of these: ask for the exact variant
        precisions = ("exact",) if exact else ("w4a16", "w4a8")
        again = ["--force"] if converted_before(name, gguf) is None else []  # an 8B file converts in minutes
        pulled = subprocess.run([sys.executable, "-m", "nerva_cli", "pull", str(gguf), "--name", name, *again,
                                 *(["--quant", layers] if exact else [])], capture_output=True, text=True)
        if pulled.returncode:
            sys.exit(f"nerva pull {gguf} failed: {pulled.stderr.strip().splitlines()[-1]}")
        variants = (pulled.stdout.split()[0].split(":")[1],)  # "name:variant  ...": the GGUF's own format
    text = PROMPT_SEED_TEXT * (max(args.prompt_tokens) // 40 + 2)
    configs = [(v, p) for v in variants for p in precisions]
    rows = []
    for threads, n_prompt in ((t, n) for t in args.threads for n in args.prompt_tokens):
        samples: dict = {"llama.cpp": [], **{c: [] for c in configs}}
        for _ in range(args.rounds):
            samples["llama.cpp"].append(llama_cpp(gguf, threads, n_prompt, args.gen_tokens, text, args.repeat))
            for variant, precision in configs:
                samples[variant, precision].append(nerva(f"{name}:{variant}", threads, precision, n_prompt,
                                                         args.gen_tokens, args.repeat, profile=args.gguf is None))
        med = {k: {f: statistics.median(s[f] for s in v) for f in ("prefill_tok_s", "decode_tok_s")}
               for k, v in samples.items()}
        peer = med["llama.cpp"]
        for variant, precision in configs:
            ours = med[variant, precision]
            rows.append({
                "threads": threads, "prompt_tokens": n_prompt, "variant": variant, "precision": precision,
                "nerva_decode_tok_s": round(ours["decode_tok_s"], 2),
                "llamacpp_decode_tok_s": round(peer["decode_tok_s"], 2),
                "decode_ratio": round(ours["decode_tok_s"] / peer["decode_tok_s"], 3),
                "nerva_prefill_tok_s": round(ours["prefill_tok_s"], 2),
                "llamacpp_prefill_tok_s": round(peer["prefill_tok_s"], 2),
                "prefill_ratio": round(ours["prefill_tok_s"] / peer["prefill_tok_s"], 3),
            })
            print(json.dumps(rows[-1]), flush=True)
    what = ("nerva cpu vs llama.cpp on the bundled SmolLM2-135M-Instruct GGUF (Q4_1 layers, a Q8_0 "
            "token table that is also the lm_head; nerva's q4_1 keeps both as they are, its q4_0 "
            "requantises the layers)") if args.gguf is None else (
            f"nerva cpu vs llama.cpp on {gguf.name} (random weights; nerva keeps the GGUF's formats and "
            + ("runs them exact)" if precisions == ("exact",) else
               "runs --no-profile at W4A16, then W4A8, on every layer)"))
    result = {
        "what": what, "commit": nerva_commit(),
        "machine": {"cpu": cpu_name(), "logical_cpus": os.cpu_count(), "simd": topology.cpu()["simd"]},
        "llama_cpp_python": lc.__version__, "llama_cpp_features": lc.llama_print_system_info().decode().strip(),
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens, "rounds": args.rounds, "repeat": args.repeat,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows,
    }
    if args.ppl is not None:
        result["perplexity"] = perplexities(args, gguf, configs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


def converted_before(name: str, gguf: Path):
    """The store's model `name` where it was converted from this very file (its fingerprint
    unchanged), else None."""
    from nerva_cli.errors import NervaError
    from nerva_cli.store.catalog import find_model
    from nerva_cli.store.pull import source_changed

    try:
        model = find_model(name)
    except NervaError:
        return None
    return None if source_changed(model, str(gguf)) else model


def nerva_commit() -> str | None:
    """The checkout's commit, with "-dirty" when files differ from it; None outside a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def perplexities(args, gguf: Path, configs: list) -> dict:
    """Both engines' perplexity over args.ppl on nerva's token ids, at the first thread count; nerva's
    f16 variant too, which holds the GGUF's weights rounded to f16 and no activation rounding (so
    it separates nerva's arithmetic from what a format or W4A8 changes)."""
    from nerva_cli.store.catalog import find_model
    from nerva_cli.store.tokenizer import TextTokenizer

    threads = args.threads[0]
    ids = TextTokenizer(find_model("smollm2-135m:q4_1").path).encode(args.ppl.read_text(errors="replace"),
                                                                      add_special=False)
    peer = llama_cpp_perplexity(gguf, threads, args.ppl_ctx, ids)
    result = {"file": args.ppl.name, "window": args.ppl_ctx, "tokens": peer["ppl_tokens"],
              "llamacpp": round(peer["perplexity"], 4), "nerva": {}}
    subprocess.run([sys.executable, "-m", "nerva_cli", "pull", "smollm2-135m", "--quant", "f16"], capture_output=True)
    for variant, precision in [*configs, ("f16", "exact")]:
        ours = nerva_perplexity(f"smollm2-135m:{variant}", threads, precision, args.ppl, args.ppl_ctx)
        if ours["ppl_tokens"] != peer["ppl_tokens"]:
            sys.exit(f"perplexity: nerva scored {ours['ppl_tokens']} tokens, llama.cpp {peer['ppl_tokens']}")
        result["nerva"][f"{variant} {precision}"] = {"perplexity": ours["perplexity"],
                                                    "over_llamacpp": round(ours["perplexity"] / peer["perplexity"], 4)}
        print(json.dumps({"perplexity": f"{variant} {precision}", **result["nerva"][f"{variant} {precision}"],
                          "llamacpp": result["llamacpp"]}), flush=True)
    return result


if __name__ == "__main__":
    main()
