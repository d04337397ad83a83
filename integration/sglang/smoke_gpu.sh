#!/usr/bin/env bash
# GPU smoke test of the SGLang integration: `penelope verify --engine sglang` on a CUDA GPU
# (needs SGLang 0.5.23 with its CUDA dependencies: pip install -e ".[sglang]"). Not run by the
# test suite; CPU runs of the same check are in tests/test_sglang_engine.py.
#
# Three configurations of a small Qwen3 with random weights (no download), each checked against
# the same Engine on a pool that never evicts, deterministic inference on:
#   fa3-chunk256     SGLang's default attention backend, holes larger than a chunk (hole-first)
#   triton-riders    --attention-backend triton: phantom batches through Penelope's ragged kernel
#   triton-sglang    the same with PENELOPE_ATTENTION=sglang: phantoms on SGLang's Triton kernel
# Exit 1 if any differs; JSON reports in OUT_DIR.
#
# Usage: bash integration/sglang/smoke_gpu.sh [OUT_DIR]   (default: $OUT or ./smoke_out)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${1:-${OUT:-smoke_out}}
PY=${PYTHON:-python}
mkdir -p "$OUT_DIR"

"$PY" -c "import sglang, torch; assert torch.cuda.is_available(), 'no CUDA GPU'" || {
  echo "smoke_gpu: needs a CUDA GPU and SGLang 0.5.23 with its CUDA dependencies" >&2; exit 2; }

status=0
check() {  # name, PENELOPE_ATTENTION, extra `penelope verify` arguments...
  local name=$1 attention=$2
  shift 2
  echo "== $name" >&2
  PENELOPE_ATTENTION=$attention timeout 900 "$PY" -m penelope.cli verify --engine sglang --device cuda \
    --sessions 8 --turns 6 --system-tokens 1024 --message-tokens 400 --reply-tokens 32 \
    --cache-tokens 12288 --page-size 64 --engine-arg enable_deterministic_inference=true \
    --json "$OUT_DIR/verify_$name.json" "$@" 2>&1 | tee "$OUT_DIR/verify_$name.log" || status=1
}

check fa3-chunk256 ragged --chunk 256
check triton-riders ragged --chunk 4096 --engine-arg 'attention_backend="triton"'
check triton-sglang sglang --chunk 4096 --engine-arg 'attention_backend="triton"'
exit $status
