"""KV slot copy between pools (Triton kernel and torch reference) and the swap-buffer exchange."""

from .exchange import COPY_FUNCTIONS, CopyStep, ExchangePlan, exchange_kv, plan_exchange, run_exchange
from .kernel import copy_kv_slots
from .naive import naive_copy_kv_slots
from .schedule import MIN_RUN, SwapHandle, contiguous_runs, issue_exchange, layer_groups
from .streams import CudaStreams, HostStreams, RecordingStreams, Streams

__all__ = [
    "COPY_FUNCTIONS",
    "MIN_RUN",
    "CopyStep",
    "CudaStreams",
    "ExchangePlan",
    "HostStreams",
    "RecordingStreams",
    "Streams",
    "SwapHandle",
    "contiguous_runs",
    "copy_kv_slots",
    "exchange_kv",
    "issue_exchange",
    "layer_groups",
    "naive_copy_kv_slots",
    "plan_exchange",
    "run_exchange",
]
