"""No policy but the offline oracle uses the future: replaying a workload whose future was changed
after a decision point gives the same eviction decisions up to the moment the change can be seen
(the changed request is sent), for every policy but `oracle`, whose decisions change earlier.

The change: one session's requests after its request i wait longer before they are sent and carry
other tokens (fresh keys past the shared prefix); their kinds (tool or person) stay, since a
server knows from the reply of request i whether its session waits for a tool."""

import dataclasses

import numpy as np
import pytest

from penelope.cache.manager import KVCache
from penelope.cache.policies import policy_names
from penelope.costmodel.recompute import CostModel
from penelope.costmodel.shapes import get_model
from penelope.sim.replay import Replay
from penelope.sim.timemodel import TimeModel
from penelope.sim.workloads.synthetic import SyntheticConfig, generate

COST = CostModel(get_model("qwen3-8b"))
TIME = TimeModel.estimate("qwen3-8b")
CONFIG = SyntheticConfig(sessions=6, requests_per_session=14, prefix_tokens=1024, max_context=16384,
                         first_prompt_median=2000, tool_result_median=800, human_fraction=0.3,
                         tool_wait_median=2.0, tool_wait_p90=12.0, human_wait_median=20.0,
                         summary_median=2000, output_median=120)
CAPACITY = 20 * 1024
SESSION = 0


def changed_future(workload, index: int):
    """The workload with session SESSION's requests after `index` sent later and with other tokens."""
    session = workload.sessions[SESSION]
    requests = list(session.requests)
    for j in range(index + 1, len(requests)):
        r = requests[j]
        keys = r.keys.copy()
        keys[len(keys) // 2:] += 10**12
        keys.flags.writeable = False
        requests[j] = dataclasses.replace(r, keys=keys, think_time=r.think_time * 3 + 7.0)
    sessions = list(workload.sessions)
    sessions[SESSION] = dataclasses.replace(session, requests=tuple(requests))
    return dataclasses.replace(workload, sessions=tuple(sessions))


def decisions(workload, policy: str):
    """(send time of SESSION's requests by index, [(time, hashes of the blocks deleted)] per
    eviction) of one replay."""
    cache = KVCache(CAPACITY, block_size=workload.block_size, policy=policy, cost_model=COST)
    replay = Replay(workload, cache, TIME, COST, sessions=4)
    log = []
    evict = cache.policy.evict

    def recorded(tree, n_blocks):
        released = evict(tree, n_blocks)
        hashes = np.sort(np.concatenate(released.hashes)) if released.hashes else np.empty(0, np.uint64)
        log.append((replay.now, tuple(hashes.tolist())))
        return released

    cache.policy.evict = recorded
    result = replay.run()
    sends = {r.index: r.send_time for r in result.records if r.session == workload.sessions[SESSION].id}
    return sends, log


def before(log, moment: float):
    return [entry for entry in log if entry[0] < moment]


@pytest.mark.parametrize("seed", [0, 2, 3])
def test_decisions_before_a_change_can_be_seen_do_not_depend_on_it(seed):
    workload = generate(dataclasses.replace(CONFIG, seed=seed))
    requests = workload.sessions[SESSION].requests
    # The decision point: before the session's longest wait, so that others evict meanwhile.
    index = max(range(1, len(requests) - 1), key=lambda j: requests[j + 1].think_time)
    future = changed_future(workload, index)
    oracle_changed = False
    for policy in policy_names():
        sends, log = decisions(workload, policy)
        sends_changed, log_changed = decisions(future, policy)
        assert sends[index] == sends_changed[index], policy
        seen = min(sends[index + 1], sends_changed[index + 1])
        waiting = [entry for entry in before(log, seen) if entry[0] > sends[index]]
        assert len(waiting) >= 5, f"{policy}: too few decisions while the session waits to test"
        if policy == "oracle":
            oracle_changed = before(log, seen) != before(log_changed, seen)
            continue
        assert before(log, seen) == before(log_changed, seen), f"{policy} decided with the future"
    # The oracle is told the future: its decisions change before the change is sent, which shows
    # the comparison above can see a policy that reads it.
    assert oracle_changed
