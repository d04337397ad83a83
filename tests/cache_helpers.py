"""Helpers shared by the cache manager tests."""
from __future__ import annotations

import numpy as np

from penelope.cache.manager import KVCache, MatchResult


def request_slots(match: MatchResult, n_tokens: int, new: np.ndarray) -> np.ndarray:
    """The slot row of a request: resident spans keep their slots, holes and positions from
    `compute_from` on take `new` in order."""
    slots = np.full(n_tokens, -1, dtype=np.int64)
    cursor = 0
    for span in match.spans:
        if span.end > match.compute_from:
            break
        if span.state.name == "MISSING":
            slots[span.start:span.end] = new[cursor:cursor + len(span)]
            cursor += len(span)
        else:
            slots[span.start:span.end] = span.slots
    slots[match.compute_from:] = new[cursor:]
    return slots


def serve(cache: KVCache, tokens, check: bool = True):
    """One request through the caller protocol: match, lock, alloc, insert, unlock.
    Returns the match and the insert result."""
    tokens = np.asarray(tokens, dtype=np.int64)
    match = cache.match(tokens)
    handle = cache.lock(match)
    holes = sum(end - start for start, end in match.holes)
    new = cache.alloc(holes + len(tokens) - match.compute_from)
    result = cache.insert(tokens, request_slots(match, len(tokens), new))
    cache.unlock(handle)
    if check:
        cache.check_invariants()
    return match, result


def shape(cache: KVCache):
    """The tree as sorted (start, end, states) per node, for readable assertions."""
    out = []
    for node in cache.tree.nodes():
        out.append((node.start, node.end, "".join("GCM"[s] for s in node.state)))
    return sorted(out)
