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
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from penelope.loadgen.soak import SoakConfig

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "sglang_soak.py"


def load_script():
    spec = importlib.util.spec_from_file_location("sglang_soak", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("bad", [dict(vocab=2), dict(sessions=0), dict(max_context=5000), dict(max_context=100),
                                 dict(turn_tokens=(9, 3)), dict(abort_p=0.7, disconnect_p=0.5)])
def test_a_bad_soak_configuration_is_refused(bad):
    settings = dict(vocab=1000, max_context=3072, context_length=4096) | bad
    with pytest.raises(ValueError, match="SoakConfig"):
        SoakConfig(**settings)


def test_a_short_soak_of_the_real_server(tmp_path, capsys):
    script = load_script()
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
