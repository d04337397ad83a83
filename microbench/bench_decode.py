"""Decode-step calibration: the per-step overhead and the achieved HBM bandwidth of the simulator's
decode model, fitted to timed decode steps over a grid of batch sizes and contexts.

The simulator charges a decode step of ``batch`` requests holding ``kv_tokens`` KV tokens in all

    decode_overhead + (weight_bytes + embedding_row_bytes * batch + kv_bytes_per_token * kv_tokens)
                      / hbm_bandwidth

(``penelope.sim.timemodel``). This benchmark times real decode steps for batch 1, 4, 8 and contexts
1K..128K (every request of a step at the same context) and fits ``decode_overhead`` (the intercept)
and ``hbm_bandwidth`` (the inverse slope against the bytes read) by least squares on relative
errors (``fit_decode``); the grid spans 15 GB (Qwen3-8B's weights alone) to 90 GB per step, so
both are determined. The result goes into ``calibration_<kind>.json`` (merged with what the cost
curve wrote there, ``penelope.sim.timemodel.write_calibration``), which ``penelope simulate
--calibration`` reads.

What runs (GPU, ``test_gpu_decode_calibration``): Qwen3-8B's shape with random bf16 weights
(``bench_cost_curve.device_random_weights``), the reference engine's layers
(``penelope.engine.decoder.Qwen3Decoder``: norms, RoPE, projections, SwiGLU, LM head), one new token
per request written into a KV pool laid out as SGLang's (per layer ``[slots, kv_heads, head_dim]``),
and decode attention by ``torch.nn.functional.scaled_dot_product_attention`` over the request's
slots (a request's slots are consecutive: its pages in order), with the q heads of each kv head as
the queries of one attention call (``decode_attention``), so K/V are read once per kv head. Each
grid point's step is captured in a CUDA graph, as SGLang captures its decode steps, and replayed:
CUDA events around each replay, the median of ``rounds`` after warm-up. Without a graph (capture
failed) the points say so (``graph: false``) and their overhead includes kernel launches.

What it is not: SGLang's own decode (FlashInfer or FA3 paged kernels, fused norms and RoPE,
sampling, its scheduler overlapped with the GPU). The fitted constants estimate the GPU-side
step of a CUDA-graph decode with a FlashAttention-class kernel, the quantities the simulator's
estimates guess (0.5 ms, 70% of peak; see ``penelope/sim/timemodel.py``).

KV memory: batch 8 at 128K needs 1M tokens of KV, 155 GB for Qwen3-8B, more than an H200 holds
beside the weights. The pool is sized to the free memory, and grid points that do not fit are
skipped and listed (``skipped``), so the fit uses what fits.

On CPU the same code runs on tiny shapes in ``tests/microbench/test_decode.py`` (the step against
the engine's forward, the fit against synthetic timings); it has not been timed on a GPU yet.

Run: ``python -m pytest microbench/bench_decode.py --benchmark-json out.json -s`` (GPU).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from bench_cost_curve import _gpu_kind, _qwen3_8b_engine_config, benchmark_weights
from timing import time_calls

from penelope.costmodel.shapes import ModelShape, shape_from_config
from penelope.engine.decoder import Qwen3Decoder, rms_norm
from penelope.engine.decoder_config import EngineModelConfig
from penelope.engine.kvpool import KVPool
from penelope.sim.timemodel import decode_weight_params, write_calibration
from penelope.units import format_size

BATCHES = (1, 4, 8)
CONTEXTS = tuple(k * 1024 for k in (1, 2, 4, 8, 16, 32, 64, 128))
# Share of the free GPU memory the KV pool may take (the graphs and SDPA need some room).
POOL_SHARE = 0.85


@dataclass(frozen=True)
class DecodeBytes:
    """What one decode step reads, in bytes: every step (`weights`), per request (`embedding_row`),
    per KV token (`kv_per_token`)."""

    weights: float
    embedding_row: float
    kv_per_token: float

    @classmethod
    def of(cls, shape: ModelShape, elem_bytes: int) -> DecodeBytes:
        return cls(decode_weight_params(shape) * elem_bytes, shape.hidden_size * elem_bytes,
                   shape.kv_bytes_per_token(elem_bytes))

    def step(self, batch: int, kv_tokens: int) -> float:
        return self.weights + self.embedding_row * batch + self.kv_per_token * kv_tokens


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Attention of one new query per request over all of its keys.

    q ``[B, Hq, D]``; k, v ``[B, N, Hkv, D]`` (views into the pool: a request's N keys in slot
    order; only the last dim need be contiguous); returns ``[B, Hq, D]``. The ``Hq / Hkv`` q heads of
    a kv head are the rows of one attention call, so each K/V tile is read once for the group."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_q_heads // num_kv_heads
    queries = q.view(batch, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(queries, k.transpose(1, 2), v.transpose(1, 2), scale=sm_scale)
    return out.reshape(batch, num_q_heads, head_dim)


class DecodeStep:
    """One decode step of ``batch`` requests at ``context`` tokens each, on static tensors.

    Request r owns pool slots ``r * (context + 1) .. (r + 1) * (context + 1) - 1``; its new token
    (position ``context``) is written into the last of them, and attention reads all of them.
    ``__call__`` writes the new K/V and returns the logits ``[batch, vocab]``."""

    def __init__(self, model: Qwen3Decoder, pool: KVPool, batch: int, context: int, tokens: torch.Tensor):
        span = context + 1
        if batch * span > pool.capacity:
            raise ValueError(f"{batch} requests of {span} tokens need {batch * span} slots, the pool has "
                             f"{pool.capacity}")
        device = model.device
        self.model, self.pool, self.batch, self.context = model, pool, batch, context
        self.tokens = tokens.to(device=device, dtype=torch.int64).reshape(batch)
        self.positions = torch.full((batch,), context, dtype=torch.int64, device=device)
        self.slots = torch.arange(batch, device=device, dtype=torch.int64) * span + context
        self.span = span

    def __call__(self) -> torch.Tensor:
        model, cfg = self.model, self.model.config
        hidden = model.weights.embed[self.tokens]
        for index, lw in enumerate(model.weights.layers):
            q, k, v = model._qkv(lw, hidden, self.positions)
            k_buffer, v_buffer = self.pool.layer(index)
            k_buffer.index_copy_(0, self.slots, k.to(k_buffer.dtype))
            v_buffer.index_copy_(0, self.slots, v.to(v_buffer.dtype))
            shape = (self.batch, self.span, cfg.num_kv_heads, cfg.head_dim)
            keys = k_buffer[: self.batch * self.span].view(shape)
            values = v_buffer[: self.batch * self.span].view(shape)
            attn = decode_attention(q, keys, values, model.sm_scale).reshape(self.batch, cfg.q_size)
            hidden = model._mlp_block(lw, hidden, attn)
        return model.logits(rms_norm(hidden, model.weights.final_norm, cfg.rms_norm_eps))


def runner(step: DecodeStep, graph: bool):
    """A callable that runs ``step``: a CUDA-graph replay when ``graph`` (and capture works), else
    the eager step. Returns ``(callable, captured)``."""
    if not graph or step.model.device.type != "cuda":
        return step, False
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            # Warm-up outside the graph: cuBLAS handles, SDPA's kernel choice, lazy allocations.
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            step()
        return cuda_graph.replay, True
    except RuntimeError:
        torch.cuda.synchronize()
        return step, False


def fit_decode(points, read: DecodeBytes) -> dict:
    """Fit ``seconds = decode_overhead + read.step(batch, kv_tokens) / hbm_bandwidth``.

    points: ``(batch, kv_tokens, seconds)`` per timed step. Least squares on relative errors (each
    point weighed by 1 / seconds). A negative intercept is not an overhead: the fit is then redone
    through the origin (overhead 0). Returns ``decode_overhead`` (s) and, when the slope is
    positive, ``hbm_bandwidth`` (B/s), with ``max_relative_error`` of the fitted line over the
    points; needs two points with different bytes."""
    data = np.asarray(points, dtype=np.float64).reshape(-1, 3)
    read_bytes = np.array([read.step(int(b), int(n)) for b, n, _ in data])
    if len(data) < 2 or np.ptp(read_bytes) == 0:
        raise ValueError("the decode fit needs at least two points with different bytes read")
    seconds = data[:, 2]
    weight = 1.0 / seconds
    features = np.column_stack([np.ones(len(data)), read_bytes]) * weight[:, None]
    (overhead, per_byte), *_ = np.linalg.lstsq(features, seconds * weight, rcond=None)
    if overhead < 0:
        overhead = 0.0
        per_byte = float((read_bytes * weight) @ (seconds * weight) / ((read_bytes * weight) @ (read_bytes * weight)))
    result: dict = {"decode_overhead": float(overhead)}
    if per_byte > 0:
        result["hbm_bandwidth"] = 1.0 / float(per_byte)
        fitted = overhead + per_byte * read_bytes
        result["max_relative_error"] = float(np.max(np.abs(fitted / seconds - 1.0)))
    return result


class DecodeRun:
    """The model and pool of one device, and the grid points measured so far."""

    def __init__(self, config: EngineModelConfig, dtype: torch.dtype, device, capacity: int, seed: int = 0,
                 rounds: int = 10, graph: bool = True):
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.rounds, self.graph = rounds, graph
        weights = benchmark_weights(config, dtype, self.device, seed)
        self.model = Qwen3Decoder(config, weights, attention="naive")
        self.pool = KVPool(config, capacity, dtype=dtype, device=self.device)
        gen = torch.Generator().manual_seed(seed + 1)
        self.tokens = torch.randint(0, config.vocab_size, (max(BATCHES),), generator=gen)
        self.shape = shape_from_config(config.to_hf(), name=config.name)
        self.read = DecodeBytes.of(self.shape, torch.empty((), dtype=dtype).element_size())
        self.rows: list[dict] = []
        self.skipped: list[dict] = []

    def fits(self, batch: int, context: int) -> bool:
        return batch * (context + 1) <= self.pool.capacity

    def measure(self, batch: int, context: int) -> dict | None:
        """Time the step of (batch, context); None (and listed in ``skipped``) when the pool is too small."""
        if not self.fits(batch, context):
            self.skipped.append({"batch": batch, "context": context, "reason": "KV pool too small"})
            return None
        step = DecodeStep(self.model, self.pool, batch, context, self.tokens[:batch])
        with torch.inference_mode():
            fn, captured = runner(step, self.graph)
            times = time_calls(fn, self.device, self.rounds)
        kv_tokens = batch * (context + 1)
        seconds = statistics.median(times)
        row = {
            "batch": batch,
            "context": context,
            "kv_tokens": kv_tokens,
            "seconds": seconds,
            "seconds_all": times,
            "graph": captured,
            "bytes_read": self.read.step(batch, kv_tokens),
            "achieved_bandwidth": self.read.step(batch, kv_tokens) / seconds,
        }
        self.rows.append(row)
        return row

    def calibration(self, source: str) -> dict:
        """The time-model keys this run settles (``TimeModel.from_json`` reads them)."""
        fit = fit_decode([(r["batch"], r["kv_tokens"], r["seconds"]) for r in self.rows], self.read)
        values = {"model": self.config.name}
        gpu = _gpu_kind(self.device)
        if gpu is not None:
            values["gpu"] = gpu
        values.update(
            source=source,
            decode_overhead=fit["decode_overhead"],
            weight_bytes=float(self.read.weights),
            embedding_row_bytes=float(self.read.embedding_row),
            kv_bytes_per_token=float(self.read.kv_per_token),
        )
        if "hbm_bandwidth" in fit:
            values["hbm_bandwidth"] = fit["hbm_bandwidth"]
        return values

    def write(self, folder: str | Path, kind: str) -> dict:
        """``decode_<kind>.json`` (rows, skipped points, fit), ``decode_<kind>.txt`` (the table) and
        the decode keys merged into ``calibration_<kind>.json``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        device = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        dtype = str(self.dtype).removeprefix("torch.")
        source = f"microbench/bench_decode.py ({self.config.name}, {dtype}) on {device}"
        fit = fit_decode([(r["batch"], r["kv_tokens"], r["seconds"]) for r in self.rows], self.read)
        summary = {"device": device, "model": self.config.name, "dtype": dtype,
                   "rounds": self.rounds, "timing": "median", "rows": self.rows, "skipped": self.skipped,
                   "fit": fit, "peak_bandwidth": _peak_bandwidth(self.device)}
        (folder / f"decode_{kind}.json").write_text(json.dumps(summary, indent=2) + "\n")
        (folder / f"decode_{kind}.txt").write_text(format_rows(summary) + "\n")
        summary["calibration"] = write_calibration(folder / f"calibration_{kind}.json", self.calibration(source))
        return summary


