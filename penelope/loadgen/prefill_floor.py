"""How many prefill tokens a cache that never evicts would have computed for one run's requests:
the floor under every cache's computed tokens, so computed minus floor is what eviction cost.

The prompts are rebuilt exactly as the client built them (`SessionPrompts` of the same token
space, each turn's reply the ids the server sent), then served in send order against an unbounded
page-granular prefix cache: a request's prompt can be reused from the moment it is sent (by any
request sent after it), its prompt and reply less the reply's last token (whose KV is never
computed) from the moment it ends. A request reuses the longest cached run of whole pages that
starts its prompt, never the prompt's last token (SGLang always computes at least one), and
computes the rest. So the floor is at most what any cache computes for these requests: a server
that prefills two requests sharing a prefix in one batch computes that prefix twice, which shows
as recomputed tokens without any eviction. Requests that failed or were cut are left out of the
floor (the server computed their tokens all the same; the report counts failures beside it).
"""

from __future__ import annotations

from collections.abc import Sequence

from penelope.loadgen.records import RequestRecord
from penelope.loadgen.tokens import SessionPrompts, TokenSpace
from penelope.sim.workloads.types import Workload


def rebuilt_prompts(records: Sequence[RequestRecord], workload: Workload,
                    space: TokenSpace) -> dict[tuple[int, int], list[int]]:
    """(session index, turn) -> the prompt ids the client sent, for every finished request whose
    session's earlier turns all finished. Raises ValueError when a rebuilt prompt's length is not
    the one recorded (another workload or token space than the run's)."""
    by_session: dict[int, dict[int, RequestRecord]] = {}
    for record in records:
        by_session.setdefault(record.session_index, {})[record.turn] = record
    prompts = {}
    for index, turns in by_session.items():
        session = workload.sessions[index]
        builder = SessionPrompts(space, workload.block_size, index, session, reuse_replies=workload.closed_loop)
        for turn in range(len(session.requests)):
            record = turns.get(turn)
            if record is None or not record.ok:
                if workload.closed_loop:
                    # The session ended here: its next prompt would need this reply.
                    break
                # Open loop: every prompt comes from its own keys; skip this one.
                builder.next_prompt()
                continue
            ids = list(builder.next_prompt())
            if len(ids) != record.prompt_tokens:
                raise ValueError(f"{record.rid}: rebuilt a prompt of {len(ids)} ids, the run sent "
                                 f"{record.prompt_tokens}")
            prompts[(index, turn)] = ids
            builder.add_reply(reply_ids(record, space))
    return prompts


def reply_ids(record: RequestRecord, space: TokenSpace) -> list[int]:
    """The ids the client put into the next prompt for `record`'s reply."""
    if record.reply_ids == "server":
        return list(record.output_ids)
    return space.stand_in_reply(record.session_index, record.turn, record.output_tokens)


def _page_keys(ids: Sequence[int], page: int, pages: int) -> list[int]:
    """Hashes of the prompt's first 1, 2, ... `pages` whole pages (each of the prefix up to it)."""
    keys, key = [], 0
    for p in range(pages):
        key = hash((key, tuple(ids[p * page:(p + 1) * page])))
        keys.append(key)
    return keys


def never_evicting_prefill(records: Sequence[RequestRecord], workload: Workload, space: TokenSpace,
                           page: int) -> int:
    """Prefill tokens a never-evicting cache of `page`-token pages computes for the finished
    requests of one run (see the module docstring)."""
    prompts = rebuilt_prompts(records, workload, space)
    served = [r for r in records if (r.session_index, r.turn) in prompts and r.e2e is not None]
    # (time, order, kind, record): a request's end before a send at the same instant.
    events = []
    for record in served:
        events.append((record.sent_at + record.e2e, 0, "history", record))
        events.append((record.sent_at, 1, "send", record))
    events.sort(key=lambda e: (e[0], e[1]))
    cached: set[int] = set()
    computed = 0
    for _, _, kind, record in events:
        ids = prompts[(record.session_index, record.turn)]
        if kind == "send":
            usable = (len(ids) - 1) // page
            reused = 0
            for key in _page_keys(ids, page, usable):
                if key not in cached:
                    break
                reused += 1
            computed += len(ids) - reused * page
        else:
            ids = ids + reply_ids(record, space)[:-1]
        # The prompt from its send on, prompt and reply from its end on.
        cached.update(_page_keys(ids, page, len(ids) // page))
    return computed
