"""Command-line options of a replay's servers and traffic, shared by `penelope simulate` and
`penelope analyze`: replicas behind a router, the router's thresholds, conversations recovered
from prefixes, and the time scale (fields of `penelope.sim.api.SimulationSpec`)."""

from __future__ import annotations

from penelope.sim.fleet.router import (
    BALANCE_ABS_THRESHOLD,
    BALANCE_REL_THRESHOLD,
    CACHE_THRESHOLD,
    router_names,
)


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
