#!/usr/bin/env bash
# Every GPU microbenchmark in one prepared run, on a fresh GPU machine, from the repository alone.
#
#   bash microbench/run_gpu.sh [--out DIR] [--budget SECONDS] [--only bench_x ...] [--dry-run]
#
# 1. Installs the project and what the benchmarks need with the project's own script
#    (scripts/install.sh test: the virtual environment .venv, torch with its CUDA wheels, triton,
#    SGLang's Triton kernels; a stamp file makes a second run instant), under INSTALL_BUDGET seconds
#    (default 900). Set PENELOPE_SKIP_INSTALL=1 to use PYTHON (or .venv) as it is.
# 2. Runs microbench/run_gpu.py: a CUDA check, then the test_gpu* benchmarks of every
#    microbench/bench_*.py, each under its own limit, all within --budget (TOTAL_BUDGET, default
#    450 s). Results in ${OUT:-results/gpu}: benchmarks.json, run_gpu.log, the cost curve's files.
# Exit status: 0 all steps passed and some GPU benchmark ran; 1 a step failed or timed out; 2 no
# GPU benchmark ran; 3 no CUDA GPU; 4 bad arguments; 5 the installation failed.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${PENELOPE_SKIP_INSTALL:-0}" != 1 ]; then
    echo "== installing (scripts/install.sh test, at most ${INSTALL_BUDGET:-900} s)" >&2
    if ! timeout -k 10 "${INSTALL_BUDGET:-900}" bash scripts/install.sh test; then
        echo "run_gpu.sh: the installation failed or timed out" >&2
        exit 5
    fi
fi
if [ -z "${PYTHON:-}" ]; then
    PYTHON=${PENELOPE_VENV:-.venv}/bin/python
    [ -x "$PYTHON" ] || PYTHON=python3
fi
exec "$PYTHON" microbench/run_gpu.py --python "$PYTHON" "$@"
