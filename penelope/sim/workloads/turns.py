"""Which turns of each session are replayed: `from_context` and `turns`.

`from_context` N starts each session at its first request whose prompt holds at least N trace
tokens (before any `scale`): that request is the session's first, its whole history in one
prompt, sent at once (no wait before it), and the turns after it follow as recorded. A session
that never reaches N is left out (counted in the loader's summary). This puts long histories in a
short run: histories of 16K tokens at scale 8 without replaying the 50 turns that grow them.
`turns` N then keeps at most N requests of each session. `penelope.sim.workloads.load.load`
applies both, before `limit_sessions`.
"""

from __future__ import annotations

import dataclasses

from penelope.errors import UsageError
from penelope.sim.workloads.types import Workload
from penelope.units import parse_size

BELOW_FROM_CONTEXT = "below_from_context"


def parse_turns(from_context: int | str | None, turns: int | None) -> tuple[int | None, int | None]:
    """(from_context in tokens, turns), None where not given; UsageError when bad."""
    if turns is not None and turns < 1:
        raise UsageError(f"`turns` must be at least 1, got {turns}")
    return (None if from_context is None else parse_size(from_context, "`from_context`")), turns


def select_turns(workload: Workload, *, from_context: int | None = None, turns: int | None = None) -> Workload:
    """`workload` with each session cut as the module docstring says; UsageError when no session is left."""
    if from_context is None and turns is None:
        return workload
    if turns is not None and turns < 1:
        raise UsageError(f"`turns` must be at least 1, got {turns}")
    sessions = []
    summary = dataclasses.replace(workload.summary, sessions_skipped=dict(workload.summary.sessions_skipped))
    for session in workload.sessions:
        requests = session.requests
        if from_context is not None:
            start = next((i for i, r in enumerate(requests) if r.input_tokens >= from_context), None)
            if start is None:
                summary.skip_session(BELOW_FROM_CONTEXT)
                continue
            requests = (dataclasses.replace(requests[start], think_time=0.0), *requests[start + 1:])
        if turns is not None:
            requests = requests[:turns]
        sessions.append(dataclasses.replace(session, requests=tuple(requests)))
    if not sessions:
        longest = max((r.input_tokens for s in workload.sessions for r in s.requests), default=0)
        raise UsageError(f"`from_context` {from_context:,}: no session reaches it (the longest prompt has "
                         f"{longest:,} tokens)")
    return dataclasses.replace(workload, sessions=tuple(sessions), summary=summary)
