#!/usr/bin/env bash
# The 1B-shape workload (bench_1b_shape.py) against srt_lite (default flags) and vLLM's CPU build,
# one after the other on the same machine, ROUNDS=N times in turn; the model directory is
# written first if it is missing. SERVERS limits or extends the servers (default "srt vllm";
# `srt-det` adds srt_lite with --enable-deterministic-inference).
#   benchmarks/compare_1b_shape.sh LABEL MODEL_DIR [VLLM_PYTHON]
# VLLM_PYTHON (argument or environment) is the Python of vLLM's venv, by default
# .bench-venvs/vllm/bin/python inside the repo (docs/benchmarks.md has the install).
# Results: benchmarks/results/1b-{srt,srt-det,vllm}-LABEL[-ROUND].json
set -euo pipefail
label=$1
model=$2
root=$(cd "$(dirname "$0")/.." && pwd)
vllm_py=${3:-${VLLM_PYTHON:-$root/.bench-venvs/vllm/bin/python}}
py=$root/.venv/bin/python
rounds=${ROUNDS:-1}
servers=${SERVERS:-srt vllm}

[ -f "$model/config.json" ] || $py "$root/benchmarks/bench_1b_shape.py" make "$model"
wait_health() { until curl -sf "$1/health" >/dev/null; do sleep 2; done; }

run_srt() {  # run_srt NAME [server flags...]
  local name=$1; shift
  $py -m srt_lite.launch_server --model-path "$model" --port 30000 --log-level warning "$@" > /tmp/1b-$name-$tag.log 2>&1 &
  local srt=$!
  wait_health http://127.0.0.1:30000
  $py "$root/benchmarks/bench_1b_shape.py" run --base-url http://127.0.0.1:30000 --model-dir "$model" \
    --output "$root/benchmarks/results/1b-$name-$tag.json"
  kill -TERM $srt; wait $srt || true
}

run_vllm() {
  VLLM_CPU_KVCACHE_SPACE=2 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
    setsid "$vllm_py" -m vllm.entrypoints.openai.api_server --model "$model" --served-model-name llama-1b-shape \
    --port 30100 --dtype bfloat16 --max-model-len 2048 > /tmp/vllm-1b-$tag.log 2>&1 &
  local vllm=$!
  wait_health http://127.0.0.1:30100
  $py "$root/benchmarks/bench_1b_shape.py" run --base-url http://127.0.0.1:30100 --model-dir "$model" \
    --output "$root/benchmarks/results/1b-vllm-$tag.json"
  kill -TERM -- -$vllm; sleep 5
}

for round in $(seq "$rounds"); do
  tag=$label
  [ "$rounds" = 1 ] || tag=$label-$round
  for server in $servers; do
    case $server in
      srt) run_srt srt ;;
      srt-det) run_srt srt-det --enable-deterministic-inference ;;
      vllm) run_vllm ;;
      *) echo "unknown server $server" >&2; exit 2 ;;
    esac
  done
done
