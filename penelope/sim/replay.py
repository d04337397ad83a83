"""Event loop of the simulator: replay a workload through the real KV cache and a serving-time model.

Timing (seconds of simulated time):
- Closed loop (WEKA, synthetic): `sessions` sessions run at once, the first ones starting at 0;
  a session sends request i+1 at request i's finish + its `think_time`; when a session's last
  request finishes, the next session in workload order starts then.
- Open loop (Mooncake): every request is sent at its `arrival`; `sessions` does not apply.
- The server alternates batches as SGLang does: when a prefill batch can be formed (a cut
  prompt continues, or a waiting request is admitted), it runs, pausing decode; otherwise one
  decode step runs for every request that has its first token and still generates. A prefill
  batch takes `TimeModel.prefill_time` over every span it computes (phantom holes and new
  tokens: linear units per token, attention pairs from the cost model; a batch with a phantom
  segment on the time model's `phantom_kernel`) plus CPU->GPU loads;
  a decode step takes `TimeModel.decode_step_time` of the batch's KV.
- A request's first token comes out of the batch that computes its last prompt chunk; its reply
  ends after `output_tokens - 1` decode steps (at once when it has at most one output token).
- Between events nothing changes for the scheduler, so decode steps are advanced in one go up to
  the next finish or the step during which the next request arrives (the step completes, then
  the scheduler sees the arrival).

Requests that can never fit the cache (input + output > capacity) are not sent: they are
counted in `ReplayResult.skipped`, and the session goes on with its next request as if the
skipped one had finished at its send time.

Hints (`penelope.waits`): the cache hears of every request's arrival (at its send time) and
finish, with what the session then waits for: a tool when its next request carries a tool result
(the reply ended in a tool call; in the WEKA traces 99.8% of replies that stop on `tool_use` are
followed by a tool request), else a person. Its clock is advanced to the simulated time before
every batch. Only a policy that asks for it (`uses_foresight`, the offline oracle) is also told
the session's next send time and how much of the sequence its next request reuses.
`ReplayResult.events` lists admissions and finishes in order (for `penelope.sim.bound`).
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import numpy as np

from penelope.costmodel import CostModel
from penelope.errors import InvariantError, UsageError
from penelope.sim.metrics import RequestRecord
from penelope.sim.scheduler import DEFAULT_CHUNK_SIZE, Chunk, Job, Scheduler
from penelope.sim.timemodel import TimeModel
from penelope.sim.workloads import HUMAN, MAX_CLOCK, Workload
from penelope.waits import ARRIVED, FINISHED, Foresight, Hint

# Decode steps timed in one array at most (8 MB); a longer reply is decoded over several events.
MAX_DECODE_STEPS = 1 << 20


# Bookkeeping bytes per cached token (tree keys and slots, allocator tags and free list): 28-33
# measured with long nodes, rounded up for histories split into many short nodes.
CACHED_TOKEN_BYTES = 48
# Bytes per prompt token of a running request (its token and slot arrays, match and insert copies).
RUNNING_TOKEN_BYTES = 32


def replay_memory(workload: Workload, capacity: int, concurrent: int) -> int:
    """Bytes a replay of `workload` through a cache of `capacity` tokens (both tiers) may hold at
    once: every token the cache can keep (at most the workload's distinct tokens) and the arrays of
    `concurrent` running requests of the largest size. Caches allocate as they fill, so this is
    what to check against memory before a replay, not before creating the cache."""
    requests = [request for _, _, request in workload.requests()]
    if not requests:
        return 0
    cached = min(capacity, sum(r.input_tokens for r in requests))
    if cached * CACHED_TOKEN_BYTES > 2**30:
        # Worth a closer bound: distinct blocks, plus each request's partial last block.
        distinct = np.unique(np.concatenate([r.keys for r in requests])).size
        cached = min(cached, (distinct + len(requests)) * workload.block_size)
    largest = max(r.input_tokens for r in requests)
    return cached * CACHED_TOKEN_BYTES + min(concurrent, len(requests)) * largest * RUNNING_TOKEN_BYTES


def check_clock_range(workload: Workload) -> None:
    """Raise UsageError when a workload's waits or arrivals could take the clock past `MAX_CLOCK`:
    closed loop, all think times together; open loop, the last arrival."""
    if workload.closed_loop:
        total = sum(r.think_time for s in workload.sessions for r in s.requests)
        if not total <= MAX_CLOCK:
            raise UsageError(f"the workload's think times add up to {total:.3g} s, beyond the {MAX_CLOCK:.3g} s "
                             "(136 years) the simulated clock resolves to a microsecond; cap or scale them "
                             "(--think-time cap:S or scale:X)")
        return
    last = max((r.arrival for s in workload.sessions for r in s.requests), default=0.0)
    if not last <= MAX_CLOCK:
        raise UsageError(f"the last request arrives at {last:.3g} s, beyond the {MAX_CLOCK:.3g} s (136 years) the "
                         "simulated clock resolves to a microsecond")


@dataclass
class ReplayResult:
    """What one replay produced: a record per finished request, and counters.

    skipped: requests never sent because they cannot fit the cache; prefill_batches,
    decode_steps: batches run; phantom_batches: prefill batches that refilled a hole (costed with
    the time model's `phantom_kernel`); phantom_tokens: hole tokens recomputed by phantoms;
    sim_time: simulated seconds until the last reply; wall_time: seconds the replay took;
    events: ("admit" | "finish", session number, request index) in the order they happened."""

    records: list[RequestRecord] = field(default_factory=list)
    skipped: int = 0
    prefill_batches: int = 0
    phantom_batches: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0
    phantom_tokens: int = 0
    sim_time: float = 0.0
    wall_time: float = 0.0
    events: list[tuple[str, int, int]] = field(default_factory=list)


def decode_step_times(model: TimeModel, batch_size: int, kv_tokens: int, steps: int) -> np.ndarray:
    """Seconds of `steps` consecutive decode steps ([steps] float64) of `batch_size` requests
    holding `kv_tokens` KV tokens at the first step, each step adding one token per request.
    Equal to `model.decode_step_time(batch_size, kv_tokens + k * batch_size)` for step k."""
    kv = kv_tokens + batch_size * np.arange(steps, dtype=np.float64)
    return model.decode_overhead + model.decode_read_bytes(batch_size, kv) / model.hbm_bandwidth


class Replay:
    """One replay of `workload` through `cache` (a fresh `KVCache`); call `run()` once.

    time_model: seconds per batch; cost_model: attention pairs and recompute costs (defaults to
    the time model's model); sessions: concurrent closed-loop sessions; order: `"lpm"` or
    `"fcfs"`; chunk_size: prefill tokens per batch; progress: anything with `update(n)` (a tqdm
    bar), told of every finished or skipped request."""

    def __init__(
        self,
        workload: Workload,
        cache,
        time_model: TimeModel,
        cost_model: CostModel,
        *,
        sessions: int = 4,
        order: str = "lpm",
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        progress=None,
    ):
        if sessions < 1:
            raise UsageError(f"sessions must be at least 1, got {sessions}")
        check_clock_range(workload)
        self.workload = workload
        self.cache = cache
        self.time_model = time_model
        self.cost = cost_model
        self.sessions = sessions
        self.scheduler = Scheduler(cache, order, chunk_size)
        self.progress = progress
        self.result = ReplayResult()
        self.now = 0.0
        # (send time, sequence number, session number, request index): requests not yet sent.
        self._arrivals: list[tuple[float, int, int, int]] = []
        self._sequence = 0
        self._next_session = 0
        self._decoding: list[Job] = []
        self._admitted: set[int] = set()
        self._foresight = bool(getattr(cache.policy, "uses_foresight", False))

    def run(self) -> ReplayResult:
        started = time.perf_counter()
        if self.workload.closed_loop:
            for _ in range(min(self.sessions, len(self.workload.sessions))):
                self._start_next_session(0.0)
        else:
            for number, session in enumerate(self.workload.sessions):
                for index, request in enumerate(session.requests):
                    self._push(request.arrival, number, index)
        while True:
            self._receive()
            self.cache.advance(self.now)
            if not (self._arrivals or self.scheduler.has_work() or self._decoding):
                break
            chunks = self.scheduler.form_prefill()
            if chunks:
                self._prefill(chunks)
            elif self._decoding:
                self._decode()
            elif self._arrivals:
                self.now = max(self.now, self._arrivals[0][0])
            else:
                # Nothing runs, so the whole cache is free or evictable: the head must fit.
                raise InvariantError("waiting requests cannot be admitted into an idle cache")
            if not self.now <= MAX_CLOCK:
                raise UsageError(f"the simulated clock passed {MAX_CLOCK:.3g} s (136 years) after "
                                 f"{len(self.result.records)} requests: batches take too long for the time "
                                 "model's constants to be real (check the calibration and the model)")
        self.result.sim_time = self.now
        self.result.wall_time = time.perf_counter() - started
        return self.result

    def _push(self, send_time: float, session: int, index: int) -> None:
        heapq.heappush(self._arrivals, (send_time, self._sequence, session, index))
        self._sequence += 1

    def _start_next_session(self, now: float) -> None:
        if self._next_session < len(self.workload.sessions):
            self._push(now, self._next_session, 0)
            self._next_session += 1

    def _receive(self) -> None:
        """Hand every request sent by now to the scheduler."""
        while self._arrivals and self._arrivals[0][0] <= self.now:
            send_time, _, number, index = heapq.heappop(self._arrivals)
            session = self.workload.sessions[number]
            request = session.requests[index]
            if request.input_tokens + request.output_tokens > self.cache.capacity:
                self.result.skipped += 1
                self._tick()
                self._after(number, index, send_time)
                continue
            job = Job(session.id, index, request, send_time, self.workload.tokens(request), number=number)
            self.scheduler.submit(job)
            self.cache.hint(job.tokens, Hint(send_time, ARRIVED))

    def _prefill(self, chunks: list[Chunk]) -> None:
        tokens = pairs = 0.0
        loaded = 0
        for chunk in chunks:
            for start, end in chunk.segments:
                tokens += end - start
                pairs += self.cost.attention_pairs(start, end)
            loaded += chunk.loaded
        holes = any(chunk.refills_hole for chunk in chunks)
        self.now += self.time_model.prefill_time(tokens, pairs, holes) + self.time_model.load_time(loaded)
        self.result.prefill_batches += 1
        self.result.phantom_batches += holes
        self.result.prefill_tokens += int(tokens)
        for chunk in chunks:
            if id(chunk.job) not in self._admitted:
                self._admitted.add(id(chunk.job))
                self.result.events.append(("admit", chunk.job.number, chunk.job.index))
            if not chunk.last:
                continue
            job = chunk.job
            job.first_token_time = self.now
            job.generated = min(1, job.output_tokens)
            if job.generated >= job.output_tokens:
                self._finish(job)
            else:
                self._decoding.append(job)

    def _decode(self) -> None:
        """Run decode steps up to the next finish, or through the step during which a request arrives."""
        batch = self._decoding
        steps = min(MAX_DECODE_STEPS, *(job.output_tokens - job.generated for job in batch))
        times = np.cumsum(decode_step_times(self.time_model, len(batch), sum(j.kv_tokens for j in batch), steps))
        if self._arrivals:
            arrival = self._arrivals[0][0] - self.now
            steps = min(steps, int(np.searchsorted(times, arrival, side="left")) + 1)
        self.now += float(times[steps - 1])
        self.result.decode_steps += steps
        done = []
        for job in batch:
            job.generated += steps
            if job.generated == job.output_tokens:
                done.append(job)
        if done:
            self._decoding = [job for job in batch if job.generated < job.output_tokens]
            for job in done:
                self._finish(job)

    def _finish(self, job: Job) -> None:
        reused, recomputed = job.reused, job.recomputed
        cost = sum(self.cost.span_cost(start, end) for start, end in recomputed)
        self.result.phantom_tokens += job.phantom
        tokens = job.tokens
        self.scheduler.release(job)
        self._admitted.discard(id(job))
        self.result.events.append(("finish", job.number, job.index))
        self.cache.hint(tokens, self._finished_hint(job, len(tokens)))
        self.result.records.append(
            RequestRecord(
                session=job.session,
                index=job.index,
                send_time=job.send_time,
                first_token_time=job.first_token_time,
                finish_time=self.now,
                input_tokens=job.input_tokens,
                reused_tokens=reused,
                recomputed_tokens=sum(end - start for start, end in recomputed),
                recompute_cost=cost,
                loaded_tokens=job.loaded,
                swap_loads=job.swap_loads,
            )
        )
        self._tick()
        self._after(job.number, job.index, self.now)

    def _finished_hint(self, job: Job, n_tokens: int) -> Hint:
        """What the session of a finished request waits for; its future for an oracle only."""
        requests = self.workload.sessions[job.number].requests
        following = requests[job.index + 1] if job.index + 1 < len(requests) else None
        foresight = None
        if self._foresight:
            if following is None:
                foresight = Foresight(float("inf"), 0)
            else:
                send = following.arrival if following.arrival is not None else self.now + following.think_time
                bs = self.workload.block_size
                reuse = min(_shared_keys(job.request.keys, following.keys) * bs, n_tokens // bs * bs)
                foresight = Foresight(float(send), int(reuse))
        return Hint(self.now, FINISHED, waits_for=following.kind if following is not None else HUMAN,
                    foresight=foresight)

    def _after(self, number: int, index: int, done: float) -> None:
        """Closed loop: send the session's next request after its think time, or start the next session."""
        if not self.workload.closed_loop:
            return
        requests = self.workload.sessions[number].requests
        if index + 1 < len(requests):
            self._push(done + requests[index + 1].think_time, number, index + 1)
        else:
            self._start_next_session(done)

    def _tick(self) -> None:
        if self.progress is not None:
            self.progress.update(1)


def _shared_keys(a: np.ndarray, b: np.ndarray) -> int:
    """Number of leading block keys `a` and `b` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def replay(workload: Workload, cache, time_model: TimeModel, cost_model: CostModel | None = None, **options):
    """Replay `workload` through `cache`; see `Replay` for the options. Returns a `ReplayResult`."""
    cost = cost_model if cost_model is not None else CostModel(_shape_of(time_model))
    return Replay(workload, cache, time_model, cost, **options).run()


def _shape_of(time_model: TimeModel):
    from penelope.models import get_model

    return get_model(time_model.model)

