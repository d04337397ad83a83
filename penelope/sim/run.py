"""Run several eviction policies (and cache capacities) on one workload and collect the results.

Every policy replays the same workload from an empty cache with the same serving-time model, so
their differences come from eviction alone. `ablation` names the paper's six-policy grid
(where: leaf tail, leaf head, private-history head; how much: whole node, needed blocks);
`leaf-tail-node` is SGLang's RadixCache and the baseline of every comparison.

With a CPU tier (`cpu_cache` > 0) every policy but the baseline runs on the unified two-tier cache
(`penelope.cache.tiers.TwoTierCache`: one eviction order over GPU + CPU, loads through a swap buffer
when both tiers are full), and the baseline on the HiCache-like cache (`penelope.cache.baselines.hicache`: SGLang
0.5.23's hierarchical cache, each tier evicting by its own LRU). Both report CPU hits to the
longest-prefix-first scheduler, as SGLang's scheduler counts host hits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from penelope.cache.baselines.hicache import HiCacheLikeCache
from penelope.cache.host_tier import TieredCache
from penelope.cache.manager import CacheStats, KVCache
from penelope.cache.policies import PAPER_GRID, get_policy, policy_names
from penelope.cache.tiers import DEFAULT_SWAP_BUFFER, TwoTierCache
from penelope.costmodel.recompute import CostModel
from penelope.costmodel.shapes import ModelShape, get_model
from penelope.errors import UsageError
from penelope.jsonfile import json_ready
from penelope.sim.bracket import ORACLE, compare_with_oracle, oracle_bound
from penelope.sim.fleet.router import RouterConfig, check_router, make_router
from penelope.sim.fleet.summary import FleetSummary, fleet_summary
from penelope.sim.metrics import Summary, changes_against, summarize
from penelope.sim.replay import Replay, ReplayResult
from penelope.sim.scheduler import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_MAX_PREFILL_TOKENS,
    DEFAULT_MAX_RUNNING_REQUESTS,
    DEFAULT_PAGE_SIZE,
    ORDERS,
)
from penelope.sim.timemodel import DEFAULT_GPU_CACHE, PAPER_GPU_CACHE, TimeModel
from penelope.sim.workloads.types import Workload

BASELINE = "leaf-tail-node"
BASELINE_ALIAS = "sglang"
DEFAULT_POLICIES = ("sglang", "penelope")
# SGLang's router defaults to its cache-aware policy.
DEFAULT_ROUTER = "cache-aware"

# Sessions served at once: beyond any server (SGLang runs at most a few thousand requests).
MAX_SESSIONS = 1 << 20


def ablation_policies() -> list[str]:
    """The paper's six-policy grid, canonical names, SGLang's `leaf-tail-node` first."""
    names = policy_names()
    if list(PAPER_GRID) != names[:len(PAPER_GRID)] or PAPER_GRID[0] != BASELINE:
        raise UsageError(f"the ablation grid needs the six policies {', '.join(PAPER_GRID)} registered first")
    return list(PAPER_GRID)


# Names that stand for several policies in --policies.
POLICY_GROUPS = {"ablation": ablation_policies, "all": policy_names}


def parse_policies(text: str) -> list[str]:
    """Policy names from `a,b,c`, `ablation` (the paper's grid) or `all` (every registered
    policy), validated against the registry, duplicates (aliases included) removed. The baseline
    (`sglang`) is put first when it is missing."""
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not items:
        raise UsageError("`policies`: empty list")
    names: list[str] = []
    for item in items:
        names.extend(POLICY_GROUPS[item]() if item in POLICY_GROUPS else [item])
    chosen: list[str] = []
    seen: set[str] = set()
    for name in names:
        canonical = get_policy(name).name
        if canonical not in seen:
            seen.add(canonical)
            chosen.append(name)
    if BASELINE not in seen:
        chosen.insert(0, BASELINE_ALIAS)
    return chosen


def default_gpu_cache(shape: ModelShape) -> int:
    """The paper's GPU KV capacity for a model (256K for 8B, 192K for 32B, 384K for 235B-A22B),
    256K for other models."""
    return PAPER_GPU_CACHE.get(shape.name, DEFAULT_GPU_CACHE)


@dataclass(frozen=True)
class SimConfig:
    """How the servers are simulated. Sizes in tokens (per replica); `cpu_cache` 0 means GPU only;
    `swap_buffer`: host rows reserved for loads when both tiers are full (two-tier cache, not in
    `cpu_cache`); `replicas`: servers, each with its own cache and scheduler, behind `router`
    (`penelope.sim.fleet.router`; unused with one replica) configured by `routing`; `prime`: each
    closed-loop session's first request primes the cache and is left out of the figures
    (`penelope.sim.replay.Replay`); `page_size`, `max_prefill_tokens`, `max_running_requests`:
    the scheduler's (`penelope.sim.scheduler`)."""

    gpu_cache: int
    cpu_cache: int = 0
    sessions: int = 4
    scheduler: str = "lpm"
    chunk_size: int = DEFAULT_CHUNK_SIZE
    block_size: int = 64
    swap_buffer: int = DEFAULT_SWAP_BUFFER
    replicas: int = 1
    router: str = DEFAULT_ROUTER
    routing: RouterConfig = field(default_factory=RouterConfig)
    prime: bool = False
    page_size: int = DEFAULT_PAGE_SIZE
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS
    max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS

    def __post_init__(self) -> None:
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise UsageError(f"`replicas` must be a positive integer, got {self.replicas!r}")
        check_router(self.router)
        if not isinstance(self.routing, RouterConfig):
            raise UsageError(f"routing must be a RouterConfig, got {type(self.routing).__name__}")
        if self.block_size < 1:
            raise UsageError(f"block size must be positive, got {self.block_size}")
        if self.gpu_cache < self.block_size:
            raise UsageError(f"`gpu_cache` {self.gpu_cache} is below one block of {self.block_size} tokens")
        if self.cpu_cache < 0:
            raise UsageError(f"`cpu_cache` must be non-negative, got {self.cpu_cache}")
        if 0 < self.cpu_cache < self.block_size:
            raise UsageError(f"`cpu_cache` {self.cpu_cache} is below one block of {self.block_size} tokens")
        if self.swap_buffer < self.block_size:
            raise UsageError(f"`swap_buffer` {self.swap_buffer} is smaller than one block of {self.block_size} tokens")
        if self.cpu_cache and self.swap_buffer > self.cpu_cache:
            # Loads move at most what the CPU tier holds: a larger buffer is never used, only allocated.
            raise UsageError(f"`swap_buffer` {self.swap_buffer} is larger than the CPU tier it serves "
                             f"(`cpu_cache` {self.cpu_cache})")
        if not 1 <= self.sessions <= MAX_SESSIONS:
            raise UsageError(f"`sessions` must be in [1, {MAX_SESSIONS:,}], got {self.sessions:,}")
        if self.scheduler not in ORDERS:
            raise UsageError(f"unknown scheduler {self.scheduler!r}; choose from {', '.join(ORDERS)}")
        if self.chunk_size < 1:
            raise UsageError(f"`chunk_size` must be positive, got {self.chunk_size}")
        for flag, value in (("`page_size`", self.page_size), ("`max_prefill_tokens`", self.max_prefill_tokens),
                            ("`max_running_requests`", self.max_running_requests)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{flag} must be a positive integer, got {value!r}")
        if self.block_size % self.page_size or self.chunk_size % self.page_size:
            raise UsageError(f"`page_size` {self.page_size} must divide the block size {self.block_size} and "
                             f"`chunk_size` {self.chunk_size}")


def make_cache(policy: str, config: SimConfig, cost_model: CostModel) -> KVCache:
    """A fresh cache for one replay: GPU-only, or with a CPU tier the unified two-tier cache (the
    HiCache-like cache for the baseline). The simulator only counts moves, so no plans are kept."""
    if not config.cpu_cache:
        return KVCache(config.gpu_cache, config.block_size, policy, cost_model=cost_model)
    if get_policy(policy).name == BASELINE:
        return HiCacheLikeCache(config.gpu_cache, config.cpu_cache, config.block_size, cost_model=cost_model,
                                keep_plans=False)
    return TwoTierCache(config.gpu_cache, config.cpu_cache, config.block_size, policy=policy,
                        swap_buffer=config.swap_buffer, cost_model=cost_model, keep_plans=False)


@dataclass
class PolicyResult:
    """One policy's replay: its summary, the replay counters and the cache's own statistics."""

    policy: str
    canonical: str
    summary: Summary
    replay: ReplayResult
    cache_stats: CacheStats
    changes: dict[str, float] = field(default_factory=dict)
    tiers: dict | None = None
    fleet: FleetSummary | None = None
    # The oracle's run only: a lower bound on the recompute cost of the requests it served.
    bound: float | None = None
    # Distances to the oracle's run (`penelope.sim.bracket`), when one ran beside this one.
    to_oracle: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        """JSON-ready figures: the summary (times in s, sizes in tokens), counters, and the change
        against SGLang (`vs_sglang`: relative changes, hit rate in percentage points)."""
        data = dict(self.summary.as_dict())
        data.update(
            policy=self.canonical,
            skipped_requests=self.replay.skipped,
            phantom_tokens=self.replay.phantom_tokens,
            chunk_refill_tokens=self.replay.chunk_refill_tokens,
            evicted_tokens=self.cache_stats.evicted_tokens,
            prefill_batches=self.replay.prefill_batches,
            phantom_batches=self.replay.phantom_batches,
            decode_steps=self.replay.decode_steps,
            sim_time=self.replay.sim_time,
            wall_time=self.replay.wall_time,
            vs_sglang=dict(self.changes),
        )
        if self.bound is not None:
            data["recompute_bound"] = self.bound
        if self.to_oracle:
            data["vs_oracle"] = dict(self.to_oracle)
        if self.tiers is not None:
            data["tiers"] = dict(self.tiers)
        if self.fleet is not None:
            data["fleet"] = self.fleet.as_dict()
        return json_ready(data)


def run_policies(
    workload: Workload,
    policies: list[str],
    config: SimConfig,
    time_model: TimeModel,
    cost_model: CostModel | None = None,
    progress=None,
) -> dict[str, PolicyResult]:
    """Replay `workload` once per policy (names as given, keys of the result, in order) and
    compare each with the baseline; `policies` must include it (see `parse_policies`)."""
    cost = cost_model if cost_model is not None else CostModel(get_model(time_model.model))
    results = {name: run_policy(workload, name, config, time_model, cost, progress) for name in policies}
    compare_with_baseline(results)
    compare_with_oracle(results)
    return results


def check_fleet_policies(policies: list[str], replicas: int) -> None:
    """The offline oracle's lower bound replays one cache's admissions and finishes: refuse it on
    several replicas."""
    if replicas > 1 and any(get_policy(name).name == ORACLE for name in policies):
        raise UsageError(f"`policies`: the {ORACLE} policy and its lower bound need one server, not `replicas` "
                         f"{replicas}")


def run_policy(
    workload: Workload,
    policy: str,
    config: SimConfig,
    time_model: TimeModel,
    cost_model: CostModel,
    progress=None,
) -> PolicyResult:
    """One replay of `workload` under `policy` from an empty cache; `changes` are left empty."""
    check_fleet_policies([policy], config.replicas)
    caches = [make_cache(policy, config, cost_model) for _ in range(config.replicas)]
    router = None
    if config.replicas > 1:
        router = make_router(config.router, config.replicas, workload.block_size, config.routing)
    outcome = Replay(
        workload,
        caches,
        time_model,
        cost_model,
        sessions=config.sessions,
        order=config.scheduler,
        chunk_size=config.chunk_size,
        page_size=config.page_size,
        max_prefill_tokens=config.max_prefill_tokens,
        max_running_requests=config.max_running_requests,
        router=router,
        progress=progress,
        prime=config.prime,
    ).run()
    for cache in caches:
        cache.check_invariants()
    cache = caches[0]
    tiers = None
    if isinstance(cache, TieredCache):
        counters = [c.counters.as_dict() for c in caches]
        tiers = counters[0] if len(caches) == 1 else _summed(counters)
    stats = cache.stats if len(caches) == 1 else _summed_stats([c.stats for c in caches])
    bound = oracle_bound(workload, outcome, cache, cost_model) if cache.policy.name == ORACLE else None
    summary = summarize(outcome.records)
    return PolicyResult(policy, cache.policy.name, summary, outcome, stats, tiers=tiers, bound=bound,
                        fleet=fleet_summary(outcome, workload, config, summary))


def _summed(dicts: list[dict]) -> dict:
    """Numbers summed key by key (other values from the first)."""
    total = dict(dicts[0])
    for other in dicts[1:]:
        for key, value in other.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                total[key] += value
    return total


def _summed_stats(stats: list[CacheStats]) -> CacheStats:
    """One `CacheStats` of several caches: counters summed."""
    values = _summed([dataclasses.asdict(s) for s in stats])
    return CacheStats(**values)


def compare_with_baseline(results: dict[str, PolicyResult]) -> None:
    """Set every result's `changes` against the baseline's result among them."""
    baseline = next((name for name, r in results.items() if r.canonical == BASELINE), None)
    if baseline is None:
        raise UsageError(f"the policies must include the baseline {BASELINE_ALIAS!r}")
    changes = changes_against({name: r.summary for name, r in results.items()}, baseline)
    for name, result in results.items():
        result.changes = changes[name]


def baseline_of(results: dict[str, PolicyResult]) -> PolicyResult:
    """The SGLang result among `results`."""
    for result in results.values():
        if result.canonical == BASELINE:
            return result
    raise UsageError(f"no {BASELINE_ALIAS!r} result")


