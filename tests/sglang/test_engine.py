"""Penelope inside SGLang 0.5.23's REAL Engine on CPU: scheduler process, batching, chunked
prefill, retraction, abort and decode, each Engine in a process of its own.

Every scenario serves the same agent-like traffic (4 sessions sharing a 300-token system prompt,
histories growing by 200 tokens a turn, 5 turns, 8 greedy tokens per turn, plus two probe
requests) on a 2048-token pool that must evict, and is compared with the same Engine on a pool
that never evicts: identical tokens, log-probabilities within 1e-3 (fp32 on CPU: batch shapes
differ between the runs, so results are not bitwise; SGLang's deterministic mode needs a GPU
attention backend), and every request finished. SGLang's own memory checks run at every step
(``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY``: available + evictable + protected +
request-owned == total; ``SGLANG_CHECK_KV_PAGE_INVARIANTS``: no page both owned and free, no page
freed twice; idle leak checks raise), so a leak or a double free fails the run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from model_configs import UNSERVABLE_MODELS, config_folder
from sglang_engine_env import (
    TRAFFIC,
    engine_env,
)

from penelope.integration.sglang.engine_check import AgentTraffic, EngineSetup
from penelope.integration.sglang.script_traffic import ScriptTraffic
from penelope.integration.sglang.verify import compare, run_engine, tiny_model

# A test-only SGLang plugin (its dist-info beside it): ``flashinfer`` as a CPU backend that reads
# a batch's cached prefixes before it stores the batch's K/V, as FlashInfer's ragged prefill does.
READ_BEFORE_STORE = Path(__file__).parent.parent / "read_before_store"
ATOL = 1e-3




@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(tiny_model(tmp_path_factory.mktemp("tiny-qwen3")))


@pytest.fixture(scope="module")
def reference(model) -> dict:
    """Penelope on a pool that holds all the traffic: nothing is ever evicted."""
    return run_engine(model, TRAFFIC, EngineSetup(pool_tokens=16384), engine_env())


def check_against(run: dict, reference: dict, traffic: AgentTraffic = TRAFFIC) -> dict:
    result = compare(run, reference, ATOL)
    assert result["requests"] == traffic.sessions * traffic.turns + 2
    assert result["identical_tokens"], result["different"]
    assert result["unfinished"] == 0
    assert result["max_logprob_diff"] <= ATOL, result["max_logprob_diff_at"]
    return run["counters"]


def test_the_model_reads_early_tokens(reference):
    """Probe requests that differ only in their first token generate different tokens: the
    comparisons below can see KV that is wrong anywhere in a history."""
    probes = {r["rid"]: r["output_ids"] for r in reference["requests"] if r["rid"].startswith("probe")}
    assert probes["probe0"] != probes["probe1"]
    assert reference["counters"]["evicted_tokens"] == 0


def test_chunks_smaller_than_holes_and_an_abort_mid_prefill(model, reference):
    """Chunks of 128 tokens, holes of up to 576: the holes are computed hole-first, chunk by
    chunk, by their own requests (this setup hung the scheduler before). A 1,800-token request is
    aborted while it is being prefilled. Victims by penelope-agent, which must see the aborted
    request leave the system."""
    traffic = AgentTraffic(abort=True)
    run = run_engine(model, traffic, EngineSetup(pool_tokens=2048, chunk=128, policy="penelope-agent"), engine_env())
    counters = check_against(run, reference)
    assert counters["evicted_tokens"] > 0 and counters["chunk_refill_tokens"] > 0
    # The aborted request left the system (its session waits, for something unknown).
    assert counters["hint_in_system"] == 0 and counters["hint_waiting_unknown"] == 7
    [aborted] = [r for r in run["requests"] if r["rid"] == "aborted"]
    # Aborted while it was SGLang's chunked request, between two of its chunks.
    assert aborted["aborted_mid_prefill"]
    assert aborted["finish"] == "abort" and aborted["output_ids"] == []


@pytest.fixture(scope="module")
def phantoms(model) -> dict:
    """GPU only, chunks as large as the pool."""
    return run_engine(model, TRAFFIC, EngineSetup(pool_tokens=2048, chunk=2048), engine_env())


def test_phantoms_ride_in_the_requests_batch(phantoms, reference):
    """With chunks as large as the pool, every hole is refilled by a phantom in its request's
    batch, on SGLang's own torch attention backend."""
    counters = check_against(phantoms, reference)
    assert counters["phantoms"] > 0 and counters["phantom_tokens"] == counters["phantom_tokens"] > 0


