"""An A/B run: the same traffic against one SGLang server per configuration, repeats interleaved.

Order (`run_order`): round r runs every configuration once, the list rotated by r (A B C, B C A,
C A B, ...), so no configuration always runs first or last in a round and slow drifts of the
machine (other jobs, heat) fall on every configuration alike. Round r of every configuration is
one pair: its figures are compared with the baseline's round r (`penelope.loadgen.ab_report`).

Servers (`servers`):
- `fresh` (the default): one server at a time, a freshly started one for every run (its start-up
  is not timed), so no state carries over from one run to the next.
- `kept`: each configuration's server starts once and runs all its rounds (the cache flushed
  before each, as `penelope load` does): 1-2 minutes of start-up saved per run, but a
  configuration's rounds then run back to back, not interleaved with the others'.
- `resident`: every configuration's server starts once, one after the other, and all stay up
  together (on CPU an idle SGLang scheduler sleeps, `--sleep-on-idle`); the rounds run in the
  interleaved order, each on a flushed cache. Start-up paid once per configuration and the rounds
  still interleaved in time; it needs the memory of every server at once.

After each start, `warmup` runs of the same workload (not measured, their records not kept; at
most `warmup_requests` requests each) take the server past its first-call costs (kernels loaded,
pools touched), which otherwise fall on the first measured run and change its timing, and with it
what a timing-aware policy evicts.

Before a server's first run, its `/server_info` is read back: the configuration must have been
applied (`ab_configs.check_applied`). Around each run the server's prefill counters are read
(`internal_states[0]["penelope"]`, reported by Penelope's plugin with every cache): `computed` is
the change of `prefill_tokens` (every forward's new tokens) over the run, `positions` that of
`prefill_positions` (the query-key pairs of their attention, what a recomputed token costs by its
position), and `recomputed` is `computed` less what a cache that never evicts would compute for
the same prompts (`prefill_floor`).

Ctrl-C or SIGTERM: the run in progress is cut (its records are kept, the run is not used), the
server is stopped, and `ABResult.interrupted` says so; the runs that finished stay.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp

from penelope.errors import PenelopeError, UsageError
from penelope.loadgen.ab_configs import ABConfig, ServerSetup, check_applied, penelope_counters, prefill_tokens
from penelope.loadgen.prefill_floor import never_evicting_prefill
from penelope.loadgen.records import RecordWriter, RequestRecord
from penelope.loadgen.runner import LoadConfig, RunResult, check_fits, run_load
from penelope.loadgen.summary import RunSummary, summarize
from penelope.loadgen.target import PROBE_TIMEOUT, Target, probe_server
from penelope.loadgen.tokens import TokenSpace
from penelope.sim.workloads.types import Workload

# Run numbers of warm-up runs (in their session ids), apart from the measured rounds'.
WARMUP_REPEAT = 1_000_000


FRESH, KEPT, RESIDENT = "fresh", "kept", "resident"
SERVER_MODES = (FRESH, KEPT, RESIDENT)


def record_path(out: Path, config: ABConfig) -> Path:
    """The file of `config`'s request records."""
    return out / f"records-{config.slug}.jsonl"


def log_path(out: Path, config: ABConfig, round_: int, servers: str) -> Path:
    """The log of the server that serves `config`'s run of `round_`."""
    if servers != FRESH:
        return out / f"server-{config.slug}.log"
    return out / f"server-{config.slug}-round{round_}.log"


def run_outputs(out: Path, configs: Sequence[ABConfig], repeats: int, servers: str = FRESH) -> list[Path]:
    """Every file a run of `configs` writes into `out`: records and server logs."""
    rounds = sorted({round_ for round_, _ in run_order(len(configs), repeats, servers)})
    paths = []
    for config in configs:
        paths.append(record_path(out, config))
        paths += list(dict.fromkeys(log_path(out, config, round_, servers) for round_ in rounds))
    return paths


