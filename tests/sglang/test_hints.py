"""The agent-aware policies inside SGLang: what a request tells the cache (`hints.wait_kind`), and
the arrivals and finishes the plugin reports on SGLang 0.5.23's real pools and requests on CPU
(`sglang_env.Serving`). The same through SGLang's real Engine, prefetch included:
`test_sglang_engine.test_agent_aware_policies_read_what_requests_show`. Not covered: a chat model
with ``--tool-call-parser`` (the OpenAI layer's tool-call parsing never reaches the scheduler; see
hints.py)."""
from types import SimpleNamespace

import pytest
from sglang_env import Serving, blocks, sglang_config

from penelope.errors import UsageError
from penelope.integration.sglang import options_from
from penelope.integration.sglang.engine_check import AgentTraffic
from penelope.integration.sglang.hints import HINT_KEY, wait_kind

TOOL_CALL = 151657


@pytest.fixture(autouse=True)
def _config():
    with sglang_config():
        yield


def request(output, custom=None):
    return SimpleNamespace(rid="r1", output_ids=output, sampling_params=SimpleNamespace(custom_params=custom))


def test_the_wait_kind_comes_from_the_request_hint_then_the_reply_tokens():
    assert wait_kind(request([5, TOOL_CALL, 7]), TOOL_CALL) == "tool"
    assert wait_kind(request([5, 6, 7]), TOOL_CALL) == "human"
    assert wait_kind(request([5, TOOL_CALL]), None) is None
    # The client's own hint wins over the reply's tokens.
    assert wait_kind(request([5, TOOL_CALL], {HINT_KEY: "human"}), TOOL_CALL) == "human"
    assert wait_kind(request([5], {HINT_KEY: "tool"}), None) == "tool"
    # null is no hint: the reply's tokens decide.
    assert wait_kind(request([5, TOOL_CALL], {HINT_KEY: None}), TOOL_CALL) == "tool"
    with pytest.raises(UsageError, match="request r1: custom_params\\['penelope_waits_for'\\] must be one of"):
        wait_kind(request([5], {HINT_KEY: "soon"}), None)


def test_tool_call_token_option():
    assert options_from({"tool_call_token": TOOL_CALL}, {}).tool_call_token == TOOL_CALL
    assert options_from(None, {"PENELOPE_TOOL_CALL_TOKEN": "151657"}).tool_call_token == TOOL_CALL
    assert options_from(None, {}).tool_call_token is None
    for bad in (-1, 2**31, 10**30, True, 1.0):
        with pytest.raises(UsageError, match="tool_call_token must be a token id"):
            options_from({"tool_call_token": bad}, {})
    with pytest.raises(UsageError, match="policy 'oracle' is an offline reference"):
        options_from({"policy": "oracle"}, {})
    with pytest.raises(UsageError, match="PENELOPE_TOOL_CALL_TOKEN must be an integer"):
        options_from(None, {"PENELOPE_TOOL_CALL_TOKEN": "<tool_call>"})


def serve(serving, tokens, output, custom=None):
    """One request through SGLang's pools: admitted, forwarded, its reply `output` recorded, then
    released as SGLang releases a finished request."""
    (req,) = serving.admit([tokens])
    req.sampling_params.custom_params = custom
    book = serving.cache.cache.policy.book
    assert book.in_system == 1, "the arrival was not reported"
    batch = serving.build_batch([req])
    serving.forward(batch)
    req.output_ids.extend(output)
    serving.finish(batch)
    assert book.in_system == 0
    return req


@pytest.mark.parametrize("policy", ["penelope-agent", "ttl"])
def test_finished_requests_leave_their_sessions_waiting_for_what_the_reply_shows(policy):
    serving = Serving(size=64 * 40, policy=policy)
    serving.cache.options = options_from({"policy": policy, "block_size": 64, "tool_call_token": TOOL_CALL}, {})
    book = serving.cache.cache.policy.book
    first = blocks(0, 3)
    serve(serving, first, [1, TOOL_CALL, 2])
    assert [record.kind for record in book.waiting] == ["tool"]
    assert book.waiting[0].blocks == 3
    # The same session's next turn ends its wait (observed as a tool wait) and leaves it waiting
    # for a person, as the client says.
    serve(serving, first + blocks(1000, 2), [3], {HINT_KEY: "human"})
    assert [record.kind for record in book.waiting] == ["human"] and len(book.observed["tool"]) == 1
    # Another session: its own record.
    serve(serving, blocks(5000, 2), [4])
    assert [record.kind for record in book.waiting] == ["human", "human"]
    serving.cache.check_invariants()


def test_a_request_that_reuses_no_prefix_still_arrives_with_its_whole_prompt():
    """SGLang cuts the key it matches at ``logprob_start_len`` (empty for a request that wants
    log-probabilities from its first token); the arrival is still reported, once, with every
    whole block of the prompt, and the book counts it (``WaitBook.counts``)."""
    serving = Serving(size=64 * 40, policy="penelope-agent")
    book = serving.cache.cache.policy.book
    req = serving.new_request(blocks(0, 3) + [7] * 10)
    req.return_logprob, req.logprob_start_len = True, 0
    req.init_next_round_input(serving.cache)
    assert req.prefix_len == 0
    req.init_next_round_input(serving.cache)
    assert [len(hashes) for hashes in book.arrived_hashes] == [3]
    assert book.counts() == {"observed_tool": 0, "observed_human": 0, "waiting_tool": 0, "waiting_human": 0,
                             "waiting_unknown": 0, "in_system": 1}


@pytest.mark.parametrize(("fields", "message"), [
    ({"waits_for": ("soon",)}, "traffic waits_for holds tool, human or None per session"),
    ({"waits_for": "tool"}, "traffic waits_for holds"),
    ({"waits_for": None}, "traffic waits_for holds"),
    ({"waits_for": ["tool"] * 5}, "at most 4"),
    ({"think_s": (-1,)}, "traffic think_s holds seconds in \\[0, 60\\)"),
    ({"think_s": ("1",)}, "traffic think_s holds seconds"),
    ({"think_s": [True]}, "traffic think_s holds seconds"),
    ({"think_s": 5}, "traffic think_s holds seconds"),
    ({"sessions": "4"}, "traffic sessions must be an integer of at least 1"),
    ({"sessions": 2.5}, "traffic sessions must be an integer"),
    ({"sessions": True}, "traffic sessions must be an integer"),
    ({"turns": None}, "traffic turns must be an integer"),
    ({"system_tokens": 1.5}, "traffic system_tokens must be an integer"),
    ({"abort_after": -1}, "traffic abort_after must be seconds"),
    ({"abort_after": float("nan")}, "traffic abort_after must be seconds"),
    ({"probe": 1}, "traffic probe must be true or false"),
])
def test_bad_hinted_traffic_is_refused(fields, message):
    with pytest.raises(UsageError, match=message):
        AgentTraffic(**fields)


def test_a_malformed_hint_is_logged_and_the_wait_kind_left_unknown(caplog):
    """One client's bad ``penelope_waits_for`` must not stop the scheduler (on_release runs there)."""
    serving = Serving(size=64 * 40, policy="penelope-agent")
    serving.cache.options = options_from({"policy": "penelope-agent", "block_size": 64,
                                          "tool_call_token": TOOL_CALL}, {})
    book = serving.cache.cache.policy.book
    serve(serving, blocks(0, 3), [1, TOOL_CALL], {HINT_KEY: ["tool"]})
    assert [record.kind for record in book.waiting] == [None]
    assert "custom_params['penelope_waits_for'] must be one of tool, human, got ['tool']" in caplog.text
    serving.cache.check_invariants()
