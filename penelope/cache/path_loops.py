"""The radix tree's per-node loops: the walk down a root path, the lock count along a root path,
and the recency stamp of a path.

These run several times per request over every node of its path (one node per turn of an agent's
history), so their cost per node is the tree's cost per request. The Python functions here are
the reference; `_path_loops.c` is the same three functions compiled, built by the package's
install where a C compiler is found. `RadixTree` takes the compiled ones when they were built
(`best()`); its `loops.name` says which it runs, and tests run both on the same trees.
"""
from __future__ import annotations

import importlib
from types import SimpleNamespace

import numpy as np


def walk(root, raw: bytes, block_bytes: int) -> tuple[list, int]:
    """Follow `raw` (whole blocks of int64 tokens, as bytes) down from `root` through nodes of any
    state. Returns the nodes of the path and the number of blocks matched in the last one (it may
    be less than that node's length; every earlier node matches fully)."""
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


PYTHON = SimpleNamespace(name="python", walk=walk, lock_path=lock_path, stamp=stamp)


def compiled() -> SimpleNamespace | None:
    """The compiled loops, or None where the install built no `_path_loops` extension. Its
    `source_sha256` is the SHA-256 of the C source it was built from."""
    try:
        module = importlib.import_module("penelope.cache._path_loops")
    except ImportError:
        return None
    return SimpleNamespace(name="compiled", walk=module.walk, lock_path=module.lock_path, stamp=module.stamp,
                           source_sha256=module.SOURCE_SHA256)


def best() -> SimpleNamespace:
    """The compiled loops where they were built, else the Python ones."""
    return compiled() or PYTHON
