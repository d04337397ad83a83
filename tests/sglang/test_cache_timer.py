"""The timer of the scheduler's cache calls (``cache_timer``) on a stand-in cache: what it counts.
Its run in SGLang's real Engine, on Penelope's cache and SGLang's, is in ``test_engine.py``."""
from __future__ import annotations

import time

import pytest

from penelope.integration.sglang import cache_timer


class Cache:
    def __init__(self):
        self.inserted = []

    def match_prefix(self, key):
        busy(2e-3)
        return key

    def cache_finished_req(self, req):
        # The cache calls itself: one timed call, not two.
        busy(1e-3)
        self.insert(req)

    def insert(self, req):
        busy(1e-3)
        self.inserted.append(req)

    def fail(self):
        busy(1e-3)
        raise ValueError("refused")

    def stats(self):
        # The report's own call: never timed.
        return {}

    def _helper(self):
        return "private"


def busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.fixture
def readings(monkeypatch):
    fresh = {"cache_cpu_s": 0.0, "cache_calls": 0, "cache_methods": {}, "cache_timer_floor_s": 0.0}
    monkeypatch.setattr(cache_timer, "READINGS", fresh)
    # `_timed` binds the readings it adds to when it wraps.
    monkeypatch.setattr(cache_timer._timed, "__defaults__", (fresh,))
    return fresh


def test_outermost_calls_are_timed_once_each(readings):
    cache = Cache()
    names = cache_timer.wrap_methods(cache)
    assert sorted(names) == ["cache_finished_req", "fail", "insert", "match_prefix"]
    assert cache_timer.wrap_methods(cache) == []  # wrapping again changes nothing
    assert cache.match_prefix("k") == "k"
    cache.cache_finished_req("r")
    cache.insert("s")
    with pytest.raises(ValueError, match="refused"):
        cache.fail()
    assert cache.inserted == ["r", "s"]
    methods = readings["cache_methods"]
    assert {name: calls for name, (calls, _) in methods.items()} == \
        {"match_prefix": 1, "cache_finished_req": 1, "insert": 1, "fail": 1}
    assert readings["cache_calls"] == 4
    # Busy times: 2 ms, 1 + 1 ms (the nested insert inside its caller's), 1 ms, 1 ms.
    assert methods["match_prefix"][1] == pytest.approx(2e-3, abs=1e-3)
    assert methods["cache_finished_req"][1] == pytest.approx(2e-3, abs=1e-3)
    assert readings["cache_cpu_s"] == pytest.approx(sum(s for _, s in methods.values()))
    assert readings["cache_cpu_s"] == pytest.approx(6e-3, abs=2e-3)
    # After the exception the next outermost call is timed again.
    taken = cache_timer.snapshot()
    cache.insert("t")
    assert methods["insert"][0] == 2
    # A snapshot does not move with later calls.
    assert taken["cache_calls"] == 4 and taken["cache_methods"]["insert"][0] == 1


def test_the_timer_floor_is_the_cost_of_timing_nothing(readings):
    floor = cache_timer.timer_floor(calls=500)
    assert 0 < floor < 1e-4
    assert readings["cache_calls"] == 0  # calibrated on readings of its own


@pytest.mark.parametrize("value, registers", [
    (None, False), ("", False), ("0", False), ("off", False), (" false ", False), ("NO", False),
    ("1", True), ("true", True), (" Yes", True), ("ON", True),
])
def test_the_variable_switches_the_timer(monkeypatch, value, registers):
    registered = []
    monkeypatch.setattr(cache_timer, "register_around", registered.append)
    if value is None:
        monkeypatch.delenv(cache_timer.ENV, raising=False)
    else:
        monkeypatch.setenv(cache_timer.ENV, value)
    cache_timer.register_hooks()
    assert len(registered) == registers
    if registers:
        assert cache_timer._TARGET in registered[0]


def test_a_value_that_is_not_a_switch_is_logged_and_times_nothing(monkeypatch, caplog):
    registered = []
    monkeypatch.setattr(cache_timer, "register_around", registered.append)
    monkeypatch.setenv(cache_timer.ENV, "sometimes")
    with caplog.at_level("WARNING"):
        cache_timer.register_hooks()  # the plugin must load anyway: no exception
    assert registered == []
    assert "PENELOPE_TIME_CACHE must be 1/0 or true/false, got 'sometimes'" in caplog.text
    assert "not timed" in caplog.text
