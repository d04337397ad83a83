"""A seeded generator of Mooncake-format traces with the statistics of the public conversation trace.

The real trace (`FAST25-release/traces/conversation_trace.jsonl` in github.com/kvcache-ai/Mooncake:
12,031 requests over 3,537 s, FAST'25) is not shipped with this project; tests and examples use
this generator instead, and `penelope simulate --trace FILE.jsonl` replays either file the same
way. What it reproduces, measured on the real trace (quantile tables below):
- Every request starts with block id 0 (a shared first block); blocks are 512 tokens.
- Conversations: a first turn, then follow-ups; a follow-up reuses its previous turn's whole
  blocks as its prefix (the previous turn's partial last block becomes a new, full block) and
  adds new blocks. In the real trace 61% of requests share nothing but block 0 with any earlier
  request (first turns); a turn of at least 2 whole blocks is followed up with the probability
  `CONTINUE[d]` at turn d (rising from 0.36 to 0.75; a follow-up of a shorter turn shares only
  block 0 and counts as a first turn in the real trace's statistics, so none is generated).
- Input lengths of first turns, growth of a follow-up's input over its previous turn (negative
  growth, 8% of follow-ups in the real trace, is taken as none), seconds between turns, output
  lengths: sampled from the real trace's quantiles, linearly between them.
- Arrivals: conversations start as a Poisson process at `rate / mean turns` per second, from
  `WARMUP` seconds before the trace begins so that it opens in steady state (the real trace is a
  cut of online traffic: its first minutes already hold follow-ups); the real trace's
  timestamps fall on a grid of about 3 s (`tick`), so times are rounded to it.
Not reproduced: which conversations share prefixes beyond block 0 (the real trace has a few
hundred shared system prompts), and the correlation between lengths and turns.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from penelope.errors import UsageError

BLOCK = 512
QUANTILES = (0, 5, 10, 25, 50, 75, 90, 95, 99, 100)
# Quantiles (QUANTILES, in percent) of the real conversation trace, computed from it: input tokens
# of first turns, input growth of follow-ups (tokens), seconds between turns, output tokens.
FIRST_INPUT = (891, 897, 905, 1336, 5264, 13056, 25559, 38494, 89868, 126195)
GROWTH = (0, 0, 0, 187, 454, 900, 4621, 7419, 17221, 91918)
TURN_GAP = (0.0, 30.0, 42.0, 66.0, 123.0, 264.0, 483.0, 615.4, 1476.9, 3030.0)
OUTPUT = (1, 10, 24, 156, 350, 472, 597, 698, 1118, 2000)
# Probability that a turn d (0: the first) of at least 2 whole blocks is followed up; the last
# value repeats. Measured: followed-up turns over turns at each depth (0.307 at depth 0, over all
# first turns, of which the 14% shorter than 2 blocks cannot be followed up: 0.307 / 0.86).
CONTINUE = (0.357, 0.419, 0.51, 0.587, 0.588, 0.683, 0.75)
MAX_INPUT = 126195
RATE = 12031 / 3537.0
DURATION = 3537.0
# Seconds of conversations started before the trace begins (about two 99th-percentile turn gaps).
WARMUP = 3000.0


@dataclass(frozen=True)
class MooncakeLikeConfig:
    """What to generate: `duration` seconds of arrivals at `rate` requests per second (mean),
    times rounded to `tick` seconds (0: not rounded), inputs capped at `max_input` tokens."""

    duration: float = DURATION
    rate: float = RATE
    tick: float = 3.0
    max_input: int = MAX_INPUT
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("duration", "rate", "tick"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise UsageError(f"{name} must be a number, got {value!r}")
        if self.duration <= 0 or self.rate <= 0 or self.tick < 0:
            raise UsageError(f"duration and rate must be positive and tick non-negative, got {self}")
        if isinstance(self.max_input, bool) or not isinstance(self.max_input, int) or self.max_input < 2 * BLOCK:
            raise UsageError(f"max_input must be an integer of at least {2 * BLOCK} tokens, got {self.max_input!r}")


def mean_turns() -> float:
    """Expected requests per conversation under `CONTINUE` (first turns shorter than 2 blocks,
    a fraction read from `FIRST_INPUT`, are never followed up; later turns only grow)."""
    short = float(np.interp(2 * BLOCK, FIRST_INPUT, QUANTILES)) / 100.0
    total, alive = 0.0, 1.0
    for depth in range(10_000):
        total += alive
        alive *= CONTINUE[min(depth, len(CONTINUE) - 1)] * ((1.0 - short) if depth == 0 else 1.0)
        if alive < 1e-12:
            break
    return total


def _sample(table, rng: np.random.Generator, size=None):
    return np.interp(rng.random(size), np.asarray(QUANTILES) / 100.0, np.asarray(table, dtype=np.float64))


def generate(config: MooncakeLikeConfig | None = None) -> list[dict]:
    """The requests of a trace (see the module docstring), by timestamp: dicts with `timestamp`
    (ms), `input_length`, `output_length`, `hash_ids`, as in Mooncake's JSONL."""
    config = config or MooncakeLikeConfig()
    rng = np.random.default_rng(config.seed)
    starts_per_second = config.rate / mean_turns()
    next_id = 1
    rows = []
    t = -WARMUP + rng.exponential(1.0 / starts_per_second)
    while t < config.duration:
        depth, when, ids, length = 0, t, None, 0
        while when < config.duration:
            if ids is None:
                length = int(min(config.max_input, max(BLOCK + 1, _sample(FIRST_INPUT, rng))))
                kept: list[int] = [0]
            else:
                kept = ids[: length // BLOCK]
                length = int(min(config.max_input, length + max(1, _sample(GROWTH, rng))))
            blocks = math.ceil(length / BLOCK)
            fresh = blocks - len(kept)
            ids = kept + list(range(next_id, next_id + fresh))
            next_id += fresh
            output = int(max(1, round(_sample(OUTPUT, rng))))
            stamp = round(when / config.tick) * config.tick if config.tick else when
            if stamp >= 0:
                rows.append({"timestamp": int(round(stamp * 1000)), "input_length": length,
                             "output_length": output, "hash_ids": ids})
            if length < 2 * BLOCK or length >= config.max_input:
                break
            if rng.random() >= CONTINUE[min(depth, len(CONTINUE) - 1)]:
                break
            depth += 1
            when += float(_sample(TURN_GAP, rng))
        t += rng.exponential(1.0 / starts_per_second)
    rows.sort(key=lambda row: row["timestamp"])
    return rows


def write_jsonl(path: str | Path, config: MooncakeLikeConfig | None = None) -> int:
    """Write a generated trace as Mooncake JSONL at `path`; returns the number of requests."""
    rows = generate(config)
    with Path(path).open("w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return len(rows)
