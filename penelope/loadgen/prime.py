"""`--prime`: each session's first request primes the server (`LoadConfig.prime`), and where it
cannot apply or would leave nothing to measure."""

from __future__ import annotations

from penelope.errors import UsageError
from penelope.sim.workloads.types import Workload


def add_prime_argument(parser) -> None:
    parser.add_argument("--prime", action="store_true",
                        help="each session's first request primes the server: served, its reply carried on, but "
                        "left out of the figures; with every session at once, no second turn goes before every "
                        "first has ended (measure a steady state, not a cold start)")


def check_prime(workload: Workload, *, prime: bool, sessions: int, max_requests: int | None) -> None:
    """UsageError where `prime` cannot apply or leaves nothing to measure (errors name fields:
    `prime`, `turns`, `max_requests`)."""
    if not prime:
        return
    if not workload.closed_loop:
        raise UsageError("`prime` needs a closed-loop workload (WEKA or synthetic sessions): open-loop requests "
                         "are sent at their recorded times, with no first turn to wait for")
    if all(len(s.requests) < 2 for s in workload.sessions):
        raise UsageError("`prime` leaves nothing to measure: every session has one request (raise `turns`)")
    started = min(sessions, len(workload.sessions))
    if max_requests is not None and max_requests <= started:
        raise UsageError(f"`prime` leaves nothing to measure: `max_requests` {max_requests} is spent on the "
                         f"{started} sessions' first turns")
