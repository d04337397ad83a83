"""The paper's cost curve: recomputing the front of a history is cheaper than recomputing its tail.

Experiment (per context n): a request's history of n tokens is fully cached; 30% of it is evicted
either as one span starting at position 2K (Penelope) or from the tail (SGLang); then 512 new
tokens arrive. The next request is timed both ways:

- front: ONE batch of two segments of the same request, the phantom refilling the hole
  ``[2K, 2K + 0.3n)`` and the new tokens ``[n, n + 512)``;
- tail: one segment, the recomputed tail and the new tokens ``[0.7n, n + 512)``.

Both compute the same number of tokens; only their positions differ, so the tail pays more
attention. ``penelope.costmodel.recompute.predict_speedup`` predicts the ratio tail / front from the model
shape that actually ran; each result reports both times, the measured and predicted speedups and
their relative error. The paper measured 1.14x at 8K and 2.93x at 128K (Qwen3-8B, H100), with the
model within 4%.

GPU (``test_gpu_cost_curve``): Qwen3-8B's shape (36 layers, hidden 4096, 32 q / 8 kv heads, head
dim 128, intermediate 12288), random bf16 weights drawn on the device, the reference engine
(``penelope.engine``) with the Triton ragged kernel, contexts 8K..128K, CUDA events, one warm-up
and the median of 3 rounds. The pool is filled with random K/V rather than by a prefill of the
history: attention costs the same whatever the values, and a 128K prefill would spend a large part
of ``run_gpu.sh``'s 8 minutes.

CPU (``test_cost_curve_cpu``): a scaled replica. Every position of the experiment is divided by
``CPU_SCALE`` = 16 (contexts 512..8K, hole at 128, 32 new tokens), and the model is narrowed so
that its per-token linear cost shrinks by the same factor: hidden 256, 2 layers, 4 q heads sharing
1 kv head (Qwen3-8B's group of 4), head dim 128, intermediate 1536 give
``c_lin = (256 * (2*512 + 2*128) + 3 * 256 * 1536) / (2 * 128 * 4) = 1,472 = 23,552 / 16``. So
``c_lin / context`` is the GPU experiment's at every context (2.875 at the first, 0.18 at the
last), the relative eviction is the same, and the cost model predicts the same curve to three
digits. The history is really prefilled through the model (its time enters the calibration fit).
Attention runs through ``penelope.engine.attention.tiled_sdpa_attention``, torch's fused CPU
attention over position-aligned query tiles of 128 (the Triton kernel is far too slow interpreted,
and the torch references pad tiles or compute whole rectangles, which would measure their own
overheads rather than attention). One thread, timed by its CPU time (``time.thread_time``, see
``timing.py``): this machine's 2 cores are shared with other jobs, a descheduled second worker
would stall every parallel region, and wall time would count the time the scheduler gives to
others; on an idle machine the two clocks agree. Times are the minimum of 7 rounds. Runs in well
under a minute.

Outputs (in ``--bench-out``, default ``results/<cpu|gpu>``): ``cost_curve_<kind>.json`` (the
table, with one batch-1 decode step per context for reference), ``cost_curve_<kind>.png``
(measured vs predicted), ``cost_curve_<kind>.txt`` and ``calibration_<kind>.json`` for the
simulator (``penelope.sim.timemodel.TimeModel.from_json``): ``sec_per_linear_unit``,
``sec_per_attention_pair`` and ``batch_overhead`` (per prefill batch) fitted to every timed batch
(``time = overhead + s_lin * c_lin * tokens + s_pair * pairs``, non-negative least squares on
relative errors: ``penelope.sim.calibration.fit_calibration``), and ``model``/``gpu``/``source``,
merged into what the file holds (``write_calibration``). The decode constants come from
``bench_decode.py``, which fits its own overhead and bandwidth over batch sizes and contexts.

Run: ``python -m pytest microbench/bench_cost_curve.py --benchmark-json out.json -s``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from machine import gpu_kind
from timing import elapsed

from penelope.costmodel.hf_configs import BUILTIN_CONFIGS
from penelope.costmodel.recompute import CostModel, predict_speedup
from penelope.costmodel.shapes import ModelShape, shape_from_config
from penelope.engine.attention import AttentionBackend, tiled_sdpa_attention, torch_store_kv
from penelope.engine.decoder import EngineBatch, Qwen3Decoder
from penelope.engine.decoder_config import EngineModelConfig
from penelope.engine.kvpool import KVPool
from penelope.engine.weights import expected_shapes, from_state_dict, random_weights
from penelope.sim.calibration import fit_calibration
from penelope.sim.timemodel import write_calibration
from penelope.tables import format_table

GPU_CONTEXTS = tuple(k * 1024 for k in (8, 16, 32, 64, 128))
EVICT_FRAC = 0.3
GPU_EVICT_START = 2048
GPU_APPEND = 512
PAPER_SPEEDUP = {8 * 1024: 1.14, 128 * 1024: 2.93}
CPU_SCALE = 16

TILED_SDPA = AttentionBackend("tiled-sdpa", torch_store_kv, tiled_sdpa_attention)


@dataclass(frozen=True)
class CurveSetup:
    """One machine's configuration of the experiment.

    Positions are the GPU experiment's divided by ``scale``. ``attention`` is an engine backend
    name or ``"tiled-sdpa"``; ``fill`` is ``"prefill"`` (run the history through the model) or
    ``"random"`` (random K/V in the pool); ``timing`` picks the reported time of a variant over
    its rounds (``"median"`` or ``"min"``); ``clock`` is ``"wall"`` or ``"thread"`` (CPU time of the
    calling thread, on CPU only); ``budget_s`` bounds the whole curve (contexts whose
    estimated time would pass it are skipped); ``threads`` sets torch's CPU threads (None: as is).
    """

    kind: str
    config: EngineModelConfig
    dtype: torch.dtype
    scale: int
    attention: str
    fill: str
    rounds: int
    timing: str
    budget_s: float
    threads: int | None = None
    clock: str = "wall"
    decode_rounds: int = 5

    @property
    def contexts(self) -> tuple[int, ...]:
        return tuple(n // self.scale for n in GPU_CONTEXTS)

    @property
    def evict_start(self) -> int:
        return GPU_EVICT_START // self.scale

    @property
    def append(self) -> int:
        return GPU_APPEND // self.scale

    def shape(self) -> ModelShape:
        """The cost model's shape of exactly the model that runs."""
        return shape_from_config(self.config.to_hf(), name=self.config.name)


