#!/usr/bin/env bash
# The GPU check, on a machine with a CUDA device (pip install -e '.[test,cuda13]'): the GPU tests,
# then the GPU benchmarks (scripts/gpu_bench.py), where a decode step's time goes
# (scripts/gpu_profile.py) and the matvec tuning table (scripts/gpu_matvec_sweep.py). With
# ../shared/gpu-peers packed into .gpu-peer/ (its pack.sh), llama.cpp CUDA is built and benched on
# its random Llama-3-8B-shaped Q4_0 GGUF and nerva runs the same file, so the figures are ratios
# measured in the same lease; without it, nerva runs a model of the same shapes from
# scripts/synthetic_model.py. Results, each naming the device, go to docs/perf/ (or $RESULTS).
#   bash scripts/gpu_check.sh [MODEL_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${RESULTS:-docs/perf}
mkdir -p "$out"
python3 -c "import sys; from nerva_cli.backends import cuda
sys.exit(0 if cuda.cupy_or_none() else 'gpu_check: ' + cuda.why_no_cuda)" || exit 1
model=${1:-}
peer=()
if [ -z "$model" ] && [ -d .gpu-peer ]; then
  # the llama.cpp build (about 4.5 min on 16 cores) runs while the tests do; nerva's own ratios
  # use the ceilings gpu_bench.py measures later, on a quiet GPU
  RESULTS=$out bash .gpu-peer/ceilings_and_build.sh > "$out/peer_ceilings.log" 2>&1 &
  building=$!
fi
python3 -m pytest -q -m gpu tests/ 2>&1 | tee "$out/gpu_tests.log"
tests=${PIPESTATUS[0]}
if [ -n "${building:-}" ]; then
  wait "$building"
  if RESULTS=$out bash .gpu-peer/llamacpp_bench.sh > "$out/peer_llamacpp.log" 2>&1; then
    peer=(--peer-json "$out/llama_bench_full.json")
  else
    echo "gpu_check: the llama.cpp bench failed (see $out/peer_llamacpp.log); nerva's figures come alone"
  fi
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}  # the gguf wheel the peer scripts installed
  model=${TMPDIR:-/tmp}/nerva-r8b
  python3 -m nerva_cli convert /tmp/r8b.gguf --out "$model" --force || model=
fi
if [ -z "$model" ]; then
  model=${TMPDIR:-/tmp}/nerva-synthetic-llama3-8b
  [ -f "$model/metadata.json" ] || python3 scripts/synthetic_model.py llama3-8b "$model" || exit 1
fi
python3 scripts/gpu_bench.py "$model" --out "$out" "${peer[@]}" || exit 1
python3 scripts/gpu_profile.py "$model" --json "$out/gpu_profile.json" | tee "$out/gpu_profile.txt"
python3 scripts/gpu_matvec_sweep.py | tee "$out/gpu_matvec_sweep.txt"
exit "$tests"
