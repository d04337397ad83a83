"""`penelope ab` against SGLang 0.5.23's real HTTP server on CPU: Penelope's cache against SGLang's
LRU, the tiny Qwen3 with real random weights, the prefix-aware CPU attention, 2 synthetic sessions
of 10 turns at scale 16, 2 at once, a twentieth of their recorded think times (at most 0.5 s), on
a KV pool of 2,560 tokens: the two histories (about 3,500 tokens at the end, their shared prefix
counted once) do not fit, so both caches must evict. Both servers are started once and stay up
together (`--resident-servers`), each warmed up with one unmeasured run; the rounds then run
interleaved (A B, B A), each on a flushed cache. About 2 minutes on an idle machine, most of it the
two servers' start-up.

Mechanics, not speed: every request finishes; both servers get the same prompts and send the same
greedy replies (eviction changes what is recomputed, never what is computed); both servers read
back the configuration asked for; eviction was forced; and Penelope's cache recomputes fewer
prefill tokens and fewer attention pairs than LRU (the servers' own counters; tokens less what a
never-evicting cache would compute for the same prompts). Measured over 4 runs each, on a loaded
machine: Penelope 3,760-4,352 recomputed tokens, LRU 4,624-5,392.

The think times keep the two sessions' requests mostly apart. Without them the requests overlap
or not with the machine's timing, and a cache's recomputed tokens jump between levels from run to
run (Penelope: 2,784 in most runs, 3,312 or 4,352 in some; LRU: 4,160), so the two caches can be
measured in different regimes.
"""
import json
from pathlib import Path

import pytest

from penelope.cli import main

STUB = Path(__file__).parent.parent / "engine_stub"
CONFIGS = ("penelope", "sglang-lru")


def read_records(path: Path) -> dict:
    return {r["rid"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.slow
def test_penelope_against_sglang_lru_on_forced_eviction(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", str(STUB))
    out = tmp_path / "ab"
    code = main(["ab", *CONFIGS, "--baseline", "sglang-lru", "--model", "tiny", "--pool", "2560", "--page-size", "16",
                 "--chunk", "1024", "--sessions", "2", "--limit-sessions", "2", "--turns", "10", "--scale", "16",
                 "--think-time", "scale:0.05,cap:0.5", "--resident-servers", "--repeat", "2",
                 "--startup-timeout", "300", "--no-plot", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "changes against sglang-lru, paired run by run" in printed
    result = json.loads((out / "ab.json").read_text())
    assert [(run["config"], run["round"]) for run in result["runs"]] == [
        ("penelope", 0), ("sglang-lru", 0), ("sglang-lru", 1), ("penelope", 1)]
    assert result["servers_mode"] == "resident"
    # The generated checkpoint is named by its spec too, so a comparison can rebuild it elsewhere.
    assert result["setup"]["model_spec"] == "tiny" and result["setup"]["model"] == str(out / "model")
    assert not result["interrupted"] and result["pairs"] == {"penelope": [0, 1]}
    for run in result["runs"]:
        assert run["sent"] == run["finished"] == 20 and run["errors"] == 0 and run["stopped"] == "done"
        assert run["computed_prefill_tokens"] >= run["never_evicting_prefill_tokens"] > 0
    servers = {config["name"]: config for config in result["configs"]}
    assert servers["penelope"]["applied"] == {"radix_cache_backend": "penelope", "policy": "private-head-block"}
    assert servers["sglang-lru"]["applied"] == {"radix_eviction_policy": "lru", "enable_session_radix_cache": False}
    assert servers["sglang-lru"]["server"]["attention_backend"] == "torch_native_prefix"
    # SGLang's own cache logged its tree core; Penelope's cache is not SGLang's.
    assert servers["sglang-lru"]["tree_core"] and servers["penelope"]["tree_core"] is None

    records = {name: read_records(out / f"records-{name}.jsonl") for name in CONFIGS}
    assert records["penelope"].keys() == records["sglang-lru"].keys() and len(records["penelope"]) == 40
    for rid, mine in records["penelope"].items():
        theirs = records["sglang-lru"][rid]
        assert mine["prompt_tokens"] == theirs["prompt_tokens"], rid
        assert mine["output_ids"] == theirs["output_ids"] and len(mine["output_ids"]) == mine["max_new_tokens"], rid

    # Eviction was forced in every run, and it cost Penelope fewer recomputed tokens than LRU.
    recomputed = {name: [run["recomputed_prefill_tokens"] for run in result["runs"] if run["config"] == name]
                  for name in CONFIGS}
    assert min(recomputed["sglang-lru"]) > 0
    assert sum(recomputed["penelope"]) < sum(recomputed["sglang-lru"]), recomputed
    # And fewer attention pairs: the cost by position Penelope's policy orders its victims by.
    pairs = {name: sum(run["prefill_attention_pairs"] for run in result["runs"] if run["config"] == name)
             for name in CONFIGS}
    assert pairs["penelope"] < pairs["sglang-lru"], pairs
