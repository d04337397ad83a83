"""KVCache.checkpoint and release: a running request caches what it computed and keeps it locked."""
import numpy as np
import pytest

from penelope.cache.manager import KVCache
from penelope.errors import UsageError

B = 4


def running(cache, tokens):
    """Admit `tokens` as a request: lock its match, slots for what it computes."""
    match = cache.match(tokens)
    handle = cache.lock(match)
    slots = np.concatenate([match.spans[0].slots[:match.hit_tokens] if match.hit_tokens else np.empty(0, np.int64),
                            cache.alloc(len(tokens) - match.hit_tokens)])
    return handle, slots


def test_a_checkpoint_inserts_whole_blocks_moves_the_lock_and_keeps_the_partial_blocks_slots():
    cache = KVCache(64, B, "sglang")
    tokens = np.arange(100, 114, dtype=np.int64)
    handle, slots = running(cache, tokens)
    free = cache.free_size()
    moved, held = cache.checkpoint(handle, tokens[:10], slots[:10])
    cache.check_invariants()
    np.testing.assert_array_equal(held, slots[:8])
    assert moved is not handle and not handle.active and moved.inserted == 8
    assert cache.protected_size() == 8 and cache.evictable_size() == 0 and cache.free_size() == free
    # The partial block's slots [8, 10) are still the caller's: they go in with the rest.
    cache.release(moved, tokens, slots, prompt=12)
    cache.check_invariants()
    assert cache.protected_size() == 0 and cache.evictable_size() == 12 and cache.free_size() == 64 - 12
    assert cache.stats.requests == 1


def test_a_checkpoint_inside_the_locked_path_keeps_the_lock():
    cache = KVCache(64, B, "sglang")
    tokens = np.arange(100, 112, dtype=np.int64)
    cache.insert(tokens, cache.alloc(12))
    handle, slots = running(cache, np.concatenate([tokens, [7, 8, 9]]))
    same, held = cache.checkpoint(handle, tokens[:8], slots[:8])
    assert same is handle and handle.active and handle.inserted == 8
    np.testing.assert_array_equal(held, slots[:8])
    cache.check_invariants()


def test_bad_checkpoints_are_refused():
    cache = KVCache(64, B, "sglang")
    tokens = np.arange(100, 112, dtype=np.int64)
    handle, slots = running(cache, tokens)
    moved, _ = cache.checkpoint(handle, tokens[:8], slots[:8])
    with pytest.raises(UsageError, match="active handle"):
        cache.checkpoint(handle, tokens[:8], slots[:8])
    other = tokens.copy()
    other[2] = 5
    with pytest.raises(UsageError, match="differ from the locked path"):
        cache.checkpoint(moved, other, slots)
    with pytest.raises(UsageError, match="tokens but"):
        cache.checkpoint(moved, tokens, slots[:5])
    cache.check_invariants()
