#!/usr/bin/env python3
"""`nerva bench MODEL --concurrency N` for several N, alternated round by round (a shared machine's
drift falls on every N alike): each N's aggregate decode rate and a sequence's time per token,
their medians over the rounds, and the aggregate's ratio to N = 1's (issue 50's targets: >= 2.0
at 4 sequences, >= 3.0 at 8). One JSON line on stdout (and in --out).

    python3 scripts/concurrency_bench.py [MODEL] [--sequences 1,4,8] [--rounds 3] [--threads T] [--out FILE]

With --llamacpp [GGUF] (llama-cpp-python installed; the bundled SmolLM2 GGUF by default, whose
Q4_1 layers are nerva's smollm2-135m:q4_1) each round also runs llama.cpp's own batched decode
of N sequences on that file, in its own process, as its examples/batched does: one context with
N sequence ids in its KV cache, each prompt decoded alone, then N tokens (one a sequence) a
llama_decode call, greedy; and the JSON adds its aggregate rate and nerva's ratio to it (issue
50's target: >= 1.2 at 4 and 8 sequences).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_line import bench_line, write_line  # noqa: E402

from nerva_cli.hardware.machine import cpu_name  # noqa: E402


LLAMA_CPP_BATCHED = r"""
import json, sys, time
import numpy as np
import llama_cpp as lc
path, threads, n, n_prompt, n_gen, text = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
lc.llama_backend_init()
model = lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
cp = lc.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_seq_max = n * (n_prompt + n_gen) + 64, max(n_prompt, n), n
cp.n_threads = cp.n_threads_batch = threads
ctx = lc.llama_init_from_model(model, cp)
vocab = lc.llama_model_get_vocab(model)
n_vocab = lc.llama_vocab_n_tokens(vocab)
raw = text.encode()
ids = (lc.llama_token * (len(raw) + 8))()
got = lc.llama_tokenize(vocab, raw, len(raw), ids, len(ids), False, False)
tokens = list(ids[:got])
if len(tokens) < 7 * (n - 1) + n_prompt:  # else a prompt would be short and ask no logits
    sys.exit(f'the prompt text is {len(tokens)} tokens; {n} prompts of {n_prompt} need {7 * (n - 1) + n_prompt}')
batch = lc.llama_batch_init(max(n_prompt, n), 0, n)
def put(token, pos, seq, logits):
    i = batch.n_tokens
    batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
    batch.seq_id[i][0] = seq
    batch.n_tokens = i + 1
def greedy(i):
    return int(np.argmax(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,))))
nxt = []
for s in range(n):  # a different prompt a sequence, each decoded alone
    batch.n_tokens = 0
    for p, t in enumerate(tokens[7 * s:7 * s + n_prompt]):
        put(t, p, s, p == n_prompt - 1)
    if lc.llama_decode(ctx, batch) != 0:
        sys.exit("llama_decode failed on a prompt")
    nxt.append(greedy(n_prompt - 1))
t0 = time.perf_counter()
for step in range(n_gen - 1):
    batch.n_tokens = 0
    for s in range(n):
        put(nxt[s], n_prompt + step, s, True)
    if lc.llama_decode(ctx, batch) != 0:
        sys.exit("llama_decode failed on a step")
    nxt = [greedy(s) for s in range(n)]
seconds = time.perf_counter() - t0
print(json.dumps({"aggregate_decode_tok_s": n * (n_gen - 1) / seconds}))
"""


def llama_cpp_batched(gguf: Path, n: int, args: argparse.Namespace) -> float:
    """llama.cpp's aggregate decode rate over n sequences (LLAMA_CPP_BATCHED, its own process)."""
    from nerva_cli.runtime.bench import PROMPT_SEED_TEXT

    text = PROMPT_SEED_TEXT * ((args.prompt_tokens + 7 * n) // 40 + 2)
    done = subprocess.run([sys.executable, "-c", LLAMA_CPP_BATCHED, str(gguf), str(args.threads), str(n),
                           str(args.prompt_tokens), str(args.gen_tokens), text], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp's batched decode failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["aggregate_decode_tok_s"]


def bench(model: str, n: int, args: argparse.Namespace) -> dict:
    return bench_line(model, "--concurrency", str(n), "--threads", str(args.threads), "--prompt-tokens",
                      str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens), "--repeat", "1", *args.flags.split())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m:q4_0")
    ap.add_argument("--sequences", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--flags", default="--no-profile --precision w4a8", help="more `nerva bench` flags")
    ap.add_argument("--llamacpp", type=Path, nargs="?", const=Path("bundled"), metavar="GGUF",
                    help="also llama.cpp's batched decode on this GGUF (default: the bundled SmolLM2's)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    gguf = args.llamacpp
    if gguf == Path("bundled"):
        from nerva_cli.store.sources.resolve import bundled_gguf

        gguf = bundled_gguf("smollm2-135m")
    counts = [int(n) for n in args.sequences.split(",")]
    runs: dict[int, list[dict]] = {n: [] for n in counts}
    peer: dict[int, list[float]] = {n: [] for n in counts}
    for r in range(args.rounds):
        for n in (counts if r % 2 == 0 else counts[::-1]):
            if gguf is not None:
                peer[n].append(round(llama_cpp_batched(gguf, n, args), 2))
                print(f"round {r + 1}/{args.rounds}, {n} sequences: llama.cpp {peer[n][-1]} tok/s", file=sys.stderr)
            line = bench(args.model, n, args)
            runs[n].append({"aggregate_tok_s": line["aggregate_decode_tok_s"],
                            "sequence_token_ms_p50": line["per_sequence_token_ms_p50"],
                            "hot_path_allocations": line["hot_path_allocations"]})
            print(f"round {r + 1}/{args.rounds}, {n} sequences: {line['aggregate_decode_tok_s']} tok/s", file=sys.stderr)
    median = {n: statistics.median(x["aggregate_tok_s"] for x in v) for n, v in runs.items()}
    one = median.get(1)
    result = {"what": "nerva bench --concurrency N, alternated (scripts/concurrency_bench.py)", "cpu": cpu_name(),
              "cores": os.cpu_count(), "model": args.model, "threads": args.threads, "flags": args.flags,
              "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens, "rounds": args.rounds,
              "runs": {str(n): v for n, v in runs.items()},
              "aggregate_tok_s_median": {str(n): m for n, m in median.items()},
              "sequence_token_ms_p50_median": {str(n): statistics.median(x["sequence_token_ms_p50"] for x in v)
                                               for n, v in runs.items()},
              "ratio_to_one": {str(n): round(m / one, 3) for n, m in median.items()} if one else None,
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if gguf is not None:
        import llama_cpp

        theirs = {n: statistics.median(v) for n, v in peer.items()}
        result.update(llamacpp={"gguf": str(gguf), "llama_cpp_python": llama_cpp.__version__,
                                "aggregate_tok_s": {str(n): v for n, v in peer.items()},
                                "aggregate_tok_s_median": {str(n): m for n, m in theirs.items()}},
                      vs_llamacpp={str(n): round(median[n] / theirs[n], 3) for n in counts})
    write_line(result, args.out)


if __name__ == "__main__":
    main()
