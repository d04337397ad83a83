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
``python_core_vs_rust`` likewise for SGLang's Python core (shown, not tracked). 18 Engine runs,
about 20 minutes on the 2-core development machine.

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
                run = run_engine(model, traffic, replace(setup, cache=cache), engine_env(**env))
                assert all(req["finish"] == "length" for req in run["requests"]), name
                served.add(len(run["requests"]))
                cpu[name].append(run["counters"]["serve_cpu_s"])
        return cpu

    cpu = benchmark.pedantic(rounds, rounds=1, iterations=1)
    median = {name: statistics.median(cpu[name]) for name in names}
    [requests] = served  # every run served the same requests (the probes included)
    benchmark.extra_info.update({
        "page_size": page,
        "requests": requests,
        "serve_cpu_s": cpu,
        **{f"{name}_cpu_s_per_request": median[name] / requests for name in names},
        "ratio_penelope_vs_rust": median["rust"] / median["penelope"],
        "python_core_vs_rust": median["rust"] / median["python"],
    })
    print(f"\npage {page}: scheduler CPU s while serving (median of {ROUNDS}): "
          + ", ".join(f"{name} {median[name]:.3f}" for name in names))
