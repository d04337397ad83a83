"""Which turns of each session are replayed: `--from-context` and `--turns`.

`--from-context N` starts each session at its first request whose prompt holds at least N trace
tokens (before any `--scale`): that request is the session's first, its whole history in one
prompt, sent at once (no wait before it), and the turns after it follow as recorded. A session
that never reaches N is left out (counted in the loader's summary). This puts long histories in a
short run: histories of 16K tokens at scale 8 without replaying the 50 turns that grow them.
`--turns N` then keeps at most N requests of each session. `penelope.commands.workload_options.load_from_args`
applies both, before `--limit-sessions`.
"""

from __future__ import annotations

import dataclasses

from penelope.errors import UsageError
from penelope.sim.workloads.types import Workload

BELOW_FROM_CONTEXT = "below_from_context"


def add_turn_arguments(parser) -> None:
    """--turns and --from-context."""
    parser.add_argument("--turns", type=int, metavar="N",
                        help="replay at most N requests of each session (from --from-context's, else the first)")
    parser.add_argument("--from-context", metavar="TOKENS",
                        help="start each session at its first request of at least TOKENS trace tokens (e.g. 96K; "
                        "before --scale), its whole history as the first prompt; sessions that never reach it "
                        "are left out")


def turn_arguments(args) -> tuple[int | None, int | None]:
    """(from_context in tokens, turns) of the options, None where not given; UsageError when bad."""
    from penelope.units import parse_size

    turns = getattr(args, "turns", None)
    if turns is not None and turns < 1:
        raise UsageError(f"--turns must be at least 1, got {turns}")
    text = getattr(args, "from_context", None)
    return (None if text is None else parse_size(text, "--from-context")), turns


def select_turns(workload: Workload, *, from_context: int | None = None, turns: int | None = None) -> Workload:
    """`workload` with each session cut as the module docstring says; UsageError when no session is left."""
    if from_context is None and turns is None:
        return workload
    if turns is not None and turns < 1:
        raise UsageError(f"turns must be at least 1, got {turns}")
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
        raise UsageError(f"--from-context {from_context:,}: no session reaches it (the longest prompt has "
                         f"{longest:,} tokens)")
    return dataclasses.replace(workload, sessions=tuple(sessions), summary=summary)


def left_out_line(workload: Workload, from_context: int | None) -> str | None:
    """What `--from-context` left out, for the command's header (None: nothing)."""
    count = workload.summary.sessions_skipped.get(BELOW_FROM_CONTEXT, 0)
    if not count:
        return None
    sessions = "1 session that never reaches it" if count == 1 else f"{count:,} sessions that never reach it"
    return f"--from-context {from_context:,}: left out {sessions}"