def _qwen3_8b_engine_config() -> EngineModelConfig:
    # RoPE is applied at the original positions up to 128K + 512; Qwen3-8B's config says 40,960
    # (longer contexts use YaRN), which changes the angles, not the work.
    hf = {**BUILTIN_CONFIGS["qwen3-8b"], "max_position_embeddings": GPU_CONTEXTS[-1] + GPU_APPEND}
    return EngineModelConfig.from_hf(hf, name="qwen3-8b")


CPU_CONFIG = EngineModelConfig(
    vocab_size=1024,
    hidden_size=256,
    num_layers=2,
    num_q_heads=4,
    num_kv_heads=1,
    head_dim=128,
    intermediate_size=1536,
    rope_theta=1_000_000.0,
    max_position_embeddings=(GPU_CONTEXTS[-1] + GPU_APPEND) // CPU_SCALE,
    name="qwen3-8b-cpu-1-16",
)

SETUPS = {
    "cpu": CurveSetup(
        kind="cpu", config=CPU_CONFIG, dtype=torch.float32, scale=CPU_SCALE, attention="tiled-sdpa",
        fill="prefill", rounds=7, timing="min", budget_s=240.0, threads=1, clock="thread",
    ),
    "gpu": CurveSetup(
        kind="gpu", config=_qwen3_8b_engine_config(), dtype=torch.bfloat16, scale=1, attention="triton",
        fill="random", rounds=3, timing="median", budget_s=230.0,
    ),
}


def device_random_weights(config: EngineModelConfig, dtype: torch.dtype, device, seed: int = 0):
    """Random weights drawn directly on ``device`` in ``dtype`` (``random_weights`` draws fp32 on
    the CPU: minutes for 8B parameters). Linear weights N(0, 1/fan_in), norms 1."""
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, shape in expected_shapes(config).items():
        if len(shape) == 2:
            tensor = torch.randn(shape, generator=gen, device=device, dtype=dtype)
            tensor.mul_(shape[1] ** -0.5)
        else:
            tensor = torch.ones(shape, device=device, dtype=dtype)
        state[name] = tensor
    return from_state_dict(config, state, dtype=dtype, device=device)


