#!/usr/bin/env bash
# docs/results.md's results on the 24 shared WEKA Claude Code sessions of at most 128K tokens
# (../shared/traces/weka-claude-code, --overflow skip keeps exactly those), Qwen3-8B unless
# stated, 4 sessions at once, LPM. Every setting is an ensemble of REPEAT runs (default 10), each
# with the time model's constants scaled by seeded factors in [1 - BAND, 1 + BAND] (default
# 0.03), replayed in parallel on every core. Each run prints its tables and writes JSON into
# results/weka/; at the end scripts/readme_tables.py prints docs/results.md's Markdown tables.
# About 45 minutes on two cores with the defaults (an estimate). Usage: scripts/weka_results.sh [TRACE_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
TRACE=${1:-../shared/traces/weka-claude-code}
OUT=results/weka
REPEAT=${REPEAT:-10}
BAND=${BAND:-0.03}
mkdir -p "$OUT"
# SGLang's default policy (LRU, `sglang`) and its newer ones, ported (penelope/cache/sglang_policies.py).
SGLANG_POLICIES=sglang,sglang-lfu,sglang-slru,sglang-tlru,sglang-session
VENV=${PENELOPE_VENV:-.venv}
P="$VENV/bin/penelope"
sim() { name=$1; shift; echo "== $name: penelope simulate $*"; "$P" simulate --trace "$TRACE" --overflow skip \
  --sessions 4 --repeat "$REPEAT" --band "$BAND" --no-progress --json "$OUT/$name.json" "$@"; }
start=$(date +%s)
sim gpu_sweep --gpu-cache 128K,192K,256K --policies $SGLANG_POLICIES,penelope
sim ablation --gpu-cache 192K,256K --policies ablation
sim fcfs --scheduler fcfs --gpu-cache 192K,256K
sim two_tier_equal --gpu-cache 128K --cpu-cache 128K
sim two_tier_4x --gpu-cache 128K --cpu-cache 512K
sim tool_waits --think-time tool,cap:60 --gpu-cache 192K,256K
sim gemma3 --model gemma-3-27b --gpu-cache 192K,256K
sim qwen3_32b --model qwen3-32b
sim triton_kernel --phantom-kernel triton --gpu-cache 128K,192K,256K
echo "== docs/results.md tables ($(($(date +%s) - start)) s of replays)"
"$VENV/bin/python" scripts/readme_tables.py weka "$OUT"
