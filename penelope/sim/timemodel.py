"""Serving-time model of the simulator: seconds for a prefill batch, a decode step, a CPU->GPU load.

Prefill is compute-bound and follows the cost model (`penelope.costmodel.recompute`): a batch computing
`tokens` new positions whose attention spans `pairs` query-key pairs (the cost model's unit, summed
over layers and heads) takes

    batch_overhead + sec_per_linear_unit * c_lin * tokens + sec_per_attention_pair * k * pairs

where k is the relative cost of the attention kernel that runs the batch (below).

A decode step is memory-bound: it reads the weights once (for an MoE, the experts the batch's
tokens route to), the input-embedding rows of its tokens, and every running request's KV:

    decode_overhead + (weight_bytes + expected_experts(batch) * expert_bytes
                       + embedding_row_bytes * batch
                       + kv_bytes_per_token * kv_tokens * (1 + kv_read_growth * kv_tokens / batch)
                       + window_kv_bytes_per_token * min(kv_tokens, batch * sliding_window))
                      / hbm_bandwidth

(sliding-window layers read at most their window per request; exact when every request is at
least a window long). `kv_read_growth` (per token of context, 0 in the estimate) makes a KV token
cost more to read the longer its request's context `kv_tokens / batch` (the requests of a step
taken as equally long): SGLang's CPU attention gathers each request's KV into a new tensor per
layer, and on a CPU its steps cost several times more per KV token at 16K tokens of context than
at 4K (docs/calibrate.md); `penelope calibrate` fits it, a GPU's estimate has none.

A CPU->GPU load of n tokens takes `n * (kv_bytes_per_token + window_kv_bytes_per_token) /
load_bandwidth`.

Attention kernel of a prefill batch (`prefill_kernel`): `sec_per_attention_pair` is the speed of
a FlashAttention-3-class kernel, the one SGLang runs for contiguous prefill on Hopper (k = 1).
A batch that refills a hole (a phantom segment; Penelope and the other head-evicting policies)
needs attention over disjoint position ranges of one request, which this project runs with its
own Triton ragged kernel (`penelope.kernels.ragged_attention`). `phantom_kernel="fa3"` (the
default) assumes that kernel as fast as FA3; `phantom_kernel="triton"` charges every attention
pair of such a batch `triton_pair_ratio` times FA3's seconds (the whole batch runs in one
launch of the ragged kernel). Linear layers do not depend on the kernel.

Default constants (`TimeModel.estimate`). Each says where it comes from; "estimate" marks a
judgement, not a measurement of this project. A GPU calibration replaces them.
- Peak dense bf16 FLOP/s per GPU (spec sheets): H100 SXM 989e12, H200 989e12; HBM: 3.35e12 and
  4.8e12 B/s; memory 80 and 141 GB.
- `MFU` = 0.5 for linear layers and attention alike (estimate): large prefill GEMMs and
  FlashAttention-class kernels reach about half of peak (the FlashAttention-3 paper, Shah et al.
  2024, reports up to 740 TFLOP/s = 75% of H100 peak for its forward pass at best; serving
  shapes are smaller), and the paper's measured front/tail speedups matched the cost model
  (which weighs a linear unit and an attention pair equally) within 4%.
- `BATCH_OVERHEAD` = 3 ms per prefill batch (estimate): scheduling and eager kernel launches;
  SGLang captures CUDA graphs for decode only, so a prefill batch launches every kernel of every
  layer from Python.
- `DECODE_OVERHEAD` = 0.5 ms per decode step (estimate, middle of 0.3-0.7 ms): SGLang replays a
  captured CUDA graph per decode step and overlaps its CPU scheduling with the GPU ("zero-overhead
  batch scheduler", SGLang v0.4 release blog, LMSYS, 2024-12-04), so what remains per step is the
  gaps between the graph's few hundred kernels and the sampling step, not 3 ms of launches.
  Settled by `microbench/bench_decode.py` on a GPU.
- `HBM_EFFICIENCY` = 0.7 of peak bandwidth for decode reads (estimate within the 60-75% that is
  typical): gpt-fast (pytorch-labs/gpt-fast README) reads Llama-2-7B's bf16 weights at 1,397 GB/s
  at batch 1 on an A100-80GB, 69% of its 2,039 GB/s peak, per-step overhead included; paged KV
  reads lose a little more (FlashInfer's README: its paged "vector-sparse" attention reaches 90%
  of the bandwidth of dense kernels on the same problem). Long-context steps are dominated by
  the paged KV read (128K tokens of Qwen3-8B KV are 19 GB against 15 GB of weights). Settled by
  `microbench/bench_decode.py` on a GPU.
- Weight bytes per decode step: every linear layer and the LM head, but only the rows of the
  input-embedding table that the step's tokens look up (`embedding_row_bytes` per token), not
  the whole table (622M parameters, 7.6% of Qwen3-8B's weights). With tied embeddings the one
  table is read once, as the LM head.
- `TRITON_PAIR_RATIO` = 1.5 (estimate): the project's Triton ragged kernel takes 1.5x FA3's
  seconds per attention pair. Measured elsewhere: Triton's tutorial FlashAttention-2 kernel
  against FA3 on an H100, head dim 128, 329 vs 430 TFLOP/s at 512 tokens and 477 vs 621 TFLOP/s
  at 16K (pytorch/benchmark PR #2391, commit ff65cb6), i.e. FA3 1.3x faster. Our kernel reads
  keys through `req_to_token` and has not been timed on a GPU against FA3, hence the margin.
  A calibration (`triton_pair_ratio`) overrides it.
- `LOAD_BANDWIDTH` = 50e9 B/s from pinned host memory over PCIe Gen5 x16 (estimate; 64 GB/s
  peak per direction).
- weights in bf16 (2 bytes per parameter), KV in bf16.
- GPUs per model: the smallest power of two whose memory (90% usable) holds the weights plus the
  paper's KV capacity for that model (`PAPER_GPU_CACHE`), as tensor parallelism with no
  communication cost: Qwen3-8B 1 GPU, Qwen3-32B 2 H100 or 1 H200, Qwen3-235B-A22B 8.

A calibration JSON (written by the microbenchmarks on a GPU, or by `penelope calibrate`) overrides
any of `CALIBRATION_KEYS`; `model` and `gpu` keys, when present, must name the model and GPU it is
applied to; `source` is free text; any other key is an error.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from penelope.costmodel.recompute import CostModel
from penelope.costmodel.shapes import SLIDING, ModelShape, get_model
from penelope.errors import UsageError
from penelope.jsonfile import read_json


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
HBM_EFFICIENCY = 0.7
BATCH_OVERHEAD = 3e-3
DECODE_OVERHEAD = 0.5e-3
TRITON_PAIR_RATIO = 1.5
LOAD_BANDWIDTH = 50e9
WEIGHT_BYTES_PER_PARAM = 2
KV_DTYPE_BYTES = 2
USABLE_MEMORY = 0.9
# KV capacity of the GPU tier in the paper's replay, per model (tokens); other models use 256K.
PAPER_GPU_CACHE = {"qwen3-8b": 256 * 1024, "qwen3-32b": 192 * 1024, "qwen3-235b-a22b": 384 * 1024}
DEFAULT_GPU_CACHE = 256 * 1024

# Attention kernels a prefill batch can be costed with (see the module docstring).
PREFILL_KERNELS = ("fa3", "triton")

CALIBRATION_KEYS = (
    "sec_per_linear_unit",
    "sec_per_attention_pair",
    "batch_overhead",
    "decode_overhead",
    "hbm_bandwidth",
    "weight_bytes",
    "embedding_row_bytes",
    "expert_bytes",
    "kv_bytes_per_token",
    "window_kv_bytes_per_token",
    "load_bandwidth",
    "triton_pair_ratio",
    "kv_read_growth",
)
METADATA_KEYS = ("model", "gpu", "source")
# Range of every constant, in its unit. Each bound is orders of magnitude beyond any GPU or model
# (an H100 reads 3.35e12 B/s; a unit is about 1e-13 s; an 8B model's weights are 1.6e10 B), so
# only nonsense is refused, and the replay's times stay finite: a calibration of 1e308 s per
# batch would otherwise print tables of inf and nan.
_BYTES, _BANDWIDTH = (0.0, 1e16), (1e3, 1e16)
RANGES = {
    "num_gpus": (1, 1 << 20),
    "c_lin": (0.0, 1e12),
    "sec_per_linear_unit": (0.0, 1.0),
    "sec_per_attention_pair": (0.0, 1.0),
    "batch_overhead": (0.0, 60.0),
    "decode_overhead": (0.0, 60.0),
    "hbm_bandwidth": _BANDWIDTH,
    "weight_bytes": _BYTES,
    "embedding_row_bytes": _BYTES,
    "expert_bytes": _BYTES,
    "num_experts": (0, 1 << 20),
    "experts_per_token": (0, 1 << 20),
    "kv_bytes_per_token": _BYTES,
    "window_kv_bytes_per_token": _BYTES,
    "sliding_window": (0, 2**31 - 1),
    "load_bandwidth": _BANDWIDTH,
    "triton_pair_ratio": (0.0, 1000.0),
    "kv_read_growth": (0.0, 1.0),
}
# Constants that must not be 0.
POSITIVE = ("num_gpus", "c_lin", "sec_per_linear_unit", "sec_per_attention_pair", "hbm_bandwidth", "load_bandwidth",
            "triton_pair_ratio")
# A calibration file holds a few numbers.
MAX_CALIBRATION_BYTES = 2**20


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
    decode_overhead: float
    hbm_bandwidth: float
    weight_bytes: float
    embedding_row_bytes: float
    expert_bytes: float
    num_experts: int
    experts_per_token: int
    kv_bytes_per_token: float
    window_kv_bytes_per_token: float
    sliding_window: int
    load_bandwidth: float
    triton_pair_ratio: float = TRITON_PAIR_RATIO
    kv_read_growth: float = 0.0
    phantom_kernel: str = "fa3"

    def __post_init__(self) -> None:
        for name, (low, high) in RANGES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise UsageError(f"time model: {name} must be a finite number, got {value!r}")
            if value < 0 or (value == 0 and name in POSITIVE):
                raise UsageError(
                    f"time model: {name} must be {'positive' if name in POSITIVE else '>= 0'}, got {value}"
                )
            if not low <= value <= high:
                raise UsageError(f"time model: {name} must be in [{low:g}, {high:g}], got {value:g}")
        if self.experts_per_token > self.num_experts:
            raise UsageError("time model: experts_per_token exceeds num_experts")
        if self.phantom_kernel not in PREFILL_KERNELS:
            raise UsageError(
                f"unknown phantom kernel {self.phantom_kernel!r}; choose from {', '.join(PREFILL_KERNELS)}"
            )

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
            decode_overhead=DECODE_OVERHEAD,
            hbm_bandwidth=num_gpus * spec.hbm_bandwidth * HBM_EFFICIENCY,
            weight_bytes=decode_weight_params(shape) * WEIGHT_BYTES_PER_PARAM,
            embedding_row_bytes=shape.hidden_size * WEIGHT_BYTES_PER_PARAM,
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
        data = read_json(path, "calibration file", MAX_CALIBRATION_BYTES)
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
        try:
            return dataclasses.replace(base, **values)
        except UsageError as err:
            raise UsageError(f"{path}: {err}") from None

    def prefill_kernel(self, holes: bool) -> str:
        """The attention kernel a prefill batch is costed with: `"fa3"` for contiguous prefill,
        `phantom_kernel` for a batch that refills a hole."""
        return self.phantom_kernel if holes else "fa3"

    def prefill_time(self, tokens, pairs, holes: bool = False) -> float:
        """Seconds of one prefill batch: `tokens` positions computed, `pairs` attention units.

        tokens, pairs: scalars or sequences (one entry per segment or request), summed; pairs as
        from `CostModel.attention_pairs`. `holes`: the batch refills a hole (a phantom segment),
        so its attention runs on `prefill_kernel(True)`. An empty batch takes no time."""
        tokens = float(np.sum(tokens))
        pairs = float(np.sum(pairs))
        if tokens < 0 or pairs < 0:
            raise UsageError(f"prefill work must be non-negative, got {tokens} tokens and {pairs} pairs")
        if tokens == 0:
            return 0.0
        ratio = self.triton_pair_ratio if self.prefill_kernel(holes) == "triton" else 1.0
        return (
            self.batch_overhead
            + self.sec_per_linear_unit * self.c_lin * tokens
            + self.sec_per_attention_pair * ratio * pairs
        )

    def decode_step_time(self, batch_size: int, kv_tokens: int) -> float:
        """Seconds of one decode step of `batch_size` requests holding `kv_tokens` KV tokens in all."""
        if batch_size < 0 or kv_tokens < 0:
            raise UsageError(f"decode batch must be non-negative, got {batch_size} requests, {kv_tokens} KV")
        if batch_size == 0:
            return 0.0
        return float(self.decode_overhead + self.decode_read_bytes(batch_size, kv_tokens) / self.hbm_bandwidth)

    def decode_read_bytes(self, batch_size: int, kv_tokens):
        """Bytes one decode step of `batch_size` requests reads from HBM when they hold `kv_tokens`
        KV tokens in all (a number or a float64 array of them, one per step); the KV read of
        requests of `kv_tokens / batch_size` tokens each, grown by `kv_read_growth`."""
        kv_tokens = np.asarray(kv_tokens, dtype=np.float64)
        window_tokens = np.minimum(kv_tokens, batch_size * self.sliding_window)
        context = kv_tokens / batch_size if batch_size else 0.0
        return (
            self.weight_bytes
            + self.embedding_row_bytes * batch_size
            + self.expected_experts(batch_size) * self.expert_bytes
            + self.kv_bytes_per_token * kv_tokens * (1.0 + self.kv_read_growth * context)
            + self.window_kv_bytes_per_token * window_tokens
        )

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


def decode_weight_params(shape: ModelShape) -> float:
    """Parameters every decode step reads whatever its batch: all layers (an MoE's routed experts
    left out: they depend on the batch) and the LM head, but not the input-embedding table, of
    which a step looks up one row per token. With tied embeddings the one table counts once."""
    always = shape.active_params() - shape.experts_per_token * _expert_params(shape)
    return always - shape.vocab_size * shape.hidden_size


def write_calibration(path: str | Path, values: dict) -> dict:
    """Write calibration `values` (keys of `CALIBRATION_KEYS` and `METADATA_KEYS`) to `path`,
    merged into what the file already holds for the same model and GPU, so several benchmarks
    can each settle their constants in one file; `source` lists every contributor once. Returns
    what was written."""
    path = Path(path)
    unknown = sorted(set(values) - set(CALIBRATION_KEYS) - set(METADATA_KEYS))
    if unknown:
        raise UsageError(f"unknown calibration keys {', '.join(unknown)}")
    merged: dict = {}
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except (ValueError, RecursionError):
            # Not JSON (or not UTF-8): start a new file.
            old = None
        if isinstance(old, dict) and all(old.get(key) == values.get(key) for key in ("model", "gpu")):
            merged = old
    sources = [s for s in str(merged.get("source", "")).split("; ") if s]
    merged.update(values)
    if values.get("source") and values["source"] not in sources:
        sources.append(values["source"])
    if sources:
        merged["source"] = "; ".join(sources)
    path.write_text(json.dumps(merged, indent=2) + "\n")
    return merged


def _expert_params(shape: ModelShape) -> float:
    """Parameters of one routed expert summed over the MoE layers (SwiGLU: 3 matrices)."""
    moe_layers = sum(shape.moe_layers)
    return moe_layers * 3 * shape.hidden_size * shape.expert_intermediate_size