def run_order(configs: int, repeats: int, servers: str = FRESH) -> list[tuple[int, int]]:
    """(round, configuration index) of every run, in the order they run (see the module docstring)."""
    for name, value in (("configurations", configs), ("`repeats`", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{name} must be at least 1, got {value!r}")
    if servers not in SERVER_MODES:
        raise UsageError(f"servers must be one of {', '.join(SERVER_MODES)}, got {servers!r}")
    if servers == KEPT:
        return [(r, c) for c in range(configs) for r in range(repeats)]
    return [(r, (r + k) % configs) for r in range(repeats) for k in range(configs)]


@dataclass
class ABRun:
    """One run of one configuration. computed: prefill tokens the server computed during it (its
    counter; None when it reports none); floor: what a never-evicting cache would compute;
    recomputed: computed - floor; start_s: the server's start-up time (None: reused)."""

    config: str
    round: int
    position: int
    summary: RunSummary
    computed: int | None
    floor: int | None
    wall: float
    log: str
    start_s: float | None
    flush_error: str | None = None
    floor_error: str | None = None
    positions: int | None = None

    @property
    def recomputed(self) -> int | None:
        if self.computed is None or self.floor is None:
            return None
        return self.computed - self.floor

    def value(self, metric: str) -> float:
        """A metric of `penelope.loadgen.ab_report.METRICS` (NaN when not measured)."""
        if metric in ("computed", "floor", "recomputed", "positions"):
            value = getattr(self, metric)
            return math.nan if value is None else float(value)
        return float(getattr(self.summary, metric))

    def as_dict(self) -> dict:
        return {"config": self.config, "round": self.round, "position": self.position,
                "computed_prefill_tokens": self.computed, "never_evicting_prefill_tokens": self.floor,
                "recomputed_prefill_tokens": self.recomputed, "prefill_attention_pairs": self.positions,
                "wall_s": self.wall, "server_start_s": self.start_s,
                "server_log": self.log, "flush_error": self.flush_error, "floor_error": self.floor_error,
                **self.summary.as_dict()}


@dataclass
class ABResult:
    """Every run that finished, in the order they ran; `servers`: per configuration, its options
    and the settings its server reported; `interrupted`: Ctrl-C or SIGTERM stopped the run."""

    configs: list[ABConfig]
    baseline: str
    repeats: int
    servers_mode: str
    runs: list[ABRun] = field(default_factory=list)
    servers: dict = field(default_factory=dict)
    interrupted: bool = False
    records: dict = field(default_factory=dict)
    # What interrupted it (KeyboardInterrupt, or the CLI's SIGTERM subclass of it).
    stop: BaseException | None = None
    # What stopped it after some runs had finished (a server that did not start, a setting it did
    # not apply): the runs that finished are kept and reported, then the error is.
    error: PenelopeError | None = None

    def runs_of(self, name: str) -> dict[int, ABRun]:
        """round -> run of configuration `name`."""
        return {run.round: run for run in self.runs if run.config == name}

    def paired_rounds(self, name: str) -> list[int]:
        """The rounds in which both `name` and the baseline finished a run."""
        return sorted(set(self.runs_of(name)) & set(self.runs_of(self.baseline)))


ServerFactory = Callable[[ABConfig, Path], AbstractContextManager]


def sglang_server_factory(setup: ServerSetup, env: dict[str, str] | None = None,
                          startup_timeout: float = 600.0) -> ServerFactory:
    """Starts `sglang.launch_server` for a configuration on `setup` (the context manager's value
    has `.url`), its log at the path given."""
    from penelope.loadgen.server import ServerSpec, SGLangServer

    def start(config: ABConfig, log: Path) -> AbstractContextManager:
        spec = ServerSpec(model=setup.model, log=log, args=(*setup.common_args(), *config.args),
                          env=dict(env or {}), startup_timeout=startup_timeout)
        return SGLangServer(spec)

    return start


def server_info(url: str) -> dict:
    """The server's whole `/server_info` (its `internal_states` included)."""

    async def ask() -> dict:
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT)
        async with aiohttp.ClientSession(timeout=timeout) as http, http.get(url + "/server_info") as response:
            if response.status != 200:
                return {}
            data = json.loads(await response.read())
            return data if isinstance(data, dict) else {}

    try:
        return asyncio.run(ask())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return {}


_TREE_CORE = re.compile(r"Init Unified Radix Cache\..*Tree Core: (\w+)")


def tree_core(log: Path) -> str | None:
    """The tree core SGLang's own cache logged at start-up (`RustUnifiedTreeCore` or the Python
    one; None for another cache or another log)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    found = _TREE_CORE.search(text)
    return found.group(1) if found else None


class ABRunner:
    """Runs an A/B comparison (see the module docstring). `start_server(config, log)` returns a
    context manager whose value has `.url` (SGLang by default, a stand-in in tests); `say` gets a
    progress line; `on_record(config, record)` every request's record as it ends."""

    def __init__(self, configs: Sequence[ABConfig], baseline: str, workload: Workload, load: LoadConfig, *,
                 scale: float, seed: int, page: int, out: Path, start_server: ServerFactory, repeats: int = 1,
                 servers: str = FRESH, warmup: int = 0, warmup_requests: int | None = None,
                 api: str = "generate", vocab: int | None = None,
                 say: Callable[[str], None] = print,
                 on_record: Callable[[str, RequestRecord], None] | None = None):
        self.configs = list(configs)
        self.workload, self.load = workload, load
        self.scale, self.seed, self.page = scale, seed, page
        self.out = out
        self.start_server = start_server
        self.api, self.vocab = api, vocab
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise UsageError(f"`warmup` must be a non-negative integer, got {warmup!r}")
        if warmup_requests is not None and (isinstance(warmup_requests, bool) or not isinstance(warmup_requests, int)
                                            or warmup_requests < 1):
            raise UsageError(f"`warmup_requests` must be at least 1, got {warmup_requests!r}")
        self.warmup = warmup
        self.warmup_load = self.load
        if warmup_requests is not None:
            bound = warmup_requests if load.max_requests is None else min(warmup_requests, load.max_requests)
            self.warmup_load = replace(load, max_requests=bound)
        self.say = say
        self.on_record = on_record
        self.order = run_order(len(self.configs), repeats, servers)
        self.result = ABResult(self.configs, baseline, repeats, servers)

    def record_path(self, config: ABConfig) -> Path:
        return record_path(self.out, config)

    def log_path(self, config: ABConfig, round_: int) -> Path:
        return log_path(self.out, config, round_, self.result.servers_mode)

    def run(self) -> ABResult:
        """Every run of the order; returns the result (also on Ctrl-C, `interrupted` set)."""
        writers = {c.name: RecordWriter(str(self.record_path(c))) for c in self.configs}
        self.result.records = {c.name: str(self.record_path(c)) for c in self.configs}
        try:
            if self.result.servers_mode == RESIDENT:
                self._serve_resident(writers)
            elif self.result.servers_mode == KEPT:
                for index, config in enumerate(self.configs):
                    rounds = [r for r, c in self.order if c == index]
                    self._serve(config, rounds, writers[config.name])
            else:
                for round_, index in self.order:
                    self._serve(self.configs[index], [round_], writers[self.configs[index].name])
        except KeyboardInterrupt as stop:
            self.result.interrupted = True
            self.result.stop = stop
        except PenelopeError as error:
            if not self.result.runs:
                raise
            self.result.error = error
        finally:
            for writer in writers.values():
                writer.close()
        return self.result

    def _start(self, stack: ExitStack, config: ABConfig, round_: int, label: str | None = None) -> tuple[Target, float]:
        """Start `config`'s server (stopped when `stack` closes), check it and warm it up: its target
        and its start-up seconds. `label`: the progress line's counter (default: the next run's)."""
        log = self.log_path(config, round_)
        label = label or f"[{len(self.result.runs) + 1}/{len(self.order)}]"
        self.say(f"{label} {config.name}: starting its server (log {log})")
        began = time.perf_counter()
        server = stack.enter_context(self.start_server(config, log))
        start_s = time.perf_counter() - began
        target = probe_server(server.url, self.api, vocab=self.vocab)
        info = server_info(server.url)
        if config.name not in self.result.servers:
            applied = check_applied(config, info)
            space = TokenSpace(vocab=target.vocab, seed=self.seed, scale=self.scale)
            check_fits(self.workload, space, target, self.load.max_requests)
            self.result.servers[config.name] = {"args": list(config.args), "applied": applied,
                                                "server": target.info, "url": target.url,
                                                "vocab": target.vocab, "tree_core": tree_core(log)}
        if self.warmup:
            self.say(f"  {config.name}: {self.warmup} warm-up run{'s' if self.warmup > 1 else ''} (not measured)")
            space = TokenSpace(vocab=target.vocab, seed=self.seed, scale=self.scale)
            run_load(target, self.workload, space, self.warmup_load, repeats=self.warmup, first_repeat=WARMUP_REPEAT)
        return target, start_s

    def _serve(self, config: ABConfig, rounds: list[int], writer: RecordWriter) -> None:
        """Start `config`'s server, run `rounds` on it, stop it."""
        with ExitStack() as stack:
            target, start_s = self._start(stack, config, rounds[0])
            for round_ in rounds:
                self._one_run(config, round_, target, writer, start_s)
                start_s = None

    def _serve_resident(self, writers: dict[str, RecordWriter]) -> None:
        """Start every configuration's server, then run the whole order on them; stop them all."""
        with ExitStack() as stack:
            started = {config.name: self._start(stack, config, 0, f"[server {i + 1}/{len(self.configs)}]")
                       for i, config in enumerate(self.configs)}
            for round_, index in self.order:
                config = self.configs[index]
                target, start_s = started[config.name]
                self._one_run(config, round_, target, writers[config.name], start_s)
                started[config.name] = (target, None)

    def _one_run(self, config: ABConfig, round_: int, target: Target, writer: RecordWriter,
                 start_s: float | None) -> None:
        space = TokenSpace(vocab=target.vocab, seed=self.seed, scale=self.scale)
        position = self.order.index((round_, self.configs.index(config)))
        self.say(f"[{position + 1}/{len(self.order)}] {config.name}, round {round_ + 1}: "
                 f"{self.workload.num_requests:,} requests"
                 + (f" (server started in {start_s:.0f} s)" if start_s is not None else ""))

        def on_record(record: RequestRecord) -> None:
            writer.write(record)
            if self.on_record is not None:
                self.on_record(config.name, record)

        before_info = server_info(target.url)
        before = prefill_tokens(before_info)
        [result] = run_load(target, self.workload, space, self.load, repeats=1, first_repeat=round_,
                            on_record=on_record)
        after_info = server_info(target.url)
        after = prefill_tokens(after_info)
        computed = after - before if before is not None and after is not None else None
        pairs = [prefill_tokens(i, "prefill_positions") for i in (before_info, after_info)]
        positions = pairs[1] - pairs[0] if None not in pairs else None
        floor, floor_error = self._floor(result, space)
        run = ABRun(config.name, round_, position, summarize(result), computed, floor, result.wall,
                    str(self.log_path(config, round_)), start_s, result.flush_error, floor_error, positions)
        self.result.runs.append(run)
        counters = penelope_counters(after_info) or {}
        if "policy" in counters:
            self.result.servers[config.name].setdefault("counters_last", {}).update(counters)
        self.say(f"  {config.name}, round {round_ + 1}: {run.summary.finished:,}/{run.summary.sent:,} finished, "
                 f"TTFT mean {run.summary.ttft_mean * 1e3:,.1f} ms, "
                 + (f"{computed:,} prefill tokens computed" if computed is not None else "prefill not reported")
                 + (f", {run.recomputed:,} recomputed" if run.recomputed is not None else "")
                 + f" ({result.wall:.0f} s)")

    def _floor(self, result: RunResult, space: TokenSpace) -> tuple[int | None, str | None]:
        try:
            return never_evicting_prefill(result.records, self.workload, space, self.page), None
        except ValueError as err:
            return None, str(err)
