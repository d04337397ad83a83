"""Event loop of the simulator: replay a workload through one or more servers, each with its real
KV cache and a serving-time model, behind a router.

Timing (seconds of simulated time):
- Closed loop (WEKA, synthetic): `sessions` sessions run at once, the first ones starting at 0;
  a session sends request i+1 at request i's finish + its `think_time`; when a session's last
  request finishes, the next session in workload order starts then.
- Open loop (Mooncake): every request is sent at its `arrival`; `sessions` does not apply.
- Each server (`penelope.sim.server.Server`) alternates prefill batches and decode runs on its own
  clock. A request is routed when it is sent (`penelope.sim.fleet.router`; with one server it goes to
  that one) and reaches its server at once: a decode run in progress stops after the step during
  which it arrived, then the server's scheduler sees it. A request's first token comes out of the
  batch that computes its last prompt chunk; its reply ends after `output_tokens - 1` decode steps
  (at once when it has at most one output token).
- Events at equal times: servers first finish their actions, then requests sent at that time
  are routed, then idle servers start their next actions.

Priming (`prime`, closed loop only): each session's first request primes the cache; its record
says it is not measured (`RequestRecord.measured`), and the figures leave it out. When every
session starts at once, no session sends its second request before every first request has
ended: each sends it the last first request's end + its think time later, as the load
generator's `--prime` does (`penelope.loadgen.runner`).

Requests that can never fit a server's cache (input + output > capacity) are routed, turned away
by the server, and counted in `ReplayResult.skipped`; the session goes on with its next request
as if the skipped one had finished at its send time.

The cost of one event does not grow with the number of requests waiting: the arrival and event
queues are heaps, and a server's scheduler sorts at most `LPM_QUEUE_MAX` waiting requests
(SGLang's own limit, see `penelope.sim.scheduler`).

Hints (`penelope.cache.hints`): each server's cache hears of every request's arrival (at its send time)
and finish, with what the session then waits for: a tool when its next request carries a tool
result (the reply ended in a tool call; in the WEKA traces 99.8% of replies that stop on
`tool_use` are followed by a tool request), else a person. Its clock is advanced to the server's
before every batch. Only a policy that asks for it (`uses_foresight`, the offline oracle) is also
told the session's next send time and how much of the sequence its next request reuses.
`ReplayResult.events` lists admissions and finishes in order (for `penelope.sim.bound`; one
server only).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from penelope.cache.hints import FINISHED, Foresight, Hint
from penelope.costmodel.recompute import CostModel
from penelope.errors import UsageError
from penelope.sim.fleet.router import Router
from penelope.sim.metrics import RequestRecord
from penelope.sim.scheduler import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_MAX_PREFILL_TOKENS,
    DEFAULT_MAX_RUNNING_REQUESTS,
    DEFAULT_PAGE_SIZE,
    LPM_QUEUE_MAX,
    Job,
)
from penelope.sim.server import MAX_DECODE_STEPS, Server, ServerCounters, decode_step_times
from penelope.sim.timemodel import TimeModel
from penelope.sim.workloads.types import HUMAN, MAX_CLOCK, Workload

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
                             "(`think_time` cap:S or scale:X)")
        return
    last = max((r.arrival for s in workload.sessions for r in s.requests), default=0.0)
    if not last <= MAX_CLOCK:
        raise UsageError(f"the last request arrives at {last:.3g} s, beyond the {MAX_CLOCK:.3g} s (136 years) the "
                         "simulated clock resolves to a microsecond")

__all__ = ["MAX_DECODE_STEPS", "Replay", "ReplayResult", "check_clock_range", "decode_step_times", "replay",
           "replay_memory"]

# Order of events at equal times (see the module docstring).
_FINISH, _SEND, _START = 0, 1, 2


@dataclass
class ReplayResult:
    """What one replay produced: a record per finished request, and counters.

    skipped: requests never served because they cannot fit the cache; prefill_batches,
    decode_steps: batches run (all servers); phantom_batches: prefill batches that refilled a hole
    (costed with the time model's `phantom_kernel`); phantom_tokens: hole tokens recomputed by
    phantoms riding in their request's batch; chunk_refill_tokens: hole tokens hole-first requests
    recomputed in their own chunks; sim_time: simulated seconds until the last reply; wall_time: seconds the replay
    took; servers: each server's counters (`penelope.sim.server.ServerCounters`); routing: how
    the router decided, by kind (cache-aware router only); events: ("admit" | "finish", session
    number, request index) in the order they happened (one server; empty for several)."""

    records: list[RequestRecord] = field(default_factory=list)
    skipped: int = 0
    prefill_batches: int = 0
    phantom_batches: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0
    phantom_tokens: int = 0
    chunk_refill_tokens: int = 0
    sim_time: float = 0.0
    wall_time: float = 0.0
    servers: list[ServerCounters] = field(default_factory=list)
    routing: dict[str, int] = field(default_factory=dict)
    events: list[tuple[str, int, int]] = field(default_factory=list)


class Replay:
    """One replay of `workload`; call `run()` once.

    cache: a fresh `KVCache` (one server), or a sequence of them (one server each, behind
    `router`, a `penelope.sim.fleet.router.Router` over that many replicas); time_model: seconds per
    batch; cost_model: attention pairs and recompute costs; sessions: concurrent closed-loop
    sessions; order: `"lpm"` or `"fcfs"`; chunk_size: chunk tokens per prefill batch; lpm_queue_max:
    the longest queue LPM sorts; page_size, max_prefill_tokens, max_running_requests: the
    scheduler's (`penelope.sim.scheduler.Scheduler`); progress: anything with `update(n)` (a tqdm
    bar), told of every finished or skipped request; prime: each session's first request primes
    the cache (see the module docstring)."""

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
        lpm_queue_max: int = LPM_QUEUE_MAX,
        page_size: int = DEFAULT_PAGE_SIZE,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS,
        router: Router | None = None,
        progress=None,
        prime: bool = False,
    ):
        if sessions < 1:
            raise UsageError(f"sessions must be at least 1, got {sessions}")
        if prime and not workload.closed_loop:
            raise UsageError("`prime` needs a closed-loop workload: open-loop requests have no first turn to wait for")
        caches = list(cache) if isinstance(cache, Sequence) else [cache]
        if not caches:
            raise UsageError("a replay needs at least one server")
        if len(caches) > 1 and router is None:
            raise UsageError(f"{len(caches)} servers need a router")
        if router is not None and router.replicas != len(caches):
            raise UsageError(f"the router spreads over {router.replicas} replicas, not {len(caches)}")
        check_clock_range(workload)
        self.workload = workload
        self.time_model = time_model
        self.cost = cost_model
        self.sessions = sessions
        self._foresight = caches[0].policy.uses_foresight
        self.servers = [
            Server(i, c, time_model, cost_model, order=order, chunk_size=chunk_size, lpm_queue_max=lpm_queue_max,
                   page_size=page_size, max_prefill_tokens=max_prefill_tokens,
                   max_running_requests=max_running_requests, finished_hint=self._finished_hint)
            for i, c in enumerate(caches)
        ]
        self.router = router
        self.progress = progress
        self.result = ReplayResult()
        self.now = 0.0
        # (time, kind, sequence number, payload): FINISH/START carry (server, its action number),
        # SEND carries (session number, request index).
        self._events: list[tuple[float, int, int, tuple[int, int]]] = []
        self._sequence = 0
        self._next_session = 0
        # Per server: the number of its current action, so a cut decode run's old end is ignored.
        self._action = [0] * len(self.servers)
        self._starting = [False] * len(self.servers)
        self.prime = prime
        # Sessions whose first request has not ended while the others wait for them (prime), and
        # the sessions waiting.
        self._priming = 0
        self._primed: list[int] = []

    @property
    def cache(self):
        """The first server's cache (the only one with one server)."""
        return self.servers[0].cache

    def run(self) -> ReplayResult:
        started = time.perf_counter()
        if self.workload.closed_loop:
            if self.prime and len(self.workload.sessions) <= self.sessions:
                self._priming = len(self.workload.sessions)
            for _ in range(min(self.sessions, len(self.workload.sessions))):
                self._start_next_session(0.0)
        else:
            for number, session in enumerate(self.workload.sessions):
                for index, request in enumerate(session.requests):
                    self._push(request.arrival, _SEND, (number, index))
        events = self._events
        while events:
            at, kind, _, payload = heapq.heappop(events)
            self.now = max(self.now, at)
            if kind == _SEND:
                self._send(*payload, at)
                continue
            number, action = payload
            if action != self._action[number]:
                continue  # a decode run cut short: it ended earlier
            if kind == _FINISH:
                self._finish(number)
            else:
                self._starting[number] = False
                self._start(number)
        self.result.sim_time = self.now
        self.result.wall_time = time.perf_counter() - started
        self._total()
        return self.result

    def _push(self, at: float, kind: int, payload: tuple[int, int]) -> None:
        heapq.heappush(self._events, (at, kind, self._sequence, payload))
        self._sequence += 1

    def _start_next_session(self, now: float) -> None:
        if self._next_session < len(self.workload.sessions):
            self._push(now, _SEND, (self._next_session, 0))
            self._next_session += 1

    def _send(self, number: int, index: int, at: float) -> None:
        """Route request `index` of session `number`, sent at `at`, and hand it to its server."""
        session = self.workload.sessions[number]
        request = session.requests[index]
        chosen = 0
        if self.router is not None:
            chosen = self.router.route(request, number, [s.in_flight for s in self.servers], at)
        server = self.servers[chosen]
        if request.input_tokens + request.output_tokens > server.cache.capacity:
            self._reschedule(chosen, server.turn_away(at))
            self.result.skipped += 1
            self._tick()
            self._after(number, index, at)
            return
        job = Job(session.id, index, request, at, self.workload.tokens(request), number=number,
                  reply=self.workload.reply_tokens(request))
        self._reschedule(chosen, server.receive(job, at))

    def _reschedule(self, number: int, cut: bool) -> None:
        """After an arrival: a decode run it `cut` ends at the server's clock now; an idle server
        starts at once."""
        server = self.servers[number]
        if server.busy:
            if cut:
                self._action[number] += 1
                self._push(server.now, _FINISH, (number, self._action[number]))
        elif not self._starting[number]:
            server.now = max(server.now, self.now)
            self._starting[number] = True
            self._push(server.now, _START, (number, self._action[number]))

    def _start(self, number: int) -> None:
        server = self.servers[number]
        if server.start():
            # A server's clock moves only here; arrivals were checked against MAX_CLOCK up front.
            if not server.now <= MAX_CLOCK:
                raise UsageError(f"the simulated clock passed {MAX_CLOCK:.3g} s (136 years) after "
                                 f"{len(self.result.records)} requests: batches take too long for the time "
                                 "model's constants to be real (check the calibration and the model)")
            self._action[number] += 1
            self._push(server.now, _FINISH, (number, self._action[number]))

    def _finish(self, number: int) -> None:
        server = self.servers[number]
        for job in server.complete():
            self._record(job, number)
        self._starting[number] = True
        self._push(server.now, _START, (number, self._action[number]))

    def _record(self, job: Job, replica: int) -> None:
        recomputed = job.recomputed
        cost = sum(self.cost.span_cost(start, end) for start, end in recomputed)
        self.result.records.append(
            RequestRecord(
                session=job.session,
                index=job.index,
                send_time=job.send_time,
                first_token_time=job.first_token_time,
                finish_time=self.servers[replica].now,
                input_tokens=job.input_tokens,
                reused_tokens=job.reused,
                recomputed_tokens=sum(end - start for start, end in recomputed),
                recompute_cost=cost,
                loaded_tokens=job.loaded,
                swap_loads=job.swap_loads,
                replica=replica,
                admit_time=job.admit_time,
                measured=not (self.prime and job.index == 0),
            )
        )
        self._tick()
        self._after(job.number, job.index, self.servers[replica].now)

    def _after(self, number: int, index: int, done: float) -> None:
        """Closed loop: send the session's next request after its think time, or start the next session."""
        if not self.workload.closed_loop:
            return
        if index == 0 and self._priming:
            self._primed.append(number)
            self._priming -= 1
            if self._priming == 0:
                for waiting in self._primed:
                    self._send_next(waiting, 0, done)
            return
        self._send_next(number, index, done)

    def _send_next(self, number: int, index: int, done: float) -> None:
        requests = self.workload.sessions[number].requests
        if index + 1 < len(requests):
            self._push(done + requests[index + 1].think_time, _SEND, (number, index + 1))
        else:
            self._start_next_session(done)

    def _finished_hint(self, job: Job, tokens, now: float) -> Hint:
        """What the session of a finished request waits for, whether it closes (its last
        request); its future for an oracle only."""
        requests = self.workload.sessions[job.number].requests
        following = requests[job.index + 1] if job.index + 1 < len(requests) else None
        foresight = None
        if self._foresight:
            if following is None:
                foresight = Foresight(float("inf"), 0)
            else:
                send = following.arrival if following.arrival is not None else now + following.think_time
                bs = self.workload.block_size
                keys = job.request.keys
                if job.request.output_blocks is not None:
                    keys = np.concatenate([keys, job.request.output_blocks])
                reuse = min(_shared_keys(keys, following.keys) * bs, len(tokens) // bs * bs)
                foresight = Foresight(float(send), int(reuse))
        return Hint(now, FINISHED, waits_for=following.kind if following is not None else HUMAN,
                    foresight=foresight, session=job.session, closes=following is None)

    def _total(self) -> None:
        result = self.result
        result.servers = [server.counters for server in self.servers]
        if len(self.servers) == 1:
            result.events = self.servers[0].events
        for counters in result.servers:
            result.prefill_batches += counters.prefill_batches
            result.phantom_batches += counters.phantom_batches
            result.decode_steps += counters.decode_steps
            result.prefill_tokens += counters.prefill_tokens
            result.phantom_tokens += counters.phantom_tokens
            result.chunk_refill_tokens += counters.chunk_refill_tokens
        result.routing = dict(self.router.decisions) if self.router is not None else {}

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
    from penelope.costmodel.shapes import get_model

    return get_model(time_model.model)

