"""Host-side checks and query tiling shared by the ragged attention kernel and its reference.

A batch is described by segments, an int32 tensor ``[N, 4]`` whose rows are
``(req_row, q_start, pos_start, length)``: query rows ``q[q_start : q_start + length]`` hold the
absolute positions ``pos_start .. pos_start + length - 1`` of request row ``req_row`` of the
``req_to_token`` table. Segments must cover the query rows exactly once, and two segments of the
same request row must not share a position.
"""

import math

import numpy as np
import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Columns of a segment row and of a query-tile row (same layout: a tile is a piece of a segment).
REQ_ROW, Q_START, POS_START, LENGTH = range(4)


def segments_to_numpy(segments) -> np.ndarray:
    """Segments (tensor, array or nested list) as an int64 numpy array ``[N, 4]``."""
    if isinstance(segments, torch.Tensor):
        array = segments.detach().to("cpu", torch.int64).numpy()
    else:
        array = np.asarray(segments, dtype=np.int64)
    if array.size == 0:
        return np.zeros((0, 4), dtype=np.int64)
    if array.ndim != 2 or array.shape[1] != 4:
        raise ValueError(f"segments must have shape [N, 4], got {tuple(array.shape)}")
    return array


def check_segments(segs: np.ndarray, num_tokens: int, num_req_rows: int, max_len: int) -> None:
    """Raise ValueError unless ``segs`` (int64 ``[N, 4]``) is a valid cover of ``num_tokens`` query rows."""
    for name, column in (("length", LENGTH), ("q_start", Q_START), ("pos_start", POS_START)):
        bad = np.flatnonzero(segs[:, column] < 0)
        if bad.size:
            raise ValueError(f"segment {bad[0]}: negative {name} {segs[bad[0], column]}")
    live = segs[segs[:, LENGTH] > 0]
    live_index = np.flatnonzero(segs[:, LENGTH] > 0)
    bad = np.flatnonzero((live[:, REQ_ROW] < 0) | (live[:, REQ_ROW] >= num_req_rows))
    if bad.size:
        raise ValueError(
            f"segment {live_index[bad[0]]}: req_row {live[bad[0], REQ_ROW]} outside [0, {num_req_rows})"
        )
    q_end = live[:, Q_START] + live[:, LENGTH]
    bad = np.flatnonzero(q_end > num_tokens)
    if bad.size:
        raise ValueError(
            f"segment {live_index[bad[0]]}: query rows [{live[bad[0], Q_START]}, {q_end[bad[0]]}) "
            f"beyond q's {num_tokens} rows"
        )
    pos_end = live[:, POS_START] + live[:, LENGTH]
    bad = np.flatnonzero(pos_end > max_len)
    if bad.size:
        raise ValueError(
            f"segment {live_index[bad[0]]}: positions up to {pos_end[bad[0]] - 1} beyond "
            f"req_to_token's {max_len} columns"
        )

    order = np.argsort(live[:, Q_START], kind="stable")
    starts, ends = live[order, Q_START], q_end[order]
    overlap = np.flatnonzero(starts[1:] < ends[:-1])
    if overlap.size:
        first, second = live_index[order[overlap[0]]], live_index[order[overlap[0] + 1]]
        raise ValueError(f"segments {first} and {second} overlap in query rows")
    covered = int(live[:, LENGTH].sum())
    if covered != num_tokens:
        raise ValueError(f"segments cover {covered} query rows but q has {num_tokens}: each row needs one")

    order = np.lexsort((live[:, POS_START], live[:, REQ_ROW]))
    rows, starts, ends = live[order, REQ_ROW], live[order, POS_START], pos_end[order]
    overlap = np.flatnonzero((rows[1:] == rows[:-1]) & (starts[1:] < ends[:-1]))
    if overlap.size:
        first, second = live_index[order[overlap[0]]], live_index[order[overlap[0] + 1]]
        raise ValueError(
            f"segments {first} and {second} overlap in positions of request row {rows[overlap[0]]}"
        )


def check_ragged_inputs(q, k_buffer, v_buffer, req_to_token, segments, sm_scale):
    """Validate the arguments of ``ragged_prefill_attention`` the simple way (the reference's checks;
    they read the table's slots on the host, a sync on a GPU).

    Returns ``(segs, sm_scale)``: the segments as int64 numpy ``[N, 4]`` and the scale as a float.
    """
    sm_scale = check_layer_inputs(q, k_buffer, v_buffer, sm_scale)
    check_table(req_to_token, q.device)
    segs = host_segments(segments, q.device)
    num_req_rows, max_len = req_to_token.shape
    check_segments(segs, q.shape[0], num_req_rows, max_len)
    _check_slots(req_to_token, segs, k_buffer.shape[0])
    return segs, sm_scale


