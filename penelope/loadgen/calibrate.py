"""Timing a running server for the simulator's time model: prefill batches and decode steps.

Prefill points: for each cached prefix length p (`prefixes`), the prefix is sent once (one token
out) so the server caches it, then `repeat` times the prefix plus n fresh tokens for each n of
`new_tokens` (n at most one chunk, so each point is one prefill batch). A point is the time to the
first streamed token and the work that batch did: n new tokens whose attention spans
`n * p + n * (n - 1) / 2` query-key pairs. Where the server reports Penelope's counters
(`/server_info` `internal_states[0]["penelope"]`: `prefill_tokens`, `prefill_positions`, installed
beside any SGLang cache by Penelope's plugin), the work is read from them instead, so a prefix the
server did not keep is counted as computed. The cache is flushed before each prefix.

Decode points: for each batch size b (`batches`) and context c (`contexts`), b prompts of c fresh
tokens are prefilled (one token out each), then sent again together with `decode_tokens` tokens to
generate: all b requests decode in the same steps, and the point is the median inter-token
latency of the b streams against (b, the KV tokens they hold: b * (c + decode_tokens / 2)).

Before any point is timed, a warm-up round runs each prefill size once and one decode of the
largest batch (not measured): a server's first batch of a new shape can take several times its
later ones (SGLang on CPU took 3x for its first 256- and 1K-token prefills).

Token ids are drawn below the vocabulary from `seed`, fresh for every request, so nothing but
the intended prefix is ever reused.

`read_points` reads back the points file `penelope calibrate --points` writes, so the fits can be
redone without the server.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from penelope.errors import PenelopeError, UsageError
from penelope.jsonfile import read_json
from penelope.loadgen.client import Sampling, request_body, stream_request
from penelope.loadgen.records import RequestRecord
from penelope.loadgen.target import Target, client_session, flush_cache


@dataclass(frozen=True)
class CalibrationPlan:
    prefixes: tuple[int, ...] = (0, 1024, 2048, 4096, 8192, 16384)
    new_tokens: tuple[int, ...] = (64, 256, 1024)
    batches: tuple[int, ...] = (1, 2, 4)
    contexts: tuple[int, ...] = (1024, 4096, 8192, 16384)
    decode_tokens: int = 32
    repeat: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        """UsageError naming the fields when the plan cannot give three points to each fit."""
        for name in ("prefixes", "new_tokens", "batches", "contexts"):
            values = getattr(self, name)
            if not values or any(v < (0 if name == "prefixes" else 1) for v in values):
                raise UsageError(f"`{name}`: give positive token counts, got {list(values)}")
        if self.decode_tokens < 2:
            raise UsageError(f"`decode_tokens` must be at least 2 (a step is the time between two tokens), got "
                             f"{self.decode_tokens}")
        if self.repeat < 1:
            raise UsageError(f"`repeat` must be at least 1, got {self.repeat}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise UsageError(f"`seed` must be an integer in [0, 2**63), got {self.seed!r}")
        if len(self.prefixes) * len(self.new_tokens) * self.repeat < 3:
            raise UsageError("`prefixes` x `new_tokens` x `repeat` gives fewer than 3 prefill points: the fit of 3 "
                             "constants needs at least 3")
        if len(self.contexts) * len(self.batches) * self.repeat < 3:
            raise UsageError("`contexts` x `batches` x `repeat` gives fewer than 3 decode points: the fit of 3 "
                             "constants needs at least 3")

    def check(self, target: Target) -> None:
        """UsageError naming the fields when a request of the plan cannot fit `target`'s context."""
        if target.max_total is None:
            return
        prefill = max(self.prefixes) + max(self.new_tokens)
        if prefill > target.max_total:
            raise UsageError(f"`prefixes` + `new_tokens`: a prefill point of {prefill:,} tokens does not fit the "
                             f"server's context ({target.max_total:,} tokens)")
        decode = max(self.contexts) + self.decode_tokens
        if decode > target.max_total:
            raise UsageError(f"`contexts` + `decode_tokens`: a decode point of {decode:,} tokens does not fit the "
                             f"server's context ({target.max_total:,} tokens)")


