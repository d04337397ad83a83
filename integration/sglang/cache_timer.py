"""The scheduler's CPU time inside its radix cache, for benchmarks that compare caches in SGLang's
real Engine (``microbench/bench_scheduler_cpu.py``).

With ``PENELOPE_TIME_CACHE=1`` (or true/yes/on) in the server's environment, the plugin wraps every
public method of the scheduler's tree cache, whichever cache it is (Penelope's, SGLang's
``UnifiedRadixCache`` on either tree core, its ``RadixCache``), right after the scheduler built it,
but ``stats``, which only the report calls. Only outermost calls are timed, each with its thread's
CPU clock: a method the cache calls on itself (its ``cache_finished_req`` inserting, say) counts
once. Calls through references taken while the cache was being built (before the wrap) are not
counted. Unset or off (0/false/no/off), nothing is wrapped; another value is logged as a warning
and nothing is wrapped.

``READINGS`` (per process, reported with the hooks' counters): ``cache_cpu_s``, ``cache_calls``,
``cache_methods`` {name: [calls, CPU seconds]} and ``cache_timer_floor_s``, what one timed call
of a method doing nothing counts (the timer's own cost; a reader subtracts calls x floor).
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
import time

from penelope.errors import UsageError

from .options import yes_or_no
from .patching import register_around

logger = logging.getLogger(__name__)

ENV = "PENELOPE_TIME_CACHE"
_TARGET = "sglang.srt.managers.scheduler.Scheduler.init_schedule_policy"
# Per scheduler process.
READINGS = {"cache_cpu_s": 0.0, "cache_calls": 0, "cache_methods": {}, "cache_timer_floor_s": 0.0}
_nesting = threading.local()
# Called by the hooks' report (`PenelopeRadixCache.stats`), on Penelope's cache only: not the
# scheduler's work.
UNTIMED = frozenset({"stats"})


def enabled() -> bool:
    """Whether ``PENELOPE_TIME_CACHE`` turns the timer on: 1/true/yes/on; unset, empty or
    0/false/no/off leave it off; another value raises UsageError."""
    value = os.environ.get(ENV, "")
    return bool(value.strip()) and yes_or_no(value, ENV)


def snapshot() -> dict:
    """A copy of ``READINGS`` that later calls do not change."""
    return {**READINGS, "cache_methods": {name: list(entry) for name, entry in READINGS["cache_methods"].items()}}


def register_hooks() -> None:
    """Register the wrap of the scheduler's cache when ``PENELOPE_TIME_CACHE`` says so. A value
    that is not a switch is logged and leaves the cache untimed (the plugin must load anyway)."""
    try:
        on = enabled()
    except UsageError as error:
        logger.warning("%s: the radix cache is not timed", error)
        return
    if on:
        register_around({_TARGET: _after_policy_init})


def _after_policy_init(original, scheduler, *args, **kwargs):
    # The scheduler built its tree cache before its schedule policy, which holds the same object.
    out = original(scheduler, *args, **kwargs)
    cache = getattr(scheduler, "tree_cache", None)
    if cache is not None:
        wrap_methods(cache)
        READINGS["cache_timer_floor_s"] = timer_floor()
    return out


def timer_floor(calls: int = 2000) -> float:
    """Seconds a timed call of a method that does nothing counts (the clock and the call through
    the wrap), least mean of three runs of `calls`."""
    means = []
    for _ in range(3):
        readings = {"cache_cpu_s": 0.0, "cache_calls": 0, "cache_methods": {}}
        nothing = _timed(lambda: None, "nothing", readings)
        for _ in range(calls):
            nothing()
        means.append(readings["cache_cpu_s"] / calls)
    return min(means)


def wrap_methods(cache) -> list[str]:
    """Time every public method of `cache` (instance attributes shadowing its class's functions)
    but those the reporting itself calls (`UNTIMED`); returns their names. Wrapping twice changes
    nothing."""
    names = []
    for name, _ in inspect.getmembers(type(cache), inspect.isfunction):
        if name.startswith("_") or name in UNTIMED or getattr(cache.__dict__.get(name), "_penelope_timed", False):
            continue
        setattr(cache, name, _timed(getattr(cache, name), name))
        names.append(name)
    return names


def _timed(method, name: str, readings: dict = READINGS):
    @functools.wraps(method)
    def timed(*args, **kwargs):
        if getattr(_nesting, "inside", False):
            return method(*args, **kwargs)
        _nesting.inside = True
        start = time.thread_time_ns()
        try:
            return method(*args, **kwargs)
        finally:
            seconds = (time.thread_time_ns() - start) * 1e-9
            readings["cache_cpu_s"] += seconds
            readings["cache_calls"] += 1
            calls_and_seconds = readings["cache_methods"].setdefault(name, [0, 0.0])
            calls_and_seconds[0] += 1
            calls_and_seconds[1] += seconds
            _nesting.inside = False

    timed._penelope_timed = True
    return timed
