"""Synthetic agent sessions with the statistics of the paper's Claude Code replay (the default workload).

The paper replayed 24 Claude Code sessions: 4,688 requests (about 195 per session), a 15.6K-token
shared tools+system prefix, per-turn context median about 80K tokens within a 128K window. The
WEKA traces (see `weka.py`) give the rest: tool waits median 8 s and p90 67 s, human waits
median 131 s for about 8% of turns, outputs of a few hundred tokens, about 3% compactions.

A session, turn by turn (every random draw from one seeded generator per session, so adding
sessions leaves the earlier ones unchanged):
- the first request is the shared prefix plus a human prompt;
- each next request appends the previous output and either a tool result (a tool turn) or a
  human prompt (with probability `human_fraction`), after a lognormal wait of that kind;
- when the context would pass the session's compaction threshold (drawn per cycle in
  `compaction_range` times `max_context`, as an agent compacts when its window fills up), the
  history is reset to the prefix plus a summary of fresh blocks, then the turn's new input.
Block keys follow the trace convention: a block keeps its key while the history is only
extended; the block that was partial gets a new key when it fills, and a compaction starts a new
history after the shared prefix blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from penelope.errors import UsageError
from penelope.memory import check_memory
from penelope.sim.workloads.types import (
    HUMAN,
    TOOL,
    Request,
    Session,
    Workload,
    WorkloadSummary,
    session_key_base,
    tail_key,
)

# z-score of the 90th percentile of a standard normal: a lognormal with median m and p90 q has
# sigma = ln(q / m) / Z90.
Z90 = 1.2815515655446004


@dataclass(frozen=True)
class SyntheticConfig:
    """Parameters of the generator; token figures in tokens, waits in seconds.

    Each `*_median` / `*_sigma` pair is a lognormal (median, sigma of the log). Session lengths
    are uniform in `requests_per_session * (1 -+ requests_spread)`."""

    sessions: int = 24
    requests_per_session: int = 195
    requests_spread: float = 0.2
    prefix_tokens: int = 15_600
    max_context: int = 128 * 1024
    block_size: int = 64
    first_prompt_median: float = 3_000.0
    first_prompt_sigma: float = 0.8
    tool_result_median: float = 1_100.0
    tool_result_sigma: float = 1.3
    human_prompt_median: float = 300.0
    human_prompt_sigma: float = 1.0
    output_median: float = 250.0
    output_sigma: float = 0.9
    output_max: int = 8_192
    human_fraction: float = 0.08
    tool_wait_median: float = 8.0
    tool_wait_p90: float = 67.0
    human_wait_median: float = 131.0
    human_wait_sigma: float = 1.5
    summary_median: float = 22_000.0
    summary_sigma: float = 0.35
    compaction_range: tuple[float, float] = (0.9, 1.0)
    seed: int = 0

    def __post_init__(self) -> None:
        positive = ("sessions", "requests_per_session", "prefix_tokens", "max_context", "block_size")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise UsageError(f"synthetic workload: {name} must be a positive integer, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or not 0 <= self.seed < 2**63:
            raise UsageError(f"seed of the synthetic workload must be an integer in [0, 2**63), got {self.seed!r}")
        for name, value in vars(self).items():
            if isinstance(value, float) and not np.isfinite(value):
                raise UsageError(f"synthetic workload: {name} must be finite, got {value}")
        # Every request holds its context's block keys (8 bytes per block); check the largest
        # workload these settings can make against memory before making it.
        requests = self.sessions * self.requests_per_session * (1 + self.requests_spread)
        check_memory(requests * (self.max_context // self.block_size + 1) * 8,
                     f"a synthetic workload of {self.sessions} sessions with contexts up to {self.max_context} tokens")
        if not 0 <= self.requests_spread < 1:
            raise UsageError(f"synthetic workload: requests_spread {self.requests_spread} is not in [0, 1)")
        if not 0 <= self.human_fraction <= 1:
            raise UsageError(f"synthetic workload: human_fraction {self.human_fraction} is not in [0, 1]")
        if self.tool_wait_p90 < self.tool_wait_median:
            raise UsageError("synthetic workload: tool_wait_p90 must be at least tool_wait_median")
        low, high = self.compaction_range
        if not 0 < low <= high <= 1:
            raise UsageError(f"synthetic workload: compaction_range {low, high} needs 0 < low <= high <= 1")
        # The post-compaction context (prefix + a typical summary) must leave room to grow.
        if self.prefix_tokens + self.summary_median >= low * self.max_context:
            raise UsageError(
                f"synthetic workload: prefix {self.prefix_tokens} + summary {self.summary_median:.0f} "
                f"leave no room below the compaction threshold of a {self.max_context}-token context"
            )


def generate(config: SyntheticConfig | None = None) -> Workload:
    """A closed-loop workload of `config.sessions` synthetic agent sessions (see the module docstring)."""
    config = config or SyntheticConfig()
    sessions = tuple(_session(config, index) for index in range(config.sessions))
    summary = WorkloadSummary(
        format="synthetic",
        sources=[f"synthetic(seed={config.seed})"],
        sessions=len(sessions),
        requests=sum(len(s.requests) for s in sessions),
    )
    return Workload(sessions=sessions, block_size=config.block_size, closed_loop=True, summary=summary)


class _History:
    """The block keys of one session's current context; a compaction starts a new one."""

    def __init__(self, config: SyntheticConfig, base: int):
        self.size = config.block_size
        self.shared_blocks = config.prefix_tokens // self.size
        self.capacity = config.max_context // self.size
        self.base = base
        self.next_id = 0
        self.reset()

    def reset(self) -> None:
        # A fresh array: views handed to earlier requests must not change.
        self.keys = np.empty(self.capacity, dtype=np.int64)
        self.keys[: self.shared_blocks] = np.arange(self.shared_blocks)
        self.filled = self.shared_blocks

    def keys_for(self, context: int) -> np.ndarray:
        """Read-only keys of the first `context // block_size` blocks, new keys for new blocks."""
        n = context // self.size
        if n > self.filled:
            count = n - self.filled
            self.keys[self.filled : n] = self.base + self.next_id + np.arange(count)
            self.next_id += count
            self.filled = n
        view = self.keys[:n]
        view.flags.writeable = False
        return view


