"""Command-line options of a replay's servers and traffic, shared by `penelope simulate` and
`penelope analyze`: replicas behind a router, the router's thresholds, conversations recovered
from prefixes, and the time scale."""

from __future__ import annotations

import dataclasses
import math

from penelope.errors import UsageError
from penelope.sim.fleet.router import (
    BALANCE_ABS_THRESHOLD,
    BALANCE_REL_THRESHOLD,
    CACHE_THRESHOLD,
    RouterConfig,
    check_router,
    router_names,
)
from penelope.sim.workloads.types import Workload


def add_fleet_arguments(parser, sweep: bool = True, replicas_help: str = "default 1") -> None:
    """--replicas (default 1, or None when `replicas_help` says what None means), --router (a
    comma-separated sweep when `sweep`), the cache-aware router's thresholds, --conversations and
    --time-scale."""
    parser.add_argument(
        "--replicas", type=int, default=1 if replicas_help == "default 1" else None, metavar="N",
        help=f"servers, each with its own cache (--gpu-cache each) and scheduler, behind a router ({replicas_help})",
    )
    names = " | ".join(router_names())
    parser.add_argument(
        "--router",
        help=f"with --replicas N > 1: {names}" + (", comma-separated to sweep, or 'all'" if sweep else "")
        + " (default cache-aware, SGLang router's default)",
    )
    parser.add_argument(
        "--cache-threshold", type=float,
        help=f"cache-aware router: matched fraction of a request above which its best match wins (default "
        f"{CACHE_THRESHOLD}, SGLang router's)",
    )
    parser.add_argument(
        "--balance-abs-threshold", type=int,
        help="cache-aware router: loads are imbalanced (the least loaded replica wins) when the largest exceeds "
        f"the smallest by more than this many requests and --balance-rel-threshold holds (default "
        f"{BALANCE_ABS_THRESHOLD})",
    )
    parser.add_argument(
        "--balance-rel-threshold", type=float,
        help=f"cache-aware router: ... and the largest load exceeds the smallest times this (default "
        f"{BALANCE_REL_THRESHOLD})",
    )
    parser.add_argument(
        "--conversations", default="none",
        help="open-loop traces without session ids (Mooncake's): none (each request is its own session) | prefix "
        "(a request continues the conversation whose previous turn's blocks it starts with; sessions for JCT "
        "and the session router)",
    )
    parser.add_argument(
        "--time-scale", type=float, default=1.0, metavar="X",
        help="replay every wait between requests X times as long: open-loop arrival times, closed-loop "
        "think times (X > 1: a slower, lighter trace; default 1)",
    )


THRESHOLDS = ("--cache-threshold", "--balance-abs-threshold", "--balance-rel-threshold")


def routers_from_args(args, sweep: bool = True) -> list[str]:
    """The routers named by --router (validated; duplicates removed; 'all' for every router;
    default cache-aware). A router or a threshold that the replay would not use is an error."""
    given = args.router is not None
    items = [item.strip() for item in str(args.router or "cache-aware").split(",") if item.strip()]
    if not items:
        raise UsageError("--router: empty list")
    names: list[str] = []
    for item in items:
        for name in router_names() if item == "all" else [check_router(item)]:
            if name not in names:
                names.append(name)
    if not sweep and len(names) > 1:
        raise UsageError("--router: give one router here")
    if args.replicas is not None and args.replicas < 1:
        raise UsageError(f"--replicas must be a positive integer, got {args.replicas}")
    # `analyze` without --replicas chooses the replica count after this check: any may come.
    one_server = args.replicas == 1 and not getattr(args, "replicas_chosen_later", False)
    if given and one_server:
        raise UsageError("--router applies to --replicas N > 1 (one server needs no router)")
    thresholds = [flag for flag in THRESHOLDS if getattr(args, flag[2:].replace("-", "_")) is not None]
    if thresholds and (one_server or "cache-aware" not in names):
        raise UsageError(f"{thresholds[0]} applies to the cache-aware router with --replicas N > 1")
    return names


def routing_from_args(args) -> RouterConfig:
    def given(value, default):
        return default if value is None else value

    return RouterConfig(
        cache_threshold=given(args.cache_threshold, CACHE_THRESHOLD),
        balance_abs_threshold=given(args.balance_abs_threshold, BALANCE_ABS_THRESHOLD),
        balance_rel_threshold=given(args.balance_rel_threshold, BALANCE_REL_THRESHOLD),
    )


# Slowing a trace down or speeding it up more than this turns seconds into days or microseconds.
TIME_SCALE_RANGE = (1e-4, 1e4)


def check_time_scale(factor: float) -> float:
    low, high = TIME_SCALE_RANGE
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise UsageError(f"--time-scale must be a positive number, got {factor!r}")
    if not low <= factor <= high:
        raise UsageError(f"--time-scale must be in [{low:g}, {high:g}], got {factor:g}")
    return float(factor)


def scale_time(workload: Workload, factor: float) -> Workload:
    """`workload` with every wait between requests times `factor`: open-loop arrivals (so the
    request rate is divided by it), closed-loop think times. The same object when `factor` is 1."""
    factor = check_time_scale(factor)
    if factor == 1.0:
        return workload
    sessions = []
    for session in workload.sessions:
        if workload.closed_loop:
            requests = tuple(dataclasses.replace(r, think_time=r.think_time * factor) for r in session.requests)
        else:
            requests = tuple(dataclasses.replace(r, arrival=r.arrival * factor) for r in session.requests)
        sessions.append(dataclasses.replace(session, requests=requests))
    return dataclasses.replace(workload, sessions=tuple(sessions))
