"""The tree's per-node loops: the compiled ones (`_path_loops.c`) against the Python reference
(`path_loops.py`), on the same trees, and a whole cache run on each."""
from __future__ import annotations

import hashlib
import random
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
from cache_helpers import request_slots
from reference_cache import dump_real

from penelope.cache import path_loops
from penelope.cache.manager import KVCache
from penelope.cache.tree import RadixTree

COMPILED = path_loops.compiled()
SYSTEM = list(range(5000, 5024))


def test_the_install_built_the_compiled_loops_and_the_tree_runs_them():
    """The test environment's install compiles the loops (a failed build would leave the tree on
    the Python ones, silently slower)."""
    assert COMPILED is not None, "penelope.cache._path_loops was not built: is a C compiler installed?"
    source = Path(path_loops.__file__).with_name("_path_loops.c").read_bytes()
    assert COMPILED.source_sha256 == hashlib.sha256(source).hexdigest(), \
        "the built extension is stale: _path_loops.c changed since (did its build fail?)"
    assert RadixTree(4).loops.name == "compiled"
    assert RadixTree(4, loops=path_loops.PYTHON).loops.name == "python"


def grown_cache(block_size: int, policy: str, seed: int, loops=None) -> KVCache:
    """A cache after a random agent-like workload: sessions sharing a prefix, growing turn by turn,
    some forking mid-block, evictions (holes under `penelope`) and locks held across turns."""
    cache = KVCache(4096, block_size=block_size, policy=policy)
    if loops is not None:
        cache.tree.loops = loops
    rng = random.Random(seed)
    sessions = [list(SYSTEM) + [rng.randrange(100_000) for _ in range(rng.randrange(0, 40))] for _ in range(6)]
    held = []
    for _ in range(120):
        s = rng.randrange(len(sessions))
        if rng.random() < 0.1:
            # A fork: a new session sharing a random prefix of this one.
            cut = rng.randrange(len(sessions[s]) + 1)
            sessions.append(sessions[s][:cut] + [rng.randrange(100_000) for _ in range(rng.randrange(1, 20))])
            s = len(sessions) - 1
        tokens = np.asarray(sessions[s], dtype=np.int64)
        match = cache.match(tokens)
        handle = cache.lock(match)
        holes = sum(end - start for start, end in match.holes)
        new = cache.alloc(holes + len(tokens) - match.compute_from)
        cache.insert(tokens, request_slots(match, len(tokens), new))
        if rng.random() < 0.3:
            held.append(handle)
        else:
            cache.unlock(handle)
        if held and rng.random() < 0.3:
            cache.unlock(held.pop(rng.randrange(len(held))))
        if rng.random() < 0.2:
            cache.evict(rng.randrange(1, 200))
        sessions[s] = sessions[s] + [rng.randrange(100_000) for _ in range(rng.randrange(1, 30))]
        cache.check_invariants()
    return cache


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("policy", ["penelope", "sglang"])
def test_compiled_walks_find_what_the_python_walk_finds(block_size, policy):
    """Probes that end at a node's end, inside a node, where a token differs in the middle of a
    block, at the root, and beyond every path: the same nodes and the same last block count."""
    cache = grown_cache(block_size, policy, seed=block_size)
    tree, rng = cache.tree, np.random.default_rng(block_size)
    paths = [list(node.tokens) for node in tree.nodes()]
    probes = [np.empty(0, dtype=np.int64), np.asarray(SYSTEM[:block_size], dtype=np.int64)]
    for node in tree.nodes():
        # The node's whole root path, then cut and changed in random places.
        full = np.concatenate([n.tokens for n in tree.path_to_root(node)])
        probes.append(full)
        for _ in range(3):
            probe = full[:rng.integers(0, len(full) + 1)].copy()
            if len(probe) and rng.random() < 0.5:
                probe[rng.integers(0, len(probe))] += 1
            probes.append(np.concatenate([probe, rng.integers(0, 100_000, rng.integers(0, 3 * block_size))]))
    assert len(probes) > 50 and paths
    for probe in probes:
        n_blocks = len(probe) // block_size
        raw = probe[:n_blocks * block_size].tobytes()
        want_path, want_last = path_loops.PYTHON.walk(tree.root, raw, tree._block_bytes)
        got_path, got_last = COMPILED.walk(tree.root, raw, tree._block_bytes)
        assert [n.id for n in got_path] == [n.id for n in want_path] and got_last == want_last


def test_the_python_walk_stops_at_the_block_of_the_first_differing_token():
    """The reference itself, against tokens compared one by one."""
    tree = grown_cache(4, "sglang", seed=3).tree
    node = max(tree.nodes(), key=lambda n: n.end)
    full = np.concatenate([n.tokens for n in tree.path_to_root(node)])
    for differ in range(0, len(full), 3):
        probe = full.copy()
        probe[differ] += 1
        path, last = path_loops.PYTHON.walk(tree.root, probe.tobytes(), tree._block_bytes)
        reached = path[-1].start + last * 4 if path else 0
        assert reached == differ // 4 * 4


