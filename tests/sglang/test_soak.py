"""The soak of SGLang's real HTTP server on CPU with Penelope's cache (``scripts/sglang_soak.py``),
short: 16 closed-loop sessions for 40 s per configuration (device pool only, and two tiers), under
eviction pressure (a 16,384-token pool against 16 histories of up to 3,072 tokens), with clients
disconnecting mid-stream, ``/abort_request``, ``/flush_cache`` during load and in quiet moments,
prompts longer than the context and malformed requests, SGLang's strict memory checks on.

Every check of the script must hold: no scheduler fault in the log, every fault answered as
expected (a 4xx for bad requests, an abort for an aborted request), the server generating at the
end, nothing cached after the final flush, and every completed reply identical to a reference
server that computes every prompt whole. The five-minute run is the script's default
(``python scripts/sglang_soak.py``; its figures are in integration/sglang/README.md).
"""
import json

import pytest
import scripts_env

from penelope.loadgen.soak import SoakConfig, server_faults


@pytest.mark.parametrize("bad", [dict(vocab=2), dict(sessions=0), dict(max_context=5000), dict(max_context=100),
                                 dict(turn_tokens=(9, 3)), dict(abort_p=0.7, disconnect_p=0.5)])
def test_a_bad_soak_configuration_is_refused(bad):
    settings = dict(vocab=1000, max_context=3072, context_length=4096) | bad
    with pytest.raises(ValueError, match="SoakConfig"):
        SoakConfig(**settings)


def test_a_scheduler_traceback_is_reported_by_its_last_frame_and_exception(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("[x] Prefill batch. #new-seq: 1\n"
                   "[x] Scheduler hit an exception: Traceback (most recent call last):\n"
                   '  File "scheduler.py", line 10, in run\n    step()\n'
                   '  File "cache.py", line 99, in evict\n    assert held >= 0\n'
                   "AssertionError: held -16\n\n[x] Decode batch.\n")
    assert server_faults(log) == ['Traceback: File "cache.py", line 99, in evict -> AssertionError: held -16']
    log.write_text("[x] ok\n[x] KV cache memory leak detected: 16 pages\n")
    assert server_faults(log) == ["[x] KV cache memory leak detected: 16 pages"]
    assert server_faults(tmp_path / "missing.log")[0].startswith("log unreadable")


@pytest.mark.slow
def test_a_short_soak_of_the_real_server(tmp_path, capsys):
    script = scripts_env.load_script("sglang_soak")
    code = script.main(["--minutes", "0.67", "--sessions", "16", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    runs = json.loads((tmp_path / "soak.json").read_text())["runs"]
    assert code == 0, printed
    assert [run["config"] for run in runs] == ["gpu", "two-tiers"]
    for run in runs:
        counts = run["counts"]
        assert run["problems"] == [] and run["faults"] == [] and run["unexpected"] == [] and run["mismatches"] == []
        # Every kind of fault happened, and the load evicted and refilled holes.
        assert counts["completed"] >= 100 and counts["disconnected"] > 0 and counts["aborted"] > 0
        assert counts["flushes_done"] > 0 and counts["oversize_refused"] > 0 and counts["malformed_refused"] > 0
        penelope = run["end"]["counters"]
        assert penelope["evicted_tokens"] > 0 and penelope["phantom_tokens"] + penelope["chunk_refill_tokens"] > 0
        assert run["end"]["held_after_flush"] == {}
    assert runs[1]["end"]["counters"]["tier_demoted_tokens"] > 0
