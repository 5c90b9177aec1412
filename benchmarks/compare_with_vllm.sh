#!/usr/bin/env bash
# The workloads of run_workloads.sh (chat c1/c8, W1-W3) against srt_lite (default flags, with n-gram speculative decoding, and with n-gram
# plus torch.compile) and then vLLM's CPU build, one after the other on the same machine, so they can be compared as
# ratios (the machine is noisy; never compare across runs).
#   benchmarks/compare_with_vllm.sh LABEL [VLLM_PYTHON]
# WORKLOADS="W3" limits the workloads; SERVERS="srt vllm" limits the servers (default: all four,
# srt srt-ngram srt-ngram-compile vllm; `srt-det` adds srt_lite with --enable-deterministic-inference; `srt-q0` srt_lite
# with --quantization none (weights in the model's dtype, as vLLM runs them); `vllm-2t` vLLM computing on every core
# (its defaults keep one core for its scheduler and compute on the rest); `llamacpp` adds llama-cpp-python's server on the default
# model's own GGUF file, 2 threads, single-stream workloads only: LLAMACPP_WORKLOADS, default
# "CHAT1 W1", its Python LLAMACPP_PYTHON, default .bench-venvs/llama/bin/python); ROUNDS=N repeats the servers N times in turn
# (labels LABEL-1 .. LABEL-N), so a drift of the host's speed hits every server alike.
# DTYPE_VLLM (default bfloat16) is vLLM's --dtype: float32 to match srt_lite's auto on a CPU (or a cap) without
# native bf16. vLLM comes from its own venv: VLLM_PYTHON (argument or environment), default
# .bench-venvs/vllm/bin/python inside the repo (docs/benchmarks.md has the install). Results:
# benchmarks/results/{srt,srt-ngram,srt-ngram-compile,vllm}-LABEL-W{1,2,3}.json
set -euo pipefail
label=$1
root=$(cd "$(dirname "$0")/.." && pwd)
vllm_py=${2:-${VLLM_PYTHON:-$root/.bench-venvs/vllm/bin/python}}
py=$root/.venv/bin/python
model=$($py -c "from srt_lite.model_loader.default_model import resolve_model_path; print(resolve_model_path(None))")

workloads=${WORKLOADS:-CHAT1 CHAT8 W1 W2 W3}
rounds=${ROUNDS:-1}
servers=${SERVERS:-srt srt-ngram srt-ngram-compile vllm}

wait_health() { until curl -sf "$1/health" >/dev/null; do sleep 2; done; }

run_srt() {  # run_srt NAME [server flags...]
  local name=$1; shift
  $py -m srt_lite.launch_server --port 30000 --log-level warning "$@" > /tmp/$name-$tag.log 2>&1 &
  local srt=$!
  wait_health http://127.0.0.1:30000
  "$root/benchmarks/run_workloads.sh" http://127.0.0.1:30000 "$name-$tag" $workloads
  kill -TERM $srt; wait $srt || true
}

run_vllm() {  # run_vllm NAME [VAR=value...]: extra environment for vLLM's processes
  local name=$1; shift
  env "$@" VLLM_CPU_KVCACHE_SPACE=2 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
    setsid "$vllm_py" -m vllm.entrypoints.openai.api_server --model "$model" --served-model-name smollm2 \
    --port 30100 --dtype "${DTYPE_VLLM:-bfloat16}" --max-model-len 2048 > /tmp/$name-$tag.log 2>&1 &
  local vllm=$!
  wait_health http://127.0.0.1:30100
  "$root/benchmarks/run_workloads.sh" http://127.0.0.1:30100 "$name-$tag" $workloads
  kill -TERM -- -$vllm; sleep 5
}

run_llamacpp() {
  local gguf
  gguf=$($py -c "from srt_lite.model_loader.default_model import default_gguf_path; print(default_gguf_path())")
  setsid "${LLAMACPP_PYTHON:-$root/.bench-venvs/llama/bin/python}" -m llama_cpp.server --model "$gguf" --n_threads 2 \
    --n_ctx 2048 --port 30200 > /tmp/llamacpp-$tag.log 2>&1 &
  local lcpp=$!
  wait_health_models http://127.0.0.1:30200
  "$root/benchmarks/run_workloads.sh" http://127.0.0.1:30200 "llamacpp-$tag" ${LLAMACPP_WORKLOADS:-CHAT1 W1}
  kill -TERM -- -$lcpp; sleep 3
}

# llama-cpp-python's server has no /health.
wait_health_models() { until curl -sf "$1/v1/models" >/dev/null; do sleep 2; done; }

for round in $(seq "$rounds"); do
  tag=$label
  [ "$rounds" = 1 ] || tag=$label-$round
  for server in $servers; do
    case $server in
      srt) run_srt srt ;;
      srt-ngram) run_srt srt-ngram --speculative-algorithm ngram ;;
      srt-det) run_srt srt-det --enable-deterministic-inference ;;
      srt-ngram-compile) run_srt srt-ngram-compile --speculative-algorithm ngram --enable-torch-compile ;;
      srt-q0) run_srt srt-q0 --quantization none ;;
      vllm) run_vllm vllm ;;
      vllm-2t) run_vllm vllm-2t VLLM_CPU_NUM_OF_RESERVED_CPU=0 OMP_NUM_THREADS="$(nproc)" ;;
      llamacpp) run_llamacpp ;;
      *) echo "unknown server $server" >&2; exit 2 ;;
    esac
  done
done
