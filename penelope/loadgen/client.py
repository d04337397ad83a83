"""One streamed request to a server, timed: SGLang's native `/generate` or an OpenAI-compatible
`/v1/completions`, both with the prompt as token ids.

Times (seconds of `time.perf_counter`, from just before the request is written):
- TTFT: until the first streamed chunk that carries an output token;
- ITL: the mean time per output token after the first chunk's, (last token's chunk - first
  token's chunk) / (tokens - tokens of the first chunk);
- E2E: until the stream ends (`data: [DONE]`, or its end after a finish reason).

What each API sends back (SGLang 0.5.23):
- `/generate`: every chunk `{"output_ids": [...], "meta_info": {...}}`; `output_ids` holds every
  id so far, or only the new ones when the server runs with `--incremental-streaming-output`;
  `meta_info` has `completion_tokens`, `prompt_tokens`, `cached_tokens` and `finish_reason`
  (`{"type": "abort", ...}` when the server gave up on the request). When the ids are
  cumulative, the first and the last chunk are parsed whole and the others only for their
  `completion_tokens` (parsing every chunk's ids would cost the square of the reply's length).
- `/v1/completions` with `return_token_ids`: each chunk's `choices[0].token_ids` holds its new
  ids; with `stream_options.include_usage` a last chunk carries `usage`, where
  `prompt_tokens_details.cached_tokens` is present only when the server runs with
  `--enable-cache-report` (otherwise the cached tokens are unknown: None). A server that sends no
  ids gets a stand-in reply of deterministic ids of the reply's length (`reply_ids` says which).
- A failure inside a stream comes as a chunk `{"error": {"message": ...}}` (HTTP status 200).

Every failure is a status on the record, never an exception: `http_error` (status 4xx/5xx),
`server_error` (an error chunk), `aborted` (finish reason abort), `broken_stream` (the stream
ended without a finish, or a chunk that is not JSON), `connection_error`, `timeout` (no byte for
`read_timeout` seconds); a request cancelled by the runner is `cut`.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass

import aiohttp

from penelope.loadgen.apis import GENERATE, OPENAI
from penelope.loadgen.records import RequestRecord

# Longest error text kept on a record.
MAX_ERROR = 300
# aiohttp splits a stream into lines of at most this many bytes; a cumulative chunk of a long
# reply is one line of about 7 bytes per id.
READ_BUFFER = 1 << 24
_COMPLETION = re.compile(rb'"completion_tokens":\s*(\d+)')
_UNFINISHED = re.compile(rb'"finish_reason":\s*null')


@dataclass(frozen=True)
class Sampling:
    """What every request asks for: greedy by default, replies of exactly the asked length (end
    tokens ignored), so replies, and with them the next prompts, are the same on every server."""

    temperature: float = 0.0
    ignore_eos: bool = True


def request_body(api: str, prompt_text: str, max_new_tokens: int, sampling: Sampling, *, rid: str,
                 session_id: str | None, model: str | None = None, hint: str | None = None) -> bytes:
    """The JSON body of a streamed request; `prompt_text`: the prompt's ids, comma-separated."""
    params = {"temperature": sampling.temperature, "ignore_eos": sampling.ignore_eos}
    extra = {"rid": rid}
    if session_id is not None:
        # SGLang's session radix cache (--enable-session-radix-cache) reads the top-level session_id.
        extra["session_id"] = session_id
    if hint is not None:
        # What the session waits for after this reply, read by Penelope's agent-aware policies.
        params["custom_params"] = {"penelope_waits_for": hint}
    if api == GENERATE:
        head = '{"input_ids":['
        rest = {"sampling_params": {"max_new_tokens": max_new_tokens, **params}, "stream": True, **extra}
    else:
        head = '{"prompt":['
        rest = {"model": model or "default", "max_tokens": max_new_tokens, **params, "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True, **extra}
    return (head + prompt_text + "]," + json.dumps(rest)[1:]).encode()


class _Stream:
    """Reads one API's chunks into a record."""

    def __init__(self, api: str, record: RequestRecord, cumulative: bool):
        self.api = api
        self.record = record
        self.cumulative = cumulative
        self.ids: list[int] = []
        self.tokens = 0
        self.finished = False
        self.first_tokens = 0
        self.first_at = self.last_at = 0.0

    def feed(self, payload: bytes, now: float) -> None:
        before = self.tokens
        if self.api == GENERATE:
            self._generate(payload)
        else:
            self._openai(payload)
        if self.tokens > before:
            if not before:
                self.first_at, self.first_tokens = now, self.tokens
            self.last_at = now

    def _error(self, obj: dict) -> bool:
        error = obj.get("error") if isinstance(obj, dict) else None
        if error is None and not (isinstance(obj, dict) and obj.get("object") == "error"):
            return False
        message = error.get("message", error) if isinstance(error, dict) else (error or obj.get("message"))
        self.record.fail("server_error", str(message))
        return True

    def _generate(self, payload: bytes) -> None:
        if self.cumulative and self.tokens and _UNFINISHED.search(payload):
            # An intermediate chunk after the first: only its token count is read (every id so
            # far is parsed once, from the last chunk).
            found = _COMPLETION.search(payload)
            if found:
                self.tokens = int(found[1])
                return
        obj = json.loads(payload)
        if self._error(obj):
            return
        meta = obj["meta_info"]
        ids = obj.get("output_ids") or []
        if self.cumulative:
            self.ids = ids
        else:
            self.ids.extend(ids)
        self.tokens = int(meta.get("completion_tokens", len(self.ids)))
        self.record.cached_tokens = meta.get("cached_tokens")
        self.record.server_prompt_tokens = meta.get("prompt_tokens")
        finish = meta.get("finish_reason")
        if finish is not None:
            self.finished = True
            kind = finish.get("type") if isinstance(finish, dict) else str(finish)
            self.record.finish_reason = kind
            if kind == "abort":
                self.record.fail("aborted", str(finish.get("message", "aborted by the server")))

    def _openai(self, payload: bytes) -> None:
        obj = json.loads(payload)
        if self._error(obj):
            return
        for choice in obj.get("choices") or ():
            ids = choice.get("token_ids")
            if ids is not None:
                self.ids.extend(ids)
                self.tokens = len(self.ids)
            elif choice.get("text"):
                self.tokens += 1
            if choice.get("finish_reason") is not None:
                self.finished = True
                self.record.finish_reason = choice["finish_reason"]
                if choice["finish_reason"] == "abort":
                    self.record.fail("aborted", "aborted by the server")
        usage = obj.get("usage")
        if usage:
            self.record.server_prompt_tokens = usage.get("prompt_tokens")
            details = usage.get("prompt_tokens_details") or {}
            self.record.cached_tokens = details.get("cached_tokens")
            if usage.get("completion_tokens") is not None and self.record.reply_ids != "server":
                self.tokens = int(usage["completion_tokens"])


async def stream_request(http: aiohttp.ClientSession, url: str, api: str, body: bytes, record: RequestRecord,
                         cumulative: bool = True) -> None:
    """POST `body` to `url` and stream the reply into `record` (times, ids, counts, status).

    cumulative: `/generate` chunks carry every id so far (SGLang's default). Never raises for a
    failed request; on cancellation the record is marked `cut` and the cancellation re-raised."""
    reader = _Stream(api, record, cumulative)
    start = time.perf_counter()
    record.reply_ids = "server" if api == GENERATE else "none"
    try:
        async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
            if response.status >= 400:
                text = await response.text(errors="replace")
                record.http_status = response.status
                record.fail("http_error", f"HTTP {response.status}: {server_message(text)}")
                return
            record.http_status = response.status
            pending = b""
            async for data in response.content.iter_any():
                now, cpu = time.perf_counter(), time.thread_time()
                pending += data.replace(b"\r\n", b"\n")
                if b"\n\n" in pending:
                    *events, pending = pending.split(b"\n\n")
                    done = _read_events(reader, events, now)
                    record.overhead += time.thread_time() - cpu
                    if done or record.status != "pending":
                        break
    except asyncio.CancelledError:
        _finish(record, reader, start)
        if record.status == "pending":
            record.status = "cut"
        raise
    except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
        record.fail("timeout", "no data from the server within the read timeout")
    except aiohttp.ClientError as err:
        # Once the reply has begun, a lost connection is a broken stream.
        status = "broken_stream" if record.http_status is not None else "connection_error"
        record.fail(status, error_text(err))
    _finish(record, reader, start)
    if record.status == "pending":
        if reader.finished:
            record.status = "ok"
        else:
            record.fail("broken_stream", "the stream ended before a finish reason")


def _read_events(reader: _Stream, events: list[bytes], now: float) -> bool:
    """Feed server-sent events (`data: ...` lines) to `reader`; True when the stream is over
    (`[DONE]`, or a chunk the request failed on)."""
    record = reader.record
    for event in events:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return True
            if reader.api == OPENAI and record.reply_ids == "none" and b'"token_ids"' in payload:
                record.reply_ids = "server"
            try:
                reader.feed(payload, now)
            except (ValueError, KeyError, TypeError, AttributeError):
                record.fail("broken_stream", f"a chunk that is not the API's JSON: {server_message(payload)}")
            if record.status != "pending":
                return True
    return False


def _finish(record: RequestRecord, reader: _Stream, start: float) -> None:
    record.e2e = time.perf_counter() - start
    record.output_tokens = reader.tokens
    if reader.tokens:
        record.ttft = reader.first_at - start
        after = reader.tokens - reader.first_tokens
        record.itl = (reader.last_at - reader.first_at) / after if after > 0 else None
    if record.reply_ids == "server":
        record.output_ids = reader.ids


def error_text(err: BaseException) -> str:
    """An exception as one line (its type when it has no message)."""
    return " ".join(str(err).split()) or type(err).__name__


def server_message(text: str | bytes) -> str:
    """The server's error message (JSON `message` or `error.message`, else the text), one line."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        inner = obj.get("error")
        text = str(inner.get("message", inner) if isinstance(inner, dict) else inner or obj.get("message") or text)
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_ERROR else text[: MAX_ERROR - 3] + "..."
