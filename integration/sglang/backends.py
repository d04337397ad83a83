"""Which SGLang attention backends phantoms may ride with (``penelope.cache.refill`` phantoms).

A phantom refills a hole in the SAME forward as its request, so the request's queries read the
hole's K/V in the layer that wrote it. That holds only on backends whose every layer stores the
batch's K/V into the pool before it attends: SGLang 0.5.23's FA3, trtllm_mha, Triton and
torch_native do, and so does the plugin's prefix-aware CPU backend (``cpu_attention.py``).
FlashInfer's ragged prefill reads the cached prefix from the pool first (its paged pass) and
stores the batch's K/V after, so a request would read its phantoms' holes before they are written;
page-interleave KV sharding gathers the prefix a layer ahead, with the same hazard. On those, and
on any backend not known to store first, holes are refilled hole-first (the request computes them
as its own chunks, each written by an earlier forward than the one that reads it), which is safe
on every backend.
"""
from __future__ import annotations

import logging

from penelope.errors import UsageError

logger = logging.getLogger(__name__)

# Prefill backends that store a batch's K/V before attending (read in SGLang 0.5.23's sources).
STORE_BEFORE_READ = frozenset({"fa3", "trtllm_mha", "triton", "torch_native", "torch_native_prefix"})
REFILL_MODES = ("auto", "phantoms", "hole-first")


def prefill_backend(tp_worker=None, server_args=None) -> str | None:
    """The prefill attention backend (None if unknown): the one this scheduler's model runner
    resolved when there is a runner, else the one `server_args` names, else the one of the
    configuration this process published."""
    runner = getattr(tp_worker, "model_runner", None)
    resolved = getattr(runner, "prefill_attention_backend_str", None)
    if resolved:
        return resolved
    if server_args is not None:
        return (getattr(server_args, "prefill_attention_backend", None)
                or getattr(server_args, "attention_backend", None))
    try:
        from sglang.srt.runtime_context import attention_backends

        return attention_backends()[0]
    except Exception:  # noqa: BLE001 - no configuration published in this process
        return None


def phantoms_allowed(mode: str, backend: str | None, kv_shard_size: int = 1) -> bool:
    """Whether phantoms may ride in their request's batch under refill `mode` on prefill
    `backend` with page-interleave shards of `kv_shard_size` pages (1: no sharding).

    Raises UsageError (one line) when `mode` is "phantoms" where phantoms would read holes before
    they are written."""
    safe = backend in STORE_BEFORE_READ and kv_shard_size <= 1
    if mode == "hole-first":
        return False
    if mode == "phantoms" and not safe:
        why = (f"page-interleave KV sharding ({kv_shard_size} pages) gathers the prefix before the batch's K/V "
               "is stored" if kv_shard_size > 1 else
               f"the {backend or 'unknown'} attention backend reads the cached prefix before it stores the "
               f"batch's K/V (known to store first: {', '.join(sorted(STORE_BEFORE_READ))})")
        raise UsageError(f"penelope: refill 'phantoms' is unsafe here: {why}; use refill 'auto' or 'hole-first'")
    if not safe:
        logger.info("penelope: holes are refilled hole-first: the %s prefill backend%s is not known to store a "
                    "batch's K/V before reading its prefix", backend or "unknown",
                    " with KV sharding" if kv_shard_size > 1 else "")
    return safe