@dataclass
class Points:
    """What was measured: prefill (tokens, pairs, seconds, counted) per point, where `counted` says
    the work came from the server's counters; decode (batch, kv_tokens, seconds)."""

    prefill: list[tuple[int, int, float, bool]] = field(default_factory=list)
    decode: list[tuple[int, int, float]] = field(default_factory=list)


class _Ids:
    def __init__(self, vocab: int, seed: int):
        self.rng = np.random.default_rng(seed)
        # Ids 0 and 1 are often special (pad, end of text): never sent.
        self.low, self.high = min(2, vocab - 1), vocab

    def fresh(self, n: int) -> list[int]:
        return self.rng.integers(self.low, self.high, size=n).tolist()


async def _counters(http, target: Target) -> tuple[int, int] | None:
    try:
        async with http.get(target.url + "/server_info") as reply:
            info = json.loads(await reply.text())
        states = info.get("internal_states") or [{}]
        counters = (states[0] or {}).get("penelope") or {}
        return int(counters["prefill_tokens"]), int(counters["prefill_positions"])
    except (KeyError, TypeError, ValueError, AttributeError, OSError, asyncio.TimeoutError):
        return None


class ServerFault(PenelopeError):
    """The server failed a calibration request (exit 1: a fault, not bad input)."""


async def _send(http, target: Target, ids: list[int], max_new: int, rid: str) -> RequestRecord:
    record = RequestRecord(repeat=0, session=rid, session_index=0, turn=0, turns=1, kind="tool", rid=rid,
                           source="calibration", sent_at=0.0, scheduled_at=None, think_time=0.0,
                           prompt_tokens=len(ids), max_new_tokens=max_new)
    body = request_body(target.api, ",".join(map(str, ids)), max_new, Sampling(temperature=0.0), rid=rid,
                        session_id=None, model=target.model)
    await stream_request(http, target.endpoint, target.api, body, record, target.cumulative)
    if not record.ok:
        raise ServerFault(f"the server failed a calibration request ({len(ids):,} tokens): {record.error}")
    return record


