"""Per-request records of a load-generator run and the JSONL file they are written to as they finish.

One JSON object per line, one line per request sent, written (and flushed) when the request
ends, so an interrupted run keeps every request that finished before it. Times in seconds.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

OK, CUT = "ok", "cut"
# Statuses of a request that failed (see `penelope.loadgen.client`).
FAILURES = ("http_error", "server_error", "aborted", "broken_stream", "connection_error", "timeout")


@dataclass
class RequestRecord:
    """One request and what the server sent back.

    repeat: which run (0-based) of `--repeat`; session: the id sent to the server;
    session_index: the session's number in the workload; turn: the request's number in its
    session (0-based), turns: the session's requests in the replayed workload.
    sent_at: when it was sent, seconds from the run's start; scheduled_at: open loop, when the
    (time-scaled) trace sends it; think_time: the wait before it (closed loop).
    prompt_tokens: ids sent; max_new_tokens: ids asked for; output_tokens: ids received;
    output_ids: those ids when the API sent them (`reply_ids` "server"; "stand-in": deterministic
    ids of the same length stood for them in the next prompt; "none": not needed).
    cached_tokens, server_prompt_tokens: what the server reported (None: not reported).
    ttft, itl, e2e: see `penelope.loadgen.client`; None when no token arrived.
    overhead: CPU seconds this client spent on the request in its own code (building and
    encoding the prompt, parsing chunks), outside the wait for the network and the server.
    status: `ok`, `cut` (in flight when a bound stopped the run) or a failure (`FAILURES`).
    measured: False for a priming turn (`LoadConfig.prime`): served, its reply carried into the
    next prompt, but left out of the latency and cached-token figures.
    """

    repeat: int
    session: str
    session_index: int
    turn: int
    turns: int
    kind: str
    rid: str
    source: str
    sent_at: float
    scheduled_at: float | None
    think_time: float
    prompt_tokens: int
    max_new_tokens: int
    status: str = "pending"
    error: str | None = None
    http_status: int | None = None
    ttft: float | None = None
    itl: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    reply_ids: str = "none"
    cached_tokens: int | None = None
    server_prompt_tokens: int | None = None
    finish_reason: str | None = None
    overhead: float = 0.0
    measured: bool = True

    def fail(self, status: str, message: str) -> None:
        """Mark the request failed (the first failure is the one kept)."""
        if self.status == "pending":
            self.status, self.error = status, message

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def failed(self) -> bool:
        return self.status in FAILURES

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RequestRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class RecordWriter:
    """Writes records to the JSONL file `path` (emptied first), one flushed line each; None: nothing."""

    def __init__(self, path: str | None):
        self.path = path
        self.handle = open(path, "w", encoding="utf-8") if path else None
        self.written = 0

    def write(self, record: RequestRecord) -> None:
        if self.handle is None:
            return
        self.handle.write(json.dumps(record.as_dict(), separators=(",", ":")) + "\n")
        self.handle.flush()
        self.written += 1

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_records(path: str) -> list[RequestRecord]:
    """The records of a JSONL file written by `RecordWriter`."""
    with open(path, encoding="utf-8") as handle:
        return [RequestRecord.from_dict(json.loads(line)) for line in handle if line.strip()]
