"""A tiny serving loop over the reference engine: multi-session, multi-turn, phantoms in the batch.

`Server.serve(prompt)` runs one request the way a Penelope-enabled engine would: match the prompt
in the cache, plan the batch (`penelope.cache.phantom`), run ONE forward holding a phantom segment per
hole and the real request's new tokens, then decode greedily (each step a 1-token segment at the
next position, with a slot from the cache), and finally insert the whole sequence back into the
cache. Requests run one at a time; sessions are just token histories (`AgentWorkload`).

Prompt log-probabilities (`logprobs=True`): for every position p the turn computes (phantom rows,
the real request's rows, decode rows), the row `log_softmax(logits[p])` over the vocabulary; the
prompt log-probability at p is its entry for token p + 1. A position whose KV is reused from the
cache has no logits in this turn; its log-probability comes from the row computed when that KV
was written (an earlier turn, possibly of another session sharing the prefix). So a whole run
covers every position of every prompt, reused or recomputed, and a position recomputed later (as
a phantom, or after a tail eviction) yields a second row that must equal the first bitwise in
deterministic mode.

Two tiers: with a `penelope.cache.tiers.TwoTierCache` the server also holds a host KV pool (the CPU tier
plus the swap buffer) and a `penelope.cache.swap_executor.SwapExecutor`. The request's CPU spans are
loaded back by `plan_request`; after every cache call that may move KV (planning, each decode
step's allocation, the final insert) the server runs every plan the cache queued, in order, on the
real pools before the next forward. So the K/V rows always hold what the cache believes, the
loaded spans are in place before the prefill reads them, and demoted rows are copied out before
their GPU slots are handed to new tokens.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from penelope.cache.hints import ARRIVED, FINISHED, HUMAN, TOOL, Foresight, Hint
from penelope.cache.host_tier import TieredCache
from penelope.cache.manager import KVCache
from penelope.cache.phantom import BatchLayout, RequestPlan, build_batch, finish_request, plan_request, release_request
from penelope.cache.swap_executor import SwapExecutor
from penelope.engine.decoder import EngineBatch, Qwen3Decoder
from penelope.engine.kvpool import KVPool
from penelope.errors import UsageError

LayoutFn = Callable[[list[RequestPlan]], BatchLayout]


@dataclass(frozen=True)
class TurnResult:
    """One served request.

    `generated`: the greedy tokens. `positions` int64 `[k]` and `logprobs` float32 `[k, vocab]`:
    every position the request computed (phantom, prompt and decode rows) and its log-softmax
    row (empty unless asked). `holes`: spans the phantoms refilled;
    `hit_tokens`: prompt tokens whose KV was reused; `computed_tokens`: rows of the prefill;
    `loaded_tokens`: prompt tokens loaded from the CPU tier, `swapped_tokens` of them through the
    swap buffer.
    """

    prompt_len: int
    generated: list[int]
    positions: np.ndarray
    logprobs: np.ndarray
    holes: list[tuple[int, int]]
    hit_tokens: int
    computed_tokens: int
    loaded_tokens: int = 0
    swapped_tokens: int = 0

    @property
    def phantom_tokens(self) -> int:
        return sum(end - start for start, end in self.holes)


class Server:
    """The engine, its KV pool and the cache manager that hands out the pool's slots.

    `model` and `pool` must agree (same config, dtype, device); `cache.capacity` must equal
    `pool.capacity`, since cache slots are pool rows. `layout_fn` turns request plans into a
    batch (`penelope.cache.phantom.build_batch`; tests pass broken ones to show verification fails).

    A cache with a CPU tier (one that queues tier plans: `TwoTierCache`, `HiCacheLikeCache`)
    needs `host_pool`, a pool of `cache.host_rows` rows with `pool`'s layout and dtype
    (`pool.host_mirror(cache.host_rows)`); its plans run through `SwapExecutor` with the copy
    function `copy` ("triton": the swap-copy kernel, "naive": torch indexed copies).
    """

    def __init__(self, model: Qwen3Decoder, cache: KVCache, pool: KVPool, layout_fn: LayoutFn = build_batch,
                 host_pool: KVPool | None = None, copy: str = "triton"):
        if cache.capacity != pool.capacity:
            raise UsageError(f"cache capacity {cache.capacity} differs from KV pool capacity {pool.capacity}")
        self.model = model
        self.cache = cache
        self.pool = pool
        self.layout_fn = layout_fn
        self.host_pool = host_pool
        self.executor: SwapExecutor | None = None
        if isinstance(cache, TieredCache):
            if not cache.keep_plans:
                raise UsageError("the cache was built with keep_plans=False: its moves could not be run on the pools")
            if host_pool is None:
                raise UsageError(f"a cache with a CPU tier needs a host pool of {cache.host_rows} rows")
            if host_pool.capacity != cache.host_rows:
                raise UsageError(f"host pool has {host_pool.capacity} rows; the cache's CPU tier and swap buffer "
                                 f"need {cache.host_rows}")
            # Compute waits for the copies layer by layer, in the next forward (`_layer_ready`).
            self.executor = SwapExecutor(pool.buffers(), host_pool.buffers(), copy, defer_waits=True)
        elif host_pool is not None:
            raise UsageError(f"a host pool needs a cache with a CPU tier; {type(cache).__name__} has none")

    def serve(self, prompt, max_new_tokens: int = 1, logprobs: bool = False) -> TurnResult:
        """Prefill `prompt` (ints `[n]`) with phantoms for its holes, then decode `max_new_tokens`
        (>= 1) greedy tokens. The sequence's KV (prompt + all generated tokens but the last,
        which was never fed back) is inserted into the cache afterwards."""
        if max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        prompt = np.asarray(prompt, dtype=np.int64).reshape(-1)
        if len(prompt) + max_new_tokens - 1 > self.model.config.max_position_embeddings:
            raise UsageError(f"{len(prompt)} + {max_new_tokens} tokens exceed the model's "
                             f"{self.model.config.max_position_embeddings} positions")
        try:
            plan = plan_request(self.cache, prompt)
        except BaseException:
            # A refused plan may still have loaded or demoted KV: the pools must follow.
            self.move_kv()
            raise
        try:
            self.move_kv()
            result = self._run(plan, prompt, max_new_tokens, logprobs)
        except BaseException:
            release_request(self.cache, plan)
            self.move_kv()
            raise
        finish_request(self.cache, plan)
        self.move_kv()
        return result

    def move_kv(self) -> int:
        """Issue every tier plan the cache queued, oldest first, on the GPU and host pools (nothing
        for a GPU-only cache). Compute does not wait for them here: the next forward waits for
        each layer's copies just before that layer (`_layer_ready`), so on a GPU a prefill's first
        layers run while later layers still load. Returns the number of plans issued."""
        if self.executor is None:
            return 0
        plans = self.cache.take_plans()
        self.executor.run_all(plans)
        return len(plans)

    def _layer_ready(self, layer: int) -> None:
        """Before layer `layer` of a forward: its rows of every issued copy are in place."""
        if self.executor is None:
            return
        self.executor.wait_layer(layer)
        if layer == self.model.config.num_layers - 1:
            self.executor.finish_layers()

    def _run(self, plan: RequestPlan, prompt: np.ndarray, max_new_tokens: int, logprobs: bool) -> TurnResult:
        layout = self.layout_fn([plan])
        computed_tokens = len(layout.tokens)
        steps: list[tuple[np.ndarray, torch.Tensor]] = []
        generated: list[int] = []
        while True:
            rows = np.arange(len(layout.tokens)) if logprobs else layout.output_rows
            logits = self.model.forward(_engine_batch(layout), self.pool, logits_rows=torch.as_tensor(rows),
                                        layer_ready=self._layer_ready)
            out = logits[int(np.searchsorted(rows, layout.output_rows[0]))]
            generated.append(int(torch.argmax(out.float())))
            if logprobs:
                steps.append((layout.positions, logits))
            if len(generated) == max_new_tokens:
                break
            plan.append(self.cache, generated[-1:])
            # The new slot may come from a demotion: its old row goes to the host first.
            self.move_kv()
            layout = self.layout_fn([plan])
        positions, rows = _logprob_rows(steps, self.model.config.vocab_size)
        return TurnResult(len(prompt), generated, positions, rows, list(plan.holes), plan.hit_tokens,
                          computed_tokens, plan.loaded_tokens, plan.swapped_tokens)


def _engine_batch(layout: BatchLayout) -> EngineBatch:
    return EngineBatch.build(torch.from_numpy(layout.tokens), torch.from_numpy(layout.req_to_token),
                             torch.from_numpy(layout.segments))


def _logprob_rows(steps, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions int64 `[k]` and log-softmax rows float32 `[k, vocab]` of every computed row, each
    row normalized on its own (so a value does not depend on how many rows shared the call)."""
    positions = [p for rows_positions, _ in steps for p in rows_positions.tolist()]
    rows = np.empty((len(positions), vocab_size), dtype=np.float32)
    index = 0
    for _, logits in steps:
        for row in range(logits.shape[0]):
            rows[index] = torch.log_softmax(logits[row : row + 1].float(), dim=-1).cpu().numpy()[0]
            index += 1
    return np.asarray(positions, dtype=np.int64), rows


