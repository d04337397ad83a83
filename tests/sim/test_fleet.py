"""Replays over several replicas behind a router: who serves what, per-replica and fleet figures,
saturation on an overloaded trace and none on a light one, the offered-load estimate against the
replay, time scaling, and parallel sweeps equal to sequential ones."""

import dataclasses

import numpy as np
import pytest
from sim_env import COST, request, simple_time_model, workload

from penelope.cache.manager import KVCache
from penelope.costmodel.recompute import CostModel
from penelope.costmodel.shapes import get_model
from penelope.errors import UsageError
from penelope.sim.ensemble import run_ensembles
from penelope.sim.fleet.router import make_router
from penelope.sim.fleet.saturation import SATURATED_WAIT, offered_load
from penelope.sim.replay import Replay
from penelope.sim.run import SimConfig, run_policy
from penelope.sim.timemodel import TimeModel
from penelope.sim.workloads.mooncake import load_mooncake
from penelope.sim.workloads.mooncake_like import FIRST_INPUT, MooncakeLikeConfig, generate, mean_turns, write_jsonl
from penelope.sim.workloads.time_scale import scale_time

B = 64
SHAPE = get_model("qwen3-8b")
MODEL = TimeModel.estimate(SHAPE)
QWEN_COST = CostModel(SHAPE)


def mooncake_like(tmp_path, name="trace", **config):
    path = tmp_path / f"{name}.jsonl"
    write_jsonl(path, MooncakeLikeConfig(**config))
    return load_mooncake(path)


def test_one_replica_behind_a_router_is_the_single_server_replay():
    work = workload([[request([1, 2], 130, 3, arrival=0.0, tail=0)], [request([1], 70, 2, arrival=0.01, tail=1)],
                     [request([1, 2, 3], 200, 4, arrival=0.02, tail=2)]], closed_loop=False)
    alone = Replay(work, KVCache(4096, B, "sglang"), simple_time_model(), COST).run()
    routed = Replay(work, [KVCache(4096, B, "sglang")], simple_time_model(), COST,
                    router=make_router("cache-aware", 1, B)).run()
    assert alone.records == routed.records
    assert alone.sim_time == routed.sim_time


def test_round_robin_spreads_requests_and_each_replica_has_its_own_cache():
    # Four requests of one history, far apart: round-robin alternates the two replicas.
    reqs = [request([1, 2, 3], 200, 2, arrival=10.0 * i, tail=i) for i in range(4)]
    work = workload([[r] for r in reqs], closed_loop=False)
    caches = [KVCache(4096, B, "sglang") for _ in range(2)]
    result = Replay(work, caches, simple_time_model(), COST, router=make_router("round-robin", 2, B)).run()
    served = {r.session: r for r in result.records}
    assert [served[f"s{i}"].replica for i in range(4)] == [0, 1, 0, 1]
    # Each replica computes the history once: the first request on each reuses nothing.
    assert [served[f"s{i}"].reused_tokens for i in range(4)] == [0, 0, 192, 192]
    assert [c.stats.requests for c in caches] == [2, 2]
    assert [s.finished for s in result.servers] == [2, 2]


def test_cache_aware_routing_keeps_a_history_on_its_replica():
    reqs = [request([1, 2, 3], 200, 2, arrival=10.0 * i, tail=i) for i in range(4)]
    work = workload([[r] for r in reqs], closed_loop=False)
    caches = [KVCache(4096, B, "sglang") for _ in range(2)]
    result = Replay(work, caches, simple_time_model(), COST, router=make_router("cache-aware", 2, B)).run()
    assert {r.replica for r in result.records} == {0}
    assert sum(r.reused_tokens for r in result.records) == 3 * 192
    assert result.routing == {"balance": 0, "match": 3, "least-load": 1}


def test_fleet_summary_per_replica_adds_up(tmp_path):
    work = mooncake_like(tmp_path, duration=120.0, rate=1.0)
    config = SimConfig(gpu_cache=128 * 1024, replicas=3, router="least-load")
    result = run_policy(work, "penelope", config, MODEL, QWEN_COST)
    fleet = result.fleet
    assert fleet.router == "least-load" and len(fleet.replicas) == 3
    assert sum(r.summary.requests for r in fleet.replicas) == result.summary.requests == work.num_requests
    assert sum(r.summary.reused_tokens for r in fleet.replicas) == result.summary.reused_tokens
    assert sum(r.busy_time for r in fleet.replicas) == pytest.approx(
        sum(s.busy_time for s in result.replay.servers))
    assert fleet.imbalance >= 1.0 and fleet.request_imbalance >= 1.0
    assert result.cache_stats.requests == work.num_requests
    data = result.as_dict()["fleet"]
    assert data["replicas"] == 3 and len(data["per_replica"]) == 3 and data["saturation"]["saturated"] == []


