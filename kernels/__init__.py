"""Triton kernels of Penelope (imported as ``penelope.kernels``).

Each kernel lives in its own sub-package with ``kernel.py`` (Triton kernel and launcher) and
``naive.py`` (torch fp32 reference)."""

from .kv_swap import copy_kv_slots, exchange_kv, naive_copy_kv_slots, plan_exchange, run_exchange
from .ragged_attention import (
    KVStorePlan,
    RaggedPlan,
    naive_ragged_prefill_attention,
    naive_store_kv,
    plan_ragged_prefill,
    plan_store_kv,
    ragged_attention_work,
    ragged_prefill_attention,
    store_kv,
    warm_up_ragged_attention,
)

__all__ = [
    "KVStorePlan",
    "RaggedPlan",
    "copy_kv_slots",
    "exchange_kv",
    "naive_copy_kv_slots",
    "naive_ragged_prefill_attention",
    "naive_store_kv",
    "plan_exchange",
    "plan_ragged_prefill",
    "plan_store_kv",
    "ragged_attention_work",
    "ragged_prefill_attention",
    "run_exchange",
    "store_kv",
    "warm_up_ragged_attention",
]
