#!/usr/bin/env python3
"""Start-up to the first token: `nerva run MODEL -p Hi -n 1 --no-server` timed as a user runs it,
from one or more checkouts alternated run by run (a shared machine's load then falls on all of
them alike), each checkout's modules compiled to bytecode first as an install's are, and after a
run each that compiles what a first run compiles.

    python3 scripts/startup_bench.py [--tree DIR ...] [--runs 7] [--threads N] [--out FILE.json]

Per checkout, one JSON line: the time to the answer's first byte, the wall time to the process's
end and the CPU time (user + sys) of each run, and their medians; then, from one more run each with `-X importtime` and a tracing driver, what it spent
where: the import time of each big package (the self times of its modules), the tokenizer's
build, the weights' read, numba's cache loads (how many, how long), the prefill, all wall-clock
(one run: read it beside the medians, not for them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

# imports by package, self times summed (a package's cumulative time depends on who imports it first)
PACKAGES = {"numba": "numba", "llvmlite": "numba", "numpy": "numpy", "typer": "typer",
            "rich": "rich", "jinja2": "jinja2", "markupsafe": "jinja2", "tokenizers": "tokenizers",
            "nerva_cli": "nerva_cli", "scipy": "scipy, yaml", "yaml": "scipy, yaml"}

# Run inside the measured process: wraps the steps whose time is not an import, then runs nerva.
DRIVER = r"""
import json, sys, time
marks, loads = {}, []
def timed(owner, name, label):
    f = getattr(owner, name)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            marks[label] = marks.get(label, 0.0) + time.perf_counter() - t
    setattr(owner, name, w)
import nerva_cli.planes as planes, nerva_cli.store.tokenizer as tk, nerva_cli.store.catalog as catalog
import nerva_cli.planes.base as base
timed(tk.TextTokenizer, "__init__", "tokenizer build")
timed(catalog.StoredModel, "read_file", "weights read")
timed(base.EngineBase, "prefill", "prefill (with its cache loads)")
backend = planes.get_backend
def get_backend(name):
    t = time.perf_counter()
    module = backend(name)
    marks["kernels import (numba)"] = time.perf_counter() - t
    from numba.core.caching import Cache
    load = Cache.load_overload
    def counted(self, sig, ctx):
        t = time.perf_counter()
        try:
            return load(self, sig, ctx)
        finally:
            loads.append(time.perf_counter() - t)
    Cache.load_overload = counted
    return module
planes.get_backend = get_backend
import atexit
atexit.register(lambda: sys.stderr.write("\nBREAKDOWN " + json.dumps(
    {**{k: round(v, 3) for k, v in marks.items()}, "cache loads": len(loads), "cache loads s": round(sum(loads), 3)}) + "\n"))
sys.argv = ["nerva", *sys.argv[1:]]
from nerva_cli.cli.app import main
main()
"""


def run_once(tree: Path, args: list[str], extra: list[str] = ()) -> tuple[float, float, float, str]:
    """(s to the answer's first byte on stdout, wall s, CPU s of the child, its stderr)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    child = subprocess.Popen([sys.executable, *extra, *args], cwd=tree, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    err: list[str] = []  # drained meanwhile: -X importtime writes more than a pipe holds before the answer
    drain = threading.Thread(target=lambda: err.append(child.stderr.read()))
    drain.start()
    child.stdout.read(1)
    first = time.perf_counter() - t
    child.stdout.read()
    child.wait()
    drain.join()
    err = err[0]
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if child.returncode:
        sys.exit(f"{tree}: exit {child.returncode}: {err[-2000:]}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return first, wall, cpu, err


def breakdown(tree: Path, nerva_args: list[str]) -> dict:
    *_, err = run_once(tree, ["-X", "importtime", "-c", DRIVER, *nerva_args])
    imports: dict[str, float] = {}
    for line in err.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+\d+ \| *(\S+)", line)
        if m:
            group = PACKAGES.get(m.group(2).split(".")[0], "other")
            imports[group] = imports.get(group, 0) + int(m.group(1)) / 1e6
    found = re.search(r"^BREAKDOWN (.*)$", err, re.M)
    return {"imports s (self, by package)": {k: round(v, 3) for k, v in sorted(imports.items(), key=lambda kv: -kv[1])},
            "imports s": round(sum(imports.values()), 3), **(json.loads(found.group(1)) if found else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", type=Path, help="a checkout to run (repeatable; default: this one)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, help="--threads for nerva (default: nerva's own choice)")
    ap.add_argument("--out", type=Path, help="also append the lines to this file")
    a = ap.parse_args()
    trees = [t.resolve() for t in a.tree or [Path(__file__).resolve().parent.parent]]
    nerva = ["run", a.model, "-p", "Hi", "-n", "1", "--no-server"] + (["--threads", str(a.threads)] if a.threads else [])
    cmd = ["-m", "nerva_cli", *nerva]
    for tree in trees:  # its modules as bytecode, as an install has them (PYTHONDONTWRITEBYTECODE may be
        # set), then a first run that compiles the kernels for this checkout's sources
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "nerva_cli")], check=True)
        run_once(tree, cmd)
    times = {t: [] for t in trees}
    for _ in range(a.runs):
        for tree in trees:
            first, wall, cpu, _ = run_once(tree, cmd)
            times[tree].append((round(first, 3), round(wall, 3), round(cpu, 3)))
    from nerva_cli.hardware.machine import cpu_name

    for tree in trees:
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        firsts, walls, cpus = ([run[i] for run in times[tree]] for i in range(3))
        line = {"tree": str(tree), "commit": head or None, "cpu": cpu_name(), "command": "nerva " + " ".join(nerva),
                "load_avg": os.getloadavg()[0], "first_byte_s": firsts, "first_byte_median_s": statistics.median(firsts),
                "wall_s": walls, "wall_median_s": statistics.median(walls),
                "cpu_s": cpus, "cpu_median_s": round(statistics.median(cpus), 3),
                "breakdown": breakdown(tree, nerva)}
        print(json.dumps(line))
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
