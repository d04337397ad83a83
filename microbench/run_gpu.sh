#!/usr/bin/env bash
# Every GPU microbenchmark in one prepared run, for the rare machines with a GPU (an H200 here).
#
#   bash microbench/run_gpu.sh            # results in ${OUT:-results/gpu}
#
# Runs the test_gpu* benchmarks of each microbench/bench_*.py (the cost curve first, then the
# decode calibration), each under its own timeout, all within TOTAL_BUDGET seconds (default 450:
# under 8 minutes with start-up).
# Writes into the output folder (few files, so the device tool brings them all back):
#   benchmarks.json     every step's pytest-benchmark results merged (compare.py reads it)
#   run_gpu.log         every step's output, nvidia-smi, the comparison with the baseline
#   cost_curve_gpu.{json,png,txt}   from bench_cost_curve.py
#   decode_gpu.{json,txt}           from bench_decode.py (batch 1/4/8 x context 1K..128K)
#   calibration_gpu.json            prefill constants (cost curve) + decode constants (decode),
#                                   for `penelope simulate --calibration`
# Exit code: 0 when every step passed (or had no GPU benchmark), 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT_DIR=${OUT:-results/gpu}
TOTAL_BUDGET=${TOTAL_BUDGET:-450}
DEFAULT_STEP=120
# Per-step limits in seconds; the cost curve bounds itself at 230 s (SETUPS["gpu"].budget_s).
declare -A STEP_LIMIT=([bench_cost_curve]=290 [bench_decode]=150)

if [ -n "${PYTHON:-}" ]; then :; elif [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/run_gpu.log"
STEPS=$(mktemp -d)
start=$(date +%s)
: >"$LOG"
say() { echo "$@" | tee -a "$LOG"; }

say "== run_gpu.sh $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
nvidia-smi >>"$LOG" 2>&1 || say "nvidia-smi not available"
# The package maps kernels/ to penelope.kernels: it must be installed (no network needed).
if ! "$PYTHON" -c "import penelope.kernels.ragged_attention, penelope.engine.model" 2>/dev/null; then
    say "== installing penelope (editable, no dependencies)"
    "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . >>"$LOG" 2>&1 || { say "install failed"; exit 1; }
fi

files=(microbench/bench_cost_curve.py microbench/bench_decode.py)
for f in microbench/bench_*.py; do
    case "$f" in microbench/bench_cost_curve.py|microbench/bench_decode.py) ;; *) files+=("$f") ;; esac
done

status=0
for f in "${files[@]}"; do
    name=$(basename "$f" .py)
    left=$((TOTAL_BUDGET - ($(date +%s) - start)))
    if [ "$left" -lt 20 ]; then
        say "== $name: SKIPPED, ${left}s left of the ${TOTAL_BUDGET}s budget"
        status=1
        continue
    fi
    limit=${STEP_LIMIT[$name]:-$DEFAULT_STEP}
    [ "$limit" -gt "$left" ] && limit=$left
    say "== $name (limit ${limit}s)"
    step_start=$(date +%s)
    PYTHONUNBUFFERED=1 timeout -k 10 "$limit" "$PYTHON" -m pytest "$f" --gpu-only -q -s -p no:cacheprovider \
        --benchmark-json "$STEPS/$name.json" --bench-out "$OUT_DIR" 2>&1 | tee -a "$LOG" | tail -n 30
    rc=${PIPESTATUS[0]}
    case $rc in
        0) say "== $name: passed in $(($(date +%s) - step_start))s" ;;
        5) say "== $name: no GPU benchmark" ;;
        124|137) say "== $name: TIMED OUT after ${limit}s (its results are lost)"; status=1 ;;
        *) say "== $name: FAILED (exit $rc)"; status=1 ;;
    esac
done

shopt -s nullglob
"$PYTHON" - "$OUT_DIR/benchmarks.json" "$STEPS"/*.json <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
merged = None
for path in sys.argv[2:]:
    data = json.load(open(path))
    if merged is None:
        merged = data
    else:
        merged["benchmarks"].extend(data["benchmarks"])
if merged is None:
    print("no benchmark results")
else:
    json.dump(merged, open(sys.argv[1], "w"), indent=1)
    print(f"{len(merged['benchmarks'])} results in {sys.argv[1]}")
EOF
rm -rf "$STEPS"

if [ -f "$OUT_DIR/benchmarks.json" ]; then
    say "== comparison with the stored baseline of this machine kind"
    "$PYTHON" microbench/compare.py "$OUT_DIR/benchmarks.json" 2>&1 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" -eq 2 ] && say "(no baseline yet: copy benchmarks.json to microbench/baselines/<kind>.json)"
fi
say "== done in $(($(date +%s) - start))s, status $status"
exit $status
