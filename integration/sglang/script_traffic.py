"""Scripted traffic for SGLang's real ``sglang.Engine``: requests sent one at a time, in order,
each prompt built from earlier ones, so a test can lay out a cache state (a long history, other
traffic that evicts its front, then the history's next turn) and check what each request cost.

A prompt is a list of parts: an int n (n new token ids, drawn from the traffic's seed), "system"
(the shared system prompt), or the rid of an earlier request (that request's prompt followed by
its reply, as an agent resends its history). For every request the run records, beside what
``engine_check`` records, the prefill tokens the scheduler computed while serving it (the
difference of the ``prefill_tokens`` counter: the request's own chunks and its phantoms), so that
``cached_tokens`` can be checked against the tokens the server actually computed.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from penelope.errors import UsageError


@dataclass(frozen=True)
class ScriptTraffic:
    """`steps`: ((rid, parts), ...) sent in order; `system_tokens`: the shared system prompt's
    length; greedy `max_new_tokens` per request; token ids in [3, vocab) from `seed`."""

    steps: tuple
    system_tokens: int = 0
    max_new_tokens: int = 8
    vocab: int = 1000
    seed: int = 0

    def __post_init__(self):
        steps, seen = [], set()
        for step in self.steps:
            if not (isinstance(step, (list, tuple)) and len(step) == 2 and isinstance(step[0], str)
                    and isinstance(step[1], (list, tuple)) and step[1]):
                raise UsageError(f"a script step is (rid, [parts...]), got {step!r}")
            rid, parts = step
            for part in parts:
                if not (part == "system" or part in seen or (isinstance(part, int) and not isinstance(part, bool)
                                                             and part > 0)):
                    raise UsageError(f"step {rid!r}: a part is a positive count, 'system' or an earlier rid, "
                                     f"got {part!r}")
            if rid in seen or rid == "system":
                raise UsageError(f"step rid {rid!r} is used twice")
            seen.add(rid)
            steps.append((rid, tuple(parts)))
        for name, low in (("system_tokens", 0), ("max_new_tokens", 1), ("vocab", 4), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise UsageError(f"script {name} must be an integer of at least {low}, got {value!r}")
        if not steps:
            raise UsageError("a script needs at least one step")
        object.__setattr__(self, "steps", tuple(steps))

    def sampling(self) -> dict:
        return {"temperature": 0, "max_new_tokens": self.max_new_tokens, "ignore_eos": True}

    def peak_tokens(self) -> int:
        """An upper bound of the tokens every prompt and reply hold together (a pool this size never
        evicts)."""
        lengths: dict[str, int] = {"system": self.system_tokens}
        for rid, parts in self.steps:
            lengths[rid] = sum(part if isinstance(part, int) else lengths[part] for part in parts) \
                + self.max_new_tokens
        return sum(lengths.values())


async def serve_script(engine, traffic: ScriptTraffic, record, counters) -> list[dict]:
    """Send `traffic`'s requests one at a time on `engine`; `record(rid, prompt_len, reply)` makes
    a request's record, `counters()` (a coroutine) reads the scheduler's ``penelope`` counters."""
    rng = random.Random(traffic.seed)
    histories = {"system": [rng.randrange(3, traffic.vocab) for _ in range(traffic.system_tokens)]}
    out = []
    for rid, parts in traffic.steps:
        prompt = []
        for part in parts:
            prompt += [rng.randrange(3, traffic.vocab) for _ in range(part)] if isinstance(part, int) \
                else histories[part]
        before = (await counters()).get("prefill_tokens", 0)
        reply = await engine.async_generate(input_ids=prompt, rid=rid, return_logprob=True,
                                            logprob_start_len=len(prompt) - 1, sampling_params=traffic.sampling())
        after = (await counters()).get("prefill_tokens", 0)
        histories[rid] = prompt + list(reply.get("output_ids") or [])
        out.append({**record(rid, len(prompt), reply), "computed_tokens": after - before})
    return out
