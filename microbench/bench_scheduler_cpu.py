"""The scheduler's CPU time in SGLang 0.5.23's real Engine (CPU) with each cache: Penelope's plugin
and SGLang's default ``UnifiedRadixCache`` on its Rust tree core (what the Engine builds by
default) and on its Python tree core (``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python``).

The traffic of ``bench_sglang_engine.test_scheduler_overhead`` (agent sessions growing turn by
turn, decode-heavy, on a pool that never evicts: every cache hits the same whole pages, so all
serve the same batches), at page 64 and page 1. Each Engine runs in a process of its own
(``verify.run_engine``); rounds interleave the caches. Figure: the scheduler process's CPU
seconds while serving (forward passes included, the same work for every cache; robust to other
work on a shared machine), median of the rounds, per request and as ``ratio_penelope_vs_rust``
= Rust core's / Penelope's (>= 1.0: Penelope's scheduler at least as cheap);
``python_core_vs_rust`` likewise for SGLang's Python core (shown, not tracked).

The forward passes dominate that figure, and their run-to-run spread is larger than every cache's
whole share, so each run also times the cache itself (``PENELOPE_TIME_CACHE=1``,
``integration/sglang/cache_timer.py``): the CPU time of the scheduler's calls into its tree cache,
less the timer's own cost per call. Figures: ``<cache>_cache_cpu_s_per_request`` (median of the
rounds), ``cache_ratio_penelope_vs_rust`` (>= 1.0: Penelope's cache at most the Rust core's time),
``cache_python_core_vs_rust``, and per run the calls and seconds of every method. 18 Engine runs,
about 8 minutes on the 2-core development machine.

Run: ``python -m pytest microbench/bench_scheduler_cpu.py --benchmark-json out.json -s``.
"""
from __future__ import annotations

import statistics
from dataclasses import replace

import pytest
from bench_sglang_engine import engine_env

from penelope.integration.sglang.engine_check import AgentTraffic, EngineSetup
from penelope.integration.sglang.verify import run_engine, tiny_model

ROUNDS = 3
# name: (EngineSetup.cache, extra environment)
CACHES = {
    "penelope": ("penelope", {}),
    "rust": ("default", {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "rust"}),
    "python": ("default", {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(tiny_model(tmp_path_factory.mktemp("tiny-qwen3")))


@pytest.mark.parametrize("page", [64, 1])
def test_scheduler_cpu_per_cache(benchmark, model, page):
    traffic = AgentTraffic(turns=4, max_new_tokens=64)
    setup = EngineSetup(pool_tokens=16384, chunk=512, page_size=page)
    names = list(CACHES)

    served = set()

    def rounds():
        cpu = {name: [] for name in names}
        for r in range(ROUNDS):
            for name in names[r % len(names):] + names[:r % len(names)]:
                cache, env = CACHES[name]
                run = run_engine(model, traffic, replace(setup, cache=cache),
                                 engine_env(PENELOPE_TIME_CACHE="1", **env))
                assert all(req["finish"] == "length" for req in run["requests"]), name
                served.add(len(run["requests"]))
                counters = run["counters"]
                assert counters["serve_cache_calls"] > 0, f"{name}: the cache timer saw no call"
                cpu[name].append(counters["serve_cpu_s"])
                in_cache[name].append(counters["serve_cache_cpu_s"]
                                      - counters["serve_cache_calls"] * counters["cache_timer_floor_s"])
                methods[name].append(counters["cache_methods"])
        return cpu

    in_cache = {name: [] for name in names}
    methods = {name: [] for name in names}
    cpu = benchmark.pedantic(rounds, rounds=1, iterations=1)
    median = {name: statistics.median(cpu[name]) for name in names}
    cache_median = {name: statistics.median(in_cache[name]) for name in names}
    [requests] = served  # every run served the same requests (the probes included)
    benchmark.extra_info.update({
        "page_size": page,
        "requests": requests,
        "serve_cpu_s": cpu,
        **{f"{name}_cpu_s_per_request": median[name] / requests for name in names},
        "ratio_penelope_vs_rust": median["rust"] / median["penelope"],
        "python_core_vs_rust": median["rust"] / median["python"],
        "cache_cpu_s": in_cache,
        **{f"{name}_cache_cpu_s_per_request": cache_median[name] / requests for name in names},
        "cache_ratio_penelope_vs_rust": cache_median["rust"] / cache_median["penelope"],
        "cache_python_core_vs_rust": cache_median["rust"] / cache_median["python"],
        "cache_methods": methods,
    })
    print(f"\npage {page}: scheduler CPU s while serving (median of {ROUNDS}): "
          + ", ".join(f"{name} {median[name]:.3f}" for name in names)
          + "; of it in the cache, ms per request: "
          + ", ".join(f"{name} {cache_median[name] / requests * 1e3:.3f}" for name in names))
