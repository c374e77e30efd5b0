"""convert streams: about one layer in memory, measured in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

MEASURE = r"""
import json, sys
from pathlib import Path
from nerva_cli.pull import pull
import nerva_cli.sources.safetensors_dir, nerva_cli.convert, gguf.quants  # imports are not the model
def rss_now():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
before = rss_now()
pull(sys.argv[1], variant=sys.argv[2], out=Path(sys.argv[3]))
# VmHWM, not ru_maxrss: after fork+exec ru_maxrss still holds the parent's (pytest's) peak
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"before": before, "peak": peak}))
"""


@pytest.mark.parametrize("variant", ["q4_0", "f16"])
def test_convert_peak_memory_is_about_one_layer(variant, tmp_path):
    pytest.importorskip("transformers")
    from conftest import make_tiny_model

    src = tmp_path / "src"
    if not src.exists():
        make_tiny_model(src, "llama", layers=16, hidden=256, intermediate=1024, vocab=1024)
    res = subprocess.run([sys.executable, "-c", MEASURE, str(src), variant, str(tmp_path / variant)],
                         capture_output=True, text=True, check=True)
    m = json.loads(res.stdout.strip().splitlines()[-1])
    model = json.loads((src / "config.json").read_text())
    layer_bytes = 4 * (2 * 256 * 256 + 2 * 128 * 256 + 3 * 256 * 1024)  # f32 source layer
    embed_bytes = 4 * 1024 * 256
    total = (src / "model.safetensors").stat().st_size
    assert model["num_hidden_layers"] == 16 and total >= 8 * layer_bytes
    # peak minus the resident size just before converting: what the conversion itself held
    assert m["peak"] - m["before"] < 3 * layer_bytes + embed_bytes, m
