"""Attention backends of the reference engine, selected by name, and the torch attention they share.

Each layer of the decoder first stores the batch's K/V into the pool (`store_kv`), then runs
ragged prefill attention over all segments (`attend`), reading every key through
`req_to_token`. Both backends have the same contract as `penelope.kernels.ragged_attention`:

- "naive": an indexed copy into the pool and `aligned_ragged_attention`, a torch fp32 path
  that, like the kernel, tiles queries at absolute positions, so it is batch-invariant;
- "triton": the kernel package's `store_kv` and `ragged_prefill_attention`, with one
  `plan_store_kv` and one `plan_ragged_prefill` per forward batch, made from the batch's HOST-side
  slots and segments: the checks and query tiles are done once, uploads are non-blocking, and no
  layer waits for the GPU.

Why not the kernel package's `naive_ragged_prefill_attention`: it is the kernel's reference for
values, but it cuts queries per segment, so a query's rounding depends on the segment it sits
in; the deterministic engine needs results that depend only on the query's own position and
keys. The kernel package is imported when the "triton" backend is first called, not when this
module is, so the engine imports and runs ("naive" or a custom backend) without the kernels.

The torch pieces every torch attention of the project is built from live here, for the same
reason (this module imports torch only): the causal mask by absolute position (`visible_keys`,
`masked_scores`, also used by the kernel's reference) and the query tiles aligned to absolute
positions (`aligned_tiles`). `tiled_sdpa_attention` is a third torch path, a fast stand-in for the
kernel on the CPU (see its docstring).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from penelope.errors import UsageError

_KERNEL_MODULE = "penelope.kernels.ragged_attention"

StoreFn = Callable[..., None]
AttendFn = Callable[..., torch.Tensor]
PlanFn = Callable[..., object]


@dataclass(frozen=True)
class AttentionBackend:
    """A pair of functions with the kernel package's signatures.

    `store_kv(k_buffer, v_buffer, slots, k, v)`: write `k`, `v` `[T, Hkv, D]` into rows `slots`
    (int64 `[T]`) of the pool buffers `[S, Hkv, D]`, in place.
    `attend(q, k_buffer, v_buffer, req_to_token, segments, sm_scale=None) -> o`: `q` `[T, Hq, D]`,
    `req_to_token` int32 `[R, max_len]`, `segments` int32 `[N, 4]` rows
    `(req_row, q_start, pos_start, length)`; returns `o` `[T, Hq, D]` where the query at absolute
    position p attends to the keys at positions 0..p of its request, read from the pool.
    `plan(req_to_token, segments, *, num_tokens, num_slots, num_q_heads, num_kv_heads, head_dim, dtype)`
    (optional): the per-batch work of `attend`, done once per forward batch; its result goes to
    every layer's `attend` as `plan=`.
    `plan_store(slots, num_slots, device)` (optional): the per-batch work of `store_kv` from host
    slots; its result `p` goes to every layer's `store_kv` as `plan=p`, with `p.slots` as slots.
    """

    name: str
    store_kv: StoreFn
    attend: AttendFn
    plan: PlanFn | None = None
    plan_store: PlanFn | None = None

    def attend_kwargs(self, req_to_token: torch.Tensor, segments: torch.Tensor, **shape: int) -> dict:
        """Extra keyword arguments of `attend` for every layer of one batch: `{"plan": ...}`,
        planned here once, or none. `shape`: `num_tokens`, `num_slots`, `num_q_heads`,
        `num_kv_heads`, `head_dim`, `dtype`, as `plan` takes them."""
        if self.plan is None:
            return {}
        return {"plan": self.plan(req_to_token, segments, **shape)}

    def store_args(self, slots: torch.Tensor, num_slots: int, device: torch.device) -> tuple[torch.Tensor, dict]:
        """The slots every layer's `store_kv` takes for the host slots `slots` (int64 `[T]`), on
        `device`, and extra keyword arguments (`{"plan": ...}` when the backend plans stores)."""
        if self.plan_store is None:
            return to_device(slots, device), {}
        plan = self.plan_store(slots, num_slots, device)
        return plan.slots, {"plan": plan}


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without making the host wait: pinned, non-blocking on CUDA."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _kernel_function(name: str) -> Callable:
    try:
        module = importlib.import_module(_KERNEL_MODULE)
    except ImportError as exc:
        raise ImportError(f"attention backend needs {_KERNEL_MODULE}, which failed to import: {exc}") from exc
    try:
        return getattr(module, name)
    except AttributeError:
        raise ImportError(f"{_KERNEL_MODULE} does not provide {name!r}") from None


def torch_store_kv(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Indexed copy of `k`, `v` `[T, Hkv, D]` into rows `slots` (int64 `[T]`) of the buffers."""
    k_buffer.index_copy_(0, slots, k.to(k_buffer.dtype))
    v_buffer.index_copy_(0, slots, v.to(v_buffer.dtype))


