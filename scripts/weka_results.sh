#!/usr/bin/env bash
# The README's results on the 24 shared WEKA Claude Code sessions of at most 128K tokens
# (../shared/traces/weka-claude-code, --overflow skip keeps exactly those), Qwen3-8B unless
# stated, 4 sessions at once, LPM. Each run prints its tables and writes JSON into results/weka/.
# About two minutes on two cores. Usage: scripts/weka_results.sh [TRACE_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
TRACE=${1:-../shared/traces/weka-claude-code}
OUT=results/weka
mkdir -p "$OUT"
P="${PENELOPE_VENV:-.venv}/bin/penelope"
sim() { name=$1; shift; echo "== $name: penelope simulate $*"; "$P" simulate --trace "$TRACE" --overflow skip \
  --sessions 4 --no-progress --json "$OUT/$name.json" "$@"; }
sim gpu_sweep --gpu-cache 128K,192K,256K
sim ablation --gpu-cache 192K,256K --policies ablation
sim fcfs --scheduler fcfs --gpu-cache 192K,256K
sim two_tier_equal --gpu-cache 128K --cpu-cache 128K
sim two_tier_4x --gpu-cache 128K --cpu-cache 512K
sim tool_waits --think-time tool,cap:60 --gpu-cache 192K,256K
sim gemma3 --model gemma-3-27b --gpu-cache 192K,256K
sim qwen3_32b --model qwen3-32b