def check_layer_inputs(q, k_buffer, v_buffer, sm_scale) -> float:
    """Checks of one layer's ``q`` ``[T, Hq, D]`` and pool ``[S, Hkv, D]`` (types, dtypes,
    devices, shapes, strides) and of ``sm_scale``; no device sync. Returns the scale as a float."""
    tensors = {"q": q, "k_buffer": k_buffer, "v_buffer": v_buffer}
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 3:
            raise ValueError(f"{name} must be 3-D, got shape {tuple(tensor.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype {q.dtype} not supported; use one of {SUPPORTED_DTYPES}")
    for name in ("k_buffer", "v_buffer"):
        if tensors[name].dtype != q.dtype:
            raise ValueError(f"{name} dtype {tensors[name].dtype} differs from q dtype {q.dtype}")
        if tensors[name].device != q.device:
            raise ValueError(f"{name} is on {tensors[name].device} but q is on {q.device}")

    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads, kv_dim = k_buffer.shape[1:]
    if v_buffer.shape != k_buffer.shape:
        raise ValueError(f"v_buffer shape {tuple(v_buffer.shape)} != k_buffer shape {tuple(k_buffer.shape)}")
    if kv_dim != head_dim:
        raise ValueError(f"k_buffer head_dim {kv_dim} != q head_dim {head_dim}")
    if head_dim == 0 or num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"q heads ({num_q_heads}) must be a positive multiple of kv heads ({num_kv_heads})")
    if head_dim > 256:
        raise ValueError(f"head_dim {head_dim} is above the largest supported 256")
    for name, tensor in tensors.items():
        if tensor.stride(2) != 1:
            raise ValueError(f"{name} needs a unit stride on head_dim, got strides {tensor.stride()}")

    if sm_scale is None:
        sm_scale = head_dim**-0.5
    sm_scale = float(sm_scale)
    if not (math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a positive finite number, got {sm_scale}")
    return sm_scale


def check_table(req_to_token, device: torch.device | None = None) -> None:
    """Type, dtype, device and layout of ``req_to_token``: an int32 ``[R, max_len]`` tensor with unit
    column stride, on ``device`` (default: anywhere); no device sync."""
    if not isinstance(req_to_token, torch.Tensor):
        raise ValueError(f"req_to_token must be a torch.Tensor, got {type(req_to_token).__name__}")
    if req_to_token.dtype != torch.int32:
        raise ValueError(f"req_to_token must be int32, got {req_to_token.dtype}")
    if device is not None and req_to_token.device != device:
        raise ValueError(f"req_to_token is on {req_to_token.device}, not on {device} with the other inputs")
    if req_to_token.dim() != 2 or req_to_token.stride(1) != 1:
        raise ValueError(
            f"req_to_token must be 2-D with unit column stride, got shape {tuple(req_to_token.shape)} "
            f"strides {req_to_token.stride()}"
        )


def host_segments(segments, device: torch.device) -> np.ndarray:
    """``segments`` as int64 numpy ``[N, 4]``, checking their type and place.

    Host-side segments (a numpy integer array, nested lists, an int32 CPU tensor) cost nothing to
    read. An int32 tensor on ``device`` (the table's) is copied to the host: a device sync."""
    if isinstance(segments, torch.Tensor):
        if segments.dtype != torch.int32:
            raise ValueError(f"segments must be int32, got {segments.dtype}")
        if segments.device.type != "cpu" and segments.device != device:
            raise ValueError(f"segments are on {segments.device}, neither on the host nor on {device}")
        if segments.dim() != 2 or segments.shape[1] != 4:
            raise ValueError(f"segments must have shape [N, 4], got {tuple(segments.shape)}")
    elif isinstance(segments, np.ndarray) and segments.size and not np.issubdtype(segments.dtype, np.integer):
        raise ValueError(f"segments must hold integers, got {segments.dtype}")
    return segments_to_numpy(segments)


def _check_slots(req_to_token: torch.Tensor, segs: np.ndarray, num_slots: int) -> None:
    """Every slot a query can read (positions 0..last position of its row) must be in the pool.
    Reads only the batch's rows, on the host."""
    live = segs[segs[:, LENGTH] > 0]
    for row in np.unique(live[:, REQ_ROW]).tolist():
        need = int((live[live[:, REQ_ROW] == row, POS_START] + live[live[:, REQ_ROW] == row, LENGTH]).max())
        slots = req_to_token[row, :need].cpu()
        bad = torch.nonzero((slots < 0) | (slots >= num_slots))
        if bad.numel():
            pos = int(bad[0, 0])
            raise ValueError(
                f"req_to_token[{row}, {pos}] = {int(slots[pos])} is outside the pool's {num_slots} slots"
            )


def build_query_tiles(segs: np.ndarray, block_m: int) -> np.ndarray:
    """Cut every segment into query tiles aligned to absolute positions.

    Tile k of position block b holds the segment's positions in ``[b * block_m, (b + 1) * block_m)``,
    so a tile never spans two segments, and the query at position p always sits in row
    ``p % block_m`` of its tile, however the batch was cut (the first and last tiles of a segment
    may be partial). Returns int64 ``[n_tiles, 4]`` rows ``(req_row, q_start, pos_start, n_rows)``,
    the tiles with the largest last position first (they take longest, so they start first).
    """
    live = segs[segs[:, LENGTH] > 0]
    seg_start, seg_end = live[:, POS_START], live[:, POS_START] + live[:, LENGTH]
    first_block = seg_start // block_m
    tiles_per_seg = (seg_end - 1) // block_m - first_block + 1
    seg_of_tile = np.repeat(np.arange(len(live)), tiles_per_seg)
    first_tile = np.cumsum(tiles_per_seg) - tiles_per_seg
    block = first_block[seg_of_tile] + np.arange(len(seg_of_tile)) - first_tile[seg_of_tile]
    lo = np.maximum(seg_start[seg_of_tile], block * block_m)
    hi = np.minimum(seg_end[seg_of_tile], (block + 1) * block_m)
    tiles = np.empty((len(seg_of_tile), 4), dtype=np.int64)
    tiles[:, REQ_ROW] = live[seg_of_tile, REQ_ROW]
    tiles[:, Q_START] = live[seg_of_tile, Q_START] + lo - seg_start[seg_of_tile]
    tiles[:, POS_START] = lo
    tiles[:, LENGTH] = hi - lo
    return tiles[np.argsort(-(hi - 1), kind="stable")]
