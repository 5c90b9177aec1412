#!/usr/bin/env bash
# Runs the workloads of shared/BENCHMARKS.md against one running OpenAI-compatible server: the
# realistic chat ones first (sampled, EOS allowed), then the synthetic W1-W3 (EOS banned).
#   benchmarks/run_workloads.sh BASE_URL LABEL [CHAT1 CHAT8 W1 W2 W3]
# Results: benchmarks/results/LABEL-<workload>.json plus the printed tables.
# EXTRA="--num-prompts 2" appends arguments to every run (later ones win; the docs test uses it).
set -euo pipefail
url=$1; label=$2; shift 2
workloads=${*:-CHAT1 CHAT8 W1 W2 W3}
chat="--backend chat --dataset instructions --temperature 0.7 --top-p 0.95 --seed-per-request --allow-eos --output-len 256"
py=${PYTHON:-$(dirname "$0")/../.venv/bin/python}
bench="$py $(dirname "$0")/bench_serving.py --base-url $url --disable-tqdm"
for w in $workloads; do
  case $w in
    CHAT1) args="$chat --num-prompts 8 --max-concurrency 1" ;;
    CHAT8) args="$chat --num-prompts 48 --max-concurrency 8" ;;
    W1) args="--num-prompts 4 --max-concurrency 1 --input-words 32 --output-len 128" ;;
    W2) args="--num-prompts 64 --max-concurrency 16 --input-words 200 --output-len 128" ;;
    W3) args="--num-prompts 32 --max-concurrency 8 --input-words 20 --shared-prefix-words 800 --output-len 32" ;;
    *) echo "unknown workload $w" >&2; exit 2 ;;
  esac
  $bench --label "$label-$w" $args ${EXTRA:-}
done
