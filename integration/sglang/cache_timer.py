"""The scheduler's CPU time inside its radix cache, for benchmarks that compare caches in SGLang's
real Engine (``microbench/bench_scheduler_cpu.py``).

With ``PENELOPE_TIME_CACHE=1`` in the server's environment, the plugin wraps every public method
of the scheduler's tree cache, whichever cache it is (Penelope's, SGLang's ``UnifiedRadixCache``
on either tree core, its ``RadixCache``), right after the scheduler built it. Only outermost calls
are timed, each with its thread's CPU clock: a method the cache calls on itself (its
``cache_finished_req`` inserting, say) counts once. Calls through references taken while the
cache was being built (before the wrap) are not counted. Unset, nothing is wrapped.

``READINGS`` (per process, reported with the hooks' counters): ``cache_cpu_s``, ``cache_calls``,
``cache_methods`` {name: [calls, CPU seconds]} and ``cache_timer_floor_s``, what one timed call
of a method doing nothing counts (the timer's own cost; a reader subtracts calls x floor).
"""
from __future__ import annotations

import functools
import inspect
import os
import threading
import time

from .patching import applied, register_around

ENV = "PENELOPE_TIME_CACHE"
_TARGET = "sglang.srt.managers.scheduler.Scheduler.init_schedule_policy"
# Per scheduler process.
READINGS = {"cache_cpu_s": 0.0, "cache_calls": 0, "cache_methods": {}, "cache_timer_floor_s": 0.0}
_nesting = threading.local()


def enabled() -> bool:
    return os.environ.get(ENV, "") == "1"


def snapshot() -> dict:
    """A copy of ``READINGS`` that later calls do not change."""
    return {**READINGS, "cache_methods": {name: list(entry) for name, entry in READINGS["cache_methods"].items()}}


def register_hooks() -> None:
    """Register the wrap of the scheduler's cache when ``PENELOPE_TIME_CACHE=1``."""
    if enabled():
        register_around({_TARGET: _after_policy_init})


def hooks_active() -> bool:
    return applied({_TARGET: None})


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
    """Time every public method of `cache` (instance attributes shadowing its class's functions);
    returns their names. Wrapping twice changes nothing."""
    names = []
    for name, _ in inspect.getmembers(type(cache), inspect.isfunction):
        if name.startswith("_") or getattr(cache.__dict__.get(name), "_penelope_timed", False):
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
