#!/usr/bin/env bash
# Runs W1-W3 of shared/BENCHMARKS.md against one running OpenAI-compatible server.
#   benchmarks/run_workloads.sh BASE_URL LABEL [W1 W2 W3]
# Results: benchmarks/results/LABEL-W{1,2,3}.json plus the printed tables.
# EXTRA="--num-prompts 2" appends arguments to every run (later ones win; the docs test uses it).
set -euo pipefail
url=$1; label=$2; shift 2
workloads=${*:-W1 W2 W3}
py=${PYTHON:-$(dirname "$0")/../.venv/bin/python}
bench="$py $(dirname "$0")/bench_serving.py --base-url $url --disable-tqdm"
for w in $workloads; do
  case $w in
    W1) args="--num-prompts 4 --max-concurrency 1 --input-words 32 --output-len 128" ;;
    W2) args="--num-prompts 64 --max-concurrency 16 --input-words 200 --output-len 128" ;;
    W3) args="--num-prompts 32 --max-concurrency 8 --input-words 20 --shared-prefix-words 800 --output-len 32" ;;
    *) echo "unknown workload $w" >&2; exit 2 ;;
  esac
  $bench --label "$label-$w" $args ${EXTRA:-}
done
