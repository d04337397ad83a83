"""The simulated server's scheduler: waiting queue, admission through the real KV cache, chunked prefill.

Modelled on SGLang 0.5.23's scheduler, simplified where the difference does not change cache
behaviour:
- Order: `lpm` (longest prefix match first: waiting requests sorted by the tokens the cache holds
  for them, ties by arrival) or `fcfs` (by send time). SGLang matches every waiting request
  each time it forms a prefill batch to sort by prefix length; so does this scheduler, and
  each match bumps the matched path's recency in the cache, as SGLang's does.
- LPM only while the queue is short: with more than `LPM_QUEUE_MAX` (128) waiting requests,
  SGLang 0.5.23 turns prefix matching and sorting off and serves the queue in its current order
  (`SchedulePolicy._determine_active_policy`, `WAITING_QUEUE_PREFIX_MATCH_MAX = 128` in
  `sglang/srt/managers/schedule_policy.py`): the order of the last sort, newer arrivals behind.
  So does this scheduler, which keeps its cost per prefill batch bounded however long the queue
  grows (an overloaded server). Not modelled: SGLang's every-32nd-pass recency refresh of the
  first 128 waiting requests' prefixes in that mode (`_touch_waiting_prefixes`), and its
  in-batch prefix deprioritisation.
- Admission: a request is admitted when the KV it will write fits: slots for every token it
  computes (phantom holes + new tokens) and for its whole reply, all allocated up front through
  `penelope.cache.admission.admit`, which evicts as needed (never from a locked path). Its matched path is locked
  until it finishes, so a running request's KV is never evicted. The first request in order that
  does not fit stops admission (head-of-line blocking, as SGLang's prefill adder stops).
- Chunked prefill: one prefill batch computes at most `chunk_size` tokens (phantom holes count:
  they are computed in the batch); the last request admitted may be cut, and only that one
  request continues in the next prefill batch, first. A request's computation is its holes in
  position order then its new tokens, so every query's keys exist when it runs.
- The request's prompt is matched without its last token (as SGLang does), so at least one token
  is computed and the first output token has a batch to come from.

The reply's KV is not inserted into the cache when a request finishes: workloads name input
blocks only, and the next request's blocks after the previous input carry new keys, so reply
KV could never be matched. Input KV is inserted at finish (SGLang's `cache_finished_req`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from penelope.cache.admission import admit
from penelope.cache.manager import KVCache
from penelope.errors import CacheFullError, UsageError
from penelope.sim.workloads import Request

ORDERS = ("lpm", "fcfs")
DEFAULT_CHUNK_SIZE = 8192
# SGLang 0.5.23's WAITING_QUEUE_PREFIX_MATCH_MAX: beyond this many waiting requests LPM is off.
LPM_QUEUE_MAX = 128


@dataclass(eq=False)
class Job:
    """One request inside the simulated server.

    tokens: int64 `[input_tokens]`, the prompt (dropped when the job finishes).
    After admission: `slots` int64 `[input_tokens]` (KV slot of every prompt position),
    `out_slots` int64 `[output_tokens]`, `work` the (start, end) position spans still to compute
    (phantom holes, all before `compute_from`, then the new tokens from `compute_from`),
    `reused` tokens found resident, `recomputed` spans the cache had held before, `phantom`
    hole tokens refilled, `loaded` tokens loaded from a CPU tier. `number` is the session's
    position in the workload. Times in seconds of simulated time (`admit_time`: when the batch
    holding its first chunk started)."""

    session: str
    index: int
    request: Request
    send_time: float
    tokens: np.ndarray
    number: int = 0
    seq: int = 0
    handle: object = None
    slots: np.ndarray | None = None
    out_slots: np.ndarray | None = None
    work: list[tuple[int, int]] = field(default_factory=list)
    compute_from: int = 0
    reused: int = 0
    recomputed: list[tuple[int, int]] = field(default_factory=list)
    phantom: int = 0
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
    """The part of one job computed in a prefill batch: position spans, and whether it ends the prompt.
    `loaded`: CPU-tier tokens to load before this chunk (first chunk only)."""

    job: Job
    segments: tuple[tuple[int, int], ...]
    last: bool
    loaded: int = 0

    @property
    def tokens(self) -> int:
        return sum(end - start for start, end in self.segments)

    @property
    def refills_hole(self) -> bool:
        """True when a segment is a phantom's: it lies before the job's `compute_from`."""
        return any(start < self.job.compute_from for start, _ in self.segments)


class Scheduler:
    """Waiting queue and prefill-batch formation over a `KVCache` (see the module docstring).

    cache: a `penelope.cache.manager.KVCache` (GPU-only or tiered); order: `"lpm"` or `"fcfs"`; chunk_size: tokens per
        prefill batch; lpm_queue_max: the longest queue LPM sorts (longer: served in queue order).

    `waiting` is the queue in the order it was last served: arrival order for FCFS, the last LPM
    sort followed by later arrivals for LPM. Admitted requests always leave from its front."""

    def __init__(self, cache: KVCache, order: str = "lpm", chunk_size: int = DEFAULT_CHUNK_SIZE,
                 lpm_queue_max: int = LPM_QUEUE_MAX):
        if order not in ORDERS:
            raise UsageError(f"unknown scheduler {order!r}; choose from {', '.join(ORDERS)}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise UsageError(f"chunk size must be a positive number of tokens, got {chunk_size!r}")
        if isinstance(lpm_queue_max, bool) or not isinstance(lpm_queue_max, int) or lpm_queue_max < 1:
            raise UsageError(f"the LPM queue limit must be a positive number of requests, got {lpm_queue_max!r}")
        self.cache = cache
        self.order = order
        self.chunk_size = chunk_size
        self.lpm_queue_max = lpm_queue_max
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

    def form_prefill(self) -> list[Chunk]:
        """The next prefill batch: the cut request's next chunk, then admitted waiting requests in
        order while the token budget lasts. Empty when nothing can run now."""
        budget = self.chunk_size
        chunks: list[Chunk] = []
        if self.chunked is not None:
            job, self.chunked = self.chunked, None
            chunk = self._take(job, budget)
            chunks.append(chunk)
            budget -= chunk.tokens
            if not chunk.last:
                return chunks
        if budget <= 0 or not self.waiting:
            return chunks
        self._sort()
        admitted = 0
        for job in self.waiting:
            if budget <= 0:
                break
            loaded = self._admit(job)
            if loaded is None:
                break
            admitted += 1
            chunk = self._take(job, budget, loaded)
            chunks.append(chunk)
            budget -= chunk.tokens
            if not chunk.last:
                break
        # Admission stops at the first request that does not fit: the admitted ones are a prefix.
        del self.waiting[:admitted]
        return chunks

    @property
    def lpm_active(self) -> bool:
        """Whether the next prefill batch sorts the queue by prefix match (LPM and a short queue)."""
        return self.order == "lpm" and len(self.waiting) <= self.lpm_queue_max

    def release(self, job: Job) -> None:
        """A finished request: insert its prompt's KV, free its reply's slots, unlock its path."""
        self.cache.insert(job.tokens, job.slots)
        if len(job.out_slots):
            self.cache.free(job.out_slots)
        self.cache.unlock(job.handle)
        job.handle = None
        job.tokens = job.slots = job.out_slots = None

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

    def _admit(self, job: Job) -> int | None:
        """Admit `job` (`penelope.cache.admission.admit`: its prompt matched without the last token,
        its reply's slots reserved); the tokens to load from CPU, or None if it does not fit now."""
        try:
            admission = admit(self.cache, job.tokens, match_tokens=job.input_tokens - 1, reserve=job.output_tokens)
        except CacheFullError:
            return None
        match, loaded = admission.match, admission.loaded
        # Loaded CPU spans have GPU slots now; their load time is charged to the first chunk.
        job.handle = admission.handle
        job.slots = admission.slots
        job.out_slots = admission.reserved
        job.work = [(start, end) for start, end in admission.computed if end > start]
        job.compute_from = admission.compute_from
        job.reused = match.hit_tokens
        job.recomputed = list(match.recomputed)
        job.phantom = sum(end - start for start, end in match.holes)
        job.loaded = loaded.loaded_tokens
        job.swap_loads = int(loaded.swapped_tokens > 0)
        return job.loaded

    def _take(self, job: Job, budget: int, loaded: int = 0) -> Chunk:
        """Cut up to `budget` tokens from the front of `job`'s remaining work."""
        segments = []
        while job.work and budget > 0:
            start, end = job.work[0]
            stop = min(end, start + budget)
            segments.append((start, stop))
            budget -= stop - start
            if stop == end:
                job.work.pop(0)
            else:
                job.work[0] = (stop, end)
        last = not job.work
        if not last:
            self.chunked = job
        return Chunk(job, tuple(segments), last, loaded)
