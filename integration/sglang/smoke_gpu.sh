#!/usr/bin/env bash
# GPU smoke test of the SGLang integration (needs a CUDA GPU and SGLang 0.5.23 with its CUDA
# dependencies: pip install -e ".[sglang]"). Not run by the test suite.
#
# Starts real SGLang servers on a small Qwen3 configuration with random weights (--load-format
# dummy, no download, no tokenizer), drives the same multi-turn workload through each, and
# compares generated tokens and their log-probabilities with greedy decoding in deterministic mode:
#   baseline    --radix-cache-backend penelope with a pool that never evicts
#   evict-sglang  a small pool (evictions, holes, phantoms), phantom batches on SGLang's Triton path
#   evict-ragged  the same small pool, phantom batches on Penelope's ragged kernel
# evict-sglang must match the baseline bit for bit and must have run phantoms (exit 1 otherwise).
# evict-ragged uses another attention kernel for phantom batches, so its agreement is reported.
#
# Usage: bash integration/sglang/smoke_gpu.sh [OUT_DIR]   (default: $OUT or ./smoke_out)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${1:-${OUT:-smoke_out}}
PY=${PYTHON:-python}
PORT=${PORT:-31000}
SESSIONS=${SESSIONS:-8}
TURNS=${TURNS:-6}
mkdir -p "$OUT_DIR"
work=$(mktemp -d)
trap 'for p in $(jobs -p); do kill -- -$p 2>/dev/null || true; done; rm -rf "$work"' EXIT

"$PY" -c "import sglang, torch; assert torch.cuda.is_available(), 'no CUDA GPU'" || {
  echo "smoke_gpu: needs a CUDA GPU and SGLang 0.5.23 with its CUDA dependencies" >&2; exit 2; }

# The plugin's entry point: from the installed package if pyproject declares it, else from a
# distribution stub on PYTHONPATH (same entry point, same function).
if ! "$PY" -c "from importlib.metadata import entry_points as e; \
    assert any(p.value.startswith('penelope.') for p in e(group='sglang.srt.plugins'))" 2>/dev/null; then
  mkdir -p "$work/plugin/penelope_smoke-0.0.dist-info"
  printf 'Metadata-Version: 2.1\nName: penelope-smoke\nVersion: 0.0\n' > "$work/plugin/penelope_smoke-0.0.dist-info/METADATA"
  printf '[sglang.srt.plugins]\npenelope = penelope.integration.sglang.plugin:register\n' \
    > "$work/plugin/penelope_smoke-0.0.dist-info/entry_points.txt"
  export PYTHONPATH="$work/plugin${PYTHONPATH:+:$PYTHONPATH}"
fi

# A small Qwen3: 4 layers, GQA 8/4 heads of 128, random weights.
mkdir -p "$work/model"
cat > "$work/model/config.json" <<'EOF'
{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
 "intermediate_size": 3072, "num_hidden_layers": 4, "num_attention_heads": 8,
 "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 32000, "max_position_embeddings": 32768,
 "rope_theta": 1000000, "rms_norm_eps": 1e-06, "hidden_act": "silu", "attention_bias": false,
 "tie_word_embeddings": true, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
EOF

serve() {  # name, max-total-tokens, PENELOPE_ATTENTION
  local name=$1 tokens=$2 attention=$3
  PENELOPE_ATTENTION=$attention setsid "$PY" -m sglang.launch_server --model-path "$work/model" \
    --load-format dummy --skip-tokenizer-init --port "$PORT" --attention-backend triton \
    --enable-deterministic-inference --disable-prefill-cuda-graph --disable-decode-cuda-graph \
    --page-size 64 --max-total-tokens "$tokens" --max-running-requests 16 \
    --radix-cache-backend penelope --radix-eviction-policy-config '{"policy": "penelope"}' \
    > "$OUT_DIR/server_$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    kill -0 $pid 2>/dev/null || { echo "server $name died; see $OUT_DIR/server_$name.log" >&2; exit 1; }
    sleep 2
  done
  "$PY" - "$PORT" "$SESSIONS" "$TURNS" "$OUT_DIR/run_$name.json" <<'EOF'
import json, random, sys
from concurrent.futures import ThreadPoolExecutor
import requests

port, sessions, turns, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rng = random.Random(0)
system = [rng.randrange(3, 32000) for _ in range(1024)]
histories = [list(system) for _ in range(sessions)]
results = []

def ask(i):
    body = {"input_ids": histories[i], "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}}
    reply = requests.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=600).json()
    return reply["output_ids"], [entry[0] for entry in reply["meta_info"]["output_token_logprobs"]]

for turn in range(turns):
    for i in range(sessions):  # each turn: a tool result / user message of 200-600 tokens
        histories[i] += [rng.randrange(3, 32000) for _ in range(rng.randint(200, 600))]
    with ThreadPoolExecutor(sessions) as pool:
        replies = list(pool.map(ask, range(sessions)))
    for i, (ids, logprobs) in enumerate(replies):
        results.append({"turn": turn, "session": i, "prompt": len(histories[i]), "output_ids": ids,
                        "logprobs": logprobs})
        histories[i] += ids
json.dump(results, open(out, "w"))
EOF
  kill -- -$pid 2>/dev/null || true; wait $pid 2>/dev/null || true
}

serve baseline 400000 sglang
serve evict-sglang 12288 sglang
serve evict-ragged 12288 ragged

"$PY" - "$OUT_DIR" <<'EOF'
import json, pathlib, re, sys
out = pathlib.Path(sys.argv[1])
runs = {name: json.loads((out / f"run_{name}.json").read_text()) for name in ("baseline", "evict-sglang", "evict-ragged")}
def compare(name):
    pairs = list(zip(runs["baseline"], runs[name], strict=True))
    same = sum(a["output_ids"] == b["output_ids"] for a, b in pairs)
    diff = max(abs(x - y) for a, b in pairs for x, y in zip(a["logprobs"], b["logprobs"]))
    phantoms = len(re.findall(r"penelope: request \S+ refills", (out / f"server_{name}.log").read_text()))
    return {"requests": len(pairs), "identical_outputs": same, "max_abs_logprob_diff": diff, "phantom_events": phantoms}
summary = {name: compare(name) for name in ("evict-sglang", "evict-ragged")}
(out / "smoke_summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
strict = summary["evict-sglang"]
ok = strict["identical_outputs"] == strict["requests"] and strict["max_abs_logprob_diff"] == 0 and strict["phantom_events"] > 0
sys.exit(0 if ok else 1)
EOF
