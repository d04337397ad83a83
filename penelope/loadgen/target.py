"""The server a load-generator run talks to: what it is asked before the run and between runs.

`probe` reads SGLang's `/server_info` and `/model_info` (or an OpenAI server's `/v1/models`) and
sends a one-token request through the chosen API, so a wrong URL, a wrong API or a server that
cannot serve it is one line before any traffic. It finds:
- the vocabulary size: `--vocab`, else `vocab_size` of the served checkpoint's `config.json` when
  the server's `model_path` is a folder this machine can read (ids at or above the vocabulary
  crash SGLang's scheduler on CPU, so without either the run stops with one line);
- the context: SGLang 0.5.23 refuses a prompt of `max_req_input_len` tokens or more, and
  `max_req_input_len` is the smaller of the model's context and the KV pool, less 6 (its
  `tp_worker.py`: `max_req_len = min(context_len - 1, pool - 1)`, `max_req_input_len =
  max_req_len - 5`), so a prompt and its reply fit in `max_req_input_len + 6`; `--context N`
  (or vLLM's `max_model_len`) means prompts below N and prompt plus reply at most N;
- the settings that change what the client sends or reads: `--enable-session-radix-cache`
  (sessions are closed when they end), `--enable-cache-report` (OpenAI usage reports cached
  tokens), `--incremental-streaming-output` (chunks carry only new ids).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from penelope.errors import UsageError
from penelope.loadgen.apis import APIS, GENERATE, OPENAI, PATHS
from penelope.loadgen.client import (
    READ_BUFFER,
    Sampling,
    error_text,
    request_body,
    server_message,
    stream_request,
)
from penelope.loadgen.records import RequestRecord

# SGLang's max_req_len - max_req_input_len, plus one (a prompt and reply may fill max_req_len + 1).
SGLANG_INPUT_MARGIN = 6
PROBE_TIMEOUT = 30.0
# Server settings shown with the results (what configuration was measured).
SHOWN = ("version", "radix_cache_backend", "radix_eviction_policy", "radix_eviction_policy_config",
         "enable_session_radix_cache", "page_size", "max_total_num_tokens", "chunked_prefill_size",
         "attention_backend", "enable_hierarchical_cache", "disable_radix_cache")


@dataclass(frozen=True)
class Target:
    """A probed server. max_prompt: the longest prompt it accepts; max_total: the most prompt
    and reply tokens together (None: unknown). cumulative: `/generate` chunks carry every id so
    far. ids_from_server: the API sends reply ids. info: server settings for reports."""

    url: str
    api: str
    vocab: int
    model: str | None = None
    max_prompt: int | None = None
    max_total: int | None = None
    session_cache: bool = False
    cache_report: bool = True
    cumulative: bool = True
    ids_from_server: bool = True
    info: dict = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return self.url + PATHS[self.api]

    def as_dict(self) -> dict:
        return {"url": self.url, "api": self.api, "vocab": self.vocab, "model": self.model,
                "max_prompt": self.max_prompt, "max_total": self.max_total, "session_cache": self.session_cache,
                "cache_report": self.cache_report, "cumulative": self.cumulative,
                "ids_from_server": self.ids_from_server, "server": self.info}


def base_url(url: str) -> str:
    """`url` without a trailing slash; UsageError unless it is http(s)://host[:port]."""
    try:
        # A malformed bracketed (IPv6) host raises here, or on reading the host name.
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:
        host = None
    if host is None or parts.scheme not in ("http", "https"):
        raise UsageError(f"`url` {url}: expected http://HOST:PORT")
    try:
        # urllib checks the port only when asked for it.
        _ = parts.port
    except ValueError:
        raise UsageError(f"`url` {url}: the port is not a number in [0, 65535]") from None
    if parts.path not in ("", "/") or parts.query:
        raise UsageError(f"`url` {url}: give the server's address without a path (the API path is added)")
    return url.rstrip("/")


def client_session(read_timeout: float | None = None, connections: int = 0) -> aiohttp.ClientSession:
    """An aiohttp session for a run: no connection limit by default (a closed-loop run holds one
    connection per session), `read_timeout` seconds without a byte fail a request."""
    timeout = aiohttp.ClientTimeout(total=None, connect=PROBE_TIMEOUT, sock_read=read_timeout)
    return aiohttp.ClientSession(timeout=timeout, read_bufsize=READ_BUFFER,
                                 connector=aiohttp.TCPConnector(limit=connections))


def probe_server(url: str, api: str, *, vocab: int | None = None, context: int | None = None) -> Target:
    """`probe` in an event loop of its own."""

    async def ask() -> Target:
        async with client_session(PROBE_TIMEOUT) as http:
            return await probe(http, url, api, vocab=vocab, context=context)

    return asyncio.run(ask())


async def _get_json(http: aiohttp.ClientSession, url: str) -> dict | None:
    """The JSON object at `url`, None when the server has no such endpoint or it is not JSON."""
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT)) as response:
            if response.status != 200:
                return None
            data = json.loads(await response.read())
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


