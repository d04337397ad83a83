"""Front against tail eviction through SGLang's real HTTP server on CPU, against the cost model.

``python scripts/sglang_cpu_cost_curve.py --out results/cpu/sglang_cost_curve.json`` writes the
scale model of Qwen3-8B (``penelope.engine.scale_model``, scale 8 by default) and, per context,
starts ``python -m sglang.launch_server`` on 127.0.0.1 (its own process group, killed at the end)
with the prefix-aware CPU attention (``--attention-backend torch_native_prefix``), Penelope's
radix cache, pages of 64 and a pool of the context plus 5 pages. It measures, with fresh prompts
and streaming ``/generate`` with ``input_ids`` (time to the first streamed token):

- prefill: the time of a fresh prompt of 1K..32K tokens (cache flushed before each);
- eviction, at contexts 8K, 16K, 32K: a cached history of n tokens, 30% of it (E tokens, whole
  pages) evicted as one span starting at 2K / scale (front) or from the tail, then the next request
  (the history + 512 / scale new tokens) is timed. Each cache state is produced for real:
  - tail: flush, then the history's first n - E tokens as a request: the cache holds them, and the
    next request recomputes the last E tokens and the new ones;
  - front: flush, the history as a request, then its first 2K / scale tokens plus one page of other
    tokens (so the history's private part starts at 2K / scale), then a filler request of new
    tokens sized so that SGLang asks the cache for exactly E more tokens: Penelope's policy evicts
    them from the head of the least recently used history's private part, the span
    [2K / scale, 2K / scale + E). The next request refills that hole with a phantom in its batch.
  Every state is checked with the server's own counters (tokens evicted; tokens and query-key
  positions each timed request computed), so a run that did not produce the intended state fails.
  Front and tail alternate (A B, B A, ...) over ``--repeats`` rounds.

The prediction is ``penelope.costmodel.recompute.predict_speedup`` for the served checkpoint's
config (its own ``c_lin``) with the same evicted tokens, start and appended tokens; also the
times predicted by the time model fitted to this run's prefills (``fit_calibration``: overhead +
per linear unit + per attention pair). Times are wall clock on a machine that may be shared: the
medians and the 95% interval of the per-round speedups are reported.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from penelope.costmodel.recompute import CostModel, predict_speedup
from penelope.costmodel.shapes import get_model
from penelope.engine.scale_model import save_scale_model
from penelope.errors import PenelopeError, UsageError
from penelope.loadgen.server import CPU_ENV, ServerSpec, SGLangServer
from penelope.sim.calibration import fit_calibration
from penelope.sim.stats import Estimate
from penelope.tables import format_table

ROOT = Path(__file__).resolve().parents[1]
STUB = ROOT / "tests" / "engine_stub"
PAGE = 64
# Pages of pool beyond the context: the front state's extra page, and room for the filler's
# per-request page that SGLang's allocator reserves.
SPARE_PAGES = 5
ATTENTION = "torch_native_prefix"


@dataclass(frozen=True)
class Layout:
    """One context's experiment, in tokens of the scale model: the cached history, the tokens
    evicted (whole pages), where the front span starts, and the tokens the next request adds."""

    context: int
    evicted: int
    evict_start: int
    append: int

    @classmethod
    def at(cls, context: int, scale: float, evict_frac: float = 0.3) -> Layout:
        if context % PAGE:
            raise UsageError(f"context {context} is not a whole number of {PAGE}-token pages")
        start = PAGE * round(2048 / scale / PAGE)
        evicted = PAGE * round(evict_frac * context / PAGE)
        if not 0 < evicted <= context - start - PAGE:
            raise UsageError(f"cannot evict {evicted} tokens from {start} in a context of {context}")
        return cls(context, evicted, start, max(1, round(512 / scale)))

    def expected(self, state: str) -> tuple[int, int]:
        """(tokens, positions) the next request's prefill computes after the `state` eviction, as
        the server's counters count them: a token at position p attends to the p before it, so a
        segment of n tokens after a prefix of p sums ``n * p + n * (n - 1) / 2`` positions, the
        cost model's attention units."""
        segments = ([(self.evict_start, self.evicted), (self.context, self.append)] if state == "front"
                    else [(self.context - self.evicted, self.evicted + self.append)])
        return (sum(n for _, n in segments), sum(n * p + n * (n - 1) // 2 for p, n in segments))


class Server:
    """``sglang.launch_server`` on 127.0.0.1 (`penelope.loadgen.server.SGLangServer`: a process
    group of its own, its output in `log`, the whole group stopped on exit, on an error and on
    Ctrl-C), and the requests this script times."""

    def __init__(self, model: Path, port: int | None, pool: int, chunk: int, log: Path, attention: str = ATTENTION,
                 start_timeout: float = 900):
        args = ("--device", "cpu", "--dtype", "float32", "--attention-backend", attention, "--disable-cuda-graph",
                "--skip-tokenizer-init", "--page-size", str(PAGE), "--max-total-tokens", str(pool),
                "--chunked-prefill-size", str(chunk), "--max-prefill-tokens", str(chunk),
                "--max-running-requests", "4", "--sleep-on-idle", "--random-seed", "0", "--mem-fraction-static", "0.5",
                "--radix-cache-backend", "penelope", "--log-level", "warning")
        path = os.pathsep.join(p for p in (str(STUB), os.environ.get("PYTHONPATH", "")) if p)
        self.server = SGLangServer(ServerSpec(model=str(model), log=log, args=args, port=port,
                                              env={**CPU_ENV, "PYTHONPATH": path}, startup_timeout=start_timeout))

    @property
    def url(self) -> str:
        return self.server.url

    def __enter__(self) -> Server:
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()

    def ttft(self, ids: list[int], timeout: float = 900) -> tuple[float, dict]:
        """Send `ids` (one greedy token, streamed); seconds from sending to the first streamed
        token, and the last meta_info."""
        body = json.dumps({"input_ids": ids, "stream": True,
                           "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).encode()
        request = urllib.request.Request(self.url + "/generate", body, {"Content-Type": "application/json"})
        first, meta = None, {}
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            for line in reply:
                line = line.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise RuntimeError(f"the server failed a request: {chunk['error']}")
                if first is None and chunk.get("output_ids"):
                    first = time.perf_counter() - start
                meta = chunk.get("meta_info", meta)
        if first is None:
            raise RuntimeError("the server streamed no token")
        return first, meta

    def flush(self) -> None:
        with urllib.request.urlopen(urllib.request.Request(self.url + "/flush_cache", method="POST"),
                                    timeout=60) as reply:
            if reply.status != 200:
                raise RuntimeError(f"flush_cache answered {reply.status}")

    def info(self) -> dict:
        with urllib.request.urlopen(self.url + "/server_info", timeout=60) as reply:
            return json.loads(reply.read())

    def counters(self) -> dict:
        return (self.info().get("internal_states") or [{}])[0]["penelope"]


class Tokens:
    """Fresh token ids in [3, vocab): no two draws share a prefix (first tokens differ)."""

    def __init__(self, vocab: int, seed: int):
        self.vocab, self.rng, self.first = vocab, random.Random(seed), 3

    def draw(self, n: int) -> list[int]:
        self.first = 3 + (self.first - 2) % (self.vocab - 3)
        return [self.first] + [self.rng.randrange(3, self.vocab) for _ in range(n - 1)]


def measure_prefill(server: Server, tokens: Tokens, lengths: list[int], repeats: int, say) -> dict[int, list[float]]:
    """Seconds to the first token of a fresh prompt of each length (cache flushed), rotated order."""
    times: dict[int, list[float]] = {n: [] for n in lengths}
    for round_ in range(repeats):
        for n in lengths[round_ % len(lengths):] + lengths[:round_ % len(lengths)]:
            server.flush()
            before = server.counters()["prefill_tokens"]
            seconds, _ = server.ttft(tokens.draw(n))
            computed = server.counters()["prefill_tokens"] - before
            if computed != n:
                raise RuntimeError(f"a fresh prompt of {n} tokens computed {computed}")
            times[n].append(seconds)
            say(f"prefill {n:6d} tokens: {seconds:8.3f} s")
    return times


def prepare(server: Server, tokens: Tokens, layout: Layout, state: str, pool: int) -> list[int]:
    """Produce the `state` cache (module docstring); returns the history it holds."""
    history = tokens.draw(layout.context)
    server.flush()
    if state == "tail":
        server.ttft(history[:layout.context - layout.evicted])
        return history
    server.ttft(history)
    server.ttft(history[:layout.evict_start] + tokens.draw(PAGE))
    counters = server.counters()
    free = pool - counters["cached_tokens"]
    # SGLang's paged allocator asks for the extend plus one page per request; the shortfall is
    # what the cache must evict.
    server.ttft(tokens.draw(layout.evicted + free - PAGE))
    evicted = server.counters()["evicted_tokens"] - counters["evicted_tokens"]
    if evicted != layout.evicted:
        raise RuntimeError(f"the filler evicted {evicted} tokens, not {layout.evicted}")
    return history


def measure_eviction(server: Server, tokens: Tokens, layout: Layout, repeats: int, pool: int, say) -> dict:
    times = {"front": [], "tail": []}
    for round_ in range(repeats):
        for state in ("front", "tail") if round_ % 2 == 0 else ("tail", "front"):
            history = prepare(server, tokens, layout, state, pool)
            before = server.counters()
            seconds, meta = server.ttft(history + tokens.draw(layout.append))
            after = server.counters()
            computed = (after["prefill_tokens"] - before["prefill_tokens"],
                        after["prefill_positions"] - before["prefill_positions"])
            if computed != layout.expected(state):
                raise RuntimeError(f"{state} at {layout.context}: the next request computed (tokens, positions) "
                                   f"{computed}, expected {layout.expected(state)}")
            times[state].append(seconds)
            say(f"context {layout.context:6d} {state}: {seconds:8.3f} s (cached_tokens {meta.get('cached_tokens')})")
    return times


def summary(layout: Layout, times: dict, cost: CostModel, fit: dict) -> dict:
    ratios = [t / f for f, t in zip(times["front"], times["tail"], strict=True)]
    estimate = Estimate.of(ratios)
    prediction = predict_speedup(cost, layout.context, evicted=layout.evicted, evict_start=layout.evict_start,
                                 append=layout.append)
    fitted = {}
    for state in ("front", "tail"):
        tokens, positions = layout.expected(state)
        fitted[state] = fitted_seconds(fit, cost.c_lin * tokens, positions)
    front, tail = statistics.median(times["front"]), statistics.median(times["tail"])
    return {**asdict(layout), "front_s": times["front"], "tail_s": times["tail"], "front_median_s": front,
            "tail_median_s": tail, "speedup_median": tail / front, "speedup_per_round": ratios,
            "speedup_mean": estimate.mean, "speedup_low": estimate.low, "speedup_high": estimate.high,
            "predicted_speedup": prediction.predicted_speedup, "fitted_front_s": fitted["front"],
            "fitted_tail_s": fitted["tail"], "fitted_speedup": fitted["tail"] / fitted["front"]}


def fitted_seconds(fit: dict, linear_units: float, pairs: float) -> float:
    """The time model fitted to the prefills (``fit_calibration``'s keys) for a prefill of
    `linear_units` (c_lin * tokens) and `pairs` (the cost model's attention units)."""
    return (fit.get("batch_overhead", 0.0) + fit.get("sec_per_linear_unit", 0.0) * linear_units
            + fit.get("sec_per_attention_pair", 0.0) * pairs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "cpu" / "sglang_cost_curve.json")
    parser.add_argument("--model", type=Path, help="a checkpoint folder (default: write the scale model)")
    parser.add_argument("--scale", type=float, default=8.0)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--prefill", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port", type=int, default=0, help="the server's port (default: a free one)")
    parser.add_argument("--attention-backend", default=ATTENTION)
    args = parser.parse_args(argv)
    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:7.1f} s] {message}", flush=True)

    try:
        if args.repeats < 2:
            raise UsageError("--repeats must be at least 2 (an interval needs two rounds)")
        layouts = [Layout.at(context, args.scale) for context in sorted(args.contexts)]
        with tempfile.TemporaryDirectory(prefix="penelope-scale-model-") as tmp:
            model = args.model or save_scale_model(Path(tmp) / f"qwen3-8b-scale-{args.scale:g}", args.scale,
                                                   args.layers)
            cost = CostModel(get_model(model))
            config = json.loads((Path(model) / "config.json").read_text())
            args.out.parent.mkdir(parents=True, exist_ok=True)
            tokens = Tokens(config["vocab_size"], seed=0)
            prefill, eviction, servers = {}, {}, []
            largest = max([*args.prefill, layouts[-1].context])
            for layout in layouts:
                pool = layout.context + SPARE_PAGES * PAGE
                if layout is layouts[-1]:
                    pool = max(pool, largest + SPARE_PAGES * PAGE)
                chunk = PAGE * (-(-(pool + PAGE) // PAGE))
                log = args.out.with_name(f"{args.out.stem}_server_{layout.context}.log")
                say(f"starting the server for context {layout.context} (pool {pool} tokens; log {log})")
                with Server(model, args.port or None, pool, chunk, log, args.attention_backend) as server:
                    pool = server.info()["max_total_num_tokens"]
                    servers.append({"context": layout.context, "url": server.url, "pool": pool, "log": str(log)})
                    server.flush()
                    server.ttft(tokens.draw(256))
                    if layout is layouts[-1]:
                        prefill = measure_prefill(server, tokens, sorted(args.prefill), args.repeats, say)
                    eviction[layout] = measure_eviction(server, tokens, layout, args.repeats, pool, say)
    except (PenelopeError, RuntimeError, OSError) as error:
        print(f"penelope: {error}", file=sys.stderr)
        return 2

    points = [(cost.c_lin * n, cost.attention_pairs(0, n), seconds) for n, runs in prefill.items() for seconds in runs]
    fit = fit_calibration(points, model=cost.shape.name, gpu=None, source="sglang_cpu_cost_curve")
    results = [summary(layout, times, cost, fit) for layout, times in eviction.items()]
    report = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": 1},
              "model": config, "c_lin": cost.c_lin, "scale": args.scale, "attention_backend": args.attention_backend,
              "prefill": [{"tokens": n, "seconds": runs, "median_s": statistics.median(runs),
                           "cost_units": cost.span_cost(0, n),
                           "fitted_s": fitted_seconds(fit, cost.c_lin * n, cost.attention_pairs(0, n))}
                          for n, runs in prefill.items()],
              "servers": servers, "fit": fit, "eviction": results, "run_s": time.monotonic() - started}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(["prefill tokens", "median s", "fitted s"],
                       [(p["tokens"], f"{p['median_s']:.3f}", f"{p['fitted_s']:.3f}") for p in report["prefill"]]))
    print()
    print(format_table(
        ["context", "evicted", "front s", "tail s", "speedup (median)", "95% interval", "predicted", "fitted"],
        [(r["context"], r["evicted"], f"{r['front_median_s']:.3f}", f"{r['tail_median_s']:.3f}",
          f"{r['speedup_median']:.2f}x", f"[{r['speedup_low']:.2f}, {r['speedup_high']:.2f}]",
          f"{r['predicted_speedup']:.2f}x", f"{r['fitted_speedup']:.2f}x") for r in results]))
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
