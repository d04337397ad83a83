"""Agent-like traffic through SGLang's real ``sglang.Engine``: one run, in its own process.

``python -m penelope.integration.sglang.engine_check --model DIR --traffic JSON --setup JSON
--out FILE`` starts an Engine (``EngineSetup``: pool, page size, chunked prefill, request rows,
which radix cache), serves ``AgentTraffic`` (sessions that share a system prompt and send their
growing histories turn by turn, concurrently, greedy), and writes every request's generated
tokens, input log-probabilities of the tokens new in its turn, output log-probabilities and
finish reason, plus the scheduler's prefill counters (``hooks.COUNTERS``, read through
``get_server_info``), as JSON. ``penelope.integration.sglang.verify`` compares such runs.

Input log-probabilities start at the first token a turn adds: SGLang reuses cached KV only before
``logprob_start_len``, so earlier positions would be recomputed rather than read from the cache.
Every new token attends to all cached, refilled and recomputed positions before it, which is what
the comparison checks.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from penelope.cache.hints import WAIT_KINDS
from penelope.errors import UsageError

from .hints import HINT_KEY
from .script_traffic import ScriptTraffic, serve_script

CACHES = ("penelope", "default")


@dataclass(frozen=True)
class AgentTraffic:
    """Sessions with a shared system prompt whose histories grow every turn.

    Turn t of a session sends its whole history (system prompt, `first_tokens` of its own, then
    per earlier turn the reply and `growth_tokens` new tokens) and gets `max_new_tokens` greedy
    tokens. Token ids are drawn in [3, vocab) from `seed`. `abort`: also send one long request
    that is aborted `abort_after` seconds later (mid-prefill with small chunks). `probe`: two
    extra requests, session 0's first turn and a copy whose first token differs, whose outputs
    must differ (a model whose output ignores early tokens could not tell a broken cache from a
    good one); they ask for log-probabilities from their first token, so they reuse no KV and
    insert blocks the cache may hold already, on either tier. `waits_for`: per session, what its
    requests tell the agent-aware policies through ``custom_params`` (``hints.HINT_KEY``):
    "tool", "human", or None for no hint; sessions past the list send none. `think_s`: per
    session, seconds it waits after a reply before sending its next turn (0 past the list), as a
    tool or a person takes time."""

    sessions: int = 4
    turns: int = 5
    system_tokens: int = 300
    first_tokens: int = 50
    growth_tokens: int = 200
    max_new_tokens: int = 8
    vocab: int = 1000
    seed: int = 0
    abort: bool = False
    abort_tokens: int = 1500
    abort_after: float = 0.05
    probe: bool = True
    waits_for: tuple = ()
    think_s: tuple = ()

    def __post_init__(self):
        for name, low in (("sessions", 1), ("turns", 1), ("max_new_tokens", 1), ("vocab", 4), ("system_tokens", 0),
                          ("first_tokens", 0), ("growth_tokens", 0), ("abort_tokens", 0), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise UsageError(f"traffic {name} must be an integer of at least {low}, got {value!r}")
        if self.system_tokens + self.first_tokens < 2:
            raise UsageError("a first turn needs at least 2 tokens")
        for name in ("abort", "probe"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"traffic {name} must be true or false, got {getattr(self, name)!r}")
        if not _seconds(self.abort_after):
            raise UsageError(f"traffic abort_after must be seconds in [0, 60), got {self.abort_after!r}")
        for name, valid, what in (("waits_for", lambda kind: kind in (None, *WAIT_KINDS),
                                   f"{', '.join(WAIT_KINDS)} or None"),
                                  ("think_s", _seconds, "seconds in [0, 60)")):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)) or len(value) > self.sessions or not all(map(valid, value)):
                raise UsageError(f"traffic {name} holds {what} per session (at most {self.sessions}), "
                                 f"got {value!r}")
            object.__setattr__(self, name, tuple(value))

    def sampling(self, session: int | None = None) -> dict:
        """Sampling parameters: greedy, `max_new_tokens`, and session `session`'s hint if it has
        one (None: a request of no session, a probe)."""
        params = {"temperature": 0, "max_new_tokens": self.max_new_tokens, "ignore_eos": True}
        if session is not None and session < len(self.waits_for) and self.waits_for[session] is not None:
            params["custom_params"] = {HINT_KEY: self.waits_for[session]}
        return params

    def peak_tokens(self) -> int:
        """Tokens all sessions' last turns hold together (a pool this size never evicts them)."""
        last = self.system_tokens + self.first_tokens + (self.turns - 1) * (self.growth_tokens + self.max_new_tokens)
        extra = self.system_tokens + self.abort_tokens + 64 if self.abort else 0
        return self.sessions * (last + self.max_new_tokens) + extra + 4 * (last + 64)


