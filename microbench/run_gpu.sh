#!/usr/bin/env bash
# Every GPU measurement in one prepared run of at most 8 minutes, on the GPU machine as it is: no
# network, nothing installed. Penelope is imported from this working tree.
#
#   bash microbench/run_gpu.sh [--out DIR] [--budget SECONDS] [--only STAGE ...] [--shapes full|reduced] [--dry-run]
#
# Results in ${OUT:-results/gpu}: points.jsonl (every point as it is measured), run_gpu.log,
# cost_curve.png and calibration_gpu.json (written last). PYTHON picks the interpreter (default
# python3). Exit status: 0 every stage passed; 1 a stage failed, timed out or was skipped; 3 no
# CUDA GPU; 4 bad arguments; 5 a required package is missing. See microbench/run_gpu.py.
set -uo pipefail
# No cd: a relative --out or $OUT is the caller's (run_gpu.py finds the repository by its own path).
exec "${PYTHON:-python3}" "$(dirname "$0")/run_gpu.py" "$@"
