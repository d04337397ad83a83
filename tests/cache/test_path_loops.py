"""The cache's inner loops: the compiled ones (`_path_loops.c`) against the Python reference
(`path_loops.py`), on the same trees and arrays, and a whole cache run on each."""
from __future__ import annotations

import hashlib
import random
import signal
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from cache_helpers import request_slots
from reference_cache import dump_real

from penelope.cache import path_loops
from penelope.cache.manager import KVCache
from penelope.cache.tree import PrefixHasher, RadixTree

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
        cache.tree.set_loops(loops)
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
        # The tree hands the compiled walk the token array itself, read in place.
        got_path, got_last = tree.walk(np.ascontiguousarray(probe), n_blocks)
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
    # The prefix hashes: numpy's vectorized form on the Python side, the compiled recurrence here.
    assert caches[0].tree.hasher._compiled is None and caches[1].tree.hasher._compiled is not None
    hashes = [sorted((n.start, n.tokens.tobytes(), n.hashes.tolist()) for n in c.tree.nodes()) for c in caches]
    assert hashes[0] == hashes[1]
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


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("policy", ["penelope", "sglang"])
def test_compiled_gathers_copy_what_the_python_gather_copies(block_size, policy):
    """Every node's root path (holes included: their NO_SLOT entries are copied too): the same
    int64 slots as numpy's concatenation, from both versions and from `RadixTree.path_slots`."""
    cache = grown_cache(block_size, policy, seed=block_size + 20)
    tree = cache.tree
    nodes = list(tree.nodes())
    assert len(nodes) > 10
    for node in nodes:
        path = tree.path_to_root(node)
        want = np.concatenate([n.slots for n in path], dtype=np.int64)
        for loops in (path_loops.PYTHON, COMPILED):
            out = np.full(len(want), -7, dtype=np.int64)
            loops.gather(path, out)
            assert np.array_equal(out, want)
        assert np.array_equal(tree.path_slots(path), want)
    assert len(tree.path_slots([])) == 0


def test_gathers_refuse_an_out_of_the_wrong_length_or_type():
    tree = grown_cache(4, "sglang", seed=2).tree
    path = tree.path_to_root(max(tree.nodes(), key=lambda n: n.end))
    total = path[-1].end
    for loops in (path_loops.PYTHON, COMPILED):
        with pytest.raises(ValueError, match="shorter"):
            loops.gather(path, np.empty(total - 1, dtype=np.int64))
        with pytest.raises(ValueError, match="longer"):
            loops.gather(path, np.empty(total + 1, dtype=np.int64))
    for bad in (np.empty(total, dtype=np.int32), np.empty(total, dtype=np.float64), np.empty((total, 1), np.int64),
                np.empty(2 * total, dtype=np.int64)[::2], list(range(total))):
        with pytest.raises(TypeError):
            COMPILED.gather(path, bad)
    read_only = np.empty(total, dtype=np.int64)
    read_only.flags.writeable = False
    with pytest.raises(TypeError, match="writable"):
        COMPILED.gather(path, read_only)


@pytest.mark.parametrize("block_size", [1, 3, 64])
def test_compiled_prefix_hashes_follow_the_recurrence(block_size):
    """Token ids over the whole int64 range (negatives read as unsigned), bases at both ends of
    uint64, runs of 1 to 40 blocks: the compiled recurrence, the Python reference and the
    hasher's numpy form (short and long runs) give the same hashes."""
    rng = np.random.default_rng(block_size)
    numpy_form = PrefixHasher(block_size)
    compiled_form = PrefixHasher(block_size, COMPILED.prefix_hashes)
    mix, radix = numpy_form._mix, PrefixHasher._RADIX
    for base in (0, 1, 2**64 - 1, int(rng.integers(0, 2**63))):
        for k in (1, 2, 16, 17, 40):
            tokens = rng.integers(-2**63, 2**63 - 1, k * block_size, dtype=np.int64, endpoint=True)
            want = np.empty(k, dtype=np.uint64)
            path_loops.PYTHON.prefix_hashes(base, tokens, mix, radix, want)
            got = np.empty(k, dtype=np.uint64)
            COMPILED.prefix_hashes(base, tokens, mix, radix, got)
            assert got.tolist() == want.tolist()
            assert numpy_form.extend(base, 5, tokens).tolist() == want.tolist()
            assert compiled_form.extend(base, 5, tokens).tolist() == want.tolist()
    with pytest.raises(ValueError, match="blocks"):
        COMPILED.prefix_hashes(0, np.zeros(block_size + 1, dtype=np.int64), mix, radix, np.empty(1, np.uint64))
    with pytest.raises(OverflowError):
        COMPILED.prefix_hashes(-1, np.zeros(block_size, dtype=np.int64), mix, radix, np.empty(1, np.uint64))


