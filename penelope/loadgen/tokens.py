"""Token ids of a load-generator replay: deterministic per session, the server's replies in the history.

A workload request names its prompt by block keys (`penelope.sim.workloads.types`): equal keys, equal
content. Every block key becomes token ids hashed from (seed, key, offset) below the vocabulary
size, so a key that many prompts hold (the tools+system prefix of WEKA and synthetic sessions, a
Mooncake hash id) is the same token sequence in each of them. Fresh ids (text no key names) are
hashed from (seed, session, turn, offset): the same in every run with the same seed.

A closed-loop session's first prompt is its key tokens, then fresh ids up to its length. Each
later turn follows the trace's keys against the turn before:
- the history was extended (the request's keys start with all of the previous request's): the
  previous prompt, the reply the server actually sent, then fresh ids up to the request's length
  (none when the two are already that long);
- otherwise (a compaction, a branch): the previous prompt and reply cut to the blocks the two
  requests share, then key tokens of the request's other blocks, then fresh ids.
So the server's radix cache sees real multi-turn reuse, reply tokens included, and two servers
that send the same replies (greedy decoding) get the same prompts. Open-loop requests (Mooncake)
are sent before earlier replies arrive: each is its key tokens and fresh ids.

`scale` divides every token count: a block of B tokens becomes max(1, round(B / scale)) tokens,
an input or an output of n tokens max(1, round(n / scale)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from penelope.errors import UsageError
from penelope.sim.workloads.types import Request, Session, common_prefix

# Domains of the hash, so key tokens, fresh tokens and stand-in replies never share a stream.
_KEYS, _FRESH, _REPLY = 0, 1, 2
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
# Token ids travel as JSON integers and SGLang stores them as int32.
MAX_VOCAB = 2**31


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on a uint64 array (wrapping arithmetic): a bijection whose outputs
    look independent for consecutive inputs."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


@dataclass(frozen=True)
class TokenSpace:
    """How counts are scaled and ids drawn: ids in [0, vocab), from `seed`."""

    vocab: int
    seed: int = 0
    scale: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.vocab, bool) or not isinstance(self.vocab, int) or not 2 <= self.vocab <= MAX_VOCAB:
            raise UsageError(f"`vocab` must be an integer in [2, 2**31], got {self.vocab!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise UsageError(f"`seed` must be an integer in [0, 2**63), got {self.seed!r}")
        if not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale) and self.scale >= 1):
            raise UsageError(f"`scale` must be a number of at least 1 (it divides token counts), got {self.scale!r}")

    def count(self, tokens: int) -> int:
        """A trace's token count, scaled (at least 1)."""
        return max(1, round(tokens / self.scale))

    def _streams(self, domain: int, values: np.ndarray) -> np.ndarray:
        # Modulo 2**64: a seed near 2**63 overflows uint64 when tripled.
        salt = _mix(np.array([(self.seed * 3 + domain) % 2**64], dtype=np.uint64))
        return _mix(values.astype(np.uint64) ^ salt)

    def _draw(self, streams: np.ndarray, n: int) -> np.ndarray:
        offsets = np.arange(n, dtype=np.uint64) * _GOLDEN
        with np.errstate(over="ignore"):
            # [streams, n]
            mixed = _mix(streams[:, None] + offsets[None, :])
        return (mixed % np.uint64(self.vocab)).astype(np.int64).reshape(-1)

    def key_tokens(self, keys: np.ndarray, per_block: int) -> np.ndarray:
        """int64 `[len(keys) * per_block]`: `per_block` ids for every block key, in order."""
        if not keys.size:
            return np.zeros(0, dtype=np.int64)
        return self._draw(self._streams(_KEYS, keys), per_block)

    def fresh_tokens(self, session: int, turn: int, n: int, domain: int = _FRESH) -> np.ndarray:
        """int64 `[n]`: the fresh ids of turn `turn` of session number `session`."""
        stream = self._streams(domain, np.array([(session << 32) | turn], dtype=np.uint64))
        return self._draw(stream, n) if n else np.zeros(0, dtype=np.int64)

    def stand_in_reply(self, session: int, turn: int, n: int) -> list[int]:
        """Ids standing for a reply whose ids the API did not send (n of them, deterministic)."""
        return self.fresh_tokens(session, turn, n, domain=_REPLY).tolist()


