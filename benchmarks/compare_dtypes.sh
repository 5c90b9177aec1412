#!/usr/bin/env bash
# fp32 against bf16 weights, one forward step of the ModelRunner (bench_forward.py), for each
# CPU level given: the data behind `--dtype auto` (docs/benchmarks.md, "The dtype rule").
#   benchmarks/compare_dtypes.sh [MODEL_PATH] [LEVELS]
# LEVELS: space-separated SRT_LITE_CPU_CAPS values (avx512 = AVX-512 without its BF16 and AMX
# instructions, as on Skylake/Cascade Lake; avx2; default); "detected" runs uncapped.
# Default: "detected avx512 avx2".
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-}
LEVELS=${2:-detected avx512 avx2}
PY=${PY:-.venv/bin/python}
for level in $LEVELS; do
    for dtype in float32 bfloat16; do
        caps=$level
        [ "$level" = detected ] && caps=
        echo "== level $level, $dtype"
        SRT_LITE_CPU_CAPS=$caps "$PY" benchmarks/bench_forward.py ${MODEL:+--model-path "$MODEL"} --dtype "$dtype" \
            --batch-sizes 1,16 --prefill 512 --steps "${STEPS:-8}" 2>&1 | grep -E "^(decode|prefill)"
    done
done