async def probe(http: aiohttp.ClientSession, url: str, api: str, *, vocab: int | None = None,
                context: int | None = None) -> Target:
    """Ask the server at `url` what `Target` needs (see the module docstring); UsageError with
    one line when it cannot be reached, does not serve `api`, or does not say its vocabulary."""
    if api not in APIS:
        raise UsageError(f"`api` {api}: choose from {', '.join(APIS)}")
    url = base_url(url)
    try:
        info = await _get_json(http, url + "/server_info") or {}
        model_info = await _get_json(http, url + "/model_info") or {}
        models = await _get_json(http, url + "/v1/models") if api == OPENAI else None
    except asyncio.TimeoutError:
        raise UsageError(f"cannot reach the server at {url}: no answer within {PROBE_TIMEOUT:g} s") from None
    except (aiohttp.ClientError, OSError) as err:
        raise UsageError(f"cannot reach the server at {url}: {error_text(err)}") from None
    if not info and not model_info and not models:
        asked = "/server_info, /model_info" + (" and /v1/models" if api == OPENAI else "")
        raise UsageError(f"{url} answers none of {asked}: not an SGLang server"
                         + (" or an OpenAI-compatible one" if api == OPENAI else ""))
    listed = (models or {}).get("data") or [{}]
    model = model_info.get("served_model_name") or listed[0].get("id")
    vocab = vocab if vocab is not None else vocab_of(model_info.get("model_path") or info.get("model_path"))
    if vocab is None:
        raise UsageError(f"{url} does not say its vocabulary size (its model folder is not readable here); "
                         "give `vocab` N (ids at or above it crash the server)")
    max_prompt, max_total = _context(info, listed[0], context)
    target = Target(
        url=url, api=api, vocab=vocab, model=model, max_prompt=max_prompt, max_total=max_total,
        session_cache=bool(info.get("enable_session_radix_cache")),
        cache_report=api == GENERATE or bool(info.get("enable_cache_report")),
        cumulative=not info.get("incremental_streaming_output"),
        info={key: info[key] for key in SHOWN if key in info},
    )
    record = await probe_request(http, target)
    if not record.ok:
        hint = "" if record.http_status != 404 else f" (no {PATHS[api]} there: another `api`?)"
        raise UsageError(f"{target.endpoint}: a one-token request failed: {record.error}{hint}")
    return dataclasses.replace(target, ids_from_server=record.reply_ids == "server",
                               cache_report=target.cache_report or record.cached_tokens is not None)


async def probe_request(http: aiohttp.ClientSession, target: Target) -> RequestRecord:
    """One streamed request of one token (id 1) for one token, recorded."""
    record = RequestRecord(repeat=-1, session="probe", session_index=-1, turn=0, turns=1, kind="human",
                           rid="penelope-load-probe", source="probe", sent_at=0.0, scheduled_at=None,
                           think_time=0.0, prompt_tokens=1, max_new_tokens=1)
    # Not id 0: SGLang's OpenAI API takes a prompt of zeros for an empty one.
    body = request_body(target.api, "1", 1, Sampling(), rid=f"penelope-load-probe-{id(record)}", session_id=None,
                        model=target.model)
    try:
        await asyncio.wait_for(stream_request(http, target.endpoint, target.api, body, record, target.cumulative),
                               PROBE_TIMEOUT)
    except asyncio.TimeoutError:
        record.fail("timeout", f"no reply within {PROBE_TIMEOUT:.0f} s")
    return record


def vocab_of(model_path: str | None) -> int | None:
    """`vocab_size` of the checkpoint folder's config.json (or its text_config's), if readable."""
    if not model_path:
        return None
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") or {}):
        size = section.get("vocab_size") if isinstance(section, dict) else None
        if isinstance(size, int) and not isinstance(size, bool) and size > 1:
            return size
    return None


def _context(info: dict, listed: dict, context: int | None) -> tuple[int | None, int | None]:
    """(longest prompt, most prompt + reply tokens) the server accepts."""
    if context is not None:
        return context - 1, context
    limit = info.get("max_req_input_len")
    if isinstance(limit, int) and limit > 1:
        return limit - 1, limit + SGLANG_INPUT_MARGIN - 1
    limit = listed.get("max_model_len")
    if isinstance(limit, int) and limit > 1:
        return limit - 1, limit
    return None, None


async def flush_cache(http: aiohttp.ClientSession, target: Target, wait: float = 60.0) -> str | None:
    """Empty the server's prefix cache (SGLang's `/flush_cache`, which waits up to `wait` seconds
    for running requests); None when flushed, else why not."""
    try:
        async with http.post(f"{target.url}/flush_cache?timeout={wait:g}",
                             timeout=aiohttp.ClientTimeout(total=wait + PROBE_TIMEOUT)) as response:
            if response.status == 200:
                return None
            return f"/flush_cache answered {response.status}: {server_message(await response.read())}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        return f"/flush_cache failed: {error_text(err)}"


async def close_session(http: aiohttp.ClientSession, target: Target, session_id: str) -> None:
    """Release a finished session's KV in SGLang's session radix cache (failures are ignored: the
    cache then evicts it like any other)."""
    try:
        async with http.post(f"{target.url}/close_session", json={"session_id": session_id},
                             timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT)):
            pass
    except (aiohttp.ClientError, asyncio.TimeoutError):
        pass