def test_a_backend_that_reads_the_prefix_before_storing_gets_no_phantoms(model):
    """On FlashInfer's order (the cached prefix read from the pool, then the batch's K/V stored),
    a phantom's hole would be read before the phantom writes it. The plugin refills holes hole-first
    there, also where phantoms would fit the chunk: tokens identical to the never-evicting run."""
    flashinfer = {"attention_backend": "flashinfer"}
    # No flashinfer package on CPU: its version check would refuse the name.
    env = engine_env(READ_BEFORE_STORE, SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK="1")
    reference = run_engine(model, TRAFFIC, EngineSetup(pool_tokens=16384, extra=flashinfer), env)
    run = run_engine(model, TRAFFIC, EngineSetup(pool_tokens=2048, chunk=2048, extra=flashinfer), env)
    counters = check_against(run, reference)
    assert counters["evicted_tokens"] > 0 and counters["phantoms"] == 0 and counters["chunk_refill_tokens"] > 0


# A 1,600-token history (128 shared), other traffic that evicts its front while the 2,048-token
# pool stays nearly full, then the history's next turn: a front hole before a long resident tail.
FRONT_HOLE = ScriptTraffic(steps=(("a1", ("system", 1472)), ("b", ("system", 832)), ("a2", ("a1", 100)),
                                  ("c", ("system", 700)), ("a3", ("a2", 60))), system_tokens=128)


def check_cached_tokens(run: dict) -> None:
    """What the server reported cached plus what it computed is each prompt, request by request:
    a refilled hole is computed, never cached."""
    for r in run["requests"]:
        assert r["cached_tokens"] + r["computed_tokens"] == r["prompt_tokens"], r


@pytest.mark.parametrize(("chunk", "options"), [(128, {}), (2048, {}), (128, {"PENELOPE_PHANTOMS": "0"})],
                         ids=["hole-first", "phantoms", "no-phantoms"])
def test_a_front_hole_before_a_long_resident_tail_is_served(model, chunk, options):
    """The request's next turn is admitted in a nearly full pool: SGLang charged a hole-first
    request its whole prompt from the hole (the locked tail included), and without phantoms the
    lock kept the tail it recomputes; either way the scheduler waited beside it forever. Tokens
    as on a never-evicting pool; cached_tokens is what was reused."""
    env = engine_env(**options)
    reference = run_engine(model, FRONT_HOLE, EngineSetup(pool_tokens=8192, chunk=chunk), env)
    run = run_engine(model, FRONT_HOLE, EngineSetup(pool_tokens=2048, chunk=chunk), env, timeout=240)
    result = compare(run, reference, ATOL)
    assert result["identical_tokens"] and result["unfinished"] == 0, result
    assert result["max_logprob_diff"] <= ATOL
    counters = run["counters"]
    assert counters["evicted_tokens"] > 0
    if not options:
        refilled = counters["phantom_tokens"] if chunk == 2048 else counters["chunk_refill_tokens"]
        assert refilled > 0
    check_cached_tokens(run)
    check_cached_tokens(reference)


