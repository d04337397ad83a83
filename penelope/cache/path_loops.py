"""The radix tree's per-node loops: the walk down a root path, the lock count along a root path,
the recency stamp of a path, the gather of a path's slots; and two loops over a request's blocks
and pages: the prefix hashes of a run of blocks, and the checks of the pages a tree takes.

These run several times per request over every node of its path (one node per turn of an agent's
history) or every block it adds, so their cost per node is the tree's cost per request. The Python
functions here are the reference; `_path_loops.c` is the same functions compiled, built by the
package's install where a C compiler is found. `RadixTree` takes the compiled ones when they were built
(`best()`); its `loops.name` says which it runs, and tests run both on the same trees.
"""
from __future__ import annotations

import importlib
import warnings
from types import SimpleNamespace

import numpy as np


def walk(root, raw: bytes, block_bytes: int) -> tuple[list, int]:
    """Follow `raw` (whole blocks of int64 tokens, as bytes; the compiled walk also takes a
    C-contiguous int64 array, read in place) down from `root` through nodes of any state.
    Returns the nodes of the path and the number of blocks matched in the last one (it may be
    less than that node's length; every earlier node matches fully)."""
    # Children are found by their first block's bytes, and a whole node matches when `raw`
    # continues with its key (`startswith` at an offset compares in place, without slicing).
    end = len(raw)
    children, pos, path = root.children, 0, []
    while pos < end:
        child = children.get(raw[pos:pos + block_bytes])
        if child is None:
            break
        key = child.key
        if raw.startswith(key, pos):
            # The whole node matches: the common case.
            path.append(child)
            pos += len(key)
            children = child.children
            continue
        # The walk stops inside this node: at the first block holding a differing token, or where
        # the tokens end.
        n = min(len(key), end - pos)
        if raw[pos:pos + n] != key[:n]:
            ours = np.frombuffer(key, dtype=np.int64, count=n // 8)
            theirs = np.frombuffer(raw, dtype=np.int64, count=n // 8, offset=pos)
            n = int(np.flatnonzero(ours != theirs)[0]) * 8 // block_bytes * block_bytes
        path.append(child)
        return path, n // block_bytes
    return path, path[-1].n_blocks if path else 0


def lock_path(node, root, delta: int) -> tuple[int, int]:
    """Add `delta` (+1 or -1) to `lock_ref` on the root path of `node` (the root excluded).
    Returns the GPU blocks and the resident blocks of the nodes whose lock state changed (a count
    that reached 1 when locking, 0 when unlocking)."""
    edge = 1 if delta > 0 else 0
    gpu = resident = 0
    while node is not root:
        node.lock_ref += delta
        if node.lock_ref == edge:
            gpu += node.n_gpu
            resident += node.n_resident
        node = node.parent
    return gpu, resident


def stamp(path: list, clock: int) -> None:
    """Set `last_access` of every node of `path` to `clock`."""
    for node in path:
        node.last_access = clock


def gather(path: list, out: np.ndarray) -> None:
    """The nodes' slots (int32), one node after the other, into `out` (int64), whose length must
    be their total."""
    pos = 0
    for node in path:
        n = len(node.slots)
        if pos + n > len(out):
            raise ValueError("out is shorter than the path's slots")
        out[pos:pos + n] = node.slots
        pos += n
    if pos != len(out):
        raise ValueError("out is longer than the path's slots")


# Prefix hashes are computed modulo 2**64.
MASK64 = (1 << 64) - 1


def prefix_hashes(base: int, tokens: np.ndarray, mix: np.ndarray, radix: int, out: np.ndarray) -> None:
    """The prefix hash after each block of `tokens` (int64, `len(out)` blocks of `len(mix)`
    tokens) into `out` (uint64): H_i = H_{i-1} * radix + d_i + 1 (mod 2**64) from H_{-1} = `base`,
    where d_i = sum_j tokens[i * bs + j] * mix[j] (mod 2**64), tokens read as unsigned."""
    bs, k = len(mix), len(out)
    if bs == 0 or len(tokens) != k * bs:
        raise ValueError("tokens must hold len(out) blocks of len(mix) tokens")
    weights = [int(m) for m in mix]
    values = tokens.tolist()
    for i in range(k):
        digest = sum((values[i * bs + j] & MASK64) * weights[j] for j in range(bs)) & MASK64
        base = (base * radix + digest + 1) & MASK64
        out[i] = base


# What `page_problem` finds, in the order it checks.
OUTSIDE, HELD, TWICE, LISTED = 1, 2, 3, 4


def page_problem(pages: np.ndarray, end: int, held: np.ndarray, listed: np.ndarray | None,
                 scratch: np.ndarray) -> int:
    """0 if `pages` (int64 page ids) pass every check, else the first they fail, in this order:
    OUTSIDE (a page outside [1, `end`)), HELD (a page flagged in `held`, bool per page id), TWICE
    (a page passed twice), LISTED (a page in `listed`, int64 page ids, when not None). `scratch`
    (the compiled version's marks, one byte per page id) is not used here."""
    if not len(pages):
        return 0
    if int(pages.min()) < 1 or int(pages.max()) >= end:
        return OUTSIDE
    if held[pages].any():
        return HELD
    if len(np.unique(pages)) < len(pages):
        return TWICE
    if listed is not None and np.isin(pages, listed).any():
        return LISTED
    return 0


def whole_pages(slots: np.ndarray, page: int, out: np.ndarray) -> bool:
    """Whether int64 `slots` are whole pages of `page` slots, each page's slots in order (a
    multiple of `page`, then the slots after it); if so `out` (int64, one per page) receives the
    page ids (a page's first slot // `page`). False, `out` unspecified, otherwise (a length that is
    not a multiple of `page` included). The reference of the compiled version for 1-D int64
    arrays, which is all the compiled one takes."""
    if page <= 0:
        raise ValueError("page must be positive")
    if len(slots) % page:
        return False
    if len(out) != len(slots) // page:
        raise ValueError("out must hold one page id per page")
    rows = slots.reshape(-1, page)
    first = rows[:, 0]
    offsets = np.arange(page, dtype=np.int64)
    # A page whose slots would pass the largest int64 is not one (its sums below would wrap).
    if np.count_nonzero(first > np.iinfo(np.int64).max - (page - 1)):
        return False
    if np.count_nonzero(first % page) or np.count_nonzero(rows != first[:, None] + offsets):
        return False
    out[:] = first // page
    return True


_FUNCTIONS = ("walk", "lock_path", "stamp", "gather", "prefix_hashes", "page_problem", "whole_pages")
PYTHON = SimpleNamespace(name="python", walk=walk, lock_path=lock_path, stamp=stamp, gather=gather,
                         prefix_hashes=prefix_hashes, page_problem=page_problem, whole_pages=whole_pages)


def compiled() -> SimpleNamespace | None:
    """The compiled loops, or None where the install built no `_path_loops` extension. Its
    `source_sha256` is the SHA-256 of the C source it was built from."""
    try:
        module = importlib.import_module("penelope.cache._path_loops")
    except ImportError:
        return None
    missing = [name for name in _FUNCTIONS if not hasattr(module, name)]
    if missing:
        # Built from an older source (an install not rerun after an update): its loops would not
        # match this code. The Python ones run instead; the install rebuilds it.
        warnings.warn(f"penelope: the compiled cache loops are stale (no {', '.join(missing)}): running the "
                      "Python ones; rerun the install (scripts/install.sh) to rebuild them", RuntimeWarning,
                      stacklevel=2)
        return None
    return SimpleNamespace(name="compiled", **{name: getattr(module, name) for name in _FUNCTIONS},
                           source_sha256=module.SOURCE_SHA256)


def best() -> SimpleNamespace:
    """The compiled loops where they were built, else the Python ones."""
    return compiled() or PYTHON
