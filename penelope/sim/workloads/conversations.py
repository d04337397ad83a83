"""Conversations of an open-loop trace without session ids, recovered from its prefixes.

Mooncake's published traces name no session: every request is a session of its own, so session
completion time is a request's own latency and a router sticky by session routes nothing. Their
conversations are still visible in the block ids: a follow-up turn starts with its previous
turn's whole blocks (the previous partial last block, now full, gets a new id). `by_prefix`
puts a request into the conversation of the latest earlier request whose whole blocks (at least
`MIN_BLOCKS`, so a prefix shared by every request, such as Mooncake's block 0, does not count)
are the longest such prefix of its keys. Requests keep their arrival times; requests that follow
no earlier one start a conversation.
"""

from __future__ import annotations

import dataclasses

from penelope.errors import UsageError
from penelope.sim.workloads.types import Session, Workload

MIN_BLOCKS = 2
MODES = ("none", "prefix")


def by_prefix(workload: Workload, min_blocks: int = MIN_BLOCKS) -> Workload:
    """`workload` regrouped into conversations (see the module docstring); open loop only."""
    if workload.closed_loop:
        raise UsageError("`conversations` prefix: only for open-loop traces (a closed-loop one has sessions)")
    if any(len(session.requests) > 1 for session in workload.sessions):
        raise UsageError("`conversations` prefix: the trace names its sessions already")
    requests = sorted(
        ((r.arrival, s, i, r) for s, session in enumerate(workload.sessions) for i, r in enumerate(session.requests)),
        key=lambda item: item[:3],
    )
    size = workload.block_size
    # Whole-block prefix of an earlier request -> its conversation number.
    owner: dict[tuple[int, ...], int] = {}
    members: list[list] = []
    for _, _, _, request in requests:
        keys = tuple(request.keys.tolist())
        found = None
        for m in range(len(keys), min_blocks - 1, -1):
            found = owner.get(keys[:m])
            if found is not None:
                break
        if found is None:
            found = len(members)
            members.append([])
        members[found].append(request)
        whole = min(len(keys), request.input_tokens // size)
        if whole >= min_blocks:
            owner[keys[:whole]] = found
    sessions = tuple(Session(id=f"conversation {n}", requests=tuple(group)) for n, group in enumerate(members))
    summary = dataclasses.replace(workload.summary, sessions=len(sessions))
    return dataclasses.replace(workload, sessions=sessions, summary=summary)


def apply(workload: Workload, mode: str) -> Workload:
    """`mode` `"none"`: `workload` as loaded; `"prefix"`: `by_prefix` for an open-loop trace."""
    if mode not in MODES:
        raise UsageError(f"unknown `conversations` mode {mode!r}; choose from {', '.join(MODES)}")
    if mode == "none":
        return workload
    return by_prefix(workload)
