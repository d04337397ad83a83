"""Loader of WEKA's Claude Code session traces (one JSON object per session file).

Format (see `shared/traces/weka-claude-code/README.md`): `block_size` (64), `tool_tokens`,
`system_tokens`, `requests` in order; a request has `t`, `in`, `out`, `hash_ids` (`floor(in/64)`
ids, numbered from 1 in each trace), `input_types`, `think_time` and usually `api_time`. An entry
of `type: "subagent"` nests a sub-agent conversation (its own `requests`) in the parent's id space.

Choices, all counted in the summary:
- Shared prefix (on by default): the ids of the first `floor((tool_tokens + system_tokens)/64)`
  blocks of a session's first request are the tools+system prefix. Wherever those ids occur in
  the session, block k of that prefix becomes the shared key k, equal in every session, as if all
  sessions used one system prompt (the paper's 15.6K shared prefix). Sessions with prefixes of
  different lengths share the shorter one. Every other id gets the session's own key range.
- Sub-agents are skipped by default (their requests counted under `dropped["subagent"]`): they
  run another model (Claude Haiku in these traces) beside the parent, and the parent's next
  think_time already includes their run. With `subagents="replay"` each becomes a session of
  its own (`<parent>/<agent_id>`), queued like any other, keeping the parent's key range (so
  siblings share their common prompt) without the shared-prefix mapping (their prompt is not
  the parent's).
- `max_context` (tokens of input): `overflow="truncate"` (default) ends a session before its
  first request over the limit, the rest counted under `dropped["after_max_context"]`;
  `"drop"` leaves out only the requests over it (`dropped["over_max_context"]`), the next
  request keeping its own think_time (0 if it becomes the session's first); `"skip"` leaves
  out every session that has one (`sessions_skipped["over_max_context"]`): on the shared folder
  with 128K this keeps exactly the 24 sessions whose largest context fits.
- A missing `think_time` is computed as `t[i] - t[i-1] - api_time[i-1]` (without the api_time
  when that is missing too), at least 0, and counted in `think_time_derived`.
- Kind: a request whose `input_types` include `"tool_result"` is a tool turn, otherwise human.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from penelope.errors import UsageError
from penelope.jsonfile import read_json
from penelope.sim.workloads.types import (
    HUMAN,
    MAX_TRACE_ID,
    TOOL,
    Request,
    Session,
    Workload,
    WorkloadError,
    WorkloadSummary,
    frozen_keys,
    session_key_base,
    tail_key,
)

SUBAGENT_MODES = ("skip", "replay")
OVERFLOW_MODES = ("truncate", "drop", "skip")
# Token counts of one request: no context comes near 2G tokens.
MAX_TOKENS = 2**31 - 1
# Tokens per hash id: 64 in these traces; SGLang's pages are at most a few hundred tokens.
MAX_BLOCK_SIZE = 1 << 16


def trace_files(paths: str | Path | list[str | Path]) -> list[Path]:
    """The trace files named by `paths`: files as given, folders as their sorted `*.json` files."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files: list[Path] = []
    for item in paths:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.glob("*.json") if p.is_file())
            if not found:
                raise UsageError(f"{path}: no *.json trace files in this folder")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise UsageError(f"{path}: no such trace file or folder")
    if not files:
        raise UsageError("no trace files given")
    return files


def load_weka(
    paths: str | Path | list[str | Path],
    *,
    shared_prefix: bool = True,
    subagents: str = "skip",
    max_context: int | None = None,
    overflow: str = "truncate",
) -> Workload:
    """Load WEKA Claude Code traces as a closed-loop workload (see the module docstring).

    paths: a trace file, a folder of them, or a list of either. Sessions are numbered in file
    order (folders sorted by name), which fixes their key ranges."""
    if subagents not in SUBAGENT_MODES:
        raise UsageError(f"unknown sub-agent mode {subagents!r}; choose from {', '.join(SUBAGENT_MODES)}")
    if overflow not in OVERFLOW_MODES:
        raise UsageError(f"unknown overflow mode {overflow!r}; choose from {', '.join(OVERFLOW_MODES)}")
    if max_context is not None and max_context <= 0:
        raise UsageError(f"max_context must be positive, got {max_context}")
    files = trace_files(paths)
    summary = WorkloadSummary(format="weka", sources=[str(f) for f in files])
    sessions: list[Session] = []
    block_size = None
    for index, path in enumerate(files):
        trace = _read_trace(path)
        size = _int_field(trace, "block_size", path.name, minimum=1, maximum=MAX_BLOCK_SIZE)
        if block_size is None:
            block_size = size
        elif size != block_size:
            raise WorkloadError(
                f"{path.name}: block_size {size} differs from {block_size} in {files[0].name}"
            )
        reader = _TraceReader(path.name, index, block_size, summary)
        for session in reader.sessions(trace, shared_prefix, subagents):
            kept = _limit_context(session, max_context, overflow, summary)
            if kept is not None:
                sessions.append(kept)
    summary.sessions = len(sessions)
    summary.requests = sum(len(s.requests) for s in sessions)
    return Workload(sessions=tuple(sessions), block_size=block_size, closed_loop=True, summary=summary)


