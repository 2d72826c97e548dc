#!/usr/bin/env bash
# The GPU benchmark in one call of at most 8 minutes (torch >= 2.5 with Triton; made for an H200).
#
#   FASTPT_COMMIT=$(git rev-parse --short=12 HEAD) bash bench/gpu.sh [OUT_DIR] [SECTIONS]
#
# OUT_DIR defaults to $OUT. SECTIONS (comma-separated; default train,kernels,tests,modes,scale,float8,
# run in that order: the decisions first, within about 6 minutes (does +kernels beat compiled and the
# baseline, and each kernel its peers), then the GPU tests, then the levers, each beside its
# reference row; suites only when named):
#   train    python -m bench on 0.04b: eager, compiled, compiled+kernels, baseline (32 x 1024, accum 2),
#            each mode's measured peak beside fastpt.plan's planned one (and the measured CUDA context),
#            and its measured tok/s beside the planned one on this card (fastpt.plan.timing)
#   kernels  python -m bench kernels: fastpt vs torch eager / torch.compile / peers, with floors
#   modes    0.04b at 64 x 1024, accum 1 (CUDA graphs need accum 1): compiled+kernels, + CUDA graphs
#            (reduce-overhead), + autotune (max-autotune-no-cudagraphs), + both (max-autotune)
#   scale    0.35b (16 x 2048): compiled+kernels with and without activation checkpointing (full, selective)
#   float8   1b (8 x 2048): compiled+kernels with and without torchao float8 linears
#   tests    pytest -n0 -m gpu tests/ (kernels in bf16, compile, CUDA graphs, profiler, float8 numerics)
#   suites   pytest -n0 -m gpu bench/ (pytest-benchmark suites, JSON)
# Each section gets at most its own limit and what is left of BENCH_BUDGET_S (default 450 s), so
# the call ends in time even when a compile is slow; skipped or failed sections are listed in
# summary.md (run them by name in a second call). A bench section passes its limit on as
# --time-budget ({limit} below): modes that no longer fit are skipped rows, and the table of those
# that ran is still written. Files (flat, at most 8): summary.md, log.txt, train.json, modes.json,
# scale.json, float8.json, kernels.json, suites.json. FASTPT_COMMIT names the commit where the tree
# has no .git.
set -uo pipefail
out=$(mkdir -p "${1:-${OUT:?give an output folder as \$1 or set \$OUT}}" && cd "${1:-$OUT}" && pwd) || exit 2
sections=",${2:-train,kernels,tests,modes,scale,float8},"
cd "$(dirname "$0")/.."
py=$(command -v python3 || command -v python)
export PYTHONUNBUFFERED=1
budget=${BENCH_BUDGET_S:-450}
start=$SECONDS
status=()

# summary.md: machine, section outcomes, then every table written so far; rewritten after each
# section, so a call cut short still leaves the decisions it reached.
write_summary() {
    {
        echo "# fastpt GPU benchmark"
        echo
        head -2 "$out/log.txt" | sed 's/^/    /'
        echo
        echo "| section | outcome | wall |"
        echo "|---|---|---|"
        printf '%s\n' "${status[@]}"
        for f in train kernels modes scale float8; do
            [[ -f $out/$f.json ]] && "$py" -c 'import json, sys; print("\n## " + sys.argv[2] + "\n\n" + json.load(open(sys.argv[1]))["markdown"])' "$out/$f.json" "$f"
        done
    } >"$out/summary.md"
}

# run NAME LIMIT_S CMD...: the command under `timeout`, output appended to log.txt and shown;
# {limit} in CMD becomes the seconds the command itself may plan for (the limit less 20 s of slack)
run() {
    local name=$1 limit=$2 left=$((budget - (SECONDS - start)))
    shift 2
    if [[ $sections != *",$name,"* ]]; then return; fi
    ((limit > left)) && limit=$left
    if ((limit < 30)); then
        status+=("| $name | skipped: ${left} s of the budget left | |")
        return
    fi
    local cmd=("${@//\{limit\}/$((limit - 20))}")
    echo "=== $name (limit ${limit} s): ${cmd[*]}" | tee -a "$out/log.txt"
    local t0=$SECONDS
    timeout -k 15 "$limit" "${cmd[@]}" 2>&1 | tee -a "$out/log.txt"
    local rc=${PIPESTATUS[0]}
    local what="exit $rc"
    ((rc == 124 || rc == 137)) && what="timed out"
    status+=("| $name | $what | $((SECONDS - t0)) s |")
    write_summary
}

{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
} >"$out/log.txt" 2>&1

# The decisions: the 0.04b train table and the kernel table, together within about 6 minutes (the train table plans each mode too).
run train 220 "$py" -m bench --preset 0.04b --modes eager,compiled,compiled+kernels,baseline \
    --steps 20 --mode-timeout 110 --time-budget {limit} --json "$out/train.json"
run kernels 120 "$py" -m bench kernels --json "$out/kernels.json"
run tests 100 "$py" -m pytest -q -n0 -m gpu tests -p no:cacheprovider
# The levers, each beside its reference row; within a section the cheaper lever first.
run modes 110 "$py" -m bench --preset 0.04b --micro-batch 64 --grad-accum 1 --modes \
    compiled+kernels,compiled+kernels+cudagraphs,compiled+kernels+autotune,compiled+kernels+autotune+cudagraphs \
    --steps 20 --mode-timeout 90 --time-budget {limit} --json "$out/modes.json"
run scale 100 "$py" -m bench --preset 0.35b --modes compiled+kernels,compiled+kernels+ac,compiled+kernels+ac-selective \
    --steps 10 --mode-timeout 90 --time-budget {limit} --json "$out/scale.json"
run float8 90 "$py" -m bench --preset 1b --modes compiled+kernels,compiled+kernels+float8 \
    --steps 10 --mode-timeout 90 --time-budget {limit} --json "$out/float8.json"
run suites 150 "$py" -m pytest -q -n0 -m gpu bench -p no:cacheprovider --benchmark-enable --benchmark-json "$out/suites.json"

write_summary
cat "$out/summary.md"
