"""Replaying a workload against a running server: closed loop (WEKA, synthetic) or open loop
(Mooncake), within bounds, every request recorded.

Closed loop: `sessions` sessions at once; each sends its requests in order, the next one
`think_time` seconds after the previous reply, its prompt built from the previous prompt and the
reply the server sent (`penelope.loadgen.tokens`). A session whose request fails ends there (its
next prompt would need that reply); its remaining requests are counted as not sent. A finished
session is closed on a server with SGLang's session radix cache.

Open loop: every request is sent at its arrival time (from the trace's first arrival, already
time-scaled), replies or not.

Bounds: `max_requests` stops sending after that many requests (those in flight finish);
`duration` stops the run after that many seconds, cutting requests in flight (status `cut`).

The client's own cost is measured in every run: `overhead` on each record (CPU time of building
and encoding the prompt and parsing the stream), and the event loop's lateness (`loop_lag`: how
late a 20 ms timer fires), which would show a client too busy to read the server's chunks on time.

`run_load` runs `repeats` runs one after the other, emptying the server's prefix cache before
each (SGLang's `/flush_cache`), so every run starts from the same state. Ctrl-C or SIGTERM stops
it: requests in flight are cut and recorded, then KeyboardInterrupt (or the SIGTERM handler the
caller had installed) is raised.
"""

from __future__ import annotations

import asyncio
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import aiohttp

from penelope.errors import UsageError
from penelope.loadgen.client import Sampling, request_body, stream_request
from penelope.loadgen.records import RequestRecord
from penelope.loadgen.target import Target, client_session, close_session, flush_cache
from penelope.loadgen.tokens import SessionPrompts, TokenSpace, planned_lengths
from penelope.sim.workloads.types import Request, Session, Workload

LAG_TICK = 0.02
DONE, MAX_REQUESTS, DURATION = "done", "max_requests", "duration"


