"""One simulated server (a replica): its KV cache, scheduler, running decode batch and clock.
This module decides each request's TTFT: its first token exists when the prefill batch that
computes its last prompt chunk completes (`Server._complete_prefill` sets `first_token_time`);
TTFT is that time minus the send time (`penelope.sim.metrics`).

The server alternates batches as SGLang does: when a prefill batch can be formed (a cut prompt
continues, or a waiting request is admitted), it runs, pausing decode; otherwise one decode step
runs for every request that has its first token and still generates. A prefill batch takes
`TimeModel.prefill_time` over every span it computes (phantoms' holes, hole-first chunks and new
tokens; the phantom kernel's cost where phantoms are in the batch) plus CPU->GPU loads; a decode
step takes `TimeModel.decode_step_time` of the batch's KV. Decoding requests hold request rows
(`Scheduler.form_prefill`).

An action (one prefill batch, or a run of decode steps) is started at the server's clock `now`
by `start` and applied by `complete` at its end: cache admissions happen at the start, first
tokens, finished requests and the checkpoint of a cut request (`Scheduler.checkpoint`) at the
end. Between events nothing changes for the scheduler, so a decode run goes on up to the next
finish in one action; a request that reaches the server during the run cuts it after the step
during which it arrived (`receive`): the step completes, then the scheduler sees the request.

`in_flight` counts the requests received and not finished (waiting, prefilling or decoding): the
load a router sees (SGLang's router counts a worker's requests from routing to response).

Hints (`penelope.cache.hints`): the server tells its cache of every request it receives (`arrived`, at
its send time) and finishes (`finished`, with what its session waits for next, made by
`finished_hint`), and advances the cache's clock to its own before every action. A request that
arrives during an action is hinted when the action completes, after the requests it finished (a
scheduler sees new requests between batches). `events` lists
its admissions and finishes in order (for `penelope.sim.bound`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from penelope.cache.hints import ARRIVED, Hint
from penelope.costmodel.recompute import CostModel
from penelope.errors import InvariantError
from penelope.sim.scheduler import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_MAX_PREFILL_TOKENS,
    DEFAULT_MAX_RUNNING_REQUESTS,
    DEFAULT_PAGE_SIZE,
    LPM_QUEUE_MAX,
    Chunk,
    Job,
    Scheduler,
)
from penelope.sim.timemodel import TimeModel

# Decode steps timed in one array at most (8 MB); a longer reply is decoded over several actions.
MAX_DECODE_STEPS = 1 << 20


def decode_step_times(model: TimeModel, batch_size: int, kv_tokens: int, steps: int) -> np.ndarray:
    """Seconds of `steps` consecutive decode steps ([steps] float64) of `batch_size` requests
    holding `kv_tokens` KV tokens at the first step, each step adding one token per request.
    Equal to `model.decode_step_time(batch_size, kv_tokens + k * batch_size)` for step k."""
    kv = kv_tokens + batch_size * np.arange(steps, dtype=np.float64)
    return model.decode_overhead + model.decode_read_bytes(batch_size, kv) / model.hbm_bandwidth


@dataclass
class ServerCounters:
    """What one server did. Times in seconds of simulated time, sizes in tokens.

    busy_time: seconds spent in prefill batches and decode steps; received: requests that reached
    the server (skipped ones included); phantom_batches: prefill batches with phantoms;
    phantom_tokens: hole tokens phantoms computed; chunk_refill_tokens: hole tokens hole-first
    requests computed in their own chunks; max_waiting: longest waiting queue seen at an arrival;
    last_arrival, last_finish: times of the last request received and the last one finished."""

    received: int = 0
    finished: int = 0
    prefill_batches: int = 0
    phantom_batches: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0
    phantom_tokens: int = 0
    chunk_refill_tokens: int = 0
    busy_time: float = 0.0
    max_waiting: int = 0
    last_arrival: float = 0.0
    last_finish: float = 0.0
    # (arrival time, requests waiting then): the queue as each request arrived, in order.
    queue: list[tuple[float, int]] = field(default_factory=list)

    def as_dict(self) -> dict:
        data = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "queue"}
        data["waiting_at_last_arrival"] = self.queue[-1][1] if self.queue else 0
        return data


@dataclass
class _Decode:
    """A run of decode steps started at `start`: cumulative seconds `ends` of its steps, of which
    the first `steps` run (fewer once a request arriving during the run cuts it)."""

    start: float
    ends: np.ndarray
    steps: int


class Server:
    """One replica over `cache` (a fresh `KVCache` or two-tier cache); see the module docstring.

    index: the replica's number; order, chunk_size, lpm_queue_max, page_size, max_prefill_tokens,
    max_running_requests: the scheduler's (`penelope.sim.scheduler.Scheduler`); finished_hint:
    (job, the tokens its finish inserted, now) -> the `Hint` the cache is given when the job
    finishes (None: no finish hints)."""

    def __init__(
        self,
        index: int,
        cache,
        time_model: TimeModel,
        cost_model: CostModel,
        *,
        order: str = "lpm",
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        lpm_queue_max: int = LPM_QUEUE_MAX,
        page_size: int = DEFAULT_PAGE_SIZE,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS,
        finished_hint=None,
    ):
        self.index = index
        self.cache = cache
        self.time_model = time_model
        self.cost = cost_model
        self.scheduler = Scheduler(cache, order, chunk_size, lpm_queue_max, page_size=page_size,
                                   max_prefill_tokens=max_prefill_tokens,
                                   max_running_requests=max_running_requests)
        self.decoding: list[Job] = []
        self.counters = ServerCounters()
        self.in_flight = 0
        # The clock: the end of the action in progress, or when the server last became idle.
        self.now = 0.0
        self.action: list[Chunk] | _Decode | None = None
        self.finished_hint = finished_hint
        # ("admit" | "finish", session number, request index), in the order they happened.
        self.events: list[tuple[str, int, int]] = []
        # Arrival hints of requests received during the action in progress: (tokens, send time).
        self._arrivals: list[tuple[np.ndarray, float]] = []

    @property
    def busy(self) -> bool:
        return self.action is not None

    def fits(self, job: Job) -> bool:
        """Whether `job` can ever fit this server's cache alone (input + output tokens)."""
        return job.input_tokens + job.output_tokens <= self.cache.capacity

    def receive(self, job: Job, now: float) -> bool:
        """A request reaches the server at `now` (its send time): queue it, and cut a decode run
        in progress after the step during which it arrived. True when that moved `now`."""
        counters = self.counters
        counters.received += 1
        counters.last_arrival = now
        waiting = len(self.scheduler.waiting)
        counters.queue.append((now, waiting))
        counters.max_waiting = max(counters.max_waiting, waiting)
        self.scheduler.submit(job)
        if self.busy:
            self._arrivals.append((job.tokens, now))
        else:
            self.cache.hint(job.tokens, Hint(now, ARRIVED))
        self.in_flight += 1
        return self.interrupt(now)

    def turn_away(self, now: float) -> bool:
        """A request that can never fit reaches the server at `now`: it is refused, but like any
        arrival it cuts a decode run in progress. True when that moved `now`."""
        self.counters.received += 1
        return self.interrupt(now)

    def interrupt(self, now: float) -> bool:
        """Cut a decode run in progress after the step during which `now` falls; True when cut."""
        action = self.action
        if isinstance(action, _Decode):
            step = int(np.searchsorted(action.ends, now - action.start, side="left")) + 1
            if step < action.steps:
                action.steps = step
                self.now = action.start + float(action.ends[step - 1])
                return True
        return False

    def start(self) -> bool:
        """Start the next action at `now`: a prefill batch if one can be formed, else a decode run.
        False when there is nothing to run (the server idles until a request arrives)."""
        self.cache.advance(self.now)
        chunks = self.scheduler.form_prefill(running=len(self.decoding))
        if chunks:
            self._start_prefill(chunks)
            return True
        if self.decoding:
            batch = self.decoding
            steps = min(MAX_DECODE_STEPS, *(job.output_tokens - job.generated for job in batch))
            ends = np.cumsum(decode_step_times(self.time_model, len(batch), sum(j.kv_tokens for j in batch), steps))
            self.action = _Decode(self.now, ends, steps)
            self.now += float(ends[steps - 1])
            return True
        if self.scheduler.has_work():
            # Nothing runs, so the whole cache is free or evictable: the head must fit.
            raise InvariantError(f"replica {self.index}: waiting requests cannot be admitted into an idle cache")
        return False

    def complete(self) -> list[Job]:
        """Apply the action that ends at `now`; the requests it finished, in order (their KV
        inserted into the cache and released)."""
        action, self.action = self.action, None
        done = self._complete_decode(action) if isinstance(action, _Decode) else self._complete_prefill(action)
        for tokens, sent in self._arrivals:
            self.cache.hint(tokens, Hint(sent, ARRIVED))
        self._arrivals.clear()
        return done

    def _complete_prefill(self, action: list[Chunk]) -> list[Job]:
        done, cut = [], []
        for chunk in action:
            if not chunk.last:
                cut.append(chunk.job)
                continue
            job = chunk.job
            # The batch that computed the last prompt chunk ends: the first token, so the TTFT.
            job.first_token_time = self.now
            job.generated = min(1, job.output_tokens)
            if job.generated >= job.output_tokens:
                done.append(job)
            else:
                self.decoding.append(job)
        for job in done:
            self._release(job)
        # SGLang stashes the cut request when it forms the next batch, after the finished
        # requests of this one were released.
        for job in cut:
            self.scheduler.checkpoint(job)
        return done

    def _start_prefill(self, chunks: list[Chunk]) -> None:
        tokens = pairs = 0.0
        loaded = 0
        for chunk in chunks:
            for start, end in chunk.segments:
                tokens += end - start
                pairs += self.cost.attention_pairs(start, end)
            loaded += chunk.loaded
        phantoms = any(chunk.phantoms for chunk in chunks)
        seconds = self.time_model.prefill_time(tokens, pairs, phantoms) + self.time_model.load_time(loaded)
        for chunk in chunks:
            if chunk.job.admit_time is None:
                chunk.job.admit_time = self.now
                self.events.append(("admit", chunk.job.number, chunk.job.index))
        counters = self.counters
        counters.prefill_batches += 1
        counters.phantom_batches += phantoms
        counters.prefill_tokens += int(tokens)
        counters.phantom_tokens += sum(chunk.phantom_tokens for chunk in chunks)
        counters.chunk_refill_tokens += sum(chunk.chunk_refill_tokens for chunk in chunks)
        counters.busy_time += seconds
        self.action = chunks
        self.now += seconds

    def _complete_decode(self, action: _Decode) -> list[Job]:
        steps = action.steps
        self.counters.decode_steps += steps
        self.counters.busy_time += float(action.ends[steps - 1])
        batch = self.decoding
        done = []
        for job in batch:
            job.generated += steps
            if job.generated == job.output_tokens:
                done.append(job)
        if done:
            self.decoding = [job for job in batch if job.generated < job.output_tokens]
            for job in done:
                self._release(job)
        return done

    def _release(self, job: Job) -> None:
        """Finish `job`: count it, then hand its KV back to the cache (see `Scheduler.release`)."""
        self.counters.finished += 1
        self.counters.last_finish = self.now
        self.in_flight -= 1
        # The record needs the recomputed spans; the scheduler drops the prompt and slots only.
        tokens = self.scheduler.release(job)
        self.events.append(("finish", job.number, job.index))
        if self.finished_hint is not None:
            self.cache.hint(tokens, self.finished_hint(job, tokens, self.now))