# The deployment that stalled: a 32K history whose front lost ~9.8K tokens (more than two chunks of
# 4,096) while a 36,864-token pool stays ~36.7K full, SGLang's default max_prefill_tokens (16,384).
LONG_HOLE = ScriptTraffic(steps=(("a1", ("system", 30208)), ("b", ("system", 14400)), ("a2", ("a1", 1024))),
                          system_tokens=2048)


@pytest.mark.slow
def test_a_long_history_with_a_hole_of_several_chunks(tmp_path_factory):
    """At the scale the scheduler stalled at, with the prefix-aware CPU attention (cached tokens
    are free, as on a GPU backend): the next turn is served hole-first, identical to a pool that
    never evicts, and reports as cached only what it reused."""
    model = str(tiny_model(tmp_path_factory.mktemp("tiny-qwen3-64k"), max_positions=65536))
    setup = EngineSetup(pool_tokens=36864, chunk=4096, extra={"attention_backend": "torch_native_prefix"})
    reference = run_engine(model, LONG_HOLE, replace(setup, pool_tokens=LONG_HOLE.peak_tokens() // 64 * 64 + 64),
                           engine_env())
    run = run_engine(model, LONG_HOLE, setup, engine_env(), timeout=600)
    result = compare(run, reference, ATOL)
    assert result["identical_tokens"] and result["unfinished"] == 0, result
    check_cached_tokens(run)
    # a2 computes its front hole (chunk by chunk, jumping the ~20K resident after it), then a1's
    # reply and its 1,024 new tokens; b's arrival took the hole from a1's private front.
    [a2] = [r for r in run["requests"] if r["rid"] == "a2"]
    hole = run["counters"]["chunk_refill_tokens"]
    assert 9000 < hole < 11000 and a2["computed_tokens"] == hole + 8 + 1024
    print(f"a2: {a2['prompt_tokens']} tokens, {a2['cached_tokens']} cached, hole {hole}, "
          f"served in {run['serve_s']:.0f} s")


def test_two_tiers(model, reference, phantoms):
    """A CPU tier of 1024 tokens beside the 2048-token pool: demotions instead of deletions, loads
    at admission (through the swap buffer when both tiers are full) in the same step as phantoms
    for what neither tier holds; fewer tokens recomputed than without the tier."""
    run = run_engine(model, TRAFFIC, EngineSetup(pool_tokens=2048, chunk=2048, cpu_cache=1024), engine_env())
    counters = check_against(run, reference)
    assert counters["host_tokens"] == 1024 and counters["tier_demotions"] > 0
    assert counters["tier_loads"] > 0 and counters["tier_swap_loads"] > 0 and counters["phantom_tokens"] > 0
    assert counters["prefill_tokens"] < phantoms["counters"]["prefill_tokens"]


def test_two_tiers_with_hole_chunks_and_the_swap_copy_kernel(model, reference):
    """The same with chunks smaller than the holes, and the tier's copies run by Penelope's
    Triton swap-copy kernel (interpreted on CPU)."""
    env = engine_env(PENELOPE_COPY="triton", TRITON_INTERPRET="1")
    run = run_engine(model, TRAFFIC, EngineSetup(pool_tokens=2048, chunk=128, cpu_cache=1024), env)
    counters = check_against(run, reference)
    assert counters["tier_copy"] == "triton"
    assert counters["tier_loads"] > 0 and counters["tier_swap_loads"] > 0 and counters["chunk_refill_tokens"] > 0


def reply_token_in_some(reference: dict, rids: set) -> int:
    """A token in about half of the replies of `rids` in `reference` (a stand-in for a tool-call
    token: the tiny model has no chat template)."""
    replies = [set(r["output_ids"]) for r in reference["requests"] if r["rid"] in rids]
    counts = {token: sum(token in reply for reply in replies) for reply in replies for token in reply}
    return min(counts, key=lambda token: (abs(2 * counts[token] - len(replies)), token))


def expected_waits(run: dict, traffic: AgentTraffic, tool_call_token: int) -> dict:
    """The hint counters the plugin must report after `run`: every turn but a session's last ends
    a wait when the next one arrives (observed); last turns and probes leave sessions waiting. The
    kind is the session's own hint, else whether the reply holds `tool_call_token`."""
    counts = dict.fromkeys(("observed_tool", "observed_human", "waiting_tool", "waiting_human"), 0)
    for r in run["requests"]:
        session, _, turn = r["rid"].removeprefix("s").partition("-t")
        hinted = traffic.waits_for[int(session)] if turn and int(session) < len(traffic.waits_for) else None
        kind = hinted or ("tool" if tool_call_token in r["output_ids"] else "human")
        ended = bool(turn) and int(turn) < traffic.turns - 1
        counts[f"{'observed' if ended else 'waiting'}_{kind}"] += 1
    return {f"hint_{name}": n for name, n in {**counts, "waiting_unknown": 0, "in_system": 0}.items()}


@pytest.mark.parametrize(("policy", "cpu_cache"), [("penelope-agent", 1024), ("ttl", 0)])
def test_agent_aware_policies_read_what_requests_show(model, reference, policy, cpu_cache):
    """The agent-aware policies in the real Engine: sessions 0 and 1 say what they wait for
    (``custom_params``), the others are read from their replies (``tool_call_token``); session 0's
    tool takes 1.5 s a turn while the others run. The scheduler's book of waits must hold exactly
    what the requests showed, and the outputs match the never-evicting run. Over two tiers,
    penelope-agent brings session 0's CPU blocks back to the GPU while it waits (prefetch)."""
    traffic = AgentTraffic(waits_for=("tool", "human"), think_s=(1.5,))
    unhinted = {r["rid"] for r in reference["requests"] if not r["rid"].startswith(("s0-", "s1-"))}
    token = reply_token_in_some(reference, unhinted)
    setup = EngineSetup(pool_tokens=2048, chunk=2048, policy=policy, cpu_cache=cpu_cache, tool_call_token=token)
    run = run_engine(model, traffic, setup, engine_env())
    counters = check_against(run, reference, traffic)
    assert counters["policy"] == policy and counters["evicted_tokens"] + counters.get("tier_demotions", 0) > 0
    # The policies weigh blocks by the served checkpoint's recompute cost, read from its config.json.
    assert counters["cost_model"] == Path(model).name
    want = expected_waits(run, traffic, token)
    assert {name: counters[name] for name in want} == want
    # The policy's clock is the one the scheduler broadcasts (``clock.py``): session 0's tool wait
    # of 1.5 s shows in it.
    assert counters["hint_longest_wait_s"] >= traffic.think_s[0]
    # Both kinds were read from replies: the token told some tool calls from some replies to a person.
    from_replies = expected_waits({"requests": [r for r in run["requests"] if r["rid"] in unhinted]}, traffic, token)
    assert from_replies["hint_observed_tool"] + from_replies["hint_waiting_tool"] > 0
    assert from_replies["hint_observed_human"] + from_replies["hint_waiting_human"] > 0
    if cpu_cache:
        assert counters["tier_loads"] > 0 and counters["tier_prefetches"] > 0 and counters["tier_prefetched_tokens"] > 0
    print(f"{policy}: {want}, prefetches {counters.get('tier_prefetches')}, "
          f"prefetched tokens {counters.get('tier_prefetched_tokens')}")


def test_request_rows_run_out(model, reference):
    """Two request rows: a request whose phantoms get no rows refills its holes hole-first."""
    run = run_engine(model, TRAFFIC, EngineSetup(pool_tokens=2048, chunk=1024, rows=2), engine_env())
    counters = check_against(run, reference)
    assert counters["evicted_tokens"] > 0 and counters["chunk_refill_tokens"] + counters["phantom_tokens"] > 0


def test_without_chunked_prefill(model, reference):
    """Chunked prefill off and two rows: holes without a row are dropped (their request computes
    from the first of them), the rest ride."""
    run = run_engine(model, TRAFFIC, EngineSetup(pool_tokens=2048, chunk=-1, rows=2), engine_env())
    counters = check_against(run, reference)
    assert counters["evicted_tokens"] > 0


def test_page_size_one(model, reference):
    """Page size 1: blocks of one token, as SGLang's own cache keeps every token."""
    run = run_engine(model, TRAFFIC, EngineSetup(pool_tokens=2048, page_size=1, chunk=128),
                     engine_env(PENELOPE_TIME_CACHE="1"))
    counters = check_against(run, reference)
    assert counters["block_size"] == 1 and counters["evicted_tokens"] > 0
    check_cache_timer(counters, {"match_prefix", "checkpoint", "evict_for_alloc"})
    assert reference["counters"]["cache_calls"] == 0  # untimed without PENELOPE_TIME_CACHE


def check_cache_timer(counters: dict, expected_methods: set) -> None:
    """The scheduler's calls into its cache were timed (``cache_timer``), serving unchanged."""
    methods = counters["cache_methods"]
    assert expected_methods <= set(methods), sorted(methods)
    assert counters["cache_calls"] == sum(calls for calls, _ in methods.values())
    assert 0 < counters["serve_cache_calls"] <= counters["cache_calls"]
    assert 0 < counters["serve_cache_cpu_s"] < counters["serve_cpu_s"]
    assert 0 < counters["cache_timer_floor_s"] < 1e-4


def test_retraction(model):
    """SGLANG_TEST_RETRACT retracts running requests every few decode steps (their KV released
    and their prefill redone later), with holes and phantoms in play."""
    traffic = AgentTraffic(max_new_tokens=32)
    env = engine_env(SGLANG_TEST_RETRACT="1")
    reference = run_engine(model, traffic, EngineSetup(pool_tokens=16384), env)
    run = run_engine(model, traffic, EngineSetup(pool_tokens=2048, chunk=256), env)
    counters = check_against(run, reference, traffic)
    assert counters["evicted_tokens"] > 0
    assert counters["prefill_tokens"] > reference["counters"]["prefill_tokens"]


def test_default_cache_on_the_same_traffic(model, reference):
    """SGLang's default radix cache on the small pool, through the same harness: its outputs match
    too, and both caches' recomputed prefill tokens are counted the same way."""
    run = run_engine(model, TRAFFIC, EngineSetup(pool_tokens=2048, chunk=128, cache="default"),
                     engine_env(PENELOPE_TIME_CACHE="1"))
    counters = check_against(run, reference)
    assert counters["prefill_tokens"] > reference["counters"]["prefill_tokens"]
    assert "evicted_tokens" not in counters
    check_cache_timer(counters, {"match_prefix", "checkpoint", "evict_for_alloc"})


def test_rows_taken_by_phantoms_make_a_request_wait(model):
    """Two request rows: a request with a hole (one phantom) and a fresh request in one call. The
    phantom takes the row SGLang counted for the fresh request, which waits a step (this crashed
    SGLang's allocator before)."""
    run = subprocess.run([sys.executable, str(Path(__file__).parent.parent / "engine_rows_probe.py"), model],
                         env={**os.environ, **engine_env(SGLANG_USE_CPU_ENGINE="1")}, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["finished"] == ["length", "length"] and report["phantoms"] == 1


def test_a_request_that_reuses_nothing_computes_cpu_blocks_again(model):
    """Chunks of 128 and a CPU tier: a history the CPU tier holds is sent again asking for
    log-probabilities from its first token, so SGLang matches none of it and its chunks insert KV
    the tier holds. The GPU copy replaces the host copy (this stopped the scheduler before), and
    the recomputed log-probabilities are the first run's."""
    run = subprocess.run([sys.executable, str(Path(__file__).parent.parent / "engine_cpu_recompute_probe.py"), model],
                         env={**os.environ, **engine_env(SGLANG_USE_CPU_ENGINE="1")}, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["finished"] == ["length"] * 4
    assert report["demoted_before"] > 0 and report["replaced_host_tokens"] > 0
    assert report["max_logprob_diff"] <= ATOL


def test_penelope_verify_engine_sglang(tmp_path):
    """The user's command: two Engines (Penelope on a small and on a never-evicting pool), JSON
    out, exit 0 when they agree."""
    out = tmp_path / "verify.json"
    run = subprocess.run([sys.executable, "-m", "penelope.cli", "verify", "--engine", "sglang", "--no-default",
                          "--turns", "3", "--cache-tokens", "1536", "--json", str(out)],
                         env={**os.environ, **engine_env()}, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    report = json.loads(out.read_text())
    assert report["passed"] and report["comparison"]["identical_tokens"] and report["probe_outputs_differ"]
    assert report["runs"]["penelope"]["evicted_tokens"] > 0 and report["runs"]["reference"]["evicted_tokens"] == 0
    assert run.stdout.strip().splitlines()[-2] == "PASS"


@pytest.mark.parametrize(("args", "env", "message"), [
    (["--radix-eviction-policy-config", '{"policy": "fifo"}'], {}, "penelope: unknown policy 'fifo'"),
    ([], {"PENELOPE_BLOCK_SIZE": "many"}, "penelope: PENELOPE_BLOCK_SIZE must be an integer, got 'many'"),
    (["--page-size", "64", "--radix-eviction-policy-config", '{"block_size": 96}'], {},
     "penelope: block_size 96 is not a multiple of SGLang's page size 64"),
    (["--radix-eviction-policy-config", '{"cpu_cache": 10000000000000}'], {}, "penelope: the CPU tier needs"),
    ([], {"PENELOPE_CPU_CACHE": "-5"}, "penelope: cpu_cache must be a non-negative integer"),
    (["--enable-streaming-session"], {}, "penelope: --radix-cache-backend penelope does not support --enable-stre"),
    (["--radix-eviction-policy", "lfu"], {}, "penelope: --radix-eviction-policy lfu applies to SGLang's own"),
    (["--max-total-tokens", "4096", "--radix-eviction-policy-config", '{"block_size": 8192}'], {},
     "penelope: block_size 8192 is larger than the KV pool"),
])
def test_a_bad_configuration_stops_the_server_with_one_line(model, args, env, message):
    """``python -m sglang.launch_server``: the error is the last line, there is no traceback, and
    no scheduler process was started."""
    run = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--device", "cpu",
                          "--attention-backend", "torch_native", "--skip-tokenizer-init", "--port", "31555",
                          "--radix-cache-backend", "penelope", *args],
                         env={**os.environ, **engine_env(SGLANG_USE_CPU_ENGINE="1", **env)},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1].startswith(message)
    assert "Traceback" not in run.stderr and "died" not in run.stderr


@pytest.mark.parametrize("name", ["swa", "mamba"])
def test_a_model_the_cache_cannot_serve_stops_the_server_before_anything_loads(tmp_path, name):
    """``python -m sglang.launch_server`` on a folder holding only a config.json (no weights, no
    tokenizer), so a refusal after the model began to load could not be this one line."""
    config, flags, kind = UNSERVABLE_MODELS[name]
    folder = config_folder(tmp_path / name, config)
    run = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", folder, "--device", "cpu",
                          "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", "31556",
                          "--radix-cache-backend", "penelope", *flags],
                         env={**os.environ, **engine_env(SGLANG_USE_CPU_ENGINE="1")}, capture_output=True, text=True,
                         timeout=600, start_new_session=True)
    assert run.returncode == 1, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1] == f"penelope: --radix-cache-backend penelope does not support {kind}"
    assert "Traceback" not in run.stderr and "died" not in run.stderr
