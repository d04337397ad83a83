"""What an SGLang request tells the agent-aware eviction policies (`penelope.cache.hints`).

SGLang's scheduler, where the cache lives, does not see a tool call as a finish reason: its
``finished_reason`` says only that the reply stopped on an end token, a stop string or a length,
and the tool-call parser (``--tool-call-parser``) runs later, in the OpenAI layer, on the text.
So the plugin reads the wait kind from what the request itself carries, in this order:

1. a per-request hint: ``custom_params={"penelope_waits_for": "tool" | "human"}`` in the
   sampling parameters (the OpenAI API's ``extra_body={"custom_params": {...}}``), for a client
   that knows what its session waits for after this reply (null is no hint);
2. the reply's tokens, when the ``tool_call_token`` option names the token id that opens a tool
   call in the model's chat template (Qwen3's ``<tool_call>``: 151657): a reply that contains it
   ends in a tool call and its session waits for the tool; any other reply waits for a person;
3. otherwise nothing: the wait kind is unknown (None), and the policies pool every wait.

Time is rank 0's monotonic clock, broadcast to every tensor-parallel rank with the requests
(``clock.py``), so every rank's policy reads the same times.
"""
from __future__ import annotations

from penelope.cache.hints import HUMAN, TOOL, WAIT_KINDS
from penelope.errors import UsageError

HINT_KEY = "penelope_waits_for"


def wait_kind(req, tool_call_token: int | None) -> str | None:
    """What the session of finished request `req` now waits for: "tool", "human" or None (see the
    module docstring). A malformed per-request hint raises UsageError naming the request."""
    custom = getattr(getattr(req, "sampling_params", None), "custom_params", None) or {}
    kind = custom.get(HINT_KEY)
    if kind is not None:
        if kind not in WAIT_KINDS:
            raise UsageError(f"penelope: request {req.rid}: custom_params[{HINT_KEY!r}] must be one of "
                             f"{', '.join(WAIT_KINDS)}, got {kind!r}")
        return kind
    if tool_call_token is None:
        return None
    return TOOL if tool_call_token in req.output_ids else HUMAN


def book_counters(policy) -> dict:
    """The book of a policy that reads hints (``WaitBook.counts``) as ``hint_*`` counters for
    ``get_server_info``, with the longest wait observed (seconds, 0 before any); none for a policy
    without one."""
    book = getattr(policy, "book", None)
    if book is None:
        return {}
    waits = book.waits(None)
    return {**{f"hint_{name}": value for name, value in book.counts().items()},
            "hint_longest_wait_s": waits[-1] if waits else 0.0}