async def measure(target: Target, plan: CalibrationPlan, points: Points, say: Callable[[str], None] = print,
                  read_timeout: float = 900.0) -> Points:
    """Every point of `plan` against `target` (see the module docstring), added to `points` as it is
    measured (so a run that fails or is stopped keeps what it measured). A time that is not
    positive (streamed tokens that arrived in one read) is left out and said."""
    plan.check(target)
    ids = _Ids(target.vocab, plan.seed)
    count = 0
    async with client_session(read_timeout) as http:
        await _warm_up(http, target, plan, ids, say)
        for p in plan.prefixes:
            error = await flush_cache(http, target)
            if error:
                raise ServerFault(f"cannot flush the server's cache before a prefix: {error}")
            prefix = ids.fresh(p)
            if p:
                await _send(http, target, prefix, 1, f"calibrate-prefix-{p}")
            for _ in range(plan.repeat):
                for n in plan.new_tokens:
                    count += 1
                    before = await _counters(http, target)
                    record = await _send(http, target, prefix + ids.fresh(n), 1, f"calibrate-{count}")
                    after = await _counters(http, target)
                    tokens, pairs, counted = n, n * p + n * (n - 1) // 2, False
                    if before is not None and after is not None:
                        tokens, pairs, counted = after[0] - before[0], after[1] - before[1], True
                    if not (record.ttft or 0) > 0:
                        say(f"  prefill: {tokens:,} tokens after {p:,} cached: no positive time, left out")
                        continue
                    points.prefill.append((tokens, pairs, record.ttft, counted))
                    say(f"  prefill: {tokens:,} tokens after {p:,} cached, {pairs:,} pairs: "
                        f"{record.ttft * 1e3:,.1f} ms")
        for c in plan.contexts:
            for b in plan.batches:
                await flush_cache(http, target)
                prompts = [ids.fresh(c) for _ in range(b)]
                for i, prompt in enumerate(prompts):
                    await _send(http, target, prompt, 1, f"calibrate-decode-prefill-{c}-{b}-{i}")
                for _ in range(plan.repeat):
                    records = await asyncio.gather(*(_send(http, target, prompt, plan.decode_tokens,
                                                           f"calibrate-decode-{c}-{b}-{i}-{_}")
                                                     for i, prompt in enumerate(prompts)))
                    steps = [r.itl for r in records if r.itl is not None]
                    kv = b * (c + plan.decode_tokens // 2)
                    if not steps or not statistics.median(steps) > 0:
                        say(f"  decode: batch {b}, {kv:,} KV tokens: no positive step time (tokens arrived "
                            "together), left out")
                        continue
                    points.decode.append((b, kv, statistics.median(steps)))
                    say(f"  decode: batch {b}, {kv:,} KV tokens: {statistics.median(steps) * 1e3:,.2f} ms per step")
    return points


async def _warm_up(http, target: Target, plan: CalibrationPlan, ids: _Ids, say: Callable[[str], None]) -> None:
    """Each prefill size once, then the largest batch decoding together over the shortest
    context; nothing timed (every point after flushes the cache first)."""
    say("  warm-up: " + ", ".join(f"{n:,}" for n in plan.new_tokens) + f" new tokens; a decode of batch "
        f"{max(plan.batches)}")
    for n in plan.new_tokens:
        await _send(http, target, ids.fresh(n), 1, f"calibrate-warm-up-{n}")
    batch, context = max(plan.batches), min(plan.contexts)
    await asyncio.gather(*(_send(http, target, ids.fresh(context), plan.decode_tokens, f"calibrate-warm-up-decode-{i}")
                           for i in range(batch)))


def run_measure(target: Target, plan: CalibrationPlan, points: Points,
                say: Callable[[str], None] = print) -> Points:
    from penelope.loadgen.runner import run_until_signal

    return run_until_signal(measure(target, plan, points, say))


def parse_counts(text: str, what: str, allow_zero: bool = False) -> tuple[int, ...]:
    """A comma-separated list of token counts (K suffixes allowed)."""
    from penelope.units import parse_size

    items = [item for item in str(text).split(",") if item.strip()]
    if not items:
        raise UsageError(f"{what}: empty list")
    return tuple(parse_size(item, what, allow_zero=allow_zero) for item in items)



# A points file holds a few hundred points.
MAX_POINTS_BYTES = 1 << 24


def read_points(path: str) -> tuple[Points, dict]:
    """The points of a file `penelope calibrate --points` wrote, and the file's other keys
    (`c_lin`, `model`, `server`, ...). UsageError naming the file and the first bad entry."""
    data = read_json(path, "points file", MAX_POINTS_BYTES)
    if not isinstance(data, dict) or not isinstance(data.get("prefill"), list) \
            or not isinstance(data.get("decode"), list):
        raise UsageError(f"points file {path}: expected a JSON object with lists 'prefill' and 'decode' (the "
                         "points file penelope calibrate writes)")
    points = Points()
    for i, entry in enumerate(data["prefill"]):
        if not (isinstance(entry, list) and len(entry) == 4 and _counts(entry[:2]) and _seconds(entry[2])
                and isinstance(entry[3], bool)):
            raise UsageError(f"points file {path}: prefill[{i}] is {entry!r}, expected [tokens, pairs, seconds, "
                             "counted]")
        points.prefill.append((int(entry[0]), int(entry[1]), float(entry[2]), entry[3]))
    for i, entry in enumerate(data["decode"]):
        # A step holds at least one KV token per request: kv_tokens 0 is no decode step.
        if not (isinstance(entry, list) and len(entry) == 3 and _counts(entry[:2]) and entry[0] > 0
                and entry[1] >= entry[0] and _seconds(entry[2])):
            raise UsageError(f"points file {path}: decode[{i}] is {entry!r}, expected [batch, kv_tokens, seconds] "
                             "with kv_tokens at least the batch")
        points.decode.append((int(entry[0]), int(entry[1]), float(entry[2])))
    return points, {key: value for key, value in data.items() if key not in ("prefill", "decode")}


def _counts(values) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)


def _seconds(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value) and value >= 0