def gpu_pool_capacity(config: EngineModelConfig, free_bytes: int, elem_bytes: int = 2) -> int:
    """KV slots for the grid's largest step (batch 8 at 128K), or as many as fit beside the weights
    in ``POOL_SHARE`` of ``free_bytes``."""
    shape = shape_from_config(config.to_hf(), name=config.name)
    need = max(BATCHES) * (max(CONTEXTS) + 1)
    room = POOL_SHARE * (free_bytes - shape.active_params() * elem_bytes)
    return max(0, min(need, int(room / shape.kv_bytes_per_token(elem_bytes))))


def _peak_bandwidth(device: torch.device) -> float | None:
    """The spec-sheet HBM bandwidth of a known GPU (``penelope.sim.timemodel.GPUS``), else None."""
    from penelope.sim.timemodel import GPUS

    kind = _gpu_kind(device)
    return GPUS[kind].hbm_bandwidth if kind else None


def format_rows(summary: dict) -> str:
    """The grid as text, with the fit."""
    lines = [f"decode steps ({summary['model']}, {summary['dtype']}, {summary['device']}, median of "
             f"{summary['rounds']})", f"{'batch':>5} {'context':>8} {'ms':>9} {'GB read':>8} {'GB/s':>8} graph"]
    for row in summary["rows"]:
        lines.append(f"{row['batch']:>5} {format_size(row['context']):>8} {1e3 * row['seconds']:>9.3f} "
                     f"{row['bytes_read'] / 1e9:>8.2f} {row['achieved_bandwidth'] / 1e9:>8.1f} {row['graph']}")
    for row in summary["skipped"]:
        lines.append(f"{row['batch']:>5} {format_size(row['context']):>8} skipped: {row['reason']}")
    fit = summary["fit"]
    text = f"fit: decode_overhead {1e3 * fit['decode_overhead']:.3f} ms"
    if "hbm_bandwidth" in fit:
        text += f", hbm_bandwidth {fit['hbm_bandwidth'] / 1e9:.0f} GB/s"
        if summary.get("peak_bandwidth"):
            text += f" ({fit['hbm_bandwidth'] / summary['peak_bandwidth']:.0%} of peak)"
        text += f", max relative error {fit['max_relative_error']:.1%}"
    return "\n".join(lines + [text])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_decode_calibration(benchmark, bench_out):
    config = _qwen3_8b_engine_config()
    run = DecodeRun(config, torch.bfloat16, "cuda", gpu_pool_capacity(config, torch.cuda.mem_get_info()[0]))
    points = [(b, n) for b in BATCHES for n in CONTEXTS]
    # pytest-benchmark times the smallest point; every point is timed by CUDA events.
    benchmark.pedantic(lambda: run.measure(*points[0]), rounds=1, iterations=1)
    for batch, context in points[1:]:
        run.measure(batch, context)
    summary = run.write(bench_out, "gpu")
    print("\n" + format_rows(summary))
    benchmark.extra_info.update(
        decode_overhead=summary["fit"]["decode_overhead"],
        hbm_bandwidth=summary["fit"].get("hbm_bandwidth"),
        max_relative_error=summary["fit"].get("max_relative_error"),
        points=len(run.rows),
        skipped=len(run.skipped),
        graphs=sum(row["graph"] for row in run.rows),
    )
    assert len(run.rows) >= 2 and all(math.isfinite(row["seconds"]) and row["seconds"] > 0 for row in run.rows)
