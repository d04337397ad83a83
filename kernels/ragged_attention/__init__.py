"""Ragged-position prefill attention: one launch for phantom holes and new tokens of many requests."""

from .configs import RaggedBlocks, ragged_attention_blocks, target_of
from .naive import naive_ragged_prefill_attention, naive_store_kv
from .plan import RaggedPlan, plan_ragged_prefill
from .prefill import ragged_prefill_attention, warm_up_ragged_attention
from .store import KVStorePlan, plan_store_kv, store_kv
from .work import RaggedWork, ragged_attention_work

__all__ = [
    "KVStorePlan",
    "RaggedBlocks",
    "RaggedPlan",
    "RaggedWork",
    "naive_ragged_prefill_attention",
    "naive_store_kv",
    "plan_ragged_prefill",
    "plan_store_kv",
    "ragged_attention_blocks",
    "ragged_attention_work",
    "ragged_prefill_attention",
    "store_kv",
    "target_of",
    "warm_up_ragged_attention",
]
