#!/usr/bin/env bash
# GPU smoke test of the SGLang integration: `penelope verify --engine sglang --device cuda` (bf16)
# with the project's venv (${PENELOPE_VENV:-.venv}, into which `pip install -e ".[sglang]"`
# installed SGLang 0.5.23 with its CUDA dependencies). Not run by the test suite; CPU runs of the
# same check are in tests/sglang/test_engine.py.
#
# A small Qwen3 with random weights (no download), each configuration checked against the same
# Engine on a pool that never evicts. "det": SGLang's deterministic inference (the runs agree to
# rounding); without it bf16 results depend on batch shapes and the default bf16 --atol applies.
#   fa3-chunk256-det    SGLang's default backend (FA3 on Hopper), holes larger than a chunk (hole-first)
#   fa3-phantoms-det      the default backend, holes refilled by phantoms (chunk 4096)
#   fa3-phantoms          the same without deterministic inference
#   fa3-two-tiers       phantoms and Penelope's CPU tier (pinned host pool, copies on side streams)
#   trtllm-phantoms       --attention-backend trtllm_mha with phantoms (it has no deterministic mode)
#   triton-phantoms-det   --attention-backend triton: phantom batches through Penelope's ragged kernel
#   triton-phantoms       the same without deterministic inference, prefill CUDA graphs on (SGLang's
#                       default): the ragged kernel must still run the phantom batches
#   triton-sglang-det   PENELOPE_ATTENTION=sglang: phantoms on SGLang's Triton kernel
# Exit 1 if any differs (or triton-phantoms ran no batch on the ragged kernel); JSON reports in OUT_DIR.
#
# Usage: bash integration/sglang/smoke_gpu.sh [--dry-run] [OUT_DIR]   (default: $OUT or ./smoke_out)
#   --dry-run   print the command of every configuration, one per line, and run nothing
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
OUT_DIR=${1:-${OUT:-smoke_out}}
VENV=${PENELOPE_VENV:-.venv}
PY="$VENV/bin/python"

if [ "$DRY_RUN" = 0 ]; then
  [ -x "$PY" ] || { echo "smoke_gpu: no venv at $VENV (bash scripts/install.sh, then $VENV/bin/pip install -e \".[sglang]\")" >&2; exit 2; }
  "$PY" -c "import sglang, torch; assert torch.cuda.is_available(), 'no CUDA GPU'" || {
    echo "smoke_gpu: needs a CUDA GPU and SGLang 0.5.23 with its CUDA dependencies in $VENV" >&2; exit 2; }
  mkdir -p "$OUT_DIR"
fi

DET=(--engine-arg enable_deterministic_inference=true)
status=0
check() {  # name, PENELOPE_ATTENTION, extra `penelope verify` arguments...
  local name=$1 attention=$2
  shift 2
  local command=(env PENELOPE_ATTENTION="$attention" timeout 1200 "$PY" -m penelope.cli verify --engine sglang
    --device cuda --sessions 8 --turns 6 --system-tokens 1024 --message-tokens 400 --reply-tokens 32
    --cache-tokens 12288 --page-size 64 --json "$OUT_DIR/verify_$name.json" "$@")
  if [ "$DRY_RUN" = 1 ]; then
    echo "$name: ${command[*]}"
    return
  fi
  echo "== $name" >&2
  "${command[@]}" 2>&1 | tee "$OUT_DIR/verify_$name.log" || status=1
}

check fa3-chunk256-det ragged --chunk 256 "${DET[@]}"
check fa3-phantoms-det ragged --chunk 4096 "${DET[@]}"
check fa3-phantoms ragged --chunk 4096
check fa3-two-tiers ragged --chunk 4096 --cpu-cache 8192
check trtllm-phantoms ragged --chunk 4096 --engine-arg 'attention_backend="trtllm_mha"'
check triton-phantoms-det ragged --chunk 4096 --engine-arg 'attention_backend="triton"' "${DET[@]}"
check triton-phantoms ragged --chunk 4096 --engine-arg 'attention_backend="triton"'
check triton-sglang-det sglang --chunk 4096 --engine-arg 'attention_backend="triton"' "${DET[@]}"
[ "$DRY_RUN" = 1 ] && exit 0

# Phantom batches of the ragged configuration ran on Penelope's kernel, CUDA graphs or not.
"$PY" -c "import json, sys; runs = json.load(open(sys.argv[1]))['runs']; sys.exit(0 if (runs['penelope'].get('ragged_batches') or 0) > 0 else 1)" \
  "$OUT_DIR/verify_triton-phantoms.json" || { echo "smoke_gpu: triton-phantoms ran no phantom batch on the ragged kernel" >&2; status=1; }
exit $status