@pytest.mark.parametrize("policy", ["penelope", "sglang"])
def test_compiled_locks_and_stamps_do_what_the_python_ones_do(policy):
    """Two trees grown alike, one locked and stamped by each implementation: the same counts
    returned, the same lock_ref and last_access on every node."""
    trees = [grown_cache(4, policy, seed=7).tree, grown_cache(4, policy, seed=7).tree]
    rng = random.Random(11)
    nodes = [sorted(tree.nodes(), key=lambda n: n.id) for tree in trees]
    assert [n.id for n in nodes[0]] == [n.id for n in nodes[1]]
    held = []
    for step in range(200):
        if held and rng.random() < 0.45:
            i = held.pop(rng.randrange(len(held)))
            delta = -1
        else:
            i = rng.randrange(len(nodes[0]))
            held.append(i)
            delta = +1
        got = [loops.lock_path(tree_nodes[i], tree.root, delta)
               for loops, tree, tree_nodes in zip((path_loops.PYTHON, COMPILED), trees, nodes, strict=True)]
        assert got[0] == got[1]
        path = trees[0].path_to_root(nodes[0][i])
        path_loops.PYTHON.stamp(path, step)
        COMPILED.stamp(trees[1].path_to_root(nodes[1][i]), step)
        assert [(n.lock_ref, n.last_access) for n in nodes[0]] == [(n.lock_ref, n.last_access) for n in nodes[1]]


@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("policy", ["penelope", "sglang"])
def test_a_cache_on_either_loops_ends_in_the_same_state(block_size, policy):
    """The whole random workload on the compiled and on the Python loops: the same tree, slots,
    locks, recency stamps and sizes."""
    caches = [grown_cache(block_size, policy, seed=5, loops=loops) for loops in (path_loops.PYTHON, COMPILED)]
    assert caches[0].tree.loops.name == "python" and caches[1].tree.loops.name == "compiled"
    assert dump_real(caches[0]) == dump_real(caches[1])
    assert [(c.evictable_size(), c.protected_size(), c.free_size()) for c in caches].count(
        (caches[0].evictable_size(), caches[0].protected_size(), caches[0].free_size())) == 2


def test_compiled_loops_refuse_what_is_not_a_tree():
    with pytest.raises(TypeError):
        COMPILED.walk(RadixTree(4).root, "not bytes", 32)
    for block_bytes in (0, -8, 12):
        with pytest.raises(ValueError, match="block_bytes must be a positive multiple of 8"):
            COMPILED.walk(RadixTree(4).root, b"", block_bytes)
    with pytest.raises(TypeError):
        COMPILED.stamp((), 1)


class Loose:
    """A stand-in node with any attributes."""

    def __init__(self, **attributes):
        self.__dict__.update(attributes)


def test_compiled_loops_survive_nodes_that_change_the_tree_under_them():
    """Objects whose attribute reads or writes run code that drops the node being read, or
    empties the list being stamped: no crash, and the Python reference's answer."""
    root = Loose(children={})

    class Dropping:
        children: dict = {}
        n_blocks = 1

        @property
        def key(self):
            root.children.clear()
            return b"x" * 8

    for loops in (path_loops.PYTHON, COMPILED):
        root.children = {b"x" * 8: Dropping()}
        path, last = loops.walk(root, b"x" * 16, 8)
        assert len(path) == 1 and last == 1
    path = []

    class Emptying:
        def __setattr__(self, name, value):
            path.clear()

    path.extend(Emptying() for _ in range(1000))
    COMPILED.stamp(path, 1)
    assert path == []


def test_compiled_lock_counts_refuse_to_overflow():
    root = Loose()
    node = Loose(lock_ref=sys.maxsize, n_gpu=1, n_resident=1, parent=root)
    with pytest.raises(OverflowError, match="lock count"):
        COMPILED.lock_path(node, root, 1)
    assert node.lock_ref == sys.maxsize


def test_a_compiled_loop_over_a_cycle_can_be_interrupted():
    """A parent chain that never reaches the root (a corrupted tree) loops until a signal: the
    loop checks for signals, so the handler's exception ends it as in Python."""
    root, a, b = Loose(), Loose(lock_ref=0, n_gpu=0, n_resident=0), Loose(lock_ref=0, n_gpu=0, n_resident=0)
    a.parent, b.parent = b, a

    def stop(signum, frame):
        raise TimeoutError

    previous = signal.signal(signal.SIGALRM, stop)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(TimeoutError):
            COMPILED.lock_path(a, root, 1)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
