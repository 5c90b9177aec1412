#!/usr/bin/env bash
# The CUDA check, for a session that is lent a GPU machine (device `run`, 15 minutes in all).
# That machine has python3 (3.12) with torch (CUDA), transformers, pytest and nvcc, but no
# network: carry what it lacks as wheels in .whl (see /work/.library/device/README.md), e.g.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#       -d .whl flashinfer-python apache-tvm-ffi starlette uvicorn pyzmq orjson gguf
# and the converted default model (tokenizer + weights) when the engine test and W2 should run.
# Then: run(command="bash benchmarks/gpu_check.sh", carry=[".whl", ...], timeout_s=540).
set -u
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__)"
# 1. flashinfer vs torch_native, CUDA graphs vs eager, the engine's greedy answer.
python3 -m pytest -q -m gpu tests/test_flashinfer.py 2>&1 | tee ${OUT:-/tmp}/gpu-tests.log | tail -30
# 2. W2 through the HTTP server with the default model (needs the carried model directory).
if [ -n "${SRT_LITE_MODEL:-}" ]; then
    python3 -m srt_lite.launch_server --model-path "$SRT_LITE_MODEL" --port 30000 --log-level warning &
    pid=$!
    for _ in $(seq 300); do curl -s localhost:30000/health >/dev/null && break; sleep 1; done
    python3 benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --label W2-cuda \
        --num-prompts 64 --max-concurrency 16 --input-words 200 --output-len 128 \
        --output-file ${OUT:-/tmp}/W2-cuda.json
    kill -INT $pid
fi
