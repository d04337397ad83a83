#!/usr/bin/env bash
# docs/results.md's "Beyond the paper" tables: SGLang, Penelope, the published alternatives (ttl,
# flop-recency), penelope-agent and the offline oracle on the 24 shared WEKA Claude Code sessions
# of at most 128K tokens, Qwen3-8B, 4 sessions at once, LPM; GPU-only 160K and two tiers
# 128K + 128K, with the recorded think times and with them capped at 30 s. Every setting is an
# ensemble of REPEAT runs (default 3). JSON goes to results/beyond/; at the end
# scripts/beyond_tables.py prints the Markdown tables. About 10 minutes on two cores.
# Usage: scripts/beyond_results.sh [TRACE_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
TRACE=${1:-../shared/traces/weka-claude-code}
OUT=results/beyond
REPEAT=${REPEAT:-3}
POLICIES=sglang,penelope,ttl,flop-recency,penelope-agent,oracle
mkdir -p "$OUT"
P="${PENELOPE_VENV:-.venv}/bin/penelope"
sim() { name=$1; shift; echo "== $name: penelope simulate $*"; "$P" simulate --trace "$TRACE" --overflow skip \
  --sessions 4 --policies "$POLICIES" --repeat "$REPEAT" --no-progress --json "$OUT/$name.json" "$@"; }
sim gpu_capped --think-time recorded,cap:30 --gpu-cache 160K
sim two_tier_capped --think-time recorded,cap:30 --gpu-cache 128K --cpu-cache 128K
sim gpu_recorded --think-time recorded --gpu-cache 160K
sim two_tier_recorded --think-time recorded --gpu-cache 128K --cpu-cache 128K
"${PENELOPE_VENV:-.venv}/bin/python" scripts/beyond_tables.py "$OUT"