def benchmark_weights(config: EngineModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A benchmark model's random weights: drawn on a GPU (``device_random_weights``), else the
    tests' ``random_weights``, identical on every machine."""
    if device.type == "cuda":
        return device_random_weights(config, dtype, device, seed)
    return random_weights(config, seed=seed, dtype=dtype, device=device)


def next_requests(tokens: torch.Tensor, context: int, evicted: int, evict_start: int, append: int):
    """The next request after each eviction, as engine batches over a pool whose slot is the
    position (``req_to_token`` row 0 = ``0 .. context + append - 1``).

    front: two segments of request 0, the hole ``[evict_start, evict_start + evicted)`` and the new
    tokens ``[context, context + append)``; tail: one segment ``[context - evicted, context + append)``.
    """
    table = torch.arange(context + append, dtype=torch.int32)[None]
    new = tokens[context : context + append]
    hole = tokens[evict_start : evict_start + evicted]
    front = EngineBatch.build(
        torch.cat([hole, new]), table, [[0, 0, evict_start, evicted], [0, evicted, context, append]]
    )
    tail = EngineBatch.build(tokens[context - evicted : context + append], table,
                             [[0, 0, context - evicted, evicted + append]])
    return front, tail


def _pick(times: list[float], timing: str) -> float:
    return min(times) if timing == "min" else statistics.median(times)


class CurveRun:
    """The model, pool and tokens of one setup, and the rows measured so far."""

    def __init__(self, setup: CurveSetup, device: str | torch.device = "cpu", seed: int = 0):
        self.setup = setup
        self.device = torch.device(device)
        self.started = time.perf_counter()
        self.cost = CostModel(setup.shape())
        config = setup.config
        weights = benchmark_weights(config, setup.dtype, self.device, seed)
        attention = TILED_SDPA if setup.attention == "tiled-sdpa" else setup.attention
        self.model = Qwen3Decoder(config, weights, attention=attention)
        capacity = setup.contexts[-1] + setup.append
        self.pool = KVPool(config, capacity, dtype=setup.dtype, device=self.device)
        gen = torch.Generator().manual_seed(seed + 1)
        self.tokens = torch.randint(0, config.vocab_size, (capacity,), generator=gen)
        if setup.fill == "random":
            for buffer in (*self.pool.k_buffers, *self.pool.v_buffers):
                buffer.normal_()
        self.rows: list[dict] = []

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def estimate_seconds(self, context: int, rounds: int | None = None, warmup: int = 1) -> float:
        """Expected seconds to measure ``context``, at the speed of the last measured context."""
        if not self.rows:
            return 0.0
        last = self.rows[-1]
        per_unit = (last["front_seconds"] + last["tail_seconds"]) / (last["front_units"] + last["tail_units"])
        pred = self._prediction(context)
        rounds = self.setup.rounds if rounds is None else rounds
        units = (rounds + warmup) * (pred.front_cost + pred.tail_cost)
        if self.setup.fill == "prefill":
            units += self.cost.span_cost(0, context)
        return per_unit * units

    def _prediction(self, context: int):
        setup = self.setup
        evicted = round(EVICT_FRAC * context)
        return predict_speedup(self.cost, context, evict_start=setup.evict_start, append=setup.append,
                               evicted=evicted)

    def measure(self, gpu_context: int, benchmark=None, rounds: int | None = None, warmup: int = 1) -> dict:
        """Measure the context that stands for ``gpu_context`` in the GPU experiment; returns its row.

        Each round times the front request, then the tail request (``rounds`` of them, default the
        setup's, after ``warmup`` untimed ones). With a pytest-benchmark fixture, pedantic runs the
        rounds and its statistics are those of the (front, tail) pairs."""
        setup, device, model, pool = self.setup, self.device, self.model, self.pool
        rounds = setup.rounds if rounds is None else rounds
        context = gpu_context // setup.scale
        pred = self._prediction(context)
        evicted = pred.evicted
        table = torch.arange(context + setup.append, dtype=torch.int32)[None]

        prefill_seconds = None
        if setup.fill == "prefill":
            history = EngineBatch.build(self.tokens[:context], table, [[0, 0, 0, context]])
            self._sync()
            prefill_seconds = elapsed(lambda: model.forward(history, pool, logits_rows=[context - 1]), device,
                                      setup.clock)
        front, tail = next_requests(self.tokens, context, evicted, setup.evict_start, setup.append)
        logits = {}
        times: dict[str, list[float]] = {"front": [], "tail": []}

        def run(name, batch):
            def call():
                logits[name] = model.forward(batch, pool, logits_rows=[batch.num_tokens - 1])

            times[name].append(elapsed(call, device, setup.clock))

        def one_round():
            run("front", front)
            run("tail", tail)

        self._sync()
        if benchmark is not None:
            benchmark.pedantic(one_round, rounds=rounds, warmup_rounds=warmup, iterations=1)
        else:
            for _ in range(rounds + warmup):
                one_round()
        front_times, tail_times = times["front"][warmup:], times["tail"][warmup:]
        # Both variants end with the same new tokens over the same history: the next token's
        # logits agree up to rounding, unless the pool holds random K/V instead of the history.
        logit_diff = float((logits["front"].float() - logits["tail"].float()).abs().max())

        decode = EngineBatch.build(self.tokens[context : context + 1], table, [[0, 0, context, 1]])
        decode_times = [elapsed(lambda: model.forward(decode, pool, logits_rows=[0]), device, setup.clock)
                        for _ in range(setup.decode_rounds + 1)][1:]

        front_s, tail_s = _pick(front_times, setup.timing), _pick(tail_times, setup.timing)
        measured = tail_s / front_s
        front_pairs = self.cost.attention_pairs(setup.evict_start, setup.evict_start + evicted) + \
            self.cost.attention_pairs(context, context + setup.append)
        tail_pairs = self.cost.attention_pairs(context - evicted, context + setup.append)
        row = {
            "gpu_context": gpu_context,
            "context": context,
            "evicted": evicted,
            "evict_start": setup.evict_start,
            "append": setup.append,
            "front_seconds": front_s,
            "tail_seconds": tail_s,
            "rounds": rounds,
            "front_seconds_all": front_times,
            "tail_seconds_all": tail_times,
            "measured_speedup": measured,
            "predicted_speedup": pred.predicted_speedup,
            "relative_error": measured / pred.predicted_speedup - 1.0,
            "paper_speedup": PAPER_SPEEDUP.get(gpu_context),
            "front_units": pred.front_cost,
            "tail_units": pred.tail_cost,
            "query_tokens": evicted + setup.append,
            "front_attention_pairs": int(front_pairs),
            "tail_attention_pairs": int(tail_pairs),
            "prefill_seconds": prefill_seconds,
            "history_attention_pairs": int(self.cost.attention_pairs(0, context)) if prefill_seconds else None,
            "decode_seconds": _pick(decode_times, setup.timing),
            "next_token_logit_diff": logit_diff if setup.fill == "prefill" else None,
        }
        self.rows.append(row)
        return row

    def measure_new_tokens(self, gpu_context: int, rounds: int, warmup: int = 1) -> dict:
        """Time the new tokens of ``gpu_context``'s next request as a batch of their own, over the
        resident history (median of ``rounds`` after ``warmup``). The front and tail requests have
        the same tokens, so their times alone cannot tell a batch's overhead from its per-token
        cost: this third batch, of other tokens, lets one context fit all three prefill constants
        (``calibration_points``). Returns the fields to add to the context's row."""
        setup, model, pool = self.setup, self.model, self.pool
        context = gpu_context // setup.scale
        table = torch.arange(context + setup.append, dtype=torch.int32)[None]
        batch = EngineBatch.build(self.tokens[context : context + setup.append], table,
                                  [[0, 0, context, setup.append]])
        self._sync()
        times = [elapsed(lambda: model.forward(batch, pool, logits_rows=[setup.append - 1]), self.device,
                         setup.clock) for _ in range(warmup + rounds)][warmup:]
        return {"new_tokens_seconds": _pick(times, setup.timing),
                "new_tokens_attention_pairs": int(self.cost.attention_pairs(context, context + setup.append))}

    def summary(self) -> dict:
        """Everything written to ``cost_curve_<kind>.json``."""
        setup = self.setup
        speedups = [row["measured_speedup"] for row in self.rows]
        errors = [abs(row["relative_error"]) for row in self.rows]
        config = dataclasses.asdict(setup.config)
        return {
            "kind": setup.kind,
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "model": config,
            "dtype": str(setup.dtype).removeprefix("torch."),
            "c_lin": self.cost.c_lin,
            "scale": setup.scale,
            "gpu_c_lin": CostModel(shape_from_config(BUILTIN_CONFIGS["qwen3-8b"])).c_lin,
            "evict_frac": EVICT_FRAC,
            "evict_start": setup.evict_start,
            "append": setup.append,
            "attention": setup.attention,
            "fill": setup.fill,
            "rounds": setup.rounds,
            "timing": setup.timing,
            "clock": setup.clock if self.device.type == "cpu" else "cuda-events",
            "threads": torch.get_num_threads() if self.device.type == "cpu" else None,
            "rows": self.rows,
            "max_abs_relative_error": max(errors) if errors else None,
            "speedup_grows_with_context": all(b > a for a, b in itertools.pairwise(speedups)),
            "calibration": self.calibration(),
        }

    def calibration(self) -> dict:
        """Time-model constants fitted to this run (keys of ``penelope.sim.timemodel``)."""
        return fit_calibration(calibration_points(self.rows, self.cost.c_lin), model=self.setup.config.name,
                               gpu=_gpu_kind(self.device), source=self._source())

    def _source(self) -> str:
        device = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return f"microbench/bench_cost_curve.py ({self.setup.kind}: {self.setup.config.name}, " \
               f"{str(self.setup.dtype).removeprefix('torch.')}, {self.setup.attention}) on {device}"

    def write(self, folder: str | Path) -> dict:
        """Write the table (JSON, text), the plot and the calibration into ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        summary = self.summary()
        kind = self.setup.kind
        (folder / f"cost_curve_{kind}.json").write_text(json.dumps(summary, indent=2) + "\n")
        write_calibration(folder / f"calibration_{kind}.json", summary["calibration"])
        (folder / f"cost_curve_{kind}.txt").write_text(curve_table(summary) + "\n")
        plot_curve(summary, folder / f"cost_curve_{kind}.png")
        return summary


def calibration_points(rows: list[dict], c_lin: float) -> list[tuple[float, float, float]]:
    """``(linear_units, attention_pairs, seconds)`` of every timed batch of ``rows`` (both requests
    of each context, the history's prefill when it ran, the new tokens alone when they were
    timed): ``fit_calibration``'s points."""
    points = []
    for row in rows:
        tokens = row["query_tokens"]
        points.append((c_lin * tokens, row["front_attention_pairs"], row["front_seconds"]))
        points.append((c_lin * tokens, row["tail_attention_pairs"], row["tail_seconds"]))
        if row["prefill_seconds"] is not None:
            points.append((c_lin * row["context"], row["history_attention_pairs"], row["prefill_seconds"]))
        if row.get("new_tokens_seconds") is not None:
            points.append((c_lin * row["append"], row["new_tokens_attention_pairs"], row["new_tokens_seconds"]))
    return points


def _gpu_kind(device: torch.device) -> str | None:
    return gpu_kind(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def curve_table(summary: dict) -> str:
    """The cost-curve table as text: a title, one line per context, the largest error."""
    headers = ("context", "(GPU)", "front s", "tail s", "measured", "model", "error", "paper")
    rows = [
        (row["context"], f"{row['gpu_context'] // 1024}K", f"{row['front_seconds']:.4f}",
         f"{row['tail_seconds']:.4f}", f"{row['measured_speedup']:.3f}x", f"{row['predicted_speedup']:.3f}x",
         f"{row['relative_error']:+.1%}", f"{row['paper_speedup']:.2f}" if row["paper_speedup"] else "-")
        for row in summary["rows"]
    ]
    lines = [
        f"cost curve ({summary['kind']}: {summary['model']['name']}, {summary['dtype']}, "
        f"c_lin {summary['c_lin']:,.0f}, positions / {summary['scale']}, attention {summary['attention']})",
        format_table(headers, rows),
    ]
    if summary["rows"]:
        lines.append(f"max |error| {summary['max_abs_relative_error']:.1%}; speedup grows with context: "
                     f"{summary['speedup_grows_with_context']}")
    return "\n".join(lines)


def plot_curve(summary: dict, path: Path) -> None:
    """Measured and predicted speedup against the (GPU-equivalent) context, with the paper's points."""
    from penelope.plotting import pyplot

    plt = pyplot()
    rows = summary["rows"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    x = [row["gpu_context"] for row in rows]
    ax.plot(x, [row["predicted_speedup"] for row in rows], "-", color="tab:blue", label="cost model")
    ax.plot(x, [row["measured_speedup"] for row in rows], "o", color="tab:orange",
            label=f"measured ({summary['kind']})")
    ax.plot(list(PAPER_SPEEDUP), list(PAPER_SPEEDUP.values()), "s", mfc="none", color="black",
            label="paper (H100)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(GPU_CONTEXTS), [f"{n // 1024}K" for n in GPU_CONTEXTS])
    xlabel = "context"
    if summary["scale"] != 1:
        xlabel += f" (GPU experiment's; run at 1/{summary['scale']} on {summary['kind']})"
    ax.set_xlabel(xlabel)
    ax.set_ylabel("tail / front recompute time")
    ax.set_title(f"Front vs tail eviction: {summary['model']['name']}, {summary['dtype']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _context_id(n: int) -> str:
    return f"{n // 1024}K"


# The figures of a row that each context's result records under the row's own names.
RECORDED = ("context", "gpu_context", "evicted", "rounds", "front_seconds", "tail_seconds", "measured_speedup",
            "predicted_speedup", "relative_error", "paper_speedup", "decode_seconds", "front_attention_pairs",
            "tail_attention_pairs", "next_token_logit_diff")


def _record(benchmark, run: CurveRun, row: dict) -> None:
    setup = run.setup
    benchmark.extra_info.update({key: row[key] for key in RECORDED})
    benchmark.extra_info.update(
        shape=setup.config.name,
        dtype=str(setup.dtype).removeprefix("torch."),
        scale=setup.scale,
        c_lin=run.cost.c_lin,
        attention=setup.attention,
        timing=setup.timing,
        clock=setup.clock if run.device.type == "cpu" else "cuda-events",
        torch_threads=torch.get_num_threads(),
        query_tokens_exact=row["query_tokens"],
    )


def rounds_within_budget(run: CurveRun, gpu_context: int, left: float | None = None) -> tuple[int, int] | str:
    """``(rounds, warmup)`` that measure one context within ``left`` seconds (default: what is left
    of the setup's time budget): all rounds, else (the largest contexts matter most) one round and
    no warm-up; else why not."""
    context = gpu_context // run.setup.scale
    if left is None:
        left = run.setup.budget_s - (time.perf_counter() - run.started)
    for rounds, warmup in ((run.setup.rounds, 1), (1, 0)):
        expected = run.estimate_seconds(context, rounds, warmup)
        if 0 < left and expected <= left:
            return rounds, warmup
    return f"time budget: about {expected:.0f} s needed, {max(left, 0):.0f} s left"


def _measure_or_skip(run: CurveRun, benchmark, gpu_context: int) -> dict:
    """Measure one context within the setup's time budget, else skip."""
    plan = rounds_within_budget(run, gpu_context)
    if isinstance(plan, str):
        pytest.skip(plan)
    row = run.measure(gpu_context, benchmark, rounds=plan[0], warmup=plan[1])
    _record(benchmark, run, row)
    return row


@pytest.fixture(scope="module")
def cpu_curve(bench_out):
    setup = SETUPS["cpu"]
    threads = torch.get_num_threads()
    torch.set_num_threads(setup.threads)
    try:
        run = CurveRun(setup, "cpu")
        yield run
        if run.rows:
            print("\n" + curve_table(run.write(bench_out)))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def gpu_curve(bench_out):
    run = CurveRun(SETUPS["gpu"], "cuda")
    yield run
    if run.rows:
        print("\n" + curve_table(run.write(bench_out)))
    del run
    torch.cuda.empty_cache()


@pytest.mark.parametrize("gpu_context", GPU_CONTEXTS, ids=_context_id)
def test_cost_curve_cpu(benchmark, cpu_curve, gpu_context):
    row = _measure_or_skip(cpu_curve, benchmark, gpu_context)
    assert math.isfinite(row["measured_speedup"]) and row["measured_speedup"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("gpu_context", GPU_CONTEXTS, ids=_context_id)
def test_gpu_cost_curve(benchmark, gpu_curve, gpu_context):
    row = _measure_or_skip(gpu_curve, benchmark, gpu_context)
    assert math.isfinite(row["measured_speedup"]) and row["measured_speedup"] > 0
