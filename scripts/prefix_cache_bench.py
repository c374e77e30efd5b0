#!/usr/bin/env python3
"""The prompt cache across requests, as a user of `nerva serve` meets it: a chat request whose
~1,400-token system prompt the request before it also sent, against the cold one that read it
first. Three times per trial, each trial its own system prompt (so its first request is cold):

  cold    the first request with this system prompt (nothing cached)
  same    a second question, same system prompt: its slot's cache holds the prompt's start
  other   a third, sent while a long answer holds that slot: it runs in the other slot, which
          copies the whole prefill chunks from the busy one (Engine.copy_prefix)

and, after all trials, once more for each trial's system prompt but the last one's:

  returning  by then other trials' prompts hold both slots, so its whole chunks come from the
             server's prompt cache in RAM (`--prompt-cache`, residency/prompt_cache.py)

Time to first token is the client's wall time to a 1-token answer (`max_tokens` 1, not
streamed). One JSON line: each kind's TTFTs, medians, cached_tokens and the ratios to cold
(the issue's target: <= 0.25).

    python3 scripts/prefix_cache_bench.py [--model smollm2-135m] [--trials 5] [--threads N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_line import write_line  # noqa: E402
from serve_bench import start_server  # noqa: E402  (the same server start as serve_bench's)

from nerva_cli.hardware.machine import cpu_name  # noqa: E402

SYSTEM = ("You are the assistant of a small bakery in a seaside town. The bakery opens at six, sells bread, "
          "pastries and cakes, and takes orders for weddings a month ahead. Answer briefly and politely. ")


def ask(url: str, model: str, system: str, question: str, max_tokens: int = 1) -> tuple[float, dict]:
    body = json.dumps({"model": model, "max_tokens": max_tokens, "temperature": 0,
                       "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as r:
        answer = json.loads(r.read())
    return time.perf_counter() - t0, answer["usage"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    proc, url = start_server(args.model, 2, args.threads, 2048, 8)
    rows = {"cold": [], "same": [], "other": [], "returning": []}
    systems = [f"Session {trial}. " + SYSTEM * 33 for trial in range(args.trials)]  # some 1,400 tokens each
    try:
        ask(url, args.model, "Warm-up.", "Hi")  # the load and first compile are no request's
        for trial in range(args.trials):
            system = systems[trial]
            for kind, question in (("cold", "When do you open?"), ("same", "Do you sell cakes?")):
                rows[kind].append(ask(url, args.model, system, question))
            # a long answer holds the slot with the cache; the next request runs in the other one
            busy = threading.Thread(target=ask, args=(url, args.model, system, "Tell me everything.", 120))
            busy.start()
            time.sleep(1.0)  # its prefill (all cached) is done and it is decoding
            rows["other"].append(ask(url, args.model, system, "Can I order a wedding cake?"))
            busy.join()
            print(f"trial {trial + 1}/{args.trials}: " + ", ".join(
                f"{k} {v[-1][0] * 1000:.0f} ms ({v[-1][1]['prompt_tokens_details']['cached_tokens']} cached)"
                for k, v in rows.items() if v), file=sys.stderr)
        for system in systems[:-1]:  # the last trial's prompt is in both slots: the rest only in the prompt cache
            rows["returning"].append(ask(url, args.model, system, "Are you open on Sundays?"))
    finally:
        proc.terminate()
        proc.wait()
    median = {k: statistics.median(t for t, _ in v) for k, v in rows.items()}
    line = {"what": "TTFT of a request sharing a ~1,400-token system prompt with the one before it "
                    "(scripts/prefix_cache_bench.py)",
            "cpu": cpu_name(), "cores": os.cpu_count(), "model": args.model, "threads": args.threads,
            "server_parallel": 2, "prompt_tokens": rows["cold"][0][1]["prompt_tokens"],
            **{f"{k}_ttft_ms": [round(t * 1000, 1) for t, _ in v] for k, v in rows.items()},
            **{f"{k}_cached_tokens": [u["prompt_tokens_details"]["cached_tokens"] for _, u in v] for k, v in rows.items()},
            **{f"{k}_ttft_ms_median": round(m * 1000, 1) for k, m in median.items()},
            "same_to_cold": round(median["same"] / median["cold"], 3),
            "other_to_cold": round(median["other"] / median["cold"], 3),
            "returning_to_cold": round(median["returning"] / median["cold"], 3),
            "date": time.strftime("%Y-%m-%d")}
    write_line(line, args.out)


if __name__ == "__main__":
    main()