@dataclass(frozen=True)
class Layout:
    """Where a prompt's tokens come from, in order: `keep` tokens of the previous prompt and its
    reply, then key tokens of the request's blocks from block `first_block` (`keyed` tokens),
    then `fresh` fresh ids."""

    keep: int
    first_block: int
    keyed: int
    fresh: int

    @property
    def length(self) -> int:
        return self.keep + self.keyed + self.fresh


def layout(previous: Request | None, request: Request, history: int, per_block: int, target: int) -> Layout:
    """The layout of `request`'s prompt of `target` tokens after `previous` (None: a first turn or an
    open-loop request), whose prompt and reply hold `history` tokens together (see the module
    docstring). The prompt is longer than `target` only when an extended history already is."""
    if previous is not None:
        shared = common_prefix(previous.keys, request.keys)
        if shared == previous.n_blocks:
            return Layout(history, request.n_blocks, 0, max(0, target - history))
        keep = min(shared * per_block, history, target)
    else:
        shared = keep = 0
    keyed = min((request.n_blocks - shared) * per_block, target - keep)
    return Layout(keep, shared, keyed, target - keep - keyed)


class SessionPrompts:
    """The prompts of session number `index`, turn by turn: `next_prompt()`, send it, then
    `add_reply(ids)` with the reply's ids before the next `next_prompt()`.

    `reuse_replies`: closed loop (each turn builds on the previous prompt and reply, see the
    module docstring); False: every prompt from its own keys (open loop)."""

    def __init__(self, space: TokenSpace, block_size: int, index: int, session: Session, reuse_replies: bool):
        self.space = space
        self.per_block = space.count(block_size)
        self.index = index
        self.session = session
        self.reuse_replies = reuse_replies
        self.turn = 0
        self.ids: list[int] = []
        # The prompt as comma-separated ids: extended in place when the history is, so a long
        # prompt is not encoded again every turn.
        self.text = ""
        self.reply: list[int] = []

    def next_prompt(self) -> list[int]:
        """The ids of the next turn's prompt (a list owned by this object: do not change it)."""
        request = self.session.requests[self.turn]
        previous = self.session.requests[self.turn - 1] if self.turn and self.reuse_replies else None
        history = len(self.ids) + len(self.reply) if previous is not None else 0
        plan = layout(previous, request, history, self.per_block, self.space.count(request.input_tokens))
        fresh = self.space.fresh_tokens(self.index, self.turn, plan.fresh).tolist()
        keyed = self.space.key_tokens(request.keys[plan.first_block:], self.per_block)[: plan.keyed].tolist()
        if previous is not None and plan.keep == history:
            added = self.reply + keyed + fresh
            self.ids.extend(added)
            self.text = ",".join(filter(None, (self.text, ",".join(map(str, added)))))
        else:
            kept = (self.ids + self.reply)[: plan.keep] if plan.keep else []
            self.ids = kept + keyed + fresh
            self.text = ",".join(map(str, self.ids))
        self.reply = []
        self.turn += 1
        return self.ids

    def add_reply(self, ids: list[int]) -> None:
        self.reply = list(ids)


def planned_lengths(space: TokenSpace, block_size: int, session: Session, reuse_replies: bool) -> list[tuple[int, int]]:
    """(prompt tokens, tokens to generate) of every request of `session`, when every reply has
    the length asked for (the server stops at that length and ignores end tokens)."""
    per_block = space.count(block_size)
    lengths = []
    prompt = reply = 0
    previous = None
    for request in session.requests:
        plan = layout(previous if reuse_replies else None, request, prompt + reply, per_block,
                      space.count(request.input_tokens))
        prompt, reply = plan.length, space.count(request.output_tokens)
        lengths.append((prompt, reply))
        previous = request
    return lengths
