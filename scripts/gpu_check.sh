#!/usr/bin/env bash
# The GPU check, on a machine with a CUDA device (pip install -e '.[test,cuda13]'): the GPU tests,
# then the GPU benchmarks (scripts/gpu_bench.py) on a random-weight model with Llama-3-8B's
# shapes. Results, each naming the device, go to docs/perf/ (or $RESULTS).
#   bash scripts/gpu_check.sh [MODEL_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${RESULTS:-docs/perf}
mkdir -p "$out"
python3 -c "import sys; from nerva_cli.backends import cuda
sys.exit(0 if cuda.cupy_or_none() else 'gpu_check: ' + cuda.why_no_cuda)" || exit 1
python3 -m pytest -q -m gpu tests/ 2>&1 | tee "$out/gpu_tests.log"
tests=${PIPESTATUS[0]}
model=${1:-${TMPDIR:-/tmp}/nerva-synthetic-llama3-8b}
if [ ! -f "$model/metadata.json" ]; then
  python3 scripts/synthetic_model.py llama3-8b "$model" || exit 1
fi
python3 scripts/gpu_bench.py "$model" --out "$out" || exit 1
exit "$tests"