@dataclass(frozen=True)
class LoadConfig:
    """How a workload is replayed. sessions: closed loop, sessions at once; max_requests,
    duration (seconds): bounds (None: none); read_timeout: seconds without a byte before a
    request fails; hints: tell the server what each session waits for after a reply (Penelope's
    agent-aware policies read it); close_sessions: close finished sessions on a server with a
    session radix cache; prime: each closed-loop session's first request is a priming turn, served
    but not measured (`RequestRecord.measured`), and when every session starts at once no second
    turn is sent before every first turn has ended, so the measured turns start from histories the
    server has computed (a steady state, not a cold start)."""

    sessions: int = 4
    max_requests: int | None = None
    duration: float | None = None
    read_timeout: float = 600.0
    sampling: Sampling = field(default_factory=Sampling)
    hints: bool = False
    close_sessions: bool = True
    prime: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.sessions, bool) or not isinstance(self.sessions, int) or self.sessions < 1:
            raise UsageError(f"`sessions` must be at least 1, got {self.sessions!r}")
        if self.max_requests is not None and self.max_requests < 1:
            raise UsageError(f"`max_requests` must be at least 1, got {self.max_requests}")
        for name, value in (("duration", self.duration), ("read_timeout", self.read_timeout)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise UsageError(f"`{name}` must be a positive number of seconds, got {value}")
        if not (math.isfinite(self.sampling.temperature) and self.sampling.temperature >= 0):
            raise UsageError(f"`temperature` must be a non-negative number, got {self.sampling.temperature}")


@dataclass
class RunResult:
    """One run: its records in the order they finished, its wall time (s), why it stopped,
    the event loop's lateness per tick (s), requests not sent (sessions ended by a failure or a
    bound), and why the cache could not be flushed before it (None: flushed or not asked)."""

    repeat: int
    records: list[RequestRecord]
    wall: float
    stopped: str
    loop_lag: list[float]
    not_sent: int
    flush_error: str | None = None


def check_fits(workload: Workload, space: TokenSpace, target: Target, max_requests: int | None = None) -> None:
    """UsageError naming the first request whose prompt and reply cannot fit the server's
    context (lengths as `planned_lengths` predicts them; only the first `max_requests` turns of
    a session can be sent)."""
    if target.max_prompt is None and target.max_total is None:
        return
    for session in workload.sessions:
        lengths = planned_lengths(space, workload.block_size, session, workload.closed_loop)
        for (prompt, reply), request in zip(lengths[:max_requests], session.requests, strict=False):
            too_long = target.max_prompt is not None and prompt > target.max_prompt
            if too_long or (target.max_total is not None and prompt + reply > target.max_total):
                limit = f"prompts up to {target.max_prompt:,}" if too_long else f"{target.max_total:,} in all"
                raise UsageError(
                    f"{request.source}: a prompt of {prompt:,} tokens and a reply of {reply:,} do not fit the "
                    f"server's context ({limit}, at `scale` {space.scale:g}); scale the workload down (`scale`), "
                    "or leave the longest requests out (`max_context`, `turns`)")


def check_scale(workload: Workload, space: TokenSpace) -> None:
    """UsageError when `space.scale` makes every prompt of `workload` one token: no history left to
    cache, nothing a replay could measure."""
    longest = max((r.input_tokens for _, _, r in workload.requests()), default=0)
    if longest > 1 and space.count(longest) < 2:
        raise UsageError(f"`scale` {space.scale:g} makes every prompt of the workload 1 token (its longest has "
                         f"{longest:,}): no history left to cache; give a `scale` of at most {int(longest / 1.5):,}")


class _Run:
    def __init__(self, http: aiohttp.ClientSession, target: Target, workload: Workload, space: TokenSpace,
                 config: LoadConfig, repeat: int, on_record: Callable[[RequestRecord], None] | None):
        self.http, self.target, self.workload, self.space, self.config = http, target, workload, space, config
        self.repeat = repeat
        self.on_record = on_record
        self.records: list[RequestRecord] = []
        self.sent = 0
        self.stopped = DONE
        self.start = time.perf_counter()
        self.lags: list[float] = []
        # Sessions whose first turn has not ended yet, while measured turns wait for them (prime).
        self.priming = 0
        self.primed = asyncio.Event()

    def take(self) -> bool:
        """Count one more request sent; False once `max_requests` are."""
        if self.config.max_requests is not None and self.sent >= self.config.max_requests:
            self.stopped = MAX_REQUESTS
            return False
        self.sent += 1
        return True

    def session_id(self, session: Session) -> str:
        return f"{session.id}#{self.repeat}"

    async def send(self, prompts: SessionPrompts, turn: int, request: Request,
                   scheduled_at: float | None, measured: bool = True) -> RequestRecord:
        began = time.thread_time()
        session = prompts.session
        ids = prompts.next_prompt()
        hint = None
        if self.config.hints and turn + 1 < len(session.requests):
            hint = session.requests[turn + 1].kind
        sid = self.session_id(session)
        rid = f"{sid}/{turn}"
        max_new = self.space.count(request.output_tokens)
        body = request_body(self.target.api, prompts.text, max_new, self.config.sampling, rid=rid,
                            session_id=sid, model=self.target.model, hint=hint)
        record = RequestRecord(
            repeat=self.repeat, session=sid, session_index=prompts.index, turn=turn,
            turns=len(session.requests), kind=request.kind, rid=rid, source=request.source,
            sent_at=time.perf_counter() - self.start, scheduled_at=scheduled_at,
            think_time=request.think_time if self.workload.closed_loop else 0.0,
            prompt_tokens=len(ids), max_new_tokens=max_new, measured=measured,
        )
        record.overhead = time.thread_time() - began
        try:
            await stream_request(self.http, self.target.endpoint, self.target.api, body, record,
                                 self.target.cumulative)
        finally:
            self.records.append(record)
            if self.on_record is not None:
                self.on_record(record)
        return record

    def reply_ids(self, record: RequestRecord, index: int) -> list[int]:
        if record.reply_ids == "server":
            return record.output_ids
        record.reply_ids = "stand-in"
        return self.space.stand_in_reply(index, record.turn, record.output_tokens)

    def first_turn_ended(self) -> None:
        """One session's priming turn ended (or the session did before it): the last one releases the rest."""
        self.priming -= 1
        if self.priming == 0:
            self.primed.set()

    async def closed_session(self, index: int, session: Session) -> None:
        prompts = SessionPrompts(self.space, self.workload.block_size, index, session, reuse_replies=True)
        waits_for_others = self.priming > 0
        try:
            for turn, request in enumerate(session.requests):
                if turn == 1 and waits_for_others:
                    self.first_turn_ended()
                    waits_for_others = False
                    await self.primed.wait()
                if turn and request.think_time > 0:
                    await asyncio.sleep(request.think_time)
                if not self.take():
                    return
                record = await self.send(prompts, turn, request, None, measured=not (self.config.prime and turn == 0))
                if not record.ok:
                    return
                prompts.add_reply(self.reply_ids(record, index))
        finally:
            if waits_for_others:
                self.first_turn_ended()
        if self.target.session_cache and self.config.close_sessions:
            await close_session(self.http, self.target, self.session_id(session))

    async def closed_loop(self) -> None:
        queue: Iterator[tuple[int, Session]] = iter(enumerate(self.workload.sessions))
        if self.config.prime and len(self.workload.sessions) <= self.config.sessions:
            self.priming = len(self.workload.sessions)

        async def worker():
            for index, session in queue:
                if self.stopped != DONE:
                    return
                await self.closed_session(index, session)

        await asyncio.gather(*(worker() for _ in range(min(self.config.sessions, len(self.workload.sessions)))))

    async def open_loop(self) -> None:
        prompts = [SessionPrompts(self.space, self.workload.block_size, i, s, reuse_replies=False)
                   for i, s in enumerate(self.workload.sessions)]
        order = sorted((r.arrival, i, turn) for i, s in enumerate(self.workload.sessions)
                       for turn, r in enumerate(s.requests))
        first = order[0][0] if order else 0.0
        tasks = []
        for arrival, index, turn in order:
            delay = self.start + (arrival - first) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if not self.take():
                break
            request = self.workload.sessions[index].requests[turn]
            tasks.append(asyncio.create_task(self.send(prompts[index], turn, request, arrival - first)))
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        if self.target.session_cache and self.config.close_sessions:
            for index in sorted({index for _, index, _ in order}):
                await close_session(self.http, self.target, self.session_id(self.workload.sessions[index]))

    async def monitor(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(LAG_TICK)
            self.lags.append(max(0.0, time.perf_counter() - before - LAG_TICK))

    async def run(self) -> RunResult:
        monitor = asyncio.create_task(self.monitor())
        main = asyncio.create_task(self.closed_loop() if self.workload.closed_loop else self.open_loop())
        try:
            done, _ = await asyncio.wait({main}, timeout=self.config.duration)
            if not done:
                self.stopped = DURATION
            else:
                main.result()
        finally:
            # Also on cancellation from outside (Ctrl-C): requests in flight are cut and recorded
            # before this returns.
            main.cancel()
            monitor.cancel()
            await asyncio.gather(main, monitor, return_exceptions=True)
        wall = time.perf_counter() - self.start
        planned = self.workload.num_requests
        return RunResult(self.repeat, self.records, wall, self.stopped, self.lags, planned - len(self.records))


async def replay(http: aiohttp.ClientSession, target: Target, workload: Workload, space: TokenSpace,
                 config: LoadConfig, *, repeat: int = 0,
                 on_record: Callable[[RequestRecord], None] | None = None) -> RunResult:
    """One run of `workload` against `target` (see the module docstring); `on_record` is called
    with every record as its request ends (in the event loop: keep it short)."""
    return await _Run(http, target, workload, space, config, repeat, on_record).run()


def run_load(target: Target, workload: Workload, space: TokenSpace, config: LoadConfig, *, repeats: int = 1,
             first_repeat: int = 0, flush: bool = True, on_record: Callable[[RequestRecord], None] | None = None,
             on_run: Callable[[RunResult], None] | None = None) -> list[RunResult]:
    """`repeats` runs one after the other, numbered from `first_repeat` (the number is in the
    session ids sent, so runs of one workload on one server never share a session), the
    server's cache flushed before each when `flush`; `on_run` is called after each run.
    Ctrl-C and SIGTERM: see the module docstring."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise UsageError(f"`repeats` must be at least 1, got {repeats!r}")

    async def runs() -> list[RunResult]:
        results = []
        async with client_session(config.read_timeout) as http:
            for repeat in range(first_repeat, first_repeat + repeats):
                flush_error = await flush_cache(http, target) if flush else None
                result = await replay(http, target, workload, space, config, repeat=repeat, on_record=on_record)
                result.flush_error = flush_error
                results.append(result)
                if on_run is not None:
                    on_run(result)
        return results

    return run_until_signal(runs())


def run_until_signal(coroutine):
    """Run `coroutine` in a new event loop; SIGINT or SIGTERM (in the main thread) cancels it,
    then the handler that was installed for that signal runs (Python's SIGINT handler raises
    KeyboardInterrupt), else KeyboardInterrupt is raised."""
    loop = asyncio.new_event_loop()
    main = loop.create_task(coroutine)
    caught: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.getsignal(signum)

            def cancel(signum=signum):
                caught.append(signum)
                main.cancel()

            loop.add_signal_handler(signum, cancel)
    try:
        return loop.run_until_complete(main)
    except asyncio.CancelledError:
        if not caught:
            raise
        handler = previous.get(caught[0])
        if callable(handler):
            handler(caught[0], None)
        raise KeyboardInterrupt from None
    finally:
        for signum, handler in previous.items():
            loop.remove_signal_handler(signum)
            signal.signal(signum, handler)
        loop.run_until_complete(loop.shutdown_asyncgens())
        # aiohttp resolves host names in the loop's default thread pool.
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()
