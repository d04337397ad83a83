"""A soak of a running SGLang server: closed-loop agent sessions under eviction pressure, with the
faults a deployment sees, then every completed reply checked against a reference server.

Traffic (`SoakConfig`): `sessions` closed-loop sessions share a system prompt; each turn sends the
session's history (its previous prompt and the reply the server sent) plus fresh ids, streamed on
SGLang's `/generate`, greedy, every reply of the length asked for (end tokens ignored). A history
that would outgrow `max_context` starts over from the system prompt (a new conversation). Faults,
drawn from one seeded generator per session and per fault loop:

- a client that disconnects mid-stream (`disconnect_p` of the requests, after 1-3 chunks);
- `/abort_request` for a request in flight (`abort_p`), its stream then read to its end;
- `/flush_cache` every `flush_every` seconds, in turn during load (SGLang refuses it while requests
  run: a 400 "Flush cache failed") and in a quiet moment (new requests held back until those in
  flight end: the cache is emptied, then the sessions go on over an empty tree);
- a prompt longer than the server's context every `oversize_every` seconds: a 400 that says so;
- a malformed request every `malformed_every` seconds (`MALFORMED`): a 4xx.

After a disconnect or an abort the session goes on from the prompt it sent; a request that fails
otherwise (an error status, a broken stream) ends its session. Bounds: `duration`
seconds and `max_requests` requests; requests in flight then are read to their end, each within
`read_timeout` seconds of silence.

`check_replies` sends every completed request once more to a reference server (SGLang without a
radix cache: every prompt computed whole) and compares the reply ids; `SoakReport` holds what
happened. `server_faults` reads a server's log for scheduler exceptions and failed memory checks.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

# Malformed requests and the 4xx SGLang 0.5.23 answers each with (validated before the scheduler).
MALFORMED = (
    ("not JSON", b'{"input_ids": [1, 2'),
    ("ids as a string", b'{"input_ids": "1 2 3", "sampling_params": {"max_new_tokens": 4}}'),
    ("empty prompt", b'{"input_ids": [], "sampling_params": {"max_new_tokens": 4}}'),
    ("no prompt", b'{"sampling_params": {"max_new_tokens": 4}}'),
    ("negative reply length", b'{"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": -1}}'),
    ("temperature as a string", b'{"input_ids": [5, 6, 7], "sampling_params": {"temperature": "hot"}}'),
)
# Lines of a server log that mean the scheduler failed (an exception ends it; a failed memory check
# raises with SGLang's strict checks on, and otherwise only warns).
FAULT_MARKS = ("Scheduler hit an exception", "Traceback", "memory leak", "Mem Leak", "double free",
               "use-after-free", "SIGQUIT")
FIRST_ID = 2


@dataclass(frozen=True)
class SoakConfig:
    """Token counts are ids; times are seconds. `vocab`: the served model's vocabulary (ids are
    drawn from [2, vocab)); `max_context`: the longest prompt plus reply a session sends (below the
    server's context)."""

    vocab: int
    max_context: int
    context_length: int
    sessions: int = 16
    duration: float = 300.0
    max_requests: int = 100_000
    system_tokens: int = 256
    turn_tokens: tuple[int, int] = (32, 256)
    reply_tokens: tuple[int, int] = (4, 24)
    think: tuple[float, float] = (0.0, 0.3)
    disconnect_p: float = 0.05
    abort_p: float = 0.05
    flush_every: float = 10.0
    oversize_every: float = 15.0
    malformed_every: float = 10.0
    read_timeout: float = 120.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.vocab <= FIRST_ID + 1:
            raise ValueError(f"SoakConfig.vocab must exceed {FIRST_ID + 1}, got {self.vocab}")
        if self.sessions < 1 or self.duration <= 0 or self.max_requests < 1:
            raise ValueError("SoakConfig: sessions, duration and max_requests must be positive")
        smallest = self.system_tokens + self.turn_tokens[1] + self.reply_tokens[1]
        if not smallest <= self.max_context < self.context_length:
            raise ValueError(f"SoakConfig.max_context must lie in [{smallest}, context_length "
                             f"{self.context_length}), got {self.max_context}")
        for name in ("turn_tokens", "reply_tokens", "think"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"SoakConfig.{name} must be (low, high) with 0 <= low <= high")
        if not (0 <= self.disconnect_p <= 1 and 0 <= self.abort_p <= 1 and self.disconnect_p + self.abort_p <= 1):
            raise ValueError("SoakConfig: disconnect_p and abort_p are probabilities that sum to at most 1")


@dataclass(frozen=True)
class Completed:
    """A request the server finished: its prompt, the reply ids it streamed, and what it reported."""

    rid: str
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    cached_tokens: int
    prompt_tokens: int


@dataclass
class SoakReport:
    """What a soak did (`counts`), the requests it completed, and every answer it did not expect
    (`unexpected`: what was sent, the status, the start of the answer)."""

    counts: Counter = field(default_factory=Counter)
    completed: list[Completed] = field(default_factory=list)
    unexpected: list[tuple[str, int | None, str]] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"seconds": round(self.seconds, 1), "counts": dict(sorted(self.counts.items())),
                "completed": len(self.completed), "unexpected": [list(u) for u in self.unexpected]}