def test_saturation_fires_on_an_overloaded_trace_and_not_on_a_light_one(tmp_path):
    config = SimConfig(gpu_cache=128 * 1024)
    heavy = mooncake_like(tmp_path, "heavy", duration=240.0, rate=3.4, seed=1)
    light = mooncake_like(tmp_path, "light", duration=240.0, rate=0.2, seed=1)
    assert offered_load(heavy, MODEL, QWEN_COST, config.gpu_cache).load > 2
    assert offered_load(light, MODEL, QWEN_COST, config.gpu_cache).load < 0.5
    overloaded = run_policy(heavy, "sglang", config, MODEL, QWEN_COST).fleet.saturation
    assert overloaded.saturated == [0]
    [server] = overloaded.servers
    assert server.late_wait > SATURATED_WAIT * overloaded.span and server.waiting_at_last_arrival > 50
    assert server.drain_time > server.late_wait and server.utilization > 0.95
    assert "SATURATED: the server could not keep up" in overloaded.warning()
    calm = run_policy(light, "sglang", config, MODEL, QWEN_COST).fleet.saturation
    assert calm.saturated == [] and calm.warning() is None
    assert calm.servers[0].late_wait < 0.01 * calm.span


def test_closed_loop_replays_are_never_called_saturated(tmp_path):
    work = workload([[request([1], 64, 300, tail=0), request([1, 2], 130, 300, think=0.0, tail=1)]])
    result = run_policy(work, "sglang", SimConfig(gpu_cache=4096), simple_time_model(), COST)
    assert result.fleet.saturation.open_loop is False and result.fleet.saturation.saturated == []
    with pytest.raises(UsageError, match="closed-loop workload has no offered load"):
        offered_load(work, MODEL, QWEN_COST, 4096)


def test_the_offered_load_tells_how_many_replicas_keep_up(tmp_path):
    work = mooncake_like(tmp_path, duration=300.0, rate=2.5, seed=2)
    load = offered_load(work, MODEL, QWEN_COST, 128 * 1024)
    # A lower bound: at 80% utilization of its estimate the fleet keeps up, with fewer servers
    # than the estimate's minimum it cannot.
    assert 2 < load.load < 4 and load.replicas_needed() == int(load.load) + 1
    enough = SimConfig(gpu_cache=128 * 1024, replicas=load.replicas_needed(0.8), router="least-load")
    assert run_policy(work, "sglang", enough, MODEL, QWEN_COST).fleet.saturation.saturated == []
    fewer = dataclasses.replace(enough, replicas=load.replicas_needed() - 1)
    assert run_policy(work, "sglang", fewer, MODEL, QWEN_COST).fleet.saturation.saturated


def test_time_scale_stretches_arrivals_and_divides_the_offered_load(tmp_path):
    work = mooncake_like(tmp_path, duration=120.0, rate=2.0)
    slower = scale_time(work, 2.0)
    arrivals = [r.arrival for s in work.sessions for r in s.requests]
    assert [r.arrival for s in slower.sessions for r in s.requests] == [2.0 * a for a in arrivals]
    base = offered_load(work, MODEL, QWEN_COST, 128 * 1024)
    assert offered_load(slower, MODEL, QWEN_COST, 128 * 1024).load == pytest.approx(base.load / 2)
    assert scale_time(work, 1.0) is work
    closed = workload([[request([1], 64, 1, tail=0), request([1, 2], 130, 1, think=3.0, tail=1)]])
    assert [r.think_time for r in scale_time(closed, 0.5).sessions[0].requests] == [0.0, 1.5]
    with pytest.raises(UsageError, match="`time_scale` must be a positive number"):
        scale_time(work, 0.0)


def test_a_parallel_sweep_of_routers_and_capacities_equals_the_sequential_one(tmp_path):
    work = mooncake_like(tmp_path, duration=60.0, rate=3.0)
    configs = [SimConfig(gpu_cache=c, replicas=3, router=r) for c in (64 * 1024, 128 * 1024)
               for r in ("round-robin", "cache-aware")]

    class Counter:
        total = 0

        def update(self, n):
            self.total += n

    bar = Counter()
    sequential = run_ensembles(work, ["sglang", "penelope"], configs, MODEL, QWEN_COST, jobs=1)
    parallel = run_ensembles(work, ["sglang", "penelope"], configs, MODEL, QWEN_COST, jobs=2, progress=bar)
    assert bar.total == len(configs) * 2 * work.num_requests
    for one, other in zip(sequential, parallel, strict=True):
        assert one.config == other.config
        for name in ("sglang", "penelope"):
            a, b = one.runs[0][name], other.runs[0][name]
            assert a.summary == b.summary and a.changes == b.changes
            assert a.fleet == b.fleet
            assert dataclasses.replace(a.replay, wall_time=0) == dataclasses.replace(b.replay, wall_time=0)


