#!/usr/bin/env bash
# The GPU benchmark in one call of at most 8 minutes (torch >= 2.5 with Triton; made for an H200).
#
#   FASTPT_COMMIT=$(git rev-parse --short=12 HEAD) bash bench/gpu.sh [OUT_DIR] [SECTIONS]
#
# OUT_DIR defaults to $OUT. SECTIONS (comma-separated, default all, run in this order):
#   train    python -m bench on 0.04b: eager, compiled, compiled+kernels, baseline (32 x 1024, accum 2)
#   kernels  python -m bench kernels: fastpt vs torch eager / torch.compile / peers
#   tests    pytest -m gpu tests/   (kernel correctness in bf16, compile, kernels-vs-reference training)
#   suites   pytest -m gpu bench/   (pytest-benchmark suites, JSON)
#   sweep    micro-batch 64 x accum 1 with and without CUDA graphs, for the best tok/s that fits
# Each section gets at most its own limit and what is left of BENCH_BUDGET_S (default 450 s), so
# the call ends in time even when a compile is slow; skipped or failed sections are listed in
# summary.md. Files written (at most 8, flat): summary.md, log.txt, train.json, kernels.json,
# suites.json, sweep.json. FASTPT_COMMIT names the commit where the tree has no .git.
set -uo pipefail
out=$(mkdir -p "${1:-${OUT:?give an output folder as \$1 or set \$OUT}}" && cd "${1:-$OUT}" && pwd) || exit 2
sections=",${2:-train,kernels,tests,suites,sweep},"
cd "$(dirname "$0")/.."
py=$(command -v python3 || command -v python)
export PYTHONUNBUFFERED=1
budget=${BENCH_BUDGET_S:-450}
start=$SECONDS
status=()

# run NAME LIMIT_S CMD...: the command under `timeout`, output appended to log.txt and shown
run() {
    local name=$1 limit=$2 left=$((budget - (SECONDS - start)))
    shift 2
    if [[ $sections != *",$name,"* ]]; then return; fi
    ((limit > left)) && limit=$left
    if ((limit < 30)); then
        status+=("| $name | skipped: ${left} s of the budget left | |")
        return
    fi
    echo "=== $name (limit ${limit} s): $*" | tee -a "$out/log.txt"
    local t0=$SECONDS
    timeout -k 15 "$limit" "$@" 2>&1 | tee -a "$out/log.txt"
    local rc=${PIPESTATUS[0]}
    local what="exit $rc"
    ((rc == 124 || rc == 137)) && what="timed out"
    status+=("| $name | $what | $((SECONDS - t0)) s |")
}

{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
} >"$out/log.txt" 2>&1

run train 270 "$py" -m bench --preset 0.04b --modes eager,compiled,compiled+kernels,baseline \
    --steps 20 --mode-timeout 120 --json "$out/train.json"
run kernels 100 "$py" -m bench kernels --json "$out/kernels.json"
run tests 100 "$py" -m pytest -q -m gpu tests -p no:cacheprovider
run suites 150 "$py" -m pytest -q -m gpu bench -p no:cacheprovider --benchmark-json "$out/suites.json"
run sweep 400 "$py" -m bench --preset 0.04b --micro-batch 64 --grad-accum 1 \
    --modes compiled+kernels,compiled+kernels+cudagraphs,baseline --steps 20 --mode-timeout 120 --json "$out/sweep.json"

# summary.md: machine, section outcomes, then every table that was written
{
    echo "# fastpt GPU benchmark"
    echo
    head -2 "$out/log.txt" | sed 's/^/    /'
    echo
    echo "| section | outcome | wall |"
    echo "|---|---|---|"
    printf '%s\n' "${status[@]}"
    for f in train kernels sweep; do
        [[ -f $out/$f.json ]] && "$py" -c 'import json, sys; print("\n## " + sys.argv[2] + "\n\n" + json.load(open(sys.argv[1]))["markdown"])' "$out/$f.json" "$f"
    done
} >"$out/summary.md"
cat "$out/summary.md"