def _read_trace(path: Path) -> dict:
    trace = read_json(path, "trace file", error=WorkloadError)
    if not isinstance(trace, dict) or not isinstance(trace.get("requests"), list):
        raise WorkloadError(f"{path}: expected a JSON object with a 'requests' list (WEKA trace format)")
    return trace


def _int_field(obj: dict, key: str, where: str, minimum: int = 0, maximum: int = MAX_TOKENS) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise WorkloadError(f"{where}: '{key}' must be an integer, got {value!r}")
    if value < minimum:
        raise WorkloadError(f"{where}: '{key}' must be at least {minimum}, got {value}")
    if value > maximum:
        raise WorkloadError(f"{where}: '{key}' must be at most {maximum}, got {value}")
    return value


def _number_field(obj: dict, key: str, where: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
        raise WorkloadError(f"{where}: '{key}' must be a non-negative number, got {value!r}")
    return float(value)


class _TraceReader:
    """Turns one trace file into sessions: the parent, then replayed sub-agents."""

    def __init__(self, name: str, index: int, block_size: int, summary: WorkloadSummary):
        self.name = name
        self.block_size = block_size
        self.base = session_key_base(index)
        self.index = index
        self.summary = summary
        # Counts every request of the file, sub-agents included, so tail keys stay unique.
        self.ordinal = 0

    def sessions(self, trace: dict, shared_prefix: bool, subagents: str) -> list[Session]:
        session_id = str(trace.get("id") or Path(self.name).stem)
        prefix_ids = None
        if shared_prefix:
            tools = _int_field(trace, "tool_tokens", self.name)
            system = _int_field(trace, "system_tokens", self.name)
            prefix_ids = self._prefix_ids(trace["requests"], (tools + system) // self.block_size)
        found: list[tuple[str, list, str]] = []
        main = self._session(session_id, trace["requests"], "requests", prefix_ids, found, None)
        result = [main]
        # Sub-agents found inside replayed sub-agents are appended to `found` as we go.
        i = 0
        while i < len(found):
            agent_id, entries, where = found[i]
            i += 1
            if subagents == "replay":
                self.summary.subagents_replayed += 1
                result.append(self._session(agent_id, entries, where, None, found, session_id))
            else:
                requests, nested = _count_entries(entries)
                self.summary.subagents += nested
                self.summary.drop("subagent", requests)
        return result

    def _prefix_ids(self, entries: list, n_blocks: int) -> np.ndarray:
        for i, entry in enumerate(entries):
            if isinstance(entry, dict) and entry.get("type") != "subagent":
                ids = entry.get("hash_ids")
                if not isinstance(ids, list):
                    raise WorkloadError(f"{self.name} requests[{i}]: 'hash_ids' must be a list")
                return frozen_keys(ids[:n_blocks], f"{self.name} requests[{i}]")
        return np.zeros(0, dtype=np.int64)

    def _session(self, session_id, entries, where, prefix_ids, found, parent) -> Session:
        requests: list[Request] = []
        previous: dict | None = None
        for i, entry in enumerate(entries):
            here = f"{self.name} {where}[{i}]"
            if not isinstance(entry, dict):
                raise WorkloadError(f"{here}: expected a JSON object, got {type(entry).__name__}")
            if entry.get("type") == "subagent":
                nested = entry.get("requests")
                if not isinstance(nested, list):
                    raise WorkloadError(f"{here}: a sub-agent needs a 'requests' list")
                self.summary.subagents += 1
                agent = str(entry.get("agent_id") or f"subagent{self.summary.subagents}")
                found.append((f"{session_id}/{agent}", nested, f"{where}[{i}].requests"))
                continue
            requests.append(self._request(entry, previous, not requests, prefix_ids, here))
            previous = entry
        return Session(id=session_id, requests=tuple(requests), parent=parent)

    def _request(self, entry, previous, first, prefix_ids, here) -> Request:
        size = self.block_size
        input_tokens = _int_field(entry, "in", here)
        output_tokens = _int_field(entry, "out", here)
        ids = entry.get("hash_ids")
        if not isinstance(ids, list):
            raise WorkloadError(f"{here}: 'hash_ids' must be a list, got {type(ids).__name__}")
        if len(ids) != input_tokens // size:
            raise WorkloadError(
                f"{here}: {len(ids)} hash_ids for an input of {input_tokens} tokens "
                f"(expected floor({input_tokens}/{size}) = {input_tokens // size})"
            )
        ids = frozen_keys(ids, here)
        if ids.size and (ids.min() < 0 or ids.max() >= MAX_TRACE_ID):
            raise WorkloadError(
                f"{here}: hash ids must be in [0, {MAX_TRACE_ID}), got {ids.min()}..{ids.max()}"
            )
        keys = ids + self.base
        if prefix_ids is not None and prefix_ids.size:
            keys = _map_prefix(ids, keys, prefix_ids)
        keys.flags.writeable = False
        input_types = entry.get("input_types")
        if not isinstance(input_types, list):
            raise WorkloadError(f"{here}: 'input_types' must be a list, got {input_types!r}")
        self.ordinal += 1
        return Request(
            keys=keys,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            think_time=0.0 if first else self._think_time(entry, previous, here),
            arrival=None,
            kind=TOOL if "tool_result" in input_types else HUMAN,
            tail_key=tail_key(self.index, self.ordinal - 1),
            source=here,
        )

    def _think_time(self, entry: dict, previous: dict, here: str) -> float:
        recorded = _number_field(entry, "think_time", here)
        if recorded is not None:
            return recorded
        t = _number_field(entry, "t", here)
        t_prev = _number_field(previous, "t", here + " (previous request)")
        if t is None or t_prev is None:
            raise WorkloadError(f"{here}: no 'think_time', and no 't' here and before to derive it from")
        api = _number_field(previous, "api_time", here + " (previous request)") or 0.0
        self.summary.think_time_derived += 1
        return max(0.0, t - t_prev - api)


def _map_prefix(ids: np.ndarray, keys: np.ndarray, prefix_ids: np.ndarray) -> np.ndarray:
    """Keys with every id of the session's prefix replaced by its shared key (its prefix index)."""
    unique, first_index = np.unique(prefix_ids, return_index=True)
    where = np.searchsorted(unique, ids)
    where = np.minimum(where, unique.size - 1)
    shared = unique[where] == ids
    mapped = keys.copy()
    mapped[shared] = first_index[where[shared]]
    return mapped


def _count_entries(entries: list) -> tuple[int, int]:
    """(requests, sub-agents) nested in a skipped sub-agent's entries, at any depth (iterative:
    sub-agents may nest deeper than Python's recursion limit)."""
    requests = subagents = 0
    stack = [entries]
    while stack:
        for entry in stack.pop():
            nested = entry.get("requests") if isinstance(entry, dict) else None
            if isinstance(nested, list) and entry.get("type") == "subagent":
                stack.append(nested)
                subagents += 1
            else:
                requests += 1
    return requests, subagents


def _limit_context(session: Session, max_context, overflow: str, summary: WorkloadSummary) -> Session | None:
    """Apply `max_context` to one session; None when the whole session is left out."""
    if not session.requests:
        summary.skip_session("no_requests")
        return None
    if max_context is None:
        return session
    over = [i for i, r in enumerate(session.requests) if r.input_tokens > max_context]
    if not over:
        return session
    if overflow == "skip":
        summary.skip_session("over_max_context")
        summary.drop("session_over_max_context", len(session.requests))
        return None
    if overflow == "drop":
        summary.drop("over_max_context", len(over))
        requests = tuple(r for r in session.requests if r.input_tokens <= max_context)
        if requests and requests[0].think_time:
            # A session's first request is sent when the session starts.
            requests = (dataclasses.replace(requests[0], think_time=0.0),) + requests[1:]
    else:
        summary.drop("after_max_context", len(session.requests) - over[0])
        summary.sessions_truncated += 1
        requests = session.requests[: over[0]]
    if not requests:
        summary.skip_session("over_max_context")
        return None
    return Session(id=session.id, requests=requests, parent=session.parent)