def _seconds(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 <= value < 60


@dataclass(frozen=True)
class EngineSetup:
    """How the Engine runs: KV pool tokens, page size, chunked prefill (-1: off), request rows,
    the radix cache (``penelope`` or SGLang's ``default``), Penelope's policy, CPU tier
    (`cpu_cache` tokens, 0: GPU only) and `tool_call_token` option (``hints.py``), dtype and device.
    `extra`: more ``sglang.Engine`` arguments."""

    pool_tokens: int
    page_size: int = 64
    chunk: int = 128
    rows: int = 8
    cache: str = "penelope"
    policy: str = "penelope"
    cpu_cache: int = 0
    tool_call_token: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.cache not in CACHES:
            raise UsageError(f"cache must be one of {', '.join(CACHES)}, got {self.cache!r}")
        if self.pool_tokens < self.page_size or self.page_size < 1 or self.rows < 1:
            raise UsageError(f"bad engine setup: pool {self.pool_tokens}, page {self.page_size}, rows {self.rows}")
        if self.chunk != -1 and self.chunk < self.page_size:
            raise UsageError(f"chunk must be -1 (off) or at least one page, got {self.chunk}")
        if self.cpu_cache < 0 or (self.cpu_cache and self.cache != "penelope"):
            raise UsageError(f"cpu_cache must be >= 0 and is Penelope's CPU tier, got {self.cpu_cache} "
                             f"with the {self.cache} cache")

    def engine_args(self, model: str) -> dict:
        args = dict(model_path=model, skip_tokenizer_init=True, dtype=self.dtype, device=self.device,
                    max_total_tokens=self.pool_tokens, page_size=self.page_size,
                    chunked_prefill_size=self.chunk, max_running_requests=self.rows, random_seed=0,
                    mem_fraction_static=0.5, log_level="warning")
        if self.device == "cpu":
            args.update(attention_backend="torch_native", disable_cuda_graph=True)
        if self.cache == "penelope":
            config = {"policy": self.policy, "cpu_cache": self.cpu_cache}
            if self.tool_call_token is not None:
                config["tool_call_token"] = self.tool_call_token
            args.update(radix_cache_backend="penelope", radix_eviction_policy_config=config)
        args.update(self.extra)
        return args


def traffic_tokens(traffic: AgentTraffic) -> tuple[list[list[int]], list[list[list[int]]], list[int], list[list[int]]]:
    """(first turn of each session, per session per turn the tokens added after the reply,
    the aborted request's prompt, the two probe prompts)."""
    rng = random.Random(traffic.seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(3, traffic.vocab) for _ in range(n)]

    system = draw(traffic.system_tokens)
    firsts = [system + draw(traffic.first_tokens) for _ in range(traffic.sessions)]
    growth = [[draw(traffic.growth_tokens) for _ in range(traffic.turns)] for _ in range(traffic.sessions)]
    aborted = system + draw(traffic.abort_tokens)
    probe = list(firsts[0])
    other = [3 + (probe[0] - 2) % (traffic.vocab - 3)] + probe[1:]
    return firsts, growth, aborted, [probe, other]


async def _session(engine, index: int, history: list[int], growth, traffic: AgentTraffic, out: list) -> None:
    start = 0
    for turn in range(traffic.turns):
        reply = await engine.async_generate(
            input_ids=list(history), rid=f"s{index}-t{turn}", return_logprob=True, logprob_start_len=start,
            sampling_params=traffic.sampling(index))
        out.append(_record(f"s{index}-t{turn}", len(history), reply))
        # The next turn's new tokens start after the last reply token (whose KV the next turn computes).
        start = len(history) + len(reply["output_ids"]) - 1
        history += reply["output_ids"] + growth[turn]
        if index < len(traffic.think_s) and turn < traffic.turns - 1:
            await asyncio.sleep(traffic.think_s[index])


async def _aborted(engine, prompt: list[int], after: float, out: list) -> None:
    """Send a long request and abort it once the scheduler is prefilling it chunk by chunk (it is
    SGLang's chunked request), or after `after` seconds more if that is never seen."""
    rid = "aborted"
    task = asyncio.ensure_future(engine.async_generate(
        input_ids=prompt, rid=rid, sampling_params={"temperature": 0, "max_new_tokens": 4}))
    mid_prefill = False
    deadline = time.perf_counter() + 30
    while not mid_prefill and time.perf_counter() < deadline and not task.done():
        await asyncio.sleep(0.005)
        counters = (await engine.tokenizer_manager.get_internal_state())[0].get("penelope") or {}
        mid_prefill = counters.get("chunked_rid") == rid
    if not mid_prefill:
        await asyncio.sleep(after)
    engine.tokenizer_manager.abort_request(rid)
    reply = await task
    out.append({**_record(rid, len(prompt), reply), "aborted_mid_prefill": mid_prefill})


def _record(rid: str, prompt_len: int, reply: dict) -> dict:
    meta = reply["meta_info"]
    finish = meta.get("finish_reason")
    return {"rid": rid, "prompt_tokens": prompt_len, "output_ids": list(reply.get("output_ids") or []),
            "finish": (finish or {}).get("type") if isinstance(finish, dict) else str(finish),
            "cached_tokens": meta.get("cached_tokens", 0),
            "input_logprobs": [x[0] for x in meta.get("input_token_logprobs") or []],
            "output_logprobs": [x[0] for x in meta.get("output_token_logprobs") or []]}


def traffic_from(fields: dict) -> AgentTraffic | ScriptTraffic:
    """The traffic a JSON object describes: a script when it has `steps`."""
    return ScriptTraffic(**fields) if "steps" in fields else AgentTraffic(**fields)


def run_traffic(model: str, traffic: AgentTraffic | ScriptTraffic, setup: EngineSetup, timeout: float = 600) -> dict:
    """Serve `traffic` on a new Engine and return what `main` writes as JSON."""
    import sglang

    started = time.perf_counter()
    engine = sglang.Engine(**setup.engine_args(model))
    ready = time.perf_counter()
    out: list[dict] = []
    idle = _counters(engine)

    async def counters() -> dict:
        return (await engine.tokenizer_manager.get_internal_state())[0].get("penelope") or {}

    async def serve():
        if isinstance(traffic, ScriptTraffic):
            out.extend(await serve_script(engine, traffic, _record, counters))
            return
        firsts, growth, aborted, probes = traffic_tokens(traffic)
        tasks = [_session(engine, i, list(first), growth[i], traffic, out) for i, first in enumerate(firsts)]
        if traffic.abort:
            tasks.append(_aborted(engine, aborted, traffic.abort_after, out))
        await asyncio.gather(*tasks)
        if traffic.probe:
            for i, prompt in enumerate(probes):
                # Log-probabilities from the first token: SGLang matches none of the prompt, so the
                # probe computes again, and inserts, blocks the cache may hold on either tier.
                reply = await engine.async_generate(
                    input_ids=prompt, rid=f"probe{i}", return_logprob=True, logprob_start_len=0,
                    sampling_params=traffic.sampling())
                out.append(_record(f"probe{i}", len(prompt), reply))

    try:
        engine.loop.run_until_complete(asyncio.wait_for(serve(), timeout))
        served = time.perf_counter()
        counters = _counters(engine)
    finally:
        engine.shutdown()
    if counters is not None and idle is not None:
        # CPU seconds the scheduler process spent serving: unlike wall time, not stretched by
        # other work on a shared machine.
        counters["serve_cpu_s"] = counters["process_cpu_s"] - idle["process_cpu_s"]
        # The part spent inside the radix cache (with PENELOPE_TIME_CACHE=1, ``cache_timer``).
        counters["serve_cache_cpu_s"] = counters["cache_cpu_s"] - idle["cache_cpu_s"]
        counters["serve_cache_calls"] = counters["cache_calls"] - idle["cache_calls"]
    return {"setup": asdict(setup), "traffic": asdict(traffic), "start_s": ready - started, "serve_s": served - ready,
            "requests": sorted(out, key=lambda r: r["rid"]), "counters": counters}


def _counters(engine) -> dict | None:
    """The scheduler's ``penelope`` counters (``hooks.COUNTERS``), None without the plugin."""
    states = engine.get_server_info().get("internal_states") or [{}]
    return states[0].get("penelope")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--traffic", required=True, help="AgentTraffic fields as a JSON object")
    parser.add_argument("--setup", required=True, help="EngineSetup fields as a JSON object")
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = run_traffic(args.model, traffic_from(json.loads(args.traffic)), EngineSetup(**json.loads(args.setup)),
                         args.timeout)
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