class _Soak:
    def __init__(self, url: str, config: SoakConfig, http: aiohttp.ClientSession, report: SoakReport, progress=None):
        self.url, self.config, self.http, self.progress = url.rstrip("/"), config, http, progress
        self.report = report
        self.deadline = time.monotonic() + config.duration
        self.system = _ids(random.Random(f"{config.seed}/system"), config.system_tokens, config.vocab)
        # Sessions wait on `gate` before sending; `in_flight` counts requests sent and not ended.
        self.gate = asyncio.Event()
        self.gate.set()
        self.in_flight = 0
        self.failed: set[str] = set()

    def running(self) -> bool:
        return time.monotonic() < self.deadline and self.report.counts["sent"] < self.config.max_requests

    def note(self, what: str, status: int | None, text: str, rid: str | None = None) -> None:
        """An answer the soak did not expect; `rid`: the session request it failed."""
        self.report.unexpected.append((what, status, text[:200]))
        if rid is not None:
            self.failed.add(rid)

    async def session(self, index: int) -> None:
        config = self.config
        rng = random.Random(f"{config.seed}/session/{index}")
        history, turn = list(self.system), 0
        while self.running():
            reply = rng.randint(*config.reply_tokens)
            prompt = history + _ids(rng, rng.randint(*config.turn_tokens), config.vocab)
            if len(prompt) + reply > config.max_context:
                history = list(self.system)
                self.report.counts["restarts"] += 1
                continue
            draw = rng.random()
            fault = ("disconnect" if draw < config.disconnect_p else
                     "abort" if draw < config.disconnect_p + config.abort_p else None)
            await self.gate.wait()
            rid = f"soak-{config.seed}-{index}-{turn}"
            self.in_flight += 1
            try:
                output = await self.generate(rid, prompt, reply, fault, rng)
            finally:
                self.in_flight -= 1
            if rid in self.failed:
                # A request that failed (not a fault this soak made): its session ends there,
                # so a server that went away is not sent a request a moment until the end.
                self.report.counts["sessions_ended_by_a_failure"] += 1
                return
            history = prompt + list(output) if output is not None else prompt
            turn += 1
            await asyncio.sleep(rng.uniform(*config.think))

    async def generate(self, rid: str, prompt: list[int], reply: int, fault: str | None,
                       rng: random.Random) -> tuple[int, ...] | None:
        """One streamed request; its reply ids if it completed, else None."""
        counts = self.report.counts
        counts["sent"] += 1
        body = {"rid": rid, "input_ids": prompt, "stream": True,
                "sampling_params": {"max_new_tokens": reply, "temperature": 0.0, "ignore_eos": True}}
        cut_after = rng.randint(1, 3) if fault == "disconnect" else None
        chunks, last, aborting = 0, None, None
        try:
            async with self.http.post(self.url + "/generate", json=body) as response:
                if response.status != 200:
                    counts["request_http_error"] += 1
                    self.note(f"request {rid}", response.status, await response.text(), rid)
                    return None
                async for line in _data_lines(response, self.config.read_timeout):
                    chunk = json.loads(line)
                    if "error" in chunk:
                        counts["request_server_error"] += 1
                        self.note(f"request {rid}", 200, line.decode(errors="replace"), rid)
                        return None
                    chunks, last = chunks + 1, chunk
                    if cut_after is not None and chunks >= cut_after:
                        counts["disconnected"] += 1
                        response.close()
                        return None
                    if fault == "abort" and aborting is None:
                        aborting = asyncio.ensure_future(self.abort(rid))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
            # ValueError: a chunk that is not JSON.
            counts["request_connection_error" if not isinstance(error, ValueError) else "request_broken_stream"] += 1
            self.note(f"request {rid}", None, repr(error), rid)
            return None
        finally:
            if aborting is not None:
                await aborting
        finish = ((last or {}).get("meta_info") or {}).get("finish_reason") or {}
        if finish.get("type") == "abort":
            counts["aborted" if fault == "abort" else "aborted_unasked"] += 1
            if fault != "abort":
                self.note(f"request {rid}", 200, json.dumps(finish), rid)
            return None
        output = tuple((last or {}).get("output_ids") or ())
        if finish.get("type") != "length" or len(output) != reply:
            counts["request_wrong_finish"] += 1
            self.note(f"request {rid}", 200, f"finish {finish}, {len(output)} ids of {reply}", rid)
            return None
        meta = last["meta_info"]
        counts["completed" if fault != "abort" else "completed_before_abort"] += 1
        self.report.completed.append(Completed(rid, tuple(prompt), output, int(meta.get("cached_tokens") or 0),
                                               int(meta.get("prompt_tokens") or 0)))
        if self.progress is not None:
            self.progress(self.report)
        return output

    async def abort(self, rid: str) -> None:
        self.report.counts["abort_requests"] += 1
        await self.expect("abort", "/abort_request", json.dumps({"rid": rid}).encode(), 200)

    async def expect(self, what: str, path: str, data: bytes, status: int, says: str = "") -> bool:
        """POST `data` to `path`; True when the answer has `status` (any 4xx for 400) and holds
        `says`, else the answer is noted as unexpected."""
        try:
            async with self.http.post(self.url + path, data=data,
                                      headers={"Content-Type": "application/json"}) as response:
                text = await response.text()
                code = response.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            self.note(what, None, repr(error))
            return False
        fits = code == status or (status == 400 and 400 <= code < 500)
        if fits and says in text:
            return True
        self.note(what, code, text)
        return False

    async def flush(self, quiet: bool) -> None:
        """`/flush_cache` during load (refused while requests run: a 400, or done if none runs) or,
        `quiet`, once every request in flight has ended, new ones held back meanwhile."""
        counts = self.report.counts
        counts["flushes"] += 1
        try:
            async with self.http.post(self.url + "/flush_cache", data=b"{}") as response:
                text, code = await response.text(), response.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            self.note("flush", None, repr(error))
            return
        if code == 200 and "Cache flushed" in text:
            counts["flushes_done"] += 1
        elif not quiet and code == 400 and "Flush cache failed" in text:
            counts["flushes_refused_busy"] += 1
        else:
            self.note("flush" + (" when quiet" if quiet else ""), code, text)

    async def faults(self, name: str, every: float) -> None:
        """Every `every` seconds one fault of kind `name`, until the soak ends."""
        rng = random.Random(f"{self.config.seed}/{name}")
        counts = self.report.counts
        while True:
            await asyncio.sleep(every * rng.uniform(0.5, 1.5))
            if not self.running():
                return
            if name == "flush":
                quiet = counts["flushes"] % 2 == 1
                if quiet:
                    self.gate.clear()
                    while self.in_flight and time.monotonic() < self.deadline + self.config.read_timeout:
                        await asyncio.sleep(0.05)
                try:
                    await self.flush(quiet)
                finally:
                    self.gate.set()
            elif name == "oversize":
                counts["oversize_sent"] += 1
                prompt = _ids(rng, self.config.context_length + rng.randint(1, 64), self.config.vocab)
                body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4}}
                if await self.expect("oversize", "/generate", json.dumps(body).encode(), 400, "longer than"):
                    counts["oversize_refused"] += 1
            else:
                what, data = MALFORMED[counts["malformed_sent"] % len(MALFORMED)]
                counts["malformed_sent"] += 1
                if await self.expect(f"malformed: {what}", "/generate", data, 400):
                    counts["malformed_refused"] += 1