def test_the_mooncake_like_trace_has_the_real_traces_statistics():
    rows = generate(MooncakeLikeConfig(seed=3))
    times = np.array([r["timestamp"] for r in rows]) / 1000
    assert np.all(np.diff(times) >= 0) and np.all(times % 3.0 == 0)
    # About 3.4 requests per second (12,031 in 3,537 s), every one starting with the shared block 0.
    assert len(rows) == pytest.approx(12031, rel=0.1)
    assert all(r["hash_ids"][0] == 0 for r in rows)
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // 512) for r in rows)
    # Requests sharing only block 0 with earlier ones (first turns): 61.3% in the real trace.
    seen, first_turns = set(), []
    for r in rows:
        first_turns.append(r["hash_ids"][1] not in seen)
        seen.update(r["hash_ids"])
    assert np.mean(first_turns) == pytest.approx(0.613, abs=0.05)
    assert 1.5 < mean_turns() < 1.8
    firsts = [r["input_length"] for r, first in zip(rows, first_turns, strict=True) if first]
    assert np.median(firsts) == pytest.approx(FIRST_INPUT[4], rel=0.15)
    assert generate(MooncakeLikeConfig(duration=300.0, seed=3)) == generate(MooncakeLikeConfig(duration=300.0, seed=3))


def test_generator_options_are_validated():
    with pytest.raises(UsageError, match="duration and rate must be positive"):
        MooncakeLikeConfig(rate=0.0)
    with pytest.raises(UsageError, match="max_input"):
        MooncakeLikeConfig(max_input=100)


def test_parallel_results_come_back_in_task_order_whatever_order_they_finish(tmp_path):
    # The first setting is many times slower (64-token prefill chunks), so with two workers the
    # three others finish before it: results must still be put back in settings order.
    work = mooncake_like(tmp_path, duration=30.0, rate=3.0)
    configs = [SimConfig(gpu_cache=128 * 1024, replicas=2, router="least-load", chunk_size=64)] + [
        SimConfig(gpu_cache=c, replicas=2, router="round-robin") for c in (64 * 1024, 96 * 1024, 128 * 1024)]
    sequential = run_ensembles(work, ["sglang"], configs, MODEL, QWEN_COST, jobs=1)
    parallel = run_ensembles(work, ["sglang"], configs, MODEL, QWEN_COST, jobs=2)
    # The first setting's work, in prefill batches, is what makes it slow (not a timing assertion).
    slow, fast = (sequential[i].runs[0]["sglang"].replay.prefill_batches for i in (0, 1))
    assert slow > 20 * fast
    for one, other in zip(sequential, parallel, strict=True):
        assert one.config == other.config
        assert one.runs[0]["sglang"].summary == other.runs[0]["sglang"].summary
        assert one.runs[0]["sglang"].fleet == other.runs[0]["sglang"].fleet


class HintLog(KVCache):
    """A KVCache that notes every hint (event, time) and clock advance it receives, in order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = []

    def hint(self, tokens, hint):
        self.log.append((hint.event, hint.now))
        super().hint(tokens, hint)

    def advance(self, now):
        self.log.append(("advance", now))
        super().advance(now)


def test_a_request_arriving_during_a_batch_is_hinted_after_the_batch_finishes():
    # A's prefill (200 tokens, about 0.4 s) is running when B arrives at 0.01 s: a scheduler sees
    # B between batches, so the cache hears of A's finish first.
    work = workload([[request([1, 2, 3], 200, 1, arrival=0.0, tail=0)],
                     [request([4], 70, 1, arrival=0.01, tail=1)]], closed_loop=False)
    cache = HintLog(4096, B, "sglang")
    Replay(work, cache, simple_time_model(), COST).run()
    events = [event for event, _ in cache.log]
    assert events[:4] == ["arrived", "advance", "finished", "arrived"]
    assert cache.log[3] == ("arrived", 0.01) and cache.log[2][1] > 0.01


def test_utilization_is_over_one_window_for_every_replica():
    """A replica that served one short request is nearly idle over the trace, not 'busy 100% of
    its own window'."""
    from types import SimpleNamespace

    from penelope.sim.fleet.saturation import measure

    busy = SimpleNamespace(queue=[(0.0, 0), (90.0, 0)], last_finish=100.0, last_arrival=90.0, busy_time=80.0,
                           max_waiting=1)
    once = SimpleNamespace(queue=[(50.0, 0)], last_finish=51.0, last_arrival=50.0, busy_time=1.0, max_waiting=1)
    saturation = measure([busy, once], [], True, 0.0, 90.0)
    assert [round(s.utilization, 3) for s in saturation.servers] == [0.8, 0.01]
