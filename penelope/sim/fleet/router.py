"""Routers: which replica serves a request, as SGLang's router (`sglang-router`) decides.

Every router sees, when a request is sent, the replicas' loads: requests routed to a replica and
not yet finished (SGLang's router counts a worker's load from routing to response, not its
queue). Ties go to the lowest replica number (SGLang breaks them by its first minimum or at
random). The routers:
- `round-robin`: replica i, i+1, ... in turn (SGLang's `round_robin`).
- `least-load`: the least loaded replica.
- `session`: sticky by session: a session's first request goes to the least loaded replica,
  its later requests to the same one (SGLang's `manual` policy with the `min_load` assignment
  mode, keyed by the `X-SMG-Routing-Key` header). A Mooncake request without a session field
  is a session of its own.
- `cache-aware` (SGLang's default, `policies/cache_aware.rs` in `sgl-model-gateway`): when the
  loads are imbalanced, `max - min > balance_abs_threshold` AND
  `max > min * balance_rel_threshold`, the least loaded replica; otherwise the request is
  matched against the router's approximate prefix tree (`penelope.sim.fleet.router_tree`) and goes to
  the replica named by the deepest match when the matched fraction of its input exceeds
  `cache_threshold`, else to the least loaded replica. Either way the request is inserted into
  the tree under the chosen replica. Every `eviction_interval` seconds each replica's part of the
  tree is cut to `max_tree_tokens` (least recently used blocks first). Older router versions
  sent a low match to the replica with the smallest tree instead of the least loaded one.

Defaults are those of `python -m sglang_router.launch_router` (`RouterArgs` in
`sgl-model-gateway/bindings/python/sglang_router/router_args.py`): cache threshold 0.3,
balance thresholds 64 requests and 1.5, eviction every 120 s, max tree size 2**26. SGLang's tree
counts characters; `max_tree_tokens` takes 2**26 characters as 2**24 tokens at 4 characters per
token (an estimate for English text and BPE vocabularies).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from penelope.errors import UsageError
from penelope.sim.fleet.router_tree import PrefixTree
from penelope.sim.workloads.types import Request

CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5
EVICTION_INTERVAL = 120.0
# 2**26 characters at an estimated 4 characters per token.
MAX_TREE_TOKENS = 2**26 // 4


@dataclass(frozen=True)
class RouterConfig:
    """Thresholds of the cache-aware router (see the module docstring); the others ignore them.

    cache_threshold: matched fraction of the input above which the best match wins, in [0, 1];
    balance_abs_threshold: requests; balance_rel_threshold: ratio (>= 1); eviction_interval:
    seconds of simulated time; max_tree_tokens: tokens of the tree per replica."""

    cache_threshold: float = CACHE_THRESHOLD
    balance_abs_threshold: int = BALANCE_ABS_THRESHOLD
    balance_rel_threshold: float = BALANCE_REL_THRESHOLD
    eviction_interval: float = EVICTION_INTERVAL
    max_tree_tokens: int = MAX_TREE_TOKENS

    def __post_init__(self) -> None:
        for name in ("cache_threshold", "balance_rel_threshold", "eviction_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise UsageError(f"`{name}` must be a number, got {value!r}")
        if not 0 <= self.cache_threshold <= 1:
            raise UsageError(f"`cache_threshold` must be in [0, 1], got {self.cache_threshold}")
        if self.balance_rel_threshold < 1:
            raise UsageError(f"`balance_rel_threshold` must be at least 1, got {self.balance_rel_threshold}")
        if self.eviction_interval <= 0:
            raise UsageError(f"the router's eviction interval must be positive, got {self.eviction_interval}")
        for name in ("balance_abs_threshold", "max_tree_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UsageError(f"`{name}` must be a non-negative integer, got {value!r}")


ROUTERS: dict[str, type[Router]] = {}


def register(cls: type[Router]) -> type[Router]:
    """Add a router class to `ROUTERS` under its `name`; returns the class."""
    ROUTERS[cls.name] = cls
    return cls


def router_names() -> list[str]:
    return list(ROUTERS)


def check_router(name: str) -> str:
    """`name` if it is a known router, else a UsageError naming the known ones."""
    if name not in ROUTERS:
        raise UsageError(f"`router` {name!r} is not a router; choose from {', '.join(ROUTERS)}")
    return name


THRESHOLDS = ("cache_threshold", "balance_abs_threshold", "balance_rel_threshold")


def choose_routers(router: str | None, replicas: int | None, *, sweep: bool = True,
                   thresholds: tuple[str, ...] = (), replicas_chosen_later: bool = False) -> list[str]:
    """The routers `router` names: comma-separated, 'all' for every router, None for the
    cache-aware one (SGLang router's default); validated, duplicates removed, one unless `sweep`.
    `thresholds`: the names of the `RouterConfig` thresholds given. A router or a threshold that a
    replay on `replicas` servers would not use is an error (`replicas_chosen_later`: the count is
    chosen after this check, so any may come)."""
    items = [item.strip() for item in str(router or "cache-aware").split(",") if item.strip()]
    if not items:
        raise UsageError("`router`: empty list")
    names: list[str] = []
    for item in items:
        for name in router_names() if item == "all" else [check_router(item)]:
            if name not in names:
                names.append(name)
    if not sweep and len(names) > 1:
        raise UsageError("`router`: give one router here")
    if replicas is not None and replicas < 1:
        raise UsageError(f"`replicas` must be a positive integer, got {replicas}")
    one_server = replicas == 1 and not replicas_chosen_later
    if router is not None and one_server:
        raise UsageError("`router` applies to `replicas` N > 1 (one server needs no router)")
    given = [name for name in THRESHOLDS if name in thresholds]
    if given and (one_server or "cache-aware" not in names):
        raise UsageError(f"`{given[0]}` applies to the cache-aware router with `replicas` N > 1")
    return names


def make_router(name: str, replicas: int, block_size: int, config: RouterConfig | None = None) -> Router:
    """A fresh router `name` over `replicas` replicas of a workload with `block_size`-token keys."""
    return ROUTERS[check_router(name)](replicas, block_size, config or RouterConfig())


def least_loaded(loads: Sequence[int]) -> int:
    """The replica with the smallest load, the lowest number among ties."""
    return min(range(len(loads)), key=loads.__getitem__)


class Router:
    """Chooses a replica for each request; subclasses implement `route`."""

    name: ClassVar[str] = ""

    def __init__(self, replicas: int, block_size: int, config: RouterConfig):
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise UsageError(f"`replicas` must be a positive integer, got {replicas!r}")
        self.replicas = replicas
        self.block_size = block_size
        self.config = config
        # Why requests went where they went, per reason (routers that choose for several reasons).
        self.decisions: dict[str, int] = {}

    def route(self, request: Request, session: int, loads: Sequence[int], now: float) -> int:
        """The replica (0-based) for `request` of session number `session`, sent at `now` (s)
        when the replicas hold `loads` requests each."""
        raise NotImplementedError


@register
class RoundRobin(Router):
    name = "round-robin"

    def __init__(self, replicas, block_size, config):
        super().__init__(replicas, block_size, config)
        self._next = 0

    def route(self, request, session, loads, now):
        chosen = self._next
        self._next = (chosen + 1) % self.replicas
        return chosen


@register
class LeastLoad(Router):
    name = "least-load"

    def route(self, request, session, loads, now):
        return least_loaded(loads)


@register
class Sticky(Router):
    name = "session"

    def __init__(self, replicas, block_size, config):
        super().__init__(replicas, block_size, config)
        self._home: dict[int, int] = {}

    def route(self, request, session, loads, now):
        home = self._home.get(session)
        if home is None:
            home = self._home[session] = least_loaded(loads)
        return home


@register
class CacheAware(Router):
    name = "cache-aware"

    def __init__(self, replicas, block_size, config):
        super().__init__(replicas, block_size, config)
        self.tree = PrefixTree(block_size)
        self._next_eviction = config.eviction_interval
        # How each request was routed: "balance" (imbalanced loads), "match", "least-load".
        self.decisions = {"balance": 0, "match": 0, "least-load": 0}

    def imbalanced(self, loads: Sequence[int]) -> bool:
        high, low = max(loads), min(loads)
        config = self.config
        return high - low > config.balance_abs_threshold and high > low * config.balance_rel_threshold

    def route(self, request, session, loads, now):
        if now >= self._next_eviction:
            # SGLang's eviction task runs every interval; between routings nothing reads the tree.
            self.tree.evict(self.config.max_tree_tokens)
            interval = self.config.eviction_interval
            self._next_eviction = (math.floor(now / interval) + 1) * interval
        keys = request.keys.tolist()
        if self.imbalanced(loads):
            chosen, why = least_loaded(loads), "balance"
        else:
            blocks, tenant = self.tree.match(keys)
            matched = min(blocks * self.block_size, request.input_tokens)
            rate = matched / request.input_tokens if request.input_tokens else 0.0
            if tenant is not None and rate > self.config.cache_threshold:
                chosen, why = tenant, "match"
            else:
                chosen, why = least_loaded(loads), "least-load"
        self.tree.insert(keys, chosen, now)
        self.decisions[why] += 1
        return chosen
