"""Load generator speed: is the client ever the bottleneck?

`penelope load`'s client (`penelope.loadgen.run_load`) replays the synthetic sessions at scale 8
(prompts of about 2K to 16K ids, replies of about 30 ids, one id per streamed chunk), 32 sessions
at once, no think time, against the stand-in server of the tests (`tests/loadgen_stub.py`, in a
process of its own, answering at once, no cache tracking), 1,000 requests. The client is pinned
to one core and the stand-in to the other when the machine has two or more.

Figures in `extra_info`: requests per second of wall time and per second of the client's CPU
time (what one core sustains: the target is at least 200), the client's per-request overhead
(mean and p99, ms: prompt building, JSON encoding, stream parsing) and the event loop's lateness
(p99, ms). One round (`benchmark.pedantic(rounds=1)`).

Run: ``python -m pytest microbench/bench_loadgen.py --benchmark-json out.json -s``.
"""

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from penelope.loadgen.runner import LoadConfig, run_load
from penelope.loadgen.summary import summarize
from penelope.loadgen.target import probe_server
from penelope.loadgen.tokens import TokenSpace
from penelope.sim.workloads.load import load_workload
from penelope.sim.workloads.types import ThinkTime

STUB = Path(__file__).resolve().parents[1] / "tests" / "loadgen_stub.py"
REQUESTS, SESSIONS, SCALE = 1000, 32, 8
TARGET_RATE = 200


def _stub(tmp_path):
    port_file = tmp_path / "port"
    process = subprocess.Popen([sys.executable, str(STUB), "--port-file", str(port_file), "--no-cache"],
                               start_new_session=True)
    deadline = time.monotonic() + 60
    while not port_file.exists() or not port_file.read_text():
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            raise RuntimeError("the stand-in server did not start")
        time.sleep(0.05)
    return process, f"http://127.0.0.1:{port_file.read_text()}"


def test_client_sustains_200_requests_per_second_on_one_core(benchmark, tmp_path):
    workload = ThinkTime(cap=0.0).apply(load_workload("synthetic"))
    workload = dataclasses.replace(workload, sessions=workload.sessions[:SESSIONS])
    process, url = _stub(tmp_path)
    cores = sorted(os.sched_getaffinity(0))
    pinned = len(cores) >= 2
    previous = os.sched_getaffinity(0)
    try:
        if pinned:
            os.sched_setaffinity(process.pid, {cores[1]})
            os.sched_setaffinity(0, {cores[0]})
        target = probe_server(url, "generate", vocab=1000)
        space = TokenSpace(vocab=1000, scale=SCALE)
        config = LoadConfig(sessions=SESSIONS, max_requests=REQUESTS)

        def run():
            cpu = time.process_time()
            [result] = run_load(target, workload, space, config, flush=False)
            return result, time.process_time() - cpu

        result, cpu = benchmark.pedantic(run, rounds=1, iterations=1)
    finally:
        os.sched_setaffinity(0, previous)
        process.kill()
        process.wait()
    summary = summarize(result)
    assert summary.finished == REQUESTS, summary.failures
    per_cpu_second = REQUESTS / cpu
    overhead = np.array([r.overhead for r in result.records])
    prompts = np.array([r.prompt_tokens for r in result.records])
    benchmark.extra_info.update({
        "requests": REQUESTS,
        "sessions": SESSIONS,
        "scale": SCALE,
        "prompt_tokens_p50": float(np.median(prompts)),
        "prompt_tokens_max": int(prompts.max()),
        "output_tokens_mean": float(np.mean([r.output_tokens for r in result.records])),
        "requests_per_s_wall": REQUESTS / result.wall,
        "requests_per_client_cpu_s": per_cpu_second,
        "client_cpu_s": cpu,
        "overhead_mean_ms": float(overhead.mean() * 1e3),
        "overhead_p99_ms": float(np.percentile(overhead, 99) * 1e3),
        "loop_lag_p99_ms": summary.loop_lag_p99 * 1e3,
        "pinned_to_one_core": pinned,
    })
    print(f"\nclient: {REQUESTS / result.wall:.0f} req/s wall, {per_cpu_second:.0f} req per CPU-second; overhead "
          f"mean {overhead.mean() * 1e3:.3f} ms, p99 {np.percentile(overhead, 99) * 1e3:.3f} ms; loop lag p99 "
          f"{summary.loop_lag_p99 * 1e3:.1f} ms; prompts p50 {np.median(prompts):.0f} ids")
    assert per_cpu_second >= TARGET_RATE
