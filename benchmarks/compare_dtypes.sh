#!/usr/bin/env bash
# fp32 against bf16 weights, one forward step of the ModelRunner (bench_forward.py), for each
# CPU level given: the data behind `--dtype auto` (docs/benchmarks.md, "The dtype rule").
#   benchmarks/compare_dtypes.sh [MODEL_PATH] [LEVELS]
# LEVELS: space-separated SRT_LITE_CPU_CAPS values; "detected" runs uncapped, and
# "avx512-nobf16" runs uncapped with oneDNN held to AVX512_CORE (a Skylake/Cascade Lake CPU:
# AVX-512 without its BF16 instructions). Default: "detected avx2".
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-}
LEVELS=${2:-detected avx2}
PY=${PY:-.venv/bin/python}
for level in $LEVELS; do
    for dtype in float32 bfloat16; do
        env=()
        case $level in
            detected) ;;
            avx512-nobf16) env=(ONEDNN_MAX_CPU_ISA=AVX512_CORE) ;;
            *) env=(SRT_LITE_CPU_CAPS=$level) ;;
        esac
        echo "== level $level, $dtype"
        env "${env[@]}" "$PY" benchmarks/bench_forward.py ${MODEL:+--model-path "$MODEL"} --dtype "$dtype" \
            --batch-sizes 1,16 --prefill 512 --steps "${STEPS:-8}" 2>&1 | grep -E "^(decode|prefill)"
    done
done
