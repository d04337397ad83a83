"""Penelope's plugin in SGLang 0.5.23's real Engine (CPU): scheduler overhead and recomputation.

- ``test_scheduler_overhead``: the same decode-heavy traffic on a pool that never evicts, with
  SGLang's default radix cache and with Penelope's (no holes, so no phantoms: what every step
  pays for the plugin's hooks and tree), rounds interleaved; the ratio of serve times. With nothing
  evicted both caches hit the same whole pages, so both serve the same batches and the ratio is the
  ratio of per-step times. Three rounds each; the ratio of the scheduler process's CPU seconds
  while serving (robust to other work on a shared machine; forward passes included, the same in
  both) and of the serve wall times, medians.
- ``test_scenarios``: the scenarios of ``tests/sglang/test_engine.py`` (small pool; chunked
  prefill, rows, page size, retraction), each with Penelope, SGLang's default cache and a
  never-evicting reference: completed requests, identical tokens, the largest log-probability
  difference, and the prefill tokens (and their cost) each cache recomputed because of eviction.
  Writes ``sglang_engine_scenarios.json`` and ``.md`` into ``--bench-out``.

Each Engine runs in a process of its own (``penelope.integration.sglang.verify.run_engine``), with
the test-only ``sgl_kernel`` stand-in on CPU. About 2 minutes and 7 minutes on 2 cores.

Run: ``python -m pytest microbench/bench_sglang_engine.py --benchmark-json out.json -s``.
"""
from __future__ import annotations

import json
import os
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from penelope.integration.sglang.engine_check import AgentTraffic, EngineSetup
from penelope.integration.sglang.verify import EngineCheck, check, run_engine, tiny_model

STUB = Path(__file__).resolve().parents[1] / "tests" / "engine_stub"
SCENARIOS = {
    # name: (traffic, small-pool setup, extra environment)
    "chunk 128 < holes": (AgentTraffic(), EngineSetup(pool_tokens=2048, chunk=128), {}),
    "phantoms (chunk 2048)": (AgentTraffic(), EngineSetup(pool_tokens=2048, chunk=2048), {}),
    "2 rows, chunk 1024": (AgentTraffic(), EngineSetup(pool_tokens=2048, chunk=1024, rows=2), {}),
    "no chunking, 2 rows": (AgentTraffic(), EngineSetup(pool_tokens=2048, chunk=-1, rows=2), {}),
    "page 1, chunk 128": (AgentTraffic(), EngineSetup(pool_tokens=2048, page_size=1, chunk=128), {}),
    "retraction, chunk 256": (AgentTraffic(max_new_tokens=32), EngineSetup(pool_tokens=2048, chunk=256),
                              {"SGLANG_TEST_RETRACT": "1"}),
}


def engine_env(**extra) -> dict:
    path = os.pathsep.join(p for p in (str(STUB), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, **extra}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(tiny_model(tmp_path_factory.mktemp("tiny-qwen3")))


def test_scheduler_overhead(benchmark, model):
    traffic = AgentTraffic(turns=4, max_new_tokens=64)
    setup = EngineSetup(pool_tokens=16384, chunk=512)

    def rounds():
        times = {"default": [], "penelope": []}
        cpu = {"default": [], "penelope": []}
        for _ in range(3):
            for cache in times:
                run = run_engine(model, traffic, replace(setup, cache=cache), engine_env())
                times[cache].append(run["serve_s"])
                cpu[cache].append(run["counters"]["serve_cpu_s"])
        return times, cpu

    times, cpu = benchmark.pedantic(rounds, rounds=1, iterations=1)
    wall = statistics.median(times["penelope"]) / statistics.median(times["default"])
    ratio = statistics.median(cpu["penelope"]) / statistics.median(cpu["default"])
    benchmark.extra_info.update(serve_s=times, serve_cpu_s=cpu, cpu_ratio=ratio, wall_ratio=wall,
                                requests=traffic.sessions * traffic.turns,
                                generated_tokens=traffic.sessions * traffic.turns * traffic.max_new_tokens)
    print(f"\nscheduler CPU seconds while serving (median of 3): default {statistics.median(cpu['default']):.3f}, "
          f"penelope {statistics.median(cpu['penelope']):.3f}: ratio {ratio:.3f} (wall time ratio {wall:.3f})")


def test_scenarios(benchmark, model, request):
    out = Path(request.config.getoption("--bench-out") or "results/cpu")
    out.mkdir(parents=True, exist_ok=True)

    def all_scenarios():
        return {name: check(model, EngineCheck(traffic, setup, engine_env(**env)))
                for name, (traffic, setup, env) in SCENARIOS.items()}

    reports = benchmark.pedantic(all_scenarios, rounds=1, iterations=1)
    rows = ["| scenario | requests completed | identical tokens | max logprob diff | recomputed tokens "
            "penelope / default | recomputed cost penelope / default | phantom / hole-chunk tokens |",
            "|---|---|---|---|---|---|---|"]
    for name, report in reports.items():
        comparison, runs = report["comparison"], report["runs"]
        pen, dflt = runs["penelope"], runs["default"]
        rows.append(f"| {name} | {comparison['finished']}/{comparison['requests']} | "
                    f"{'yes' if comparison['identical_tokens'] else 'NO'} | {comparison['max_logprob_diff']:.1e} | "
                    f"{pen['recomputed_tokens']} / {dflt['recomputed_tokens']} | "
                    f"{pen['recomputed_cost']:.3g} / {dflt['recomputed_cost']:.3g} | "
                    f"{pen['phantom_tokens']} / {pen['chunk_refill_tokens']} |")
    table = "\n".join(rows)
    (out / "sglang_engine_scenarios.json").write_text(json.dumps(reports, indent=2))
    (out / "sglang_engine_scenarios.md").write_text(table + "\n")
    print("\n" + table)
    benchmark.extra_info.update(passed={name: r["passed"] for name, r in reports.items()})
    assert all(report["passed"] for report in reports.values())
