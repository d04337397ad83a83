"""SGLang's fallback from longest-prefix-first to queue order beyond 128 waiting requests: the
scheduler sorts (and matches) only short queues, keeps the queue's order otherwise, and admits
from its front."""

import numpy as np
import pytest
from sim_env import B, make_job

from penelope.cache.manager import KVCache
from penelope.errors import UsageError
from penelope.sim.scheduler import LPM_QUEUE_MAX, Scheduler


class CountingCache(KVCache):
    """A KVCache that counts its matches (each one bumps recency, as SGLang's do)."""

    matches = 0

    def match(self, tokens):
        self.matches += 1
        return super().match(tokens)


def queue(scheduler, n, cached_every=None):
    """Submit n one-block jobs sent at times 0..n-1; every `cached_every`-th one has its block cached."""
    jobs = []
    for i in range(n):
        key = 7 if cached_every and i % cached_every == cached_every - 1 else 1000 + i
        job = make_job([key], B + 1, output_tokens=1, send_time=float(i), session=f"s{i}", index=i)
        scheduler.submit(job)
        jobs.append(job)
    return jobs


def cache_holding(capacity, key=7):
    cache = CountingCache(capacity, B, "sglang")
    tokens = make_job([key], B).tokens
    cache.insert(tokens, cache.alloc(len(tokens)))
    return cache


def test_sglang_limit_is_128():
    assert LPM_QUEUE_MAX == 128


def test_a_short_queue_is_sorted_by_prefix_match_a_long_one_keeps_its_order():
    # A cached request computes 1 token, another B + 1: a budget of 1 + 1 + (B + 1) admits three.
    cache = cache_holding(64 * B)
    short = Scheduler(cache, "lpm", chunk_size=B + 3, lpm_queue_max=8)
    jobs = queue(short, 8, cached_every=4)
    chunks = short.form_prefill()
    # The two requests whose block is cached come first, then arrival order.
    assert [c.job for c in chunks] == [jobs[3], jobs[7], jobs[0]]
    assert cache.matches == 8 + 3  # the sort matched all 8, admission the 3 admitted

    cache = cache_holding(64 * B)
    long = Scheduler(cache, "lpm", chunk_size=3 * (B + 1), lpm_queue_max=8)
    jobs = queue(long, 9, cached_every=4)
    chunks = long.form_prefill()
    # Nine waiting: no sort, no match beyond admission; the queue's front goes first.
    assert [c.job for c in chunks] == jobs[:3]
    assert cache.matches == 3
    assert long.waiting == jobs[3:]


def test_after_the_fallback_the_queue_keeps_the_last_sort_with_later_arrivals_behind():
    cache = cache_holding(64 * B)
    # One token per batch: exactly one request is admitted each time.
    scheduler = Scheduler(cache, "lpm", chunk_size=1, lpm_queue_max=4)
    jobs = queue(scheduler, 4, cached_every=2)
    [first] = scheduler.form_prefill()
    assert first.job is jobs[1]
    # Sorted in place: the other cached request first, then arrival order.
    assert scheduler.waiting == [jobs[3], jobs[0], jobs[2]]
    more = [make_job([7], B + 1, send_time=10.0 + i, session=f"late{i}", index=i) for i in range(2)]
    for job in more:
        scheduler.submit(job)
    # Five waiting > 4: served in the queue's order although the late ones hit the cache.
    assert scheduler.form_prefill()[0].job is jobs[3]
    assert scheduler.waiting == [jobs[0], jobs[2], *more]


@pytest.mark.parametrize("n", [LPM_QUEUE_MAX, LPM_QUEUE_MAX + 1, 20 * LPM_QUEUE_MAX])
def test_matches_per_decision_are_bounded_by_the_limit(n):
    cache = cache_holding(4 * n * B)
    scheduler = Scheduler(cache, "lpm", chunk_size=B + 1)
    queue(scheduler, n)
    before = cache.matches
    assert len(scheduler.form_prefill()) == 1
    assert cache.matches - before == (n + 1 if n <= LPM_QUEUE_MAX else 1)


def test_fcfs_keeps_send_time_order_for_requests_submitted_out_of_order():
    cache = KVCache(64 * B, B, "sglang")
    scheduler = Scheduler(cache, "fcfs", chunk_size=10 * B)
    late = make_job([1], B + 1, send_time=5.0, session="late")
    early = make_job([2], B + 1, send_time=1.0, session="early")
    scheduler.submit(late)
    scheduler.submit(early)
    assert scheduler.waiting == [early, late]
    assert [c.job for c in scheduler.form_prefill()] == [early, late]


def test_the_limit_must_be_a_positive_count():
    with pytest.raises(UsageError, match="LPM queue limit"):
        Scheduler(KVCache(4 * B, B, "sglang"), "lpm", lpm_queue_max=0)
    assert np.iinfo(np.int64).max > LPM_QUEUE_MAX


class RecordingCache(KVCache):
    """A KVCache that notes the first block key of every sequence it matches, in order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.matched = []

    def match(self, tokens):
        self.matched.append(int(tokens[0]) // B)
        return super().match(tokens)


def test_the_sort_matches_in_arrival_order_whatever_the_queue_order():
    # Each match bumps recency, so their order decides later LRU ties: arrival order, as before
    # the queue kept its last sort (and WEKA replays stay unchanged).
    cache = RecordingCache(64 * B, B, "sglang")
    scheduler = Scheduler(cache, "lpm", lpm_queue_max=8)
    keys = (1000, 1001, 1002, 1003)
    for i, key in enumerate(keys):
        scheduler.submit(make_job([key], B + 1, output_tokens=1, send_time=float(i), session=f"s{i}", index=i))
    # The queue as a previous sort and later arrivals may have left it.
    scheduler.waiting.reverse()
    scheduler.form_prefill()
    assert cache.matched[:len(keys)] == list(keys)