@dataclass(frozen=True)
class AgentWorkload:
    """Agent-like multi-turn sessions: a shared system prompt, then per turn a message (a user
    request or a tool result) and the model's reply; each turn's prompt is the whole history.

    Message lengths are drawn in [0.75, 1.25] x `message_tokens`; all tokens come from `seed`, so
    two runs see the same messages (replies are whatever the model generates).
    """

    sessions: int = 4
    turns: int = 6
    system_tokens: int = 256
    message_tokens: int = 128
    reply_tokens: int = 8
    vocab_size: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "message_tokens", "reply_tokens", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"workload {name} must be a positive integer, got {value!r}")
        if isinstance(self.system_tokens, bool) or not isinstance(self.system_tokens, int) or self.system_tokens < 0:
            raise UsageError(f"workload system_tokens must be a non-negative integer, got {self.system_tokens!r}")

    def system_prompt(self) -> np.ndarray:
        return np.random.default_rng([self.seed, 0]).integers(0, self.vocab_size, self.system_tokens)

    def message(self, session: int, turn: int) -> np.ndarray:
        """Tokens (int64 `[m]`) that session `session` appends before turn `turn`."""
        rng = np.random.default_rng([self.seed, 1, session, turn])
        low, high = max(1, (3 * self.message_tokens) // 4), (5 * self.message_tokens) // 4
        return rng.integers(0, self.vocab_size, int(rng.integers(low, high + 1)))

    def max_sequence(self) -> int:
        """Upper bound of one session's final length (prompt of the last turn + its reply)."""
        return self.system_tokens + self.turns * ((5 * self.message_tokens) // 4 + self.reply_tokens)


@dataclass
class SessionRecord:
    """What a run produced for one session: its final history, its replies, and the log-softmax
    row (float32 `[vocab]`) of every position it computed, in order of computation."""

    history: np.ndarray
    replies: list[list[int]] = field(default_factory=list)
    logprobs: dict[int, list[np.ndarray]] = field(default_factory=dict)


@dataclass
class RunRecord:
    sessions: list[SessionRecord]
    requests: int = 0
    phantom_tokens: int = 0
    holes_refilled: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0
    loaded_tokens: int = 0
    swapped_tokens: int = 0


def turn_order(workload: AgentWorkload) -> Iterator[tuple[int, int]]:
    """(session, turn) in round-robin order: every session's turn 0, then every turn 1, ...
    The session served next is always the least recently used one: the worst case for LRU."""
    for turn in range(workload.turns):
        for session in range(workload.sessions):
            yield session, turn


def turn_hint(workload: AgentWorkload, session: int, turn: int, now: float, prompt_tokens: int,
              block_size: int, foresight: bool) -> Hint:
    """What the server tells the cache when a turn finishes at `now` (one second per request):
    its session waits for a tool on two turns of three, else for a person; an offline policy also
    learns the next send (the session's next turn comes `sessions` requests later) and that it
    reuses the whole prompt."""
    waits_for = TOOL if (session + turn) % 3 else HUMAN
    future = None
    if foresight:
        last = turn + 1 >= workload.turns
        future = Foresight(math.inf, 0) if last else Foresight(now + workload.sessions, prompt_tokens
                                                                // block_size * block_size)
    return Hint(now, FINISHED, waits_for, future)


def run_workload(server: Server, workload: AgentWorkload, logprobs: bool = True) -> RunRecord:
    """Serve every turn of `workload` through `server`, recording replies and log-probs. The cache
    hears of every request's arrival and finish (`turn_hint`), so policies that read hints run
    with them."""
    system = workload.system_prompt()
    record = RunRecord([SessionRecord(system.copy()) for _ in range(workload.sessions)])
    cache = server.cache
    foresight = cache.policy.uses_foresight
    for now, (session, turn) in enumerate(turn_order(workload)):
        state = record.sessions[session]
        prompt = np.concatenate([state.history, workload.message(session, turn)])
        cache.advance(float(now))
        cache.hint(prompt, Hint(float(now), ARRIVED))
        result = server.serve(prompt, workload.reply_tokens, logprobs=logprobs)
        cache.hint(prompt, turn_hint(workload, session, turn, float(now), len(prompt), cache.block_size, foresight))
        state.history = np.concatenate([prompt, np.asarray(result.generated, dtype=np.int64)])
        state.replies.append(result.generated)
        for position, row in zip(result.positions.tolist(), result.logprobs, strict=True):
            state.logprobs.setdefault(position, []).append(row)
        record.requests += 1
        record.phantom_tokens += result.phantom_tokens
        record.holes_refilled += len(result.holes)
        record.hit_tokens += result.hit_tokens
        record.computed_tokens += result.computed_tokens
        record.loaded_tokens += result.loaded_tokens
        record.swapped_tokens += result.swapped_tokens
    return record
