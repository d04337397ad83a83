"""Token ids of a load-generator replay (`penelope.loadgen.tokens`): deterministic, shared where
the trace's keys are shared, each turn the previous prompt + the reply + new ids, counts scaled."""
import dataclasses

import numpy as np
import pytest
from trace_paths import WEKA_TRACES

from penelope.errors import UsageError
from penelope.loadgen.tokens import SessionPrompts, TokenSpace, layout, planned_lengths
from penelope.sim.workloads.synthetic import SyntheticConfig, generate
from penelope.sim.workloads.types import HUMAN, TOOL, Request, Session, frozen_keys
from penelope.sim.workloads.weka import load_weka

SPACE = TokenSpace(vocab=1000, seed=3)


def request(keys, input_tokens, output_tokens=10, kind=TOOL, ordinal=0):
    return Request(keys=frozen_keys(keys, "test"), input_tokens=input_tokens, output_tokens=output_tokens,
                   think_time=0.0, arrival=None, kind=kind, tail_key=10**12 + ordinal, source=f"req{ordinal}")


def replay(space, session, index=0, block=4, reply=lambda turn, n: [(turn * 31 + i) % 997 for i in range(n)]):
    """Every prompt of `session`, with replies of the asked length from `reply`."""
    prompts = SessionPrompts(space, block, index, session, reuse_replies=True)
    out = []
    for turn, req in enumerate(session.requests):
        ids = list(prompts.next_prompt())
        assert prompts.text == ",".join(map(str, ids))
        answer = reply(turn, space.count(req.output_tokens))
        out.append((ids, answer))
        prompts.add_reply(answer)
    return out


def test_each_turn_is_the_previous_prompt_its_reply_and_new_ids():
    # Keys extend turn by turn (block 4): 2 blocks, then 5, then 9.
    session = Session("s", (request([0, 1], 9, 3), request([0, 1, 7, 8, 9], 20, 4, ordinal=1),
                            request([0, 1, 7, 8, 9, 11, 12, 13, 14], 38, 2, ordinal=2)))
    turns = replay(SPACE, session)
    for (prompt, reply), (following, _) in zip(turns, turns[1:], strict=False):
        assert following[: len(prompt) + len(reply)] == prompt + reply
    assert [len(p) for p, _ in turns] == [9, 20, 38]
    assert all(0 <= t < 1000 for p, _ in turns for t in p)


def test_every_seed_of_the_documented_range_draws_ids():
    """Seeds up to 2**63 - 1 (`--seed`'s range): tripling one overflows 64 bits, which must wrap."""
    session = generate(SyntheticConfig(sessions=1, requests_per_session=2, seed=1)).sessions[0]
    for seed in (0, 2**63 // 3 + 1, 2**63 - 1):
        ids = replay(dataclasses.replace(SPACE, seed=seed), session, block=64)[0][0]
        assert len(ids) > 0 and all(0 <= i < SPACE.vocab for i in ids)


def test_ids_are_deterministic_and_differ_with_the_seed_session_and_turn():
    session = generate(SyntheticConfig(sessions=2, requests_per_session=4, seed=1)).sessions[0]
    first = replay(SPACE, session, block=64)
    assert replay(SPACE, session, block=64) == first
    assert replay(dataclasses.replace(SPACE, seed=4), session, block=64)[0][0] != first[0][0]
    other = replay(SPACE, session, index=1, block=64)
    # The shared prefix is the same, the private part differs.
    shared = 15_600 // 64 * 64
    assert other[0][0][:shared] == first[0][0][:shared] and other[0][0] != first[0][0]


def test_the_prefix_all_sessions_share_is_one_token_sequence():
    """Synthetic sessions share a 15.6K tools+system prefix (keys below the session range): their
    first prompts share exactly its whole blocks, and no more."""
    workload = generate(SyntheticConfig(sessions=3, requests_per_session=2))
    firsts = [SessionPrompts(SPACE, 64, i, s, True).next_prompt() for i, s in enumerate(workload.sessions)]
    shared = 15_600 // 64 * 64
    for a, b in ((0, 1), (1, 2)):
        # (A private id may equal another session's by chance, 1 in 1000: compare whole blocks.)
        assert firsts[a][:shared] == firsts[b][:shared]
        assert firsts[a][shared: shared + 64] != firsts[b][shared: shared + 64]


def test_a_compaction_keeps_only_the_shared_blocks():
    """Turn 2 keeps only turn 1's first block (a compaction): its prompt is turn 1's first 4 ids,
    then key tokens of its own blocks (equal to another prompt holding the same keys), then fresh ids."""
    session = Session("s", (request([0, 1, 2], 12), request([0, 5, 6], 14, ordinal=1)))
    (first, _), (second, _) = replay(SPACE, session)
    assert second[:4] == first[:4] and second[4:8] != first[4:8]
    assert second[4:12] == SPACE.key_tokens(np.array([5, 6]), 4).tolist()
    assert first[:4] == SPACE.key_tokens(np.array([0]), 4).tolist()
    assert len(second) == 14
    assert layout(session.requests[0], session.requests[1], len(first) + 10, 4, 14).keep == 4


def test_open_loop_prompts_come_from_their_keys_alone():
    """Open loop (no reply reuse): requests with equal keys get equal ids, whatever came before."""
    a, b = request([5, 6, 7], 12), request([5, 6, 9], 12, ordinal=1)
    prompts = SessionPrompts(SPACE, 4, 0, Session("s", (a, b)), reuse_replies=False)
    first = list(prompts.next_prompt())
    prompts.add_reply([1, 2, 3])
    second = prompts.next_prompt()
    assert first[:8] == second[:8] and first[8:] != second[8:]


def test_scale_divides_every_count():
    space = TokenSpace(vocab=1000, scale=8)
    session = Session("s", (request(list(range(4)), 256 + 40, 80), request(list(range(6)), 400, 16, ordinal=1)))
    (first, _), (second, reply) = replay(space, session, block=64)
    assert len(first) == 37 and len(second) == 50 and len(reply) == 2
    # A block of 64 tokens is 8 ids: the first 32 ids are the 4 blocks' key tokens.
    assert first[:32] == space.key_tokens(np.arange(4), 8).tolist()
    assert space.count(3) == 1


def test_planned_lengths_are_the_lengths_sent():
    """On the WEKA traces (compactions included) at scale 16: the lengths `planned_lengths`
    predicts (for the server's context check) are those of the prompts built."""
    workload = load_weka(WEKA_TRACES / "trace_0008.json")
    space = TokenSpace(vocab=151_936, scale=16)
    session = workload.sessions[0]
    built = [(len(p), len(r)) for p, r in replay(space, session, block=workload.block_size)]
    assert built == planned_lengths(space, workload.block_size, session, reuse_replies=True)
    kinds = {r.kind for r in session.requests}
    assert kinds == {TOOL, HUMAN}


def test_bad_spaces_are_refused_naming_the_field():
    for bad, field in ((dict(vocab=1), "vocab"), (dict(vocab=2**32), "vocab"), (dict(vocab=10, scale=0.5), "scale"),
                       (dict(vocab=10, seed=-1), "seed"), (dict(vocab=10, scale=float("nan")), "scale")):
        # The library's own names; `penelope load` and `ab` show them as --vocab, --scale, --seed.
        with pytest.raises(UsageError, match=f"^`{field}` must be "):
            TokenSpace(**bad)
