"""One clock for every tensor-parallel rank: rank 0's monotonic clock, broadcast with the requests.

Every TP rank runs its own Penelope cache, and every input to an eviction decision must be the same
on every rank, or ranks evict different blocks, then report different prefixes and batch shapes
(a collective hangs, or reads garbage). The agent-aware policies read the time of arrivals and
finishes; each rank's own clock differs by milliseconds from the others'. SGLang 0.5.23 carries no
timestamp from the tokenizer to the scheduler (its request time stats propagate none), and it
solves the same problem for its own timeouts the same way: rank 0 reads its clock and what it
decides rides the broadcast of the requests (``Scheduler._poll_timeout_aborts``).

So rank 0, the rank that pulls the requests, appends a ``ClockReading`` of its monotonic clock to
what it broadcasts; every rank takes the readings out before SGLang dispatches the requests and
tells its cache (``PenelopeRadixCache.tell_time``). The cache reads no wall clock.

| target (AROUND hooks)                                         | what the hook does              |
|---------------------------------------------------------------|---------------------------------|
| ``SchedulerRequestReceiver._broadcast_reqs_across_ranks``     | rank 0 appends its reading      |
| ``Scheduler.process_input_requests``                          | every rank takes the readings   |
|                                                               | out and tells its cache         |

A reading rides only an iteration that has something to say: requests pulled, requests rank 0
decided to abort, or a batch run in the iteration before (its requests may finish in this one).
An idle scheduler broadcasts nothing more than before, and SGLang's idle accounting is unchanged.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from .options import BACKEND_NAME
from .patching import applied, register_around
from .radix_cache import PenelopeRadixCache

_RECEIVER = "sglang.srt.managers.scheduler_components.request_receiver.SchedulerRequestReceiver"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"


@dataclass(frozen=True)
class ClockReading:
    """Rank 0's monotonic clock (seconds) when it broadcast an iteration's requests."""

    now: float


def _stamp(original, receiver, recv_reqs, local_reqs=None):
    # Only the rank that pulled the requests holds a list; the others receive its broadcast.
    if (recv_reqs is not None and getattr(receiver.server_args, "radix_cache_backend", None) == BACKEND_NAME
            and (recv_reqs or local_reqs or receiver.get_last_batch() is not None)):
        recv_reqs = [*recv_reqs, ClockReading(time.monotonic())]
    return original(receiver, recv_reqs, local_reqs)


def _take_readings(original, scheduler, recv_reqs, *args, **kwargs):
    readings = [req.now for req in recv_reqs if isinstance(req, ClockReading)]
    if readings:
        # SGLang's dispatcher refuses types it does not know: the readings never reach it.
        recv_reqs = [req for req in recv_reqs if not isinstance(req, ClockReading)]
        cache = getattr(scheduler, "tree_cache", None)
        if isinstance(cache, PenelopeRadixCache):
            cache.tell_time(max(readings))
    return original(scheduler, recv_reqs, *args, **kwargs)


HOOKS = {
    f"{_RECEIVER}._broadcast_reqs_across_ranks": _stamp,
    f"{_SCHEDULER}.process_input_requests": _take_readings,
}


def register_hooks() -> None:
    """Register both hooks with SGLang's HookRegistry (``load_plugins`` applies them). Idempotent."""
    register_around(HOOKS)


def hooks_active() -> bool:
    """Whether both hooks have been applied to SGLang's classes in this process."""
    return applied(HOOKS)
