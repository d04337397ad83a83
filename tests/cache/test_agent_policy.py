"""penelope-agent's choice of victim session, by hand: histories nobody holds go first, a running
request's last, and among waiting sessions the one expected back last (per kind of wait, from the
waits observed in this run) goes first."""
import numpy as np
from cache_helpers import serve

from penelope.cache.hints import Hint
from penelope.cache.manager import KVCache

BS = 4


def history(base: int, blocks: int = 3) -> np.ndarray:
    return np.arange(base, base + blocks * BS, dtype=np.int64)


def finished(cache, tokens, now, kind):
    cache.hint(tokens, Hint(now, "arrived"))
    serve(cache, tokens)
    cache.hint(tokens, Hint(now, "finished", kind))


def first_victim(cache) -> int:
    """Token id at the front of the first block one eviction deletes."""
    before = {int(n.tokens[0]) // 100 * 100: n.n_resident for n in cache.tree.nodes() if n is not cache.tree.root}
    cache.evict(BS)
    after = {int(n.tokens[0]) // 100 * 100: n.n_resident for n in cache.tree.nodes() if n is not cache.tree.root}
    (base,) = [b for b in before if after.get(b, 0) < before[b]]
    return base


def observe(cache, kind, waits, base=9000):
    """Sessions that waited `waits` seconds each for `kind` (they are back and gone again)."""
    for i, wait in enumerate(waits):
        tokens = history(base + 100 * i, 1)
        cache.hint(tokens, Hint(0.0, "finished", kind))
        cache.hint(np.concatenate([tokens, tokens + 50]), Hint(wait, "arrived"))
        cache.hint(np.concatenate([tokens, tokens + 50]), Hint(wait, "finished", kind))


def test_a_history_nobody_holds_goes_first_even_when_most_recent():
    cache = KVCache(64, block_size=BS, policy="penelope-agent")
    finished(cache, history(100), 0.0, "human")
    finished(cache, history(200), 1.0, "tool")
    serve(cache, history(300))  # no hints: an orphan, and the most recently used
    assert first_victim(cache) == 300


def test_a_request_that_arrived_and_runs_goes_last():
    cache = KVCache(64, block_size=BS, policy="penelope-agent")
    finished(cache, history(100), 0.0, "tool")
    cache.hint(history(200), Hint(1.0, "arrived"))
    serve(cache, history(200))
    cache.hint(history(100), Hint(1.0, "arrived"))  # both in the system now; 100 back first
    cache.hint(history(100), Hint(1.0, "finished", "tool"))
    assert first_victim(cache) == 100


def test_the_session_expected_back_last_goes_first_by_its_kind_of_wait():
    cache = KVCache(64, block_size=BS, policy="penelope-agent")
    observe(cache, "tool", [1.0, 2.0, 3.0])
    observe(cache, "human", [300.0, 400.0, 500.0], base=5000)
    # The person-waiting session is more recent, but expected back in minutes, the tool one in
    # seconds: least recently used would take the tool session.
    finished(cache, history(100), 600.0, "tool")
    finished(cache, history(200), 600.0, "human")
    cache.advance(600.5)
    assert first_victim(cache) == 200
