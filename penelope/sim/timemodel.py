"""Serving-time model of the simulator: seconds for a prefill batch, a decode step, a CPU->GPU load.

Prefill is compute-bound and follows the cost model (`penelope.costmodel`): a batch computing
`tokens` new positions whose attention spans `pairs` query-key pairs (the cost model's unit, summed
over layers and heads) takes

    batch_overhead + sec_per_linear_unit * c_lin * tokens + sec_per_attention_pair * pairs.

A decode step is memory-bound: it reads the weights once (for an MoE, the experts the batch's
tokens route to) and every running request's KV:

    batch_overhead + (weight_bytes + expected_experts(batch) * expert_bytes
                      + kv_bytes_per_token * kv_tokens
                      + window_kv_bytes_per_token * min(kv_tokens, batch * sliding_window))
                     / hbm_bandwidth

(sliding-window layers read at most their window per request; exact when every request is at
least a window long). A CPU->GPU load of n tokens takes `n * (kv_bytes_per_token +
window_kv_bytes_per_token) / load_bandwidth`.

Default constants are ESTIMATES from public specifications, not measurements (`TimeModel.estimate`):
- peak dense bf16 FLOP/s per GPU: H100 SXM 989e12, H200 989e12; HBM: 3.35e12 and 4.8e12 B/s;
  memory 80 and 141 GB.
- `MFU` = 0.5 for linear layers and attention alike: large prefill GEMMs and FlashAttention-class
  kernels reach about half of peak, and the paper's measured front/tail speedups matched the cost
  model (which weighs a linear unit and an attention pair equally) within 4%.
- `HBM_EFFICIENCY` = 0.8 of peak bandwidth in decode; `BATCH_OVERHEAD` = 3 ms per batch
  (scheduling and launches); `LOAD_BANDWIDTH` = 50e9 B/s from pinned host memory over PCIe Gen5 x16.
- weights in bf16 (2 bytes per parameter), KV in bf16.
- GPUs per model: the smallest power of two whose memory (90% usable) holds the weights plus the
  paper's KV capacity for that model (`PAPER_GPU_CACHE`), as tensor parallelism with no
  communication cost: Qwen3-8B 1 GPU, Qwen3-32B 2 H100 or 1 H200, Qwen3-235B-A22B 8.

A calibration JSON (written by the cost-curve microbenchmark on a GPU) overrides any of
`CALIBRATION_KEYS`; `model` and `gpu` keys, when present, must name the model and GPU it is
applied to; `source` is free text; any other key is an error.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from penelope.costmodel import CostModel
from penelope.errors import UsageError
from penelope.models import SLIDING, ModelShape, get_model


@dataclass(frozen=True)
class GpuSpec:
    """Public per-GPU figures: dense bf16 FLOP/s, HBM bytes/s, memory bytes."""

    name: str
    peak_flops: float
    hbm_bandwidth: float
    memory_bytes: float


GPUS = {
    "h100": GpuSpec("h100", peak_flops=989e12, hbm_bandwidth=3.35e12, memory_bytes=80e9),
    "h200": GpuSpec("h200", peak_flops=989e12, hbm_bandwidth=4.8e12, memory_bytes=141e9),
}
MFU = 0.5
HBM_EFFICIENCY = 0.8
BATCH_OVERHEAD = 3e-3
LOAD_BANDWIDTH = 50e9
WEIGHT_BYTES_PER_PARAM = 2
KV_DTYPE_BYTES = 2
USABLE_MEMORY = 0.9
# KV capacity of the GPU tier in the paper's replay, per model (tokens); other models use 256K.
PAPER_GPU_CACHE = {"qwen3-8b": 256 * 1024, "qwen3-32b": 192 * 1024, "qwen3-235b-a22b": 384 * 1024}
DEFAULT_GPU_CACHE = 256 * 1024

CALIBRATION_KEYS = (
    "sec_per_linear_unit",
    "sec_per_attention_pair",
    "batch_overhead",
    "hbm_bandwidth",
    "weight_bytes",
    "expert_bytes",
    "kv_bytes_per_token",
    "window_kv_bytes_per_token",
    "load_bandwidth",
)
METADATA_KEYS = ("model", "gpu", "source")


@dataclass(frozen=True)
class TimeModel:
    """Calibrated constants of the serving-time model (see the module docstring for the formulas).

    Units: seconds, bytes, bytes per second; `c_lin` in attention-pair units per token.
    `hbm_bandwidth` is the effective bandwidth of all `num_gpus` together."""

    model: str
    gpu: str
    num_gpus: int
    c_lin: float
    sec_per_linear_unit: float
    sec_per_attention_pair: float
    batch_overhead: float
    hbm_bandwidth: float
    weight_bytes: float
    expert_bytes: float
    num_experts: int
    experts_per_token: int
    kv_bytes_per_token: float
    window_kv_bytes_per_token: float
    sliding_window: int
    load_bandwidth: float

    def __post_init__(self) -> None:
        positive = (
            "num_gpus",
            "c_lin",
            "sec_per_linear_unit",
            "sec_per_attention_pair",
            "hbm_bandwidth",
            "load_bandwidth",
        )
        non_negative = (
            "batch_overhead",
            "weight_bytes",
            "expert_bytes",
            "kv_bytes_per_token",
            "window_kv_bytes_per_token",
            "num_experts",
            "experts_per_token",
            "sliding_window",
        )
        for name in positive + non_negative:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise UsageError(f"time model: {name} must be a finite number, got {value!r}")
            if value < 0 or (value == 0 and name in positive):
                raise UsageError(
                    f"time model: {name} must be {'positive' if name in positive else '>= 0'}, got {value}"
                )
        if self.experts_per_token > self.num_experts:
            raise UsageError("time model: experts_per_token exceeds num_experts")

    @classmethod
    def estimate(
        cls, model: str | ModelShape = "qwen3-8b", gpu: str = "h100", num_gpus: int | None = None
    ) -> TimeModel:
        """Documented default estimate for a model on `num_gpus` GPUs of kind `gpu` (None: the
        smallest power of two that holds the weights and the paper's KV capacity)."""
        shape = model if isinstance(model, ModelShape) else get_model(model)
        spec = GPUS.get(gpu.lower())
        if spec is None:
            raise UsageError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)}")
        cost = CostModel(shape)
        expert_params = _expert_params(shape)
        always_params = shape.active_params() - shape.experts_per_token * expert_params
        total_params = always_params + shape.num_experts * expert_params
        window_layers = sum(kind == SLIDING for kind in shape.layer_kinds)
        kv_per_layer = 2 * shape.num_kv_heads * shape.head_dim * KV_DTYPE_BYTES
        full_kv = shape.kv_bytes_per_token(KV_DTYPE_BYTES) - window_layers * kv_per_layer
        if num_gpus is None:
            capacity = PAPER_GPU_CACHE.get(shape.name, DEFAULT_GPU_CACHE)
            kv_bytes = capacity * shape.kv_bytes_per_token(KV_DTYPE_BYTES)
            needed = total_params * WEIGHT_BYTES_PER_PARAM + kv_bytes
            num_gpus = 2 ** max(0, math.ceil(math.log2(needed / (USABLE_MEMORY * spec.memory_bytes))))
        seconds_per_unit = cost.flops_per_unit / (num_gpus * spec.peak_flops * MFU)
        return cls(
            model=shape.name,
            gpu=spec.name,
            num_gpus=num_gpus,
            c_lin=cost.c_lin,
            sec_per_linear_unit=seconds_per_unit,
            sec_per_attention_pair=seconds_per_unit,
            batch_overhead=BATCH_OVERHEAD,
            hbm_bandwidth=num_gpus * spec.hbm_bandwidth * HBM_EFFICIENCY,
            weight_bytes=always_params * WEIGHT_BYTES_PER_PARAM,
            expert_bytes=expert_params * WEIGHT_BYTES_PER_PARAM,
            num_experts=shape.num_experts,
            experts_per_token=shape.experts_per_token,
            kv_bytes_per_token=full_kv,
            window_kv_bytes_per_token=window_layers * kv_per_layer,
            sliding_window=shape.sliding_window if window_layers else 0,
            load_bandwidth=LOAD_BANDWIDTH,
        )

    @classmethod
    def from_json(
        cls,
        path: str | Path,
        model: str | ModelShape = "qwen3-8b",
        gpu: str = "h100",
        num_gpus: int | None = None,
    ) -> TimeModel:
        """The estimate for (model, gpu, num_gpus) with the calibration file's values applied."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise UsageError(f"calibration file not found: {path}") from None
        except json.JSONDecodeError as err:
            raise UsageError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
        if not isinstance(data, dict):
            raise UsageError(f"{path}: a calibration file must be a JSON object")
        unknown = sorted(set(data) - set(CALIBRATION_KEYS) - set(METADATA_KEYS))
        if unknown:
            raise UsageError(
                f"{path}: unknown calibration keys {', '.join(unknown)}; "
                f"known: {', '.join(CALIBRATION_KEYS + METADATA_KEYS)}"
            )
        base = cls.estimate(model, gpu, num_gpus)
        for key in ("model", "gpu"):
            if key in data and str(data[key]).lower() != getattr(base, key):
                raise UsageError(f"{path}: calibrated for {key} {data[key]!r}, not {getattr(base, key)!r}")
        values = {key: data[key] for key in CALIBRATION_KEYS if key in data}
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UsageError(f"{path}: '{key}' must be a number, got {value!r}")
        return dataclasses.replace(base, **values)

    def prefill_time(self, tokens, pairs) -> float:
        """Seconds of one prefill batch: `tokens` positions computed, `pairs` attention units.

        tokens, pairs: scalars or sequences (one entry per segment or request), summed; pairs as
        from `CostModel.attention_pairs`. An empty batch takes no time."""
        tokens = float(np.sum(tokens))
        pairs = float(np.sum(pairs))
        if tokens < 0 or pairs < 0:
            raise UsageError(f"prefill work must be non-negative, got {tokens} tokens and {pairs} pairs")
        if tokens == 0:
            return 0.0
        return (
            self.batch_overhead
            + self.sec_per_linear_unit * self.c_lin * tokens
            + self.sec_per_attention_pair * pairs
        )

    def decode_step_time(self, batch_size: int, kv_tokens: int) -> float:
        """Seconds of one decode step of `batch_size` requests holding `kv_tokens` KV tokens in all."""
        if batch_size < 0 or kv_tokens < 0:
            raise UsageError(f"decode batch must be non-negative, got {batch_size} requests, {kv_tokens} KV")
        if batch_size == 0:
            return 0.0
        window_tokens = min(kv_tokens, batch_size * self.sliding_window)
        read = (
            self.weight_bytes
            + self.expected_experts(batch_size) * self.expert_bytes
            + self.kv_bytes_per_token * kv_tokens
            + self.window_kv_bytes_per_token * window_tokens
        )
        return self.batch_overhead + read / self.hbm_bandwidth

    def expected_experts(self, batch_size: int) -> float:
        """Expected distinct experts per MoE layer used by `batch_size` tokens routed uniformly."""
        if not self.num_experts:
            return 0.0
        unused = (1.0 - self.experts_per_token / self.num_experts) ** batch_size
        return self.num_experts * (1.0 - unused)

    def load_time(self, tokens: int) -> float:
        """Seconds to copy the KV of `tokens` tokens from CPU to GPU memory."""
        if tokens < 0:
            raise UsageError(f"load size must be non-negative, got {tokens}")
        return tokens * (self.kv_bytes_per_token + self.window_kv_bytes_per_token) / self.load_bandwidth

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _expert_params(shape: ModelShape) -> float:
    """Parameters of one routed expert summed over the MoE layers (SwiGLU: 3 matrices)."""
    moe_layers = sum(shape.moe_layers)
    return moe_layers * 3 * shape.hidden_size * shape.expert_intermediate_size
