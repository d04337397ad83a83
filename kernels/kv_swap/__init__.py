"""KV slot copy between pools (Triton kernel and torch reference) and the swap-buffer exchange."""

from .exchange import COPY_FUNCTIONS, CopyStep, ExchangePlan, exchange_kv, plan_exchange, run_exchange
from .kernel import copy_kv_slots
from .naive import naive_copy_kv_slots

__all__ = [
    "COPY_FUNCTIONS",
    "CopyStep",
    "ExchangePlan",
    "copy_kv_slots",
    "exchange_kv",
    "naive_copy_kv_slots",
    "plan_exchange",
    "run_exchange",
]
