"""SGLang's keys and requests as Penelope sees them: token ids in namespaces, and the match handle
SGLang keeps in ``req.last_node``.

- A key with an ``extra_key`` or ``cache_salt`` is cached in a namespace of its own: its token ids
  (which must lie in [0, 2**32)) are shifted to ``token + namespace << NS_SHIFT``. Namespace
  numbers follow first use, so every TP rank assigns the same ones.
- ``MatchRef`` is the node handle: one Penelope match, the token source it was made for, the
  prefix reported to SGLang and the holes before it. Positions no resident block covers read
  ``PAD_SLOT``, SGLang's padding slot, until a phantom's slots are linked in.
"""
from __future__ import annotations

import operator
from array import array

import numpy as np

from penelope.cache.arguments import int_array
from penelope.cache.manager import MatchResult as PenelopeMatch
from penelope.cache.tree import BlockState
from penelope.errors import UsageError

# Slot 0 (page 0) is SGLang's padding slot: hole positions of a row hold it until a phantom's
# slots are linked in, so a missed link reads padding instead of another request's KV.
PAD_SLOT = 0
NS_SHIFT = 32


class Namespaces:
    """Numbers of the (extra_key, cache_salt) namespaces seen so far; 0 is the plain namespace."""

    def __init__(self):
        self._numbers: dict[tuple, int] = {}

    def number(self, extra_key, cache_salt, create: bool = False) -> int | None:
        """0 for keys without a namespace; otherwise the namespace's number (None if unknown and
        not `create`)."""
        if extra_key is None and cache_salt is None:
            return 0
        name = (extra_key, cache_salt)
        number = self._numbers.get(name)
        if number is None and create:
            number = self._numbers[name] = len(self._numbers) + 1
        return number

    def name_of(self, number: int) -> tuple:
        """(extra_key, cache_salt) of namespace `number` ((None, None) for 0)."""
        if number == 0:
            return (None, None)
        return next(name for name, n in self._numbers.items() if n == number)

    def as_dict(self) -> dict[tuple, int]:
        """{(extra_key, cache_salt): number} of the namespaces seen so far (a copy)."""
        return dict(self._numbers)


def key_tokens(token_ids, n: int, namespace: int) -> np.ndarray:
    """The first `n` token ids as int64, shifted into `namespace`. Without a namespace, a view of
    SGLang's array that the caller must not keep (a kept view would pin the growing array)."""
    if isinstance(token_ids, array) and token_ids.typecode == "q":
        # Positional arguments: numpy parses keywords here at a cost comparable to the call's own.
        tokens = np.frombuffer(token_ids, np.int64, n)
    else:
        # Checked by numpy's dtype, not token by token: floats, bools, None and ids beyond int64
        # are refused instead of being truncated or raising a TypeError.
        tokens = int_array(token_ids[:n], "penelope: token ids")
    if namespace:
        if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >> NS_SHIFT):
            raise UsageError("penelope: namespaced token ids must lie in [0, 2**32)")
        tokens = tokens + (namespace << NS_SHIFT)
    return tokens


class MatchRef:
    """The node handle SGLang keeps in ``req.last_node``: one Penelope match (None for the root),
    the token source and length it was made for, the reported prefix and the holes before it.

    The source is SGLang's token array itself (never a copy or a numpy view: a view would pin the
    growing array), read again only if the match must be redone."""

    __slots__ = ("match", "source", "n", "namespace", "prefix_len", "holes")

    def __init__(self, match: PenelopeMatch | None, source=None, n: int = 0, namespace: int = 0,
                 with_holes: bool = False):
        self.match, self.source, self.n, self.namespace = match, source, n, namespace
        spans = match.spans if match is not None else []
        if with_holes:
            self.prefix_len = match.compute_from
            self.holes = list(match.holes)
        else:
            first = spans[0] if spans else None
            self.prefix_len = first.end if first is not None and first.state == BlockState.GPU else 0
            self.holes = []

    def slots(self, n: int) -> np.ndarray:
        """Slots of positions [0, n) (int64 [n], n <= the matched length); PAD_SLOT at holes."""
        spans = self.match.spans if self.match is not None else []
        if spans and spans[0].state == BlockState.GPU and spans[0].end >= n:
            # The common case, one resident run: a copy of its first n slots.
            return spans[0].slots[:n].copy()
        out = np.full(n, PAD_SLOT, dtype=np.int64)
        for span in spans:
            if span.start >= n:
                break
            if span.state == BlockState.GPU:
                end = min(span.end, n)
                out[span.start:end] = span.slots[:end - span.start]
        return out

    def __repr__(self) -> str:
        return f"MatchRef(prefix_len={self.prefix_len}, holes={self.holes})"


def phantom_eligible(req) -> bool:
    """Requests whose holes a phantom can refill: plain token prompts (no embeddings, multimodal
    inputs or diffusion-LM blocks, whose KV at a position does not follow from the token ids)."""
    return (req is not None and req.multimodal_inputs is None and req.input_embeds is None
            and req.positional_embed_overrides is None and req.dllm_config is None)


def whole_number(value) -> int | None:
    """`value` as an int (a Python or numpy integer, a 0-dim integer tensor), None for anything
    else (bools, floats, strings, None)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
