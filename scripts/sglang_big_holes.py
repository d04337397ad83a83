"""A long history with a front hole larger than a chunk, through SGLang's real HTTP server on CPU.

``python scripts/sglang_big_holes.py --history 20000 --pool 24576 --chunk 1024`` starts
``python -m sglang.launch_server`` on 127.0.0.1 (its own process group, stopped at the end, on an
error and on Ctrl-C) with Penelope's cache, the tiny Qwen3 (context 32,768), pages of 64,
``torch_native_prefix`` attention and SGLang's strict memory checks, then sends, one at a time:

1. history A (``--history`` ids);
2. request B, sized so that the pool must evict about half of A's history: Penelope evicts it from
   the front of A's private history;
3. A's next turn (its history, reply and 300 new ids): a front hole before a long resident tail,
   refilled hole-first when it is larger than the chunk, by a phantom in the batch otherwise;
4. the same prompt with ``logprob_start_len`` 0 (SGLang then matches no prefix: computed whole),
   the reference for 3's reply.

Checked per request: it is served within ``--timeout`` seconds, ``cached_tokens`` plus the prefill
tokens the server computed for it (the plugin's ``prefill_tokens`` counter) is the prompt, and the
reply of 3 equals the reference's. Exit status 0 when every check held, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from penelope.integration.sglang.verify import tiny_model
from penelope.loadgen.models import word_level_tokenizer
from penelope.loadgen.server import CPU_ARGS, CPU_ENV, ServerSpec, SGLangServer

ROOT = Path(__file__).resolve().parents[1]
STUB = ROOT / "tests" / "engine_stub"
PAGE = 64
CONTEXT = 32768
STRICT = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1", "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1",
          "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}


def post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url + "/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def counters(url: str) -> dict:
    with urllib.request.urlopen(url + "/server_info", timeout=60) as response:
        return (json.loads(response.read()).get("internal_states") or [{}])[0].get("penelope") or {}


def generate(url: str, name: str, prompt: list[int], timeout: float, **extra) -> dict:
    """Send `prompt` (8 greedy tokens); what the server reported and computed for it."""
    before = counters(url)
    start = time.monotonic()
    reply = post(url, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                 "ignore_eos": True}, **extra}, timeout)
    after = counters(url)
    row = {"request": name, "prompt": len(prompt), "cached": reply["meta_info"]["cached_tokens"],
           "computed": after["prefill_tokens"] - before["prefill_tokens"],
           "phantom_tokens": after["phantom_tokens"] - before["phantom_tokens"],
           "hole_chunk_tokens": after["chunk_refill_tokens"] - before["chunk_refill_tokens"],
           "evicted": after["evicted_tokens"] - before["evicted_tokens"],
           "seconds": round(time.monotonic() - start, 1), "output": reply["output_ids"]}
    row["sums"] = row["cached"] + row["computed"] == row["prompt"]
    print(json.dumps({k: v for k, v in row.items() if k != "output"}), flush=True)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--history", type=int, default=20000)
    parser.add_argument("--pool", type=int, default=24576)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take")
    parser.add_argument("--out", type=Path, default=None, help="folder for the model and the server log")
    args = parser.parse_args(argv)
    if not PAGE <= args.history <= CONTEXT - 1024 or args.pool < args.history + PAGE or args.chunk % PAGE:
        parser.error(f"--history must lie in [{PAGE}, {CONTEXT - 1024}], --pool exceed it, --chunk be a "
                     f"multiple of {PAGE}")
    out = args.out or Path(tempfile.mkdtemp(prefix="penelope-big-holes-"))
    model = tiny_model(out / "tiny-qwen3", max_positions=CONTEXT)
    word_level_tokenizer(model, 1000)
    path = os.pathsep.join(p for p in (str(STUB), os.environ.get("PYTHONPATH", "")) if p)
    server_args = (*CPU_ARGS, "--attention-backend", "torch_native_prefix", "--page-size", str(PAGE),
                   "--context-length", str(CONTEXT), "--max-total-tokens", str(args.pool),
                   "--chunked-prefill-size", str(args.chunk), "--mem-fraction-static", "0.5",
                   "--random-seed", "0", "--radix-cache-backend", "penelope")
    spec = ServerSpec(model=str(model), log=out / "server.log", args=server_args, startup_timeout=600,
                      env={**CPU_ENV, **STRICT, "PYTHONPATH": path})
    rng = random.Random(1)

    def ids(n: int) -> list[int]:
        return [rng.randrange(2, 1000) for _ in range(n)]

    try:
        with SGLangServer(spec) as server:
            history = ids(args.history)
            first = generate(server.url, "A1", history, args.timeout)
            rows = [first, generate(server.url, "B (evicts A's front)", ids(args.pool - args.history // 2),
                                    args.timeout)]
            turn = history + first["output"] + ids(300)
            rows.append(generate(server.url, "A2 (front hole)", turn, args.timeout))
            rows.append(generate(server.url, "A2 computed whole", turn, args.timeout, return_logprob=True,
                                 logprob_start_len=0))
    except (OSError, KeyError) as error:
        print(f"sglang_big_holes: the server failed a request: {error} (log: {out / 'server.log'})")
        return 1
    same = rows[2]["output"] == rows[3]["output"]
    holed = rows[2]["phantom_tokens"] + rows[2]["hole_chunk_tokens"]
    print(f"A2's hole refilled: {holed} tokens; reply equals the whole computation: {same}")
    ok = same and holed > 0 and all(row["sums"] for row in rows)
    print("all checks held" if ok else "FAILED", f"(log: {out / 'server.log'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
