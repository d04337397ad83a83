"""Torch fp32 reference for ragged-position prefill attention, with an explicit position mask.

The masked scores are ``penelope.engine.attention.masked_scores``, the causal mask by absolute
position that every torch attention of the project uses (that module imports torch only).
"""

import torch

from penelope.engine.attention import masked_scores

from .segments import check_ragged_inputs

# Queries per chunk: bounds the [Hq, chunk, keys] score matrix of long segments.
_QUERY_CHUNK = 512


def naive_ragged_prefill_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    segments: torch.Tensor,
    sm_scale: float | None = None,
    return_lse: bool = False,
):
    """Reference of ``ragged_prefill_attention``: same arguments, same validation, fp32 math.

    Args:
        q: ``[T, Hq, D]`` queries.
        k_buffer, v_buffer: ``[S, Hkv, D]`` token-indexed KV pool of one layer.
        req_to_token: int32 ``[R, max_len]``, pool slot of (request row, absolute position).
        segments: int32 ``[N, 4]`` rows ``(req_row, q_start, pos_start, length)``.
        sm_scale: softmax scale, default ``D ** -0.5``.
        return_lse: also return the natural-log log-sum-exp of the scaled scores.

    Returns:
        ``o`` ``[T, Hq, D]`` in q's dtype, and ``lse`` ``[T, Hq]`` fp32 when ``return_lse``.
    """
    segs, sm_scale = check_ragged_inputs(q, k_buffer, v_buffer, req_to_token, segments, sm_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // k_buffer.shape[1]
    out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_tokens, num_q_heads, dtype=torch.float32, device=q.device)

    for req_row, q_start, pos_start, length in segs.tolist():
        for chunk in range(0, length, _QUERY_CHUNK):
            rows = min(_QUERY_CHUNK, length - chunk)
            first_pos = pos_start + chunk
            num_keys = first_pos + rows
            slots = req_to_token[req_row, :num_keys].long()
            keys = k_buffer[slots].float().repeat_interleave(group, dim=1)  # [keys, Hq, D]
            values = v_buffer[slots].float().repeat_interleave(group, dim=1)
            queries = q[q_start + chunk : q_start + chunk + rows].float()  # [rows, Hq, D]

            q_pos = torch.arange(first_pos, first_pos + rows, device=q.device)
            scores = masked_scores(queries, keys, q_pos, sm_scale)  # [Hq, rows, keys]
            chunk_lse = torch.logsumexp(scores, dim=-1)  # [Hq, rows]
            probs = torch.exp(scores - chunk_lse[..., None])
            rows_slice = slice(q_start + chunk, q_start + chunk + rows)
            out[rows_slice] = torch.einsum("hqk,khd->qhd", probs, values)
            lse[rows_slice] = chunk_lse.transpose(0, 1)

    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def naive_store_kv(k_buffer, v_buffer, slots, k, v) -> None:
    """Reference of ``store_kv``: ``k_buffer[slots] = k`` and ``v_buffer[slots] = v`` in place."""
    k_buffer[slots.long()] = k
    v_buffer[slots.long()] = v
