"""The two-tier caches in the simulator: which cache each policy gets, admission with loads (the
loaded blocks' GPU slots reach the job), LPM counting CPU hits, and `penelope simulate --cpu-cache`
end to end on real WEKA traces."""
import json

import numpy as np
import pytest
from sim_env import B, make_job
from trace_paths import WEKA_TRACES

from penelope.cache.baselines.hicache import HiCacheLikeCache
from penelope.cache.manager import KVCache
from penelope.cache.tiers import TwoTierCache
from penelope.cache.tree import BlockState
from penelope.cli import main
from penelope.costmodel.recompute import CostModel
from penelope.costmodel.shapes import get_model
from penelope.errors import UsageError
from penelope.sim.run import SimConfig, make_cache
from penelope.sim.scheduler import Scheduler
from penelope.sim.workloads.types import request_tokens

TRACES = WEKA_TRACES


def test_each_policy_gets_its_cache():
    cost = CostModel(get_model("qwen3-8b"))
    config = SimConfig(gpu_cache=64 * B, cpu_cache=128 * B, swap_buffer=2 * B)
    assert type(make_cache("sglang", config, cost)) is HiCacheLikeCache
    assert type(make_cache("leaf-tail-node", config, cost)) is HiCacheLikeCache
    for policy in ("penelope", "leaf-head-block", "private-head-node"):
        cache = make_cache(policy, config, cost)
        assert type(cache) is TwoTierCache and cache.swap_buffer == 2 * B and cache.cpu_capacity == 128 * B
        assert not cache.keep_plans
    assert type(make_cache("penelope", SimConfig(gpu_cache=64 * B), cost)) is KVCache


@pytest.mark.parametrize(
    "args, message",
    [(dict(cpu_cache=32), "`cpu_cache` 32 is below one block"),
     (dict(cpu_cache=B, swap_buffer=63), "`swap_buffer` 63 is smaller than one block")],
)
def test_config_errors(args, message):
    with pytest.raises(UsageError, match=message):
        SimConfig(gpu_cache=16 * B, **args)


def test_admission_loads_cpu_spans_and_lpm_counts_them():
    """A demoted history is admitted before a request with a shorter GPU prefix (LPM counts CPU
    hits), its CPU blocks are loaded (GPU slots in the job) and charged as a load."""
    cache = TwoTierCache(8 * B, 8 * B, B, policy="penelope", swap_buffer=B)
    history = make_job([1, 2, 3, 4, 5], 5 * B, session="a")
    tokens = request_tokens(history.request, B)
    cache.insert(tokens, cache.alloc(len(tokens)))
    cache.evict(4 * B)
    assert [s.state for s in cache.match(tokens).spans] == [BlockState.CPU, BlockState.GPU]
    scheduler = Scheduler(cache, "lpm", chunk_size=B)
    short = make_job([9], B + 10, session="bb")
    longer = make_job([1, 2, 3, 4, 5, 6], 6 * B + 1, send_time=1.0, session="a", index=1)
    scheduler.submit(short)
    scheduler.submit(longer)
    [chunk] = scheduler.form_prefill()
    assert chunk.job is longer and chunk.loaded == 4 * B and longer.loaded == 4 * B
    assert longer.reused == 5 * B and longer.swap_loads == 0
    spans = cache.match(tokens).spans
    assert [s.state for s in spans] == [BlockState.GPU]
    assert np.array_equal(longer.slots[: 5 * B], spans[0].slots)
    while scheduler.has_work():
        scheduler.form_prefill()
    for job in (short, longer):
        scheduler.release(job)
    cache.check_invariants()


def simulate(tmp_path, *args):
    out = tmp_path / "sim.json"
    assert main(["simulate", "--trace", str(TRACES), "--overflow", "skip", "--limit-sessions", "12",
                 "--gpu-cache", "64K", "--no-progress", "--json", str(out), *args]) == 0
    return json.loads(out.read_text())


def test_simulate_with_a_cpu_tier(tmp_path, capsys):
    gpu_only = simulate(tmp_path)["results"]
    payload = simulate(tmp_path, "--cpu-cache", "64K", "--swap-buffer", "2K")
    assert payload["config"]["cpu_cache"] == 64 * 1024 and payload["config"]["swap_buffer"] == 2048
    results = payload["results"]
    sglang, penelope = results["sglang"], results["penelope"]
    # The baseline writes through and never uses a swap buffer; the unified cache loads through one.
    assert sglang["tiers"]["backed_up_tokens"] > 0 and sglang["tiers"]["swapped_tokens"] == 0
    assert sglang["swap_loads"] == 0
    tiers = penelope["tiers"]
    assert tiers["backed_up_tokens"] == 0 and 0 < tiers["swap_loads"] <= tiers["loads"]
    assert 0 < penelope["swap_loads"] <= tiers["swap_loads"]
    assert penelope["loaded_tokens"] > 0
    # A CPU tier only adds hits, and the unified cache beats the HiCache-like baseline here.
    assert penelope["hit_rate"] > gpu_only["penelope"]["hit_rate"]
    assert penelope["hit_rate"] > sglang["hit_rate"] and penelope["ttft_mean"] < sglang["ttft_mean"]
    assert "CPU cache 64K" in capsys.readouterr().out
