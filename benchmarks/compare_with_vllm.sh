#!/usr/bin/env bash
# W1-W3 against srt_lite (default flags, with n-gram speculative decoding, and with n-gram
# plus torch.compile) and then vLLM's CPU build, one after the other on the same machine, so they can be compared as
# ratios (the machine is noisy; never compare across runs).
#   benchmarks/compare_with_vllm.sh LABEL [VLLM_PYTHON]
# vLLM comes from its own venv (docs/benchmarks.md has the install). Results:
# benchmarks/results/{srt,srt-ngram,srt-ngram-compile,vllm}-LABEL-W{1,2,3}.json
set -euo pipefail
label=$1
vllm_py=${2:-/work/vllm-venv/bin/python}
root=$(cd "$(dirname "$0")/.." && pwd)
py=$root/.venv/bin/python
model=$($py -c "from srt_lite.model_loader.default_model import resolve_model_path; print(resolve_model_path(None))")

wait_health() { until curl -sf "$1/health" >/dev/null; do sleep 2; done; }

run_srt() {  # run_srt NAME [server flags...]
  local name=$1; shift
  $py -m srt_lite.launch_server --port 30000 --log-level warning "$@" > /tmp/$name-$label.log 2>&1 &
  local srt=$!
  wait_health http://127.0.0.1:30000
  "$root/benchmarks/run_workloads.sh" http://127.0.0.1:30000 "$name-$label"
  kill -TERM $srt; wait $srt || true
}
run_srt srt
run_srt srt-ngram --speculative-algorithm ngram
run_srt srt-ngram-compile --speculative-algorithm ngram --enable-torch-compile

VLLM_CPU_KVCACHE_SPACE=2 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
  setsid "$vllm_py" -m vllm.entrypoints.openai.api_server --model "$model" --served-model-name smollm2 \
  --port 30100 --dtype bfloat16 --max-model-len 2048 > /tmp/vllm-$label.log 2>&1 &
vllm=$!
wait_health http://127.0.0.1:30100
"$root/benchmarks/run_workloads.sh" http://127.0.0.1:30100 "vllm-$label"
kill -TERM -- -$vllm; sleep 5
