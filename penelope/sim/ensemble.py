"""Replay ensembles: every setting replayed N times with seeded perturbations, in parallel.

`run_ensembles` replays each (capacity, run, policy) once. Run i of every policy and every
capacity uses the same perturbation (`Perturbation.time_model(model, i)` and
`Perturbation.workload(workload, i)`), so the runs are paired; each run's changes against the
baseline are computed within the run (`penelope.sim.run.compare_with_baseline`), and an
`Ensemble` reports every metric and every change as a mean with its interval
(`penelope.sim.stats`).

Replays are independent and deterministic, so they run in `jobs` worker processes (spawned, each
receiving the workload once) with results identical to a sequential run: a replay's outcome
depends only on its inputs, and results are put back in (capacity, run, policy) order whatever
the order they finish in. Only `wall_time` (seconds a replay took) differs. Every replay drops
its per-request records and its servers' queue traces once summarized; the summaries stay.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import multiprocessing
import os
import queue as queue_module
import signal
import threading
from dataclasses import dataclass

from penelope.costmodel.recompute import CostModel
from penelope.errors import UsageError
from penelope.sim.bracket import DISTANCE_FIELDS, compare_with_oracle
from penelope.sim.metrics import CHANGE_FIELDS, Summary
from penelope.sim.perturb import Perturbation
from penelope.sim.run import BASELINE, PolicyResult, SimConfig, compare_with_baseline, json_ready, run_policy
from penelope.sim.stats import CONFIDENCE, Estimate
from penelope.sim.timemodel import TimeModel
from penelope.sim.workloads.types import Workload

# Summary fields reported with an interval (times in s, sizes in tokens).
METRIC_FIELDS = tuple(field.name for field in dataclasses.fields(Summary) if field.name not in ("requests", "sessions"))
# Changes against the baseline: relative changes (lower is better), and hit-rate points (higher is better).
CHANGES = (*CHANGE_FIELDS, "hit_rate_points")
HIGHER_IS_BETTER = ("hit_rate_points",)
# A progress message from a worker every this many finished requests.
PROGRESS_BATCH = 64
# What a terminal or a service manager sends to stop the command (and its workers).
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def default_jobs() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@dataclass
class Ensemble:
    """`runs[i][policy]`: run i of each policy at one server configuration, changes paired within
    the run. `perturbation` is None for a single unperturbed run."""

    config: SimConfig
    runs: list[dict[str, PolicyResult]]
    perturbation: Perturbation | None
    confidence: float = CONFIDENCE

    @property
    def repeat(self) -> int:
        return len(self.runs)

    @property
    def policies(self) -> list[str]:
        return list(self.runs[0])

    @property
    def baseline(self) -> str:
        return next(name for name, r in self.runs[0].items() if r.canonical == BASELINE)

    def values(self, policy: str, field: str) -> list[float]:
        """The metric `field` of `policy` in every run, in run order."""
        return [float(getattr(run[policy].summary, field)) for run in self.runs]

    def estimate(self, policy: str, field: str) -> Estimate:
        """Mean and interval of a summary field of `policy` over the runs."""
        return Estimate.of(self.values(policy, field), self.confidence)

    def change(self, policy: str, field: str) -> Estimate:
        """Mean and interval of `policy`'s per-run change against the baseline (paired runs):
        relative for `CHANGE_FIELDS`, percentage points for `hit_rate_points`."""
        if field not in CHANGES:
            raise UsageError(f"unknown change {field!r}; known: {', '.join(CHANGES)}")
        return Estimate.of([run[policy].changes[field] for run in self.runs], self.confidence)

    @property
    def has_oracle(self) -> bool:
        return bool(self.runs[0][self.policies[0]].to_oracle)

    def to_oracle(self, policy: str, field: str) -> Estimate:
        """Mean and interval of `policy`'s per-run distance to the oracle's run (`field` of
        `penelope.sim.bracket.DISTANCE_FIELDS` or `cost_over_bound`)."""
        return Estimate.of([run[policy].to_oracle[field] for run in self.runs], self.confidence)

    def bound(self) -> Estimate:
        """Mean and interval of the lower bound on recompute cost (the oracle's runs)."""
        oracle = next(name for name, r in self.runs[0].items() if r.bound is not None)
        return Estimate.of([run[oracle].bound for run in self.runs], self.confidence)

    def verdict(self, policy: str, field: str) -> str:
        """`win`, `loss` or `no significant difference` for `policy`'s change of `field`."""
        return self.change(policy, field).verdict(lower_is_better=field not in HIGHER_IS_BETTER)

    def policy_dict(self, policy: str) -> dict:
        """JSON-ready: every metric and change as mean, low, high, n; each change's verdict; and
        every run's figures (`PolicyResult.as_dict`)."""
        first = self.runs[0][policy]
        return json_ready({
            "policy": first.canonical,
            "repeat": self.repeat,
            "metrics": {field: self.estimate(policy, field).as_dict() for field in METRIC_FIELDS},
            "vs_sglang": {
                field: {**self.change(policy, field).as_dict(), "verdict": self.verdict(policy, field)}
                for field in CHANGES
            },
            **({"vs_oracle": {field: self.to_oracle(policy, field).as_dict()
                              for field in (*DISTANCE_FIELDS, "cost_over_bound")}} if self.has_oracle else {}),
            "runs": [run[policy].as_dict() for run in self.runs],
        })


class _Replayer:
    """The inputs every replay of an ensemble shares, and one replay by task."""

    def __init__(self, workload, configs, time_model, cost_model, perturbation, progress=None):
        self.workload = workload
        self.configs = configs
        self.time_model = time_model
        self.cost = cost_model
        self.perturbation = perturbation
        self.progress = progress
        self._perturbed: tuple[int, Workload] | None = None

    def run(self, task: tuple[int, int, str]) -> PolicyResult:
        """Replay task (config index, run number, policy); per-request records are dropped."""
        config_index, run, policy = task
        time_model, workload = self.time_model, self.workload
        if self.perturbation is not None:
            time_model = self.perturbation.time_model(time_model, run)
            # Policies of one run follow each other in task order: perturb the workload once per run.
            if self._perturbed is None or self._perturbed[0] != run:
                self._perturbed = (run, self.perturbation.workload(workload, run))
            workload = self._perturbed[1]
        result = run_policy(workload, policy, self.configs[config_index], time_model, self.cost, self.progress)
        # The summaries (fleet ones included) are made: drop what grows with the trace.
        servers = [dataclasses.replace(counters, queue=[]) for counters in result.replay.servers]
        result.replay = dataclasses.replace(result.replay, records=[], servers=servers, events=[])
        return result


class _QueueProgress:
    """A worker's progress: finished requests sent to the parent in batches."""

    def __init__(self, channel):
        self.channel = channel
        self.pending = 0

    def update(self, n: int = 1) -> None:
        self.pending += n
        if self.pending >= PROGRESS_BATCH:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.channel.put(self.pending)
            self.pending = 0


_WORKER: _Replayer | None = None


def _start_worker(workload, configs, time_model, cost_model, perturbation, channel) -> None:
    global _WORKER
    # Ctrl-C and SIGTERM reach every process of the terminal's (or service's) group: workers
    # ignore them and the parent, which owns the outcome, stops them (`_stop_workers`).
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    _WORKER = _Replayer(workload, configs, time_model, cost_model, perturbation, _QueueProgress(channel))


def _run_in_worker(task):
    try:
        return _WORKER.run(task)
    finally:
        _WORKER.progress.flush()


def run_ensembles(
    workload: Workload,
    policies: list[str],
    configs: list[SimConfig],
    time_model: TimeModel,
    cost_model: CostModel,
    repeat: int = 1,
    perturbation: Perturbation | None = None,
    jobs: int = 1,
    progress=None,
    on_ensemble=None,
) -> list[Ensemble]:
    """One `Ensemble` per configuration: `repeat` runs of every policy (`policies` must include the
    baseline), run i perturbed by `perturbation` (None: every run is the nominal replay).

    jobs: worker processes (1: in this process); progress: anything with `update(n)` (a tqdm bar),
    told of every finished or skipped request of every replay; on_ensemble: called with
    (configuration index, Ensemble) as soon as every run of a configuration is done (so a caller
    interrupted later keeps what finished)."""
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise UsageError(f"`repeat` must be a positive integer, got {repeat!r}")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise UsageError(f"`jobs` must be a positive integer, got {jobs!r}")
    tasks = [(c, run, policy) for c in range(len(configs)) for run in range(repeat) for policy in policies]
    jobs = min(jobs, len(tasks))
    by_task: dict[tuple[int, int, str], PolicyResult] = {}
    left = [repeat * len(policies)] * len(configs)
    ensembles: dict[int, Ensemble] = {}

    def done(task, result: PolicyResult) -> None:
        by_task[task] = result
        c = task[0]
        left[c] -= 1
        if left[c]:
            return
        runs = []
        for run in range(repeat):
            outcome = {policy: by_task[c, run, policy] for policy in policies}
            compare_with_baseline(outcome)
            compare_with_oracle(outcome)
            runs.append(outcome)
        ensembles[c] = Ensemble(configs[c], runs, perturbation)
        if on_ensemble is not None:
            on_ensemble(c, ensembles[c])

    if jobs == 1:
        replayer = _Replayer(workload, configs, time_model, cost_model, perturbation, progress)
        for task in tasks:
            done(task, replayer.run(task))
    else:
        _run_parallel(tasks, jobs, (workload, configs, time_model, cost_model, perturbation), progress, done)
    return [ensembles[c] for c in range(len(configs))]


@contextlib.contextmanager
def _signals_ignored():
    """Ctrl-C and SIGTERM ignored in this process for a while (a second Ctrl-C must not break
    the cleanup of the first), but a SIGTERM among them is delivered when the while ends: a
    service that terminated the run must see it exit as terminated. A no-op outside the main
    thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    # SIGINT is ignored at once; a SIGTERM only noted (if it is still being handled when the while
    # ends, the restored handler takes it, which is the same delivery).
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
                signal.SIGTERM: signal.signal(signal.SIGTERM, lambda signum, frame: held.append(signum))}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if held:
            signal.raise_signal(signal.SIGTERM)


@contextlib.contextmanager
def _signals_deferred():
    """Ctrl-C and SIGTERM held back for a while, then delivered: blocked (so processes started
    meanwhile inherit the block and ignore both while they import, until their initializer
    ignores them for good) and, should another thread of this process take one, only noted by
    the handler. Ignoring them instead lost them. Falls back to ignoring them where signals
    cannot be blocked (outside the main thread it does nothing)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        with _signals_ignored():
            yield
        return
    held: list[int] = []
    handlers = {sig: signal.signal(sig, lambda signum, frame: held.append(signum)) for sig in _STOP_SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if held:
            # Signals held together are handled in signal-number order, SIGINT first, whatever
            # order they came in: a termination wins.
            signal.raise_signal(signal.SIGTERM if signal.SIGTERM in held else held[0])


def _stop_workers(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Kill the pool's workers (they ignore signals) and shut it down without waiting for tasks."""
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.kill()
    pool.shutdown(wait=True)


def _run_parallel(tasks, jobs: int, shared: tuple, progress, done) -> None:
    """Run `tasks` in `jobs` worker processes; `done(task, result)` as each finishes."""
    # Spawned workers: nothing of this process's state (threads, locks, a progress bar) is
    # inherited; each receives the shared inputs once, pickled.
    context = multiprocessing.get_context("spawn")
    channel = context.Queue()

    def drain() -> None:
        while True:
            try:
                count = channel.get_nowait()
            except queue_module.Empty:
                return
            if progress is not None:
                progress.update(count)

    pool = concurrent.futures.ProcessPoolExecutor(
        max_workers=jobs, mp_context=context, initializer=_start_worker, initargs=(*shared, channel))
    try:
        # Workers start while submitting, with Ctrl-C and SIGTERM blocked until their initializer
        # ignores them for good, so a Ctrl-C while they import prints no traceback there; here
        # the signal is delivered once they have started (ignoring it instead lost it).
        with _signals_deferred():
            futures = {pool.submit(_run_in_worker, task): index for index, task in enumerate(tasks)}
        pending = set(futures)
        while pending:
            finished, pending = concurrent.futures.wait(
                pending, timeout=0.2, return_when=concurrent.futures.FIRST_COMPLETED
            )
            drain()
            for future in finished:
                index = futures[future]
                done(tasks[index], future.result())
    except BaseException:
        with _signals_ignored():
            _stop_workers(pool)
            # A killed worker may have left a message half written: never wait on the channel.
            channel.cancel_join_thread()
        raise
    pool.shutdown(wait=True)
    # The pool has shut down, so every worker's messages are in the pipe.
    drain()
    channel.close()
