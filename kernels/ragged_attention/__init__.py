"""Ragged-position prefill attention: one launch for phantom holes and new tokens of many requests."""

from .kernel import (
    RaggedBlocks,
    RaggedPlan,
    RaggedWork,
    plan_ragged_prefill,
    ragged_attention_blocks,
    ragged_attention_work,
    ragged_prefill_attention,
    store_kv,
)
from .naive import naive_ragged_prefill_attention, naive_store_kv

__all__ = [
    "RaggedBlocks",
    "RaggedPlan",
    "RaggedWork",
    "naive_ragged_prefill_attention",
    "naive_store_kv",
    "plan_ragged_prefill",
    "ragged_attention_blocks",
    "ragged_attention_work",
    "ragged_prefill_attention",
    "store_kv",
]
