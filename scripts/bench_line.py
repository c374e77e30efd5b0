"""`nerva bench` run as a user runs it, for the scripts that alternate it with something else."""

from __future__ import annotations

import json
import subprocess
import sys


def bench_line(*args: str) -> dict:
    """`nerva bench ARGS...` in a subprocess -> its one JSON line (exit with its stderr if it failed)."""
    cmd = [sys.executable, "-m", "nerva_cli", "bench", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr}")
    return json.loads(done.stdout)


def write_line(result: dict, out=None) -> None:
    """`result` as the scripts' one JSON line on stdout, and in the file `out` where given."""
    text = json.dumps(result)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
