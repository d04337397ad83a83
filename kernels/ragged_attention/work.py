"""Work of a ragged attention launch, counted on the host from the kernel's own tiling."""

from typing import NamedTuple

import numpy as np

from .configs import SM90A, ragged_attention_blocks
from .segments import LENGTH, POS_START, build_query_tiles, segments_to_numpy


class RaggedWork(NamedTuple):
    """Work of one launch, counted on the host from the kernel's own tiling.

    Pairs are query-key pairs summed over q heads; tile pairs are (query tile, KV tile) visits
    summed over kv heads; bytes are read from the pool (K and V) and from ``req_to_token``.
    """

    query_tiles: int
    tile_pairs_visited: int
    tile_pairs_masked: int
    tile_pairs_needed: int
    tile_pairs_unskipped: int
    causal_pairs: int
    computed_pairs: int
    kv_bytes: int
    index_bytes: int
    num_queries: int

    @property
    def efficiency(self) -> float:
        """Causal query-key pairs over score elements computed (1.0 = no wasted score)."""
        return self.causal_pairs / self.computed_pairs if self.computed_pairs else 1.0

    @property
    def tile_efficiency(self) -> float:
        """Tile pairs a causal mask needs over tile pairs visited (1.0 = nothing skippable visited)."""
        return self.tile_pairs_needed / self.tile_pairs_visited if self.tile_pairs_visited else 1.0

    @property
    def kv_bytes_per_query(self) -> float:
        return self.kv_bytes / self.num_queries if self.num_queries else 0.0


def ragged_attention_work(
    segments,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    elem_bytes: int = 2,
    block_m: int | None = None,
    block_n: int | None = None,
    target: str = SM90A,
) -> RaggedWork:
    """Count the work of ``ragged_prefill_attention`` for ``segments`` without running it.

    Args:
        segments: ``[N, 4]`` rows ``(req_row, q_start, pos_start, length)`` (tensor or array).
        num_q_heads, num_kv_heads, head_dim: attention shape.
        elem_bytes: bytes per K/V element (2 for fp16/bf16).
        block_m, block_n: tiling; default: the pinned configuration of ``target`` (Hopper).
        target: the compile target whose pinned tiles are counted (``configs.TARGETS`` or
            ``"interpreter"``).

    Returns:
        ``RaggedWork``. ``tile_pairs_needed`` counts the (query tile, KV tile) pairs holding at least
        one query-key pair with key position <= query position, found by testing each pair;
        ``tile_pairs_unskipped`` is what a kernel without tile skipping would visit (every KV tile
        of the request up to its longest segment end).
    """
    segs = segments_to_numpy(segments)
    group = num_q_heads // num_kv_heads
    default = ragged_attention_blocks(head_dim, group, target)
    block_m = default.block_m if block_m is None else block_m
    block_n = default.block_n if block_n is None else block_n
    # Rows of the dots: block_m positions x group heads, padded to a power of two.
    dot_rows = 1 << (block_m * group - 1).bit_length()
    tiles = build_query_tiles(segs, block_m)
    first, length = tiles[:, POS_START], tiles[:, LENGTH]
    last = first + length - 1

    # The kernel's loop bounds.
    visited = last // block_n + 1
    masked = visited - (first + 1) // block_n
    # Independently: KV tile j is needed iff its first key is <= the tile's largest position.
    kv_tiles = np.arange(int(visited.max()) + 1 if len(tiles) else 0)
    needed = (kv_tiles[None, :] * block_n <= last[:, None]).sum(axis=1) if len(tiles) else visited
    live = segs[segs[:, LENGTH] > 0]
    row_end = {}
    for req_row, _, pos_start, length in live.tolist():
        row_end[req_row] = max(row_end.get(req_row, 0), pos_start + length)
    unskipped = -(-np.array([row_end[r] for r in tiles[:, 0].tolist()], dtype=np.int64) // block_n)

    # A query at position p attends to p + 1 keys.
    causal_per_head = int(((live[:, POS_START] + 1) * live[:, LENGTH] + live[:, LENGTH] * (live[:, LENGTH] - 1)
                           // 2).sum())
    # Each program loads the K and V rows of positions 0 .. last (masked loads stop at last).
    kv_rows = int((last + 1).sum()) * num_kv_heads
    return RaggedWork(
        query_tiles=len(tiles),
        tile_pairs_visited=int(visited.sum()) * num_kv_heads,
        tile_pairs_masked=int(masked.sum()) * num_kv_heads,
        tile_pairs_needed=int(needed.sum()) * num_kv_heads,
        tile_pairs_unskipped=int(unskipped.sum()) * num_kv_heads,
        causal_pairs=causal_per_head * num_q_heads,
        computed_pairs=int(visited.sum()) * num_kv_heads * dot_rows * block_n,
        kv_bytes=kv_rows * head_dim * elem_bytes * 2,
        index_bytes=kv_rows * 4,
        num_queries=int(live[:, LENGTH].sum()),
    )
