#!/usr/bin/env python3
"""`nerva serve` under N concurrent clients on loopback: time to first token and time per output
token (p50, p99, as each client sees them), aggregate tok/s and refusals, for N = 1, 2, 4, 8; and
the server's overhead: one client's decode rate against `nerva bench`'s on the same model, same
threads, measured in the same run (the ratio is what to read on a shared machine).

    python3 scripts/serve_bench.py [--model smollm2-135m] [--parallel 4] [--out docs/perf/serve_FILE.json]

The server starts as a user starts it (a subprocess, a free loopback port, --threads as given)
with `--parallel P`: P requests run at once, each on its own engine, one engine step at a time
(serve/scheduler.py); clients past P wait in its queue. Each client sends --requests requests in
turn from a fixed mix of prompts, streamed from /api/generate at temperature 0, every answer
at most --max-tokens long (raw prompts the model goes on with; an answer that ends at its EOS
sooner counts the tokens it made). One JSON line on stdout (and in --out).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from nerva_cli.hardware.machine import cpu_name

PROMPTS = [  # a fixed mix of lengths, each one SmolLM2 goes on with for hundreds of tokens at temperature 0
    "1, 2, 3, 4, 5,",
    "The lighthouse keeper climbed the stairs each night and lit the lamp. Ships passed in the dark, "
    "and none of them knew his name. One winter night a storm came in from the sea, and",
    "Here is a long list of fruits: apple, banana, cherry,",
    "Chapter 1\n\nIt was a cold morning in the village when",
]


def start_server(model: str, parallel: int, threads: int, ctx: int, max_queue: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("NERVA_HOST", "NERVA_API_KEY")}
    proc = subprocess.Popen([sys.executable, "-m", "nerva_cli", "serve", model, "--port", str(port), "--parallel",
                             str(parallel), "--threads", str(threads), "--ctx", str(ctx), "--max-queue",
                             str(max_queue), "--keep-alive", "-1"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            sys.exit(f"the server exited: {proc.stderr.read()}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return proc, url
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                proc.kill()
                sys.exit("the server was not ready within 600 s")
            time.sleep(0.2)


def one_request(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """A streamed /api/generate: client-side arrival times of its tokens, or its refusal."""
    body = json.dumps({"model": model, "prompt": prompt, "raw": True, "stream": True,
                       "options": {"temperature": 0, "num_predict": max_tokens, "repeat_penalty": 1.0}}).encode()
    request = urllib.request.Request(f"{url}/api/generate", data=body, headers={"Content-Type": "application/json"})
    sent = time.perf_counter()
    arrivals, done = [], None
    try:
        with urllib.request.urlopen(request, timeout=600) as r:
            for line in r:
                obj = json.loads(line)
                arrivals.append(time.perf_counter())
                if obj.get("done"):
                    done = obj
    except urllib.error.HTTPError as e:
        if e.code == 503:
            return {"rejected": True}
        raise
    tokens = done["eval_count"]
    # one NDJSON line per token that adds text; the done line ends it: TTFT is its first line,
    # time per output token the mean gap of the rest, as the client saw them
    first = arrivals[0] - sent
    tpot = (arrivals[-1] - arrivals[0]) / max(1, tokens - 1)
    return {"rejected": False, "ttft": first, "tpot": tpot, "tokens": tokens, "start": sent, "end": arrivals[-1]}


def run_clients(url: str, model: str, clients: int, requests: int, max_tokens: int) -> dict:
    results: list[dict] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        for i in range(requests):
            r = one_request(url, model, PROMPTS[(k + i) % len(PROMPTS)], max_tokens)
            with lock:
                results.append(r)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    ok = [r for r in results if not r["rejected"]]
    ttft = np.array([r["ttft"] for r in ok]) * 1000
    tpot = np.array([r["tpot"] for r in ok if r["tokens"] > 1]) * 1000
    return {"clients": clients, "requests": len(results), "rejected": len(results) - len(ok),
            "ttft_ms_p50": round(float(np.percentile(ttft, 50)), 1), "ttft_ms_p99": round(float(np.percentile(ttft, 99)), 1),
            "tpot_ms_p50": round(float(np.percentile(tpot, 50)), 2), "tpot_ms_p99": round(float(np.percentile(tpot, 99)), 2),
            "aggregate_tok_s": round(sum(r["tokens"] for r in ok) / wall, 2), "wall_s": round(wall, 2)}


def nerva_bench(model: str, threads: int, ctx: int, max_tokens: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "nerva_cli", "bench", model, "--threads", str(threads), "--ctx",
                          str(ctx), "--gen-tokens", str(max_tokens), "--prompt-tokens", "32", "--repeat", "3"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--clients", default="1,2,4,8", help="comma-separated client counts")
    ap.add_argument("--parallel", type=int, default=4, help="the server's --parallel")
    ap.add_argument("--requests", type=int, default=3, help="requests per client, one after the other")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2, help="bench / one-client rounds, interleaved")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    counts = [int(c) for c in a.clients.split(",")]
    bench_rates, one_client = [], []
    subprocess.run([sys.executable, "-m", "nerva_cli", "pull", a.model], check=True, stdout=subprocess.DEVNULL)
    proc, url = start_server(a.model, a.parallel, a.threads, a.ctx, max_queue=max(counts) * a.requests)
    try:
        run_clients(url, a.model, 1, 1, 8)  # a warm-up: the first answer's allocations and caches
        runs = [run_clients(url, a.model, n, a.requests, a.max_tokens) for n in counts]
        # the overhead: one client through the server against `nerva bench` in its own process,
        # alternating so that drift on a shared machine hits both (the server idles meanwhile)
        for _ in range(a.rounds):
            bench_rates.append(nerva_bench(a.model, a.threads, a.ctx, a.max_tokens)["decode_tok_s"])
            one = run_clients(url, a.model, 1, a.requests, a.max_tokens)
            one_client.append(1000 / one["tpot_ms_p50"])
    finally:
        proc.terminate()
        proc.wait(30)
    bench_tok_s, served_tok_s = float(np.median(bench_rates)), float(np.median(one_client))
    result = {"what": "nerva serve, N concurrent streaming clients on loopback (scripts/serve_bench.py)",
              "cpu": cpu_name(), "cores": os.cpu_count(), "model": a.model, "threads": a.threads,
              "server_parallel": a.parallel, "max_tokens": a.max_tokens, "requests_per_client": a.requests,
              "runs": runs, "bench_decode_tok_s": round(bench_tok_s, 2),
              "one_client_decode_tok_s": round(served_tok_s, 2),
              "server_overhead": round(1 - served_tok_s / bench_tok_s, 4),
              "bench_rounds": bench_rates, "one_client_rounds": [round(x, 2) for x in one_client],
              "date": time.strftime("%Y-%m-%d")}
    line = json.dumps(result)
    print(line)
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