async def _data_lines(response: aiohttp.ClientResponse, read_timeout: float):
    """The payloads of a server-sent-event stream, up to `data: [DONE]`."""
    while True:
        line = await asyncio.wait_for(response.content.readline(), read_timeout)
        if not line:
            return
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        yield payload


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


async def soak(url: str, config: SoakConfig, progress=None, report: SoakReport | None = None) -> SoakReport:
    """Run the soak against the server at `url` (see the module docstring) and return its report;
    `progress(report)` is called after every completed request. `report`, if given, is filled as
    the soak goes, so a caller keeps what happened when the soak is cancelled (Ctrl-C)."""
    report = report if report is not None else SoakReport()
    started = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
            run = _Soak(url, config, http, report, progress)
            loops = [run.faults("flush", config.flush_every), run.faults("oversize", config.oversize_every),
                     run.faults("malformed", config.malformed_every)]
            await asyncio.gather(*(run.session(i) for i in range(config.sessions)), *loops)
    finally:
        report.seconds = time.monotonic() - started
    return report


def reply_problems(completed: list[Completed]) -> list[str]:
    """What the server reported wrongly about its completed requests: a prompt length other than
    the prompt sent, or more cached tokens than the prompt has."""
    problems = []
    for done in completed:
        if done.prompt_tokens != len(done.prompt):
            problems.append(f"{done.rid}: prompt_tokens {done.prompt_tokens}, sent {len(done.prompt)}")
        if not 0 <= done.cached_tokens <= done.prompt_tokens:
            problems.append(f"{done.rid}: cached_tokens {done.cached_tokens} of a {done.prompt_tokens}-token prompt")
    return problems


