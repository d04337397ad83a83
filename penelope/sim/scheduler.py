"""The simulated server's scheduler: waiting queue, admission through the real KV cache, chunked prefill.

Modelled on SGLang 0.5.23's scheduler (`Scheduler.get_new_batch_prefill`, `PrefillAdder` in
`sglang/srt/managers/schedule_policy.py`) with the Penelope plugin's refill rule, simplified where
the difference does not change cache behaviour or batch shapes:
- Order: `lpm` (longest prefix match first: waiting requests sorted by the tokens the cache holds
  for them, ties by arrival) or `fcfs` (by send time). SGLang matches every waiting request
  each time it forms a prefill batch to sort by prefix length; so does this scheduler, and
  each match bumps the matched path's recency in the cache, as SGLang's does.
- LPM only while the queue is short: with more than `LPM_QUEUE_MAX` (128) waiting requests,
  SGLang 0.5.23 turns prefix matching and sorting off and serves the queue in its current order
  (`SchedulePolicy._determine_active_policy`, `WAITING_QUEUE_PREFIX_MATCH_MAX = 128`): the order
  of the last sort, newer arrivals behind. So does this scheduler, which keeps its cost per
  prefill batch bounded however long the queue grows (an overloaded server). Not modelled:
  SGLang's every-32nd-pass recency refresh of the first 128 waiting requests' prefixes in that
  mode (`_touch_waiting_prefixes`), and its in-batch prefix deprioritisation.
- Admission: a request is admitted when the KV it will write fits: slots for every token it
  computes (holes + new tokens) and for its whole reply, all allocated up front through
  `penelope.cache.admission.admit`, which evicts as needed (never from a locked path). Its matched
  path is locked until it finishes, so a running request's KV is never evicted. The first request
  in order that does not fit stops admission (head-of-line blocking, as SGLang's prefill adder
  stops).
- Two token budgets per prefill batch, as `PrefillAdder` keeps them: `chunk_size` (SGLang's
  `chunked_prefill_size`, `rem_chunk_tokens`) and `max_prefill_tokens` (`rem_input_tokens`). Every
  chunk is charged its tokens rounded up to whole pages (`page_size`) against both. Only the
  chunk budget cuts a request; the prefill budget stops admission once it is spent (the request
  that spends it joins whole), so it binds only when it is below the chunk size.
- Chunks: a request cut by the chunk budget stops at a page boundary and continues first in the
  next prefill batch, then as far as the budget goes (SGLang's `add_chunked_req`). One request at
  a time continues: once a request of the batch is cut, only requests that fit whole (phantoms
  included, no hole-first plan) join the batch after it, and the first that does not stops
  admission (the plugin's rule for a continuing chunk; SGLang tracks one chunked request).
- Request rows: `max_running_requests` rows (SGLang's request-to-token pool; default 2048, the
  floor of SGLang's own default). Every decoding request, the continuing request and every request
  admitted to the batch holds one; a phantom holds one during its batch. Admission stops when none
  is free.
- Holes (MISSING spans before the last resident span of a match; Penelope's policies leave them)
  are refilled by the plugin's rule, `penelope.cache.refill.plan_refill`, given the chunk budget
  left in the batch, the free rows and the page size: phantoms (one phantom per hole in the
  request's batch, when the holes and a page of the request's own tokens fit and every phantom
  gets a row) or hole-first chunks (the request computes from its first hole, each chunk stopping
  at a hole's end, jumping over the resident spans between holes: `next_chunk`). Counted apart:
  `Chunk.phantom_tokens` (the plugin's `phantom_tokens`) and `Chunk.chunk_refill_tokens` (hole
  tokens a request computes in its own chunks, the plugin's `chunk_refill_tokens`).
- The request's prompt is matched without its last token (as SGLang does), so at least one token
  is computed and the first output token has a batch to come from.

Not modelled: chunked prefill turned off (SGLang's `--chunked-prefill-size -1`, where holes
without a row are dropped), mixed prefill-decode batches, the allocator's page rounding of KV
slots (slots are allocated per token; the cache keeps whole blocks, which hold whole pages),
`truncation_align_size`, and retraction.

A request cut by the chunk budget inserts what it has computed after every chunk but its last
(`checkpoint`, SGLang's `checkpoint_kv_cache`: the whole pages of its first positions, its lock
moved to the node they end on), so a long prompt is a chain of chunk-sized nodes, as in SGLang's
tree, and KV another request computed meanwhile is shared from there on. At finish (SGLang's
`release_kv_cache`) the prompt's KV is inserted; where the workload names the reply's blocks
(`Request.output_blocks`: the next prompt holds the reply, as the real-server load generator
builds it) the reply's KV is inserted too, all of it but the last token, whose KV no step
computes, and under a policy that models SGLang's own cache (`EvictionPolicy.splits_reply_off`)
the prompt is inserted once more, which splits the reply into a leaf of its own as SGLang's
`checkpoint_into_tree` does. Without reply blocks the reply's slots are freed: the next prompt's
blocks after the previous input carry new keys, so reply KV could never be matched.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from penelope.cache.admission import admit
from penelope.cache.manager import KVCache
from penelope.cache.refill import RefillPlan, next_chunk, plan_refill
from penelope.errors import CacheFullError, InvariantError, UsageError
from penelope.sim.workloads.types import Request

ORDERS = ("lpm", "fcfs")
DEFAULT_CHUNK_SIZE = 8192
# SGLang 0.5.23's defaults: `--max-prefill-tokens`, `--page-size` on most attention backends, and
# the fewest request rows it sizes a pool with when `--max-running-requests` is not given.
DEFAULT_MAX_PREFILL_TOKENS = 16384
DEFAULT_PAGE_SIZE = 1
DEFAULT_MAX_RUNNING_REQUESTS = 2048
# SGLang 0.5.23's WAITING_QUEUE_PREFIX_MATCH_MAX: beyond this many waiting requests LPM is off.
LPM_QUEUE_MAX = 128


@dataclass(eq=False)
class Job:
    """One request inside the simulated server.

    tokens: int64 `[input_tokens]`, the prompt (dropped when the job finishes). reply: int64
    `[output_tokens]`, the reply's tokens as the next prompt holds them, or None where the workload
    does not name them (`Request.output_blocks`).
    After admission: `slots` int64 `[input_tokens]` (KV slot of every prompt position),
    `out_slots` int64 `[output_tokens]`, `compute_from` where its new tokens start (the end of its
    resident match), `plan` how its holes are refilled (`penelope.cache.refill`; None without
    holes), `position` where its next chunk starts (a hole-first request first jumps the resident
    spans there), `reused` tokens found resident, `recomputed` spans the cache had held before,
    `loaded` tokens loaded from a CPU tier. `number` is the session's position in the workload.
    Times in seconds of simulated time (`admit_time`: when the batch holding its first chunk
    started)."""

    session: str
    index: int
    request: Request
    send_time: float
    tokens: np.ndarray
    number: int = 0
    reply: np.ndarray | None = None
    seq: int = 0
    handle: object = None
    slots: np.ndarray | None = None
    out_slots: np.ndarray | None = None
    compute_from: int = 0
    plan: RefillPlan | None = None
    position: int = 0
    reused: int = 0
    recomputed: list[tuple[int, int]] = field(default_factory=list)
    loaded: int = 0
    swap_loads: int = 0
    admit_time: float | None = None
    first_token_time: float | None = None
    generated: int = 0

    @property
    def input_tokens(self) -> int:
        return self.request.input_tokens

    @property
    def output_tokens(self) -> int:
        return self.request.output_tokens

    @property
    def kv_tokens(self) -> int:
        """KV tokens a decode step reads for this request."""
        return self.request.input_tokens + self.generated


@dataclass(frozen=True)
class Chunk:
    """The part of one job computed in a prefill batch: position spans (its phantoms' holes first,
    then its own span), whether it ends the prompt, and `phantoms`, the holes its phantoms refill
    in this batch. `loaded`: CPU-tier tokens to load before this chunk (first chunk only)."""

    job: Job
    segments: tuple[tuple[int, int], ...]
    last: bool
    loaded: int = 0
    phantoms: tuple[tuple[int, int], ...] = ()

    @property
    def tokens(self) -> int:
        return sum(end - start for start, end in self.segments)

    @property
    def phantom_tokens(self) -> int:
        """Hole tokens phantoms compute in this batch (the plugin's `phantom_tokens`)."""
        return sum(end - start for start, end in self.phantoms)

    @property
    def chunk_refill_tokens(self) -> int:
        """Hole tokens the job computes in its own chunk (hole-first; the plugin's
        `chunk_refill_tokens`): its own span lies before its new tokens."""
        start, end = self.segments[-1]
        return end - start if end <= self.job.compute_from else 0


@dataclass
class _Budget:
    """What one prefill batch has left: chunk tokens, prefill tokens, free request rows."""

    chunk: int
    prefill: int
    rows: int

    def spent(self) -> bool:
        return self.chunk <= 0 or self.prefill <= 0 or self.rows < 1

    def charge(self, tokens: int, rows: int) -> None:
        self.chunk -= tokens
        self.prefill -= tokens
        self.rows -= rows


class Scheduler:
    """Waiting queue and prefill-batch formation over a `KVCache` (see the module docstring).

    cache: a `penelope.cache.manager.KVCache` (GPU-only or tiered); order: `"lpm"` or `"fcfs"`;
    chunk_size: chunk tokens per prefill batch; lpm_queue_max: the longest queue LPM sorts
    (longer: served in queue order); page_size: tokens per KV page (divides the cache's block
    size and the chunk size); max_prefill_tokens: prefill tokens per batch; max_running_requests:
    request rows.

    `waiting` is the queue in the order it was last served: arrival order for FCFS, the last LPM
    sort followed by later arrivals for LPM. Admitted requests always leave from its front."""

    def __init__(self, cache: KVCache, order: str = "lpm", chunk_size: int = DEFAULT_CHUNK_SIZE,
                 lpm_queue_max: int = LPM_QUEUE_MAX, *, page_size: int = DEFAULT_PAGE_SIZE,
                 max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
                 max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS):
        if order not in ORDERS:
            raise UsageError(f"unknown scheduler {order!r}; choose from {', '.join(ORDERS)}")
        for name, value in (("chunk size", chunk_size), ("LPM queue limit", lpm_queue_max),
                            ("page size", page_size), ("max prefill tokens", max_prefill_tokens),
                            ("max running requests", max_running_requests)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"the {name} must be a positive integer, got {value!r}")
        if cache.block_size % page_size or chunk_size % page_size:
            raise UsageError(f"the page size {page_size} must divide the block size {cache.block_size} "
                             f"and the chunk size {chunk_size}")
        self.cache = cache
        self.order = order
        self.chunk_size = chunk_size
        self.lpm_queue_max = lpm_queue_max
        self.page_size = page_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_running_requests = max_running_requests
        self.waiting: list[Job] = []
        # The request whose prompt was cut by the last prefill batch; it continues first.
        self.chunked: Job | None = None
        self._seq = 0

    def submit(self, job: Job) -> None:
        """Queue a request that has reached the server. It must fit an empty cache alone."""
        if job.input_tokens + job.output_tokens > self.cache.capacity:
            raise UsageError(
                f"{job.request.source}: {job.input_tokens} input + {job.output_tokens} output tokens "
                f"can never fit a cache of {self.cache.capacity} tokens"
            )
        if job.input_tokens < 1:
            raise UsageError(f"{job.request.source}: a request needs at least one input token")
        if job.reply is not None and len(job.reply) != job.output_tokens:
            raise UsageError(f"{job.request.source}: {len(job.reply)} reply tokens for {job.output_tokens} "
                             "output tokens")
        job.seq = self._seq
        self._seq += 1
        if self.order == "fcfs" and self.waiting and self.waiting[-1].send_time > job.send_time:
            # Sent earlier than a request already queued (never in a replay): keep send-time order.
            bisect.insort(self.waiting, job, key=lambda queued: (queued.send_time, queued.seq))
        else:
            self.waiting.append(job)

    def has_work(self) -> bool:
        """True while a request waits or a cut prompt has chunks left."""
        return bool(self.waiting) or self.chunked is not None

    def form_prefill(self, running: int = 0) -> list[Chunk]:
        """The next prefill batch: the cut request's next chunk, then admitted waiting requests in
        order while the budgets and rows last. `running`: rows the decoding requests hold. Empty
        when nothing can run now."""
        budget = _Budget(self.chunk_size, self.max_prefill_tokens, self.max_running_requests - running)
        chunks: list[Chunk] = []
        if self.chunked is not None:
            job, self.chunked = self.chunked, None
            chunk = self._continue(job, budget.chunk)
            chunks.append(chunk)
            budget.charge(self._paged(chunk.tokens), 1)
        if budget.spent() or not self.waiting:
            return chunks
        self._sort()
        admitted = 0
        for job in self.waiting:
            if budget.spent():
                break
            # One request at a time continues: with one cut, the rest must fit whole.
            if self.chunked is not None and not self._fits_whole(job, budget):
                break
            loaded = self._admit(job, budget)
            if loaded is None:
                break
            admitted += 1
            chunk = self._first_chunk(job, budget.chunk, loaded)
            chunks.append(chunk)
            # Phantoms' holes are whole blocks, so whole pages: the chunk's pages are its own and theirs.
            budget.charge(self._paged(chunk.tokens), 1 + len(chunk.phantoms))
        # Admission stops at the first request that does not fit: the admitted ones are a prefix.
        del self.waiting[:admitted]
        return chunks

    @property
    def lpm_active(self) -> bool:
        """Whether the next prefill batch sorts the queue by prefix match (LPM and a short queue)."""
        return self.order == "lpm" and len(self.waiting) <= self.lpm_queue_max

    def checkpoint(self, job: Job) -> None:
        """A chunk of the cut `job` ran: insert the whole pages of its first `job.position`
        tokens (`KVCache.checkpoint`, which keeps them locked) and take the tree's slots where
        the tree kept its own copy."""
        end = job.position // self.page_size * self.page_size
        job.handle, kept = self.cache.checkpoint(job.handle, job.tokens[:end], job.slots[:end])
        job.slots[:len(kept)] = kept

    def release(self, job: Job) -> np.ndarray:
        """A finished request: insert its KV (the prompt, and the reply but its last token where the
        job has reply tokens; then the prompt again where the policy splits the reply off), free
        the slots left, unlock its path (`KVCache.release`). Returns the tokens inserted."""
        tokens = job.tokens
        if job.reply is not None and job.output_tokens > 1:
            tokens = np.concatenate([tokens, job.reply[:job.output_tokens - 1]])
        slots = np.concatenate([job.slots, job.out_slots]) if len(job.out_slots) else job.slots
        self.cache.release(job.handle, tokens, slots, job.input_tokens)
        job.handle = None
        job.tokens = job.reply = job.slots = job.out_slots = None
        return tokens

    def _sort(self) -> None:
        """Order the queue for the next prefill batch. FCFS: requests are submitted in send-time
        order (`submit` keeps it so), so the queue already is in (send time, arrival) order. LPM on a short queue: by
        resident prefix, ties by (send time, arrival), matching every request (in arrival order);
        on a long queue the order stays as it is (SGLang's fallback)."""
        if not self.lpm_active:
            return
        # Longest resident match first; SGLang sorts by the length of the matched device prefix.
        # Each match bumps its path's recency: match in arrival order, whatever the queue's order.
        arrived = sorted(self.waiting, key=lambda job: job.seq)
        resident = {id(job): self.cache.match(job.tokens[:-1]).hit_tokens for job in arrived}
        self.waiting.sort(key=lambda job: (-resident[id(job)], job.send_time, job.seq))

    def _paged(self, tokens: int) -> int:
        """`tokens` rounded up to whole pages: what SGLang charges a chunk against its budgets."""
        return -(-tokens // self.page_size) * self.page_size

    def _plan(self, holes, compute_from: int, job: Job, budget: _Budget) -> RefillPlan | None:
        """The plugin's refill plan for a match with `holes` (None without holes)."""
        if not holes:
            return None
        return plan_refill(holes, compute_from, job.input_tokens - compute_from, budget.chunk, budget.rows,
                           self.page_size)

    def _fits_whole(self, job: Job, budget: _Budget) -> bool:
        """Whether `job` would join the batch whole, phantoms included (no hole-first plan)."""
        match = self.cache.match(job.tokens[: job.input_tokens - 1])
        compute_from = min(match.compute_from, job.input_tokens - 1)
        plan = self._plan(match.holes, compute_from, job, budget)
        if plan is not None and plan.hole_first:
            return False
        phantoms = plan.phantom_tokens if plan is not None else 0
        return self._paged(job.input_tokens - compute_from) + phantoms <= budget.chunk

    def _admit(self, job: Job, budget: _Budget) -> int | None:
        """Admit `job` (`penelope.cache.admission.admit`: its prompt matched without the last token,
        its reply's slots reserved) and plan the refill of its holes; the tokens to load from CPU,
        or None if it does not fit now."""
        try:
            admission = admit(self.cache, job.tokens, match_tokens=job.input_tokens - 1, reserve=job.output_tokens)
        except CacheFullError:
            return None
        match, loaded = admission.match, admission.loaded
        # Loaded CPU spans have GPU slots now; their load time is charged to the first chunk.
        job.handle = admission.handle
        job.slots = admission.slots
        job.out_slots = admission.reserved
        job.compute_from = admission.compute_from
        job.plan = self._plan(match.holes, admission.compute_from, job, budget)
        job.reused = match.hit_tokens
        job.recomputed = list(match.recomputed)
        job.loaded = loaded.loaded_tokens
        job.swap_loads = int(loaded.swapped_tokens > 0)
        return job.loaded

    def _first_chunk(self, job: Job, budget: int, loaded: int) -> Chunk:
        """The admission chunk of `job` under `budget` chunk tokens: its phantoms, then its own tokens
        from where its plan starts it (a hole-first request: its first hole, up to that hole's
        end), cut where the budget ends when they do not fit whole (`PrefillAdder`)."""
        plan = job.plan
        phantoms = plan.phantoms if plan is not None else ()
        start = plan.compute_from if plan is not None else job.compute_from
        room = budget - sum(end - begin for begin, end in phantoms)
        if plan is not None and plan.first_chunk_end is not None:
            room = min(room, plan.first_chunk_end - start)
        # Budgets, hole ends and the starts of cut requests are whole pages: so is every cut.
        end = job.input_tokens if self._paged(job.input_tokens - start) <= room else start + room
        return self._chunk(job, start, end, loaded, phantoms)

    def _continue(self, job: Job, budget: int) -> Chunk:
        """The next chunk of the cut `job`: from where it stopped (a hole-first request jumps the
        resident spans there and stops at the end of the hole it is in), as far as `budget` goes
        (SGLang's `add_chunked_req`)."""
        start, hole_end = job.position, None
        if job.plan is not None and job.plan.hole_first:
            start, hole_end = next_chunk(job.plan, job.position)
        end = min(job.input_tokens, start + budget, job.input_tokens if hole_end is None else hole_end)
        return self._chunk(job, start, end, 0, ())

    def _chunk(self, job: Job, start: int, end: int, loaded: int, phantoms) -> Chunk:
        if end <= start:
            raise InvariantError(f"{job.request.source}: an empty chunk at {start} (budgets are whole pages)")
        job.position = end
        last = end == job.input_tokens
        if not last:
            self.chunked = job
        return Chunk(job, (*phantoms, (start, end)), last, loaded, tuple(phantoms))
