#!/usr/bin/env bash
# docs/results.md's fleet result: the public Mooncake conversation trace (FAST'25, 12,031 requests over
# 3,537 s) replayed on REPLICAS Qwen3-8B servers (H100 time estimates) behind each of the four
# routers, SGLang's eviction against Penelope's, GPU caches CACHES per replica, conversations
# recovered from the trace's block prefixes. Every setting is an ensemble of REPEAT runs (time-model
# constants x U[0.97, 1.03]) replayed in parallel on every core; JSON into results/mooncake/, and
# docs/results.md's Markdown table at the end. The trace is not shipped with the project; get it with
#   curl -LO https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release/traces/conversation_trace.jsonl
# Usage: scripts/mooncake_fleet.sh PATH/TO/conversation_trace.jsonl
set -euo pipefail
cd "$(dirname "$0")/.."
TRACE=${1:?usage: scripts/mooncake_fleet.sh PATH/TO/conversation_trace.jsonl}
OUT=results/mooncake
REPLICAS=${REPLICAS:-8}
CACHES=${CACHES:-256K,512K}
REPEAT=${REPEAT:-5}
VENV=${PENELOPE_VENV:-.venv}
mkdir -p "$OUT"
start=$(date +%s)
"$VENV/bin/penelope" simulate --trace "$TRACE" --conversations prefix --gpu-cache "$CACHES" \
  --replicas "$REPLICAS" --router all --repeat "$REPEAT" --no-progress --json "$OUT/fleet.json"
echo "== docs/results.md table ($(($(date +%s) - start)) s of replays)"
"$VENV/bin/python" scripts/readme_tables.py fleet "$OUT/fleet.json"