def test_the_tree_hashes_with_the_compiled_recurrence():
    assert RadixTree(4).hasher._compiled is COMPILED.prefix_hashes
    assert RadixTree(4, loops=path_loops.PYTHON).hasher._compiled is None


def planted_pages(rng, end: int, problem: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pages, held flags, listed ids) whose first problem (`path_loops.page_problem`'s order) is
    `problem` (0: none); problems later in the order are planted too, to test the order."""
    held = np.zeros(end, dtype=bool)
    free_ids = rng.permutation(np.arange(1, end))
    pages = free_ids[:rng.integers(1, 30)].astype(np.int64)
    others = free_ids[len(pages):]
    held[others[:10]] = True
    listed = others[10:40].astype(np.int64)
    if problem <= path_loops.LISTED and problem:
        listed = np.append(listed, pages[rng.integers(0, len(pages))])
    if problem <= path_loops.TWICE and problem:
        pages = np.insert(pages, rng.integers(0, len(pages) + 1), pages[rng.integers(0, len(pages))])
    if problem <= path_loops.HELD and problem:
        held[pages[rng.integers(0, len(pages))]] = True
    if problem == path_loops.OUTSIDE:
        pages[rng.integers(0, len(pages))] = rng.choice([0, -3, end, end + 100])
    return pages, held, listed


def test_compiled_page_checks_find_the_first_problem_the_python_ones_find():
    rng = np.random.default_rng(0)
    end = 500
    for trial in range(400):
        problem = trial % 5
        pages, held, listed = planted_pages(rng, end, problem)
        for with_list in (True, False):
            listed_or_none = listed if with_list else None
            want = path_loops.PYTHON.page_problem(pages, end, held, listed_or_none, None)
            scratch = np.zeros(end, dtype=np.uint8)
            got = COMPILED.page_problem(pages, end, held, listed_or_none, scratch)
            assert got == want
            assert want == (problem if with_list or problem != path_loops.LISTED else 0)
            assert not scratch.any()


def test_compiled_page_checks_refuse_scratch_that_does_not_cover_the_pool():
    pages = np.array([1, 2], dtype=np.int64)
    with pytest.raises(ValueError, match="cover"):
        COMPILED.page_problem(pages, 10, np.zeros(10, bool), None, np.zeros(5, np.uint8))
    with pytest.raises(TypeError):
        COMPILED.page_problem(pages.astype(np.int32), 10, np.zeros(10, bool), None, np.zeros(10, np.uint8))
    # Listed ids outside the scratch (another allocator's bookkeeping) cannot match a page.
    listed = np.array([-1, 10_000], dtype=np.int64)
    assert COMPILED.page_problem(pages, 10, np.zeros(10, bool), listed, np.zeros(10, np.uint8)) == 0


def obvious_whole_pages(slots, page: int):
    """The page ids of `slots` if they are whole pages in order, else None: slot by slot, on
    Python ints."""
    values = [int(v) for v in slots]
    if len(values) % page:
        return None
    pages = []
    for start in range(0, len(values), page):
        first = values[start]
        if first % page or values[start:start + page] != list(range(first, first + page)):
            return None
        pages.append(first // page)
    return pages


def planted_slots(rng, page: int, flaw: str) -> np.ndarray:
    """Whole pages of `page` slots in order, then `flaw`: none, a swapped pair, the last page
    shifted off a multiple of `page`, a slot short, or the last slot one page up (at page 1 every
    array is whole pages)."""
    pages = rng.permutation(np.arange(-3, 200))[:rng.integers(1, 12)].astype(np.int64)
    slots = (pages[:, None] * page + np.arange(page)).ravel()
    if flaw == "swapped" and page > 1:
        i = rng.integers(0, len(slots) - 1)
        j = i + 1 if (i + 1) % page else i - 1
        slots[[i, j]] = slots[[j, i]]
    elif flaw == "shifted":
        slots[-page:] += rng.integers(1, page + 1)
    elif flaw == "short":
        slots = slots[:-1]
    elif flaw == "torn":
        slots[-1] += page
    return slots


@pytest.mark.parametrize("page", [1, 2, 16, 64])
def test_compiled_whole_page_checks_find_what_slot_by_slot_reading_finds(page):
    rng = np.random.default_rng(page)
    seen = set()
    for trial in range(300):
        flaw = ["none", "swapped", "shifted", "short", "torn"][trial % 5]
        slots = planted_slots(rng, page, flaw)
        want = obvious_whole_pages(slots, page)
        seen.add(want is None)
        for loops in (path_loops.PYTHON, COMPILED):
            out = np.full(len(slots) // page, -99, dtype=np.int64)
            got = loops.whole_pages(slots, page, out)
            assert got == (want is not None), (loops.name, flaw, slots)
            if got:
                assert out.tolist() == want
    assert seen == ({True, False} if page > 1 else {False})


def test_whole_page_checks_at_the_int64_limit_and_with_bad_arguments():
    page = 4
    top = np.iinfo(np.int64).max // page * page
    near_top = np.array([top, top + 1, top + 2, top + 3], dtype=np.int64)
    low = np.iinfo(np.int64).min
    # Page 3 from INT64_MAX - 1: its third slot would be INT64_MAX + 1, which wraps to INT64_MIN.
    wrapping = np.array([np.iinfo(np.int64).max - 1, np.iinfo(np.int64).max, low], dtype=np.int64)
    assert obvious_whole_pages(wrapping, 3) is None
    for loops in (path_loops.PYTHON, COMPILED):
        out = np.zeros(1, dtype=np.int64)
        assert loops.whole_pages(near_top, page, out) and out[0] == top // page
        assert not loops.whole_pages(np.array([1, 2, 3, 4], dtype=np.int64), page, out)
        assert not loops.whole_pages(wrapping, 3, out), loops.name
        low_page = np.array([low, low + 1, low + 2, low + 3], dtype=np.int64)
        assert loops.whole_pages(low_page, page, out) and out[0] == low // page
        with pytest.raises(ValueError, match="positive"):
            loops.whole_pages(near_top, 0, out)
        with pytest.raises(ValueError, match="one page id per page"):
            loops.whole_pages(near_top, page, np.zeros(2, dtype=np.int64))
    with pytest.raises(TypeError):
        COMPILED.whole_pages(near_top.astype(np.int32), page, np.zeros(1, dtype=np.int64))
    with pytest.raises(TypeError):
        COMPILED.whole_pages(near_top, page, np.zeros(1, dtype=np.int32))


def test_the_tree_walks_strided_token_arrays():
    """The compiled walk reads contiguous memory: the tree hands it a contiguous copy of a strided
    array, with the same result."""
    tree = grown_cache(4, "sglang", seed=9).tree
    node = max(tree.nodes(), key=lambda n: n.end)
    full = np.concatenate([n.tokens for n in tree.path_to_root(node)])
    strided = np.repeat(full, 2)[::2]
    assert not strided.flags.c_contiguous
    path, last = tree.walk(strided, len(full) // 4)
    assert path[-1] is node and last == node.n_blocks


def test_a_stale_build_falls_back_to_the_python_loops_with_a_warning(monkeypatch):
    """An extension built from an older source lacks some loops: the Python ones run, and the
    warning says to rerun the install."""
    stale = types.SimpleNamespace(walk=COMPILED.walk, lock_path=COMPILED.lock_path, stamp=COMPILED.stamp,
                                  SOURCE_SHA256="0" * 64)
    monkeypatch.setattr(path_loops.importlib, "import_module", lambda name: stale)
    with pytest.warns(RuntimeWarning, match="stale .*gather, prefix_hashes, page_problem.*install"):
        assert path_loops.compiled() is None
    with pytest.warns(RuntimeWarning):
        assert RadixTree(4).loops.name == "python"


def test_a_gather_whose_node_resizes_out_raises_instead_of_writing_freed_memory():
    out = np.zeros(1 << 16, dtype=np.int64)

    class Resizing:
        @property
        def slots(self):
            out.resize(0, refcheck=False)
            return np.arange(1 << 16, dtype=np.int32)

    with pytest.raises(ValueError, match="shorter"):
        COMPILED.gather([Resizing()], out)