def _session(config: SyntheticConfig, index: int) -> Session:
    rng = np.random.default_rng([config.seed, index])
    mean, spread = config.requests_per_session, config.requests_per_session * config.requests_spread
    count = max(1, int(rng.integers(round(mean - spread), round(mean + spread) + 1)))
    tool_wait_sigma = np.log(config.tool_wait_p90 / config.tool_wait_median) / Z90
    history = _History(config, session_key_base(index))

    def lognormal(median: float, sigma: float) -> float:
        return float(median * np.exp(sigma * rng.standard_normal()))

    def threshold() -> int:
        low, high = config.compaction_range
        return int(rng.uniform(low, high) * config.max_context)

    limit = threshold()
    context = config.prefix_tokens + round(lognormal(config.first_prompt_median, config.first_prompt_sigma))
    requests = []
    output = 0
    for i in range(count):
        kind, wait = HUMAN, 0.0
        if i > 0:
            kind = HUMAN if rng.random() < config.human_fraction else TOOL
            if kind == HUMAN:
                wait = lognormal(config.human_wait_median, config.human_wait_sigma)
                new = round(lognormal(config.human_prompt_median, config.human_prompt_sigma))
            else:
                wait = lognormal(config.tool_wait_median, tool_wait_sigma)
                new = round(lognormal(config.tool_result_median, config.tool_result_sigma))
            context += output + new
            if context > limit:
                history.reset()
                summary = round(lognormal(config.summary_median, config.summary_sigma))
                context = config.prefix_tokens + summary + new
                limit = threshold()
        # Extreme draws must not exceed the model's window.
        context = max(1, min(context, config.max_context))
        output = round(lognormal(config.output_median, config.output_sigma))
        output = min(max(output, 1), config.output_max)
        requests.append(
            Request(
                keys=history.keys_for(context),
                input_tokens=context,
                output_tokens=output,
                think_time=wait,
                arrival=None,
                kind=kind,
                tail_key=tail_key(index, i),
                source=f"synthetic session {index} request {i}",
            )
        )
    return Session(id=f"synthetic-{index:03d}", requests=tuple(requests))