def visible_keys(q_pos: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Causal mask by absolute position: bool `[rows, num_keys]`, True where the key at position k
    is visible to the query at position `q_pos[row]` (k <= that position)."""
    return torch.arange(num_keys, device=q_pos.device)[None, :] <= q_pos[:, None]


def masked_scores(queries: torch.Tensor, keys: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Scaled scores `[Hq, rows, K]` of `queries` `[rows, Hq, D]` at absolute positions `q_pos`
    `[rows]` against `keys` `[K, Hq, D]` at positions `0 .. K - 1`; -inf where a key comes after
    its query (in the dtype of the inputs: fp32 in the references)."""
    scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
    return scores.masked_fill(~visible_keys(q_pos, keys.shape[0])[None], float("-inf"))


def aligned_tiles(pos_start: int, length: int, tile: int) -> Iterator[tuple[int, int, int]]:
    """The query tiles of the segment at positions `pos_start .. pos_start + length - 1`, cut at
    multiples of `tile` as the kernel cuts its own: `(tile_start, first, last)`, the segment's
    positions `[first, last)` inside `[tile_start, tile_start + tile)`."""
    end = pos_start + length
    for tile_start in range(pos_start - pos_start % tile, end, tile):
        yield tile_start, max(tile_start, pos_start), min(tile_start + tile, end)


# Absolute positions per query tile of `aligned_ragged_attention`.
ALIGNED_TILE = 64


def aligned_ragged_attention(q, k_buffer, v_buffer, req_to_token, segments, sm_scale=None) -> torch.Tensor:
    """Ragged prefill attention in torch fp32, bitwise independent of how the batch is cut.

    Arguments as `penelope.kernels.ragged_attention.ragged_prefill_attention` (q `[T, Hq, D]`,
    pools `[S, Hkv, D]`, `req_to_token` int32 `[R, max_len]`, `segments` int32 `[N, 4]`, `sm_scale`
    a float or None for `D ** -0.5`); returns `o` `[T, Hq, D]` in q's dtype. The caller guarantees
    valid segments and slots (`EngineBatch.build` checks them).

    Queries are processed in tiles of `ALIGNED_TILE` absolute positions, padded to the full
    tile, against the keys at positions `0 .. tile end - 1` (keys past the segment's last
    position are zero rows, masked like every key after the query). Every tensor's shape thus
    depends only on the tile index, and masked keys add exact zeros, so a query's output depends
    only on its request's keys up to its position: not on the segment or batch around it.
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    group = num_q_heads // k_buffer.shape[1]
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)
    for req_row, q_start, pos_start, length in segments.tolist():
        for tile_start, lo, hi in aligned_tiles(pos_start, length, ALIGNED_TILE):
            tile_end = tile_start + ALIGNED_TILE
            rows = slice(q_start + lo - pos_start, q_start + hi - pos_start)
            queries = torch.zeros(ALIGNED_TILE, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
            queries[lo - tile_start : hi - tile_start] = q[rows].float()
            keys = torch.zeros(tile_end, *k_buffer.shape[1:], dtype=torch.float32, device=q.device)
            values = torch.zeros_like(keys)
            slots = req_to_token[req_row, :hi].long()
            keys[:hi], values[:hi] = k_buffer[slots].float(), v_buffer[slots].float()
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
            q_pos = torch.arange(tile_start, tile_end, device=q.device)
            scores = masked_scores(queries, keys, q_pos, scale)  # [Hq, TILE, tile_end]
            tile_out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values)
            out[rows] = tile_out[lo - tile_start : hi - tile_start]
    return out.to(q.dtype)


# Absolute positions per query tile of `tiled_sdpa_attention`.
SDPA_TILE = 128


def tiled_sdpa_attention(q, k_buffer, v_buffer, req_to_token, segments, sm_scale=None, tile: int = SDPA_TILE):
    """Ragged prefill attention with torch's fused attention, one call per query tile.

    Arguments and result as `aligned_ragged_attention` (`segments` may be any integer `[N, 4]`),
    in q's dtype; `tile`: absolute positions per query tile.

    Why a third torch path: it stands in for the Triton kernel where the kernel is too slow to
    time (interpreted on the CPU: the cost curve's CPU replica, `microbench/bench_cost_curve.py`),
    so its cost must scale like the kernel's work. Query tiles are aligned to absolute positions
    like the kernel's, and a tile at positions `[first, last)` reads only keys `[0, last)`: the
    work is the causal triangle plus at most one tile of masked keys per query. The q heads of a
    kv head are stacked into the rows of one call, so K/V are shared by the group without being
    copied. `aligned_ragged_attention` pads every tile and gathers keys per tile (for bitwise
    batch invariance) and the kernel's reference computes per-segment rectangles; timing either
    would measure its own overheads rather than attention. Not batch-invariant: use it to time,
    not as a reference.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    out = torch.empty_like(q)
    for req_row, q_start, pos_start, length in torch.as_tensor(segments).tolist():
        if length == 0:
            continue
        slots = req_to_token[req_row, : pos_start + length].long()
        keys = k_buffer.index_select(0, slots).transpose(0, 1).contiguous().unsqueeze(0)  # [1, Hkv, end, D]
        values = v_buffer.index_select(0, slots).transpose(0, 1).contiguous().unsqueeze(0)
        for _, first, last in aligned_tiles(pos_start, length, tile):
            rows = last - first
            row0 = q_start + first - pos_start
            # [rows, Hq, D] -> [1, Hkv, group * rows, D]: row g * rows + i is q head (kv, g) at first + i.
            queries = q[row0 : row0 + rows].reshape(rows, num_kv_heads, group, head_dim)
            queries = queries.permute(1, 2, 0, 3).reshape(1, num_kv_heads, group * rows, head_dim)
            q_pos = torch.arange(first, last, device=q.device).repeat(group)
            tile_out = F.scaled_dot_product_attention(
                queries, keys[:, :, :last], values[:, :, :last], attn_mask=visible_keys(q_pos, last), scale=scale
            )
            tile_out = tile_out.reshape(num_kv_heads, group, rows, head_dim).permute(2, 0, 1, 3)
            out[row0 : row0 + rows] = tile_out.reshape(rows, num_q_heads, head_dim)
    return out


def _triton_store_kv(k_buffer, v_buffer, slots, k, v, plan=None):
    _kernel_function("store_kv")(k_buffer, v_buffer, slots, k, v, plan=plan)


def _triton_plan_store(slots, num_slots, device):
    return _kernel_function("plan_store_kv")(slots, num_slots, device)


def _triton_plan(req_to_token, segments, **shape):
    return _kernel_function("plan_ragged_prefill")(req_to_token, segments, **shape)


def _triton_attend(q, k_buffer, v_buffer, req_to_token, segments, sm_scale=None, plan=None):
    fn = _kernel_function("ragged_prefill_attention")
    return fn(q, k_buffer, v_buffer, req_to_token, segments, sm_scale=sm_scale, plan=plan)


ATTENTION_BACKENDS: dict[str, AttentionBackend] = {
    "naive": AttentionBackend("naive", torch_store_kv, aligned_ragged_attention),
    "triton": AttentionBackend("triton", _triton_store_kv, _triton_attend, _triton_plan, _triton_plan_store),
}


def get_attention_backend(backend: str | AttentionBackend) -> AttentionBackend:
    """The backend called `backend` ("naive" or "triton"), or `backend` itself."""
    if isinstance(backend, AttentionBackend):
        return backend
    if backend not in ATTENTION_BACKENDS:
        raise UsageError(f"unknown attention backend {backend!r}; choose from {sorted(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[backend]