async def check_replies(url: str, completed: list[Completed], concurrency: int = 8) -> list[dict]:
    """Send every completed request again to the server at `url`, not streamed, greedy, with the
    same reply length; the requests whose reply ids differ (rid, the first differing position, both
    replies)."""
    gate = asyncio.Semaphore(concurrency)
    differ: list[dict] = []

    async def one(http: aiohttp.ClientSession, done: Completed) -> None:
        body = {"input_ids": list(done.prompt), "sampling_params": {
            "max_new_tokens": len(done.output), "temperature": 0.0, "ignore_eos": True}}
        async with gate, http.post(url.rstrip("/") + "/generate", json=body) as response:
            answer = await response.json(content_type=None)
        output = tuple(answer.get("output_ids") or ()) if response.status == 200 else ()
        if output != done.output:
            first = next((i for i, (a, b) in enumerate(zip(output, done.output, strict=False)) if a != b),
                         min(len(output), len(done.output)))
            differ.append({"rid": done.rid, "status": response.status, "first_difference": first,
                           "soak": list(done.output), "reference": list(output)})

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await asyncio.gather(*(one(http, done) for done in completed))
    return differ


def server_faults(log: Path) -> list[str]:
    """The lines of a server log that report a scheduler failure or a failed memory check. A
    traceback is one entry: its last frame and the exception it ends with."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError as error:
        return [f"log unreadable: {error}"]
    faults = []
    for index, line in enumerate(lines):
        if not any(mark in line for mark in FAULT_MARKS):
            continue
        if "Traceback" in line:
            line = _traceback_summary(lines, index)
        faults.append(line.strip()[:600])
    return faults


def _traceback_summary(lines: list[str], start: int) -> str:
    """'Traceback: <last frame> -> <exception>' for the traceback that starts at `lines[start]`."""
    frame = ""
    for line in lines[start + 1:]:
        if line.startswith("  File "):
            frame = line.strip()
        elif line and not line[0].isspace():
            return f"Traceback: {frame} -> {line.strip()}"
    return f"Traceback: {frame} -> (log ends)"
