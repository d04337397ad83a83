"""``scripts/sglang_cpu_cost_curve.py``: the layouts it times count what the cost model prices, and
one short run through SGLang's real HTTP server on CPU produces every cache state it intends (the
script checks each with the server's counters and exits 2 otherwise). Mechanics only: no speed is
asserted."""
import json
import socket

import pytest
import scripts_env

from penelope.costmodel.recompute import CostModel, predict_speedup
from penelope.costmodel.shapes import get_model
from penelope.engine.scale_model import scale_model_config
from penelope.errors import UsageError

script = scripts_env.load_script("sglang_cpu_cost_curve")


@pytest.mark.parametrize(("context", "scale"), [(8192, 8), (16384, 8), (32768, 8), (4096, 16), (2048, 8)])
def test_layouts_count_what_the_cost_model_prices(context, scale):
    cost = CostModel(get_model(scale_model_config(scale).to_hf()))
    layout = script.Layout.at(context, scale)
    assert layout.evicted % 64 == 0 and abs(layout.evicted - 0.3 * context) <= 32
    assert (layout.evict_start, layout.append) == (2048 // scale, 512 // scale)
    prediction = predict_speedup(cost, context, evicted=layout.evicted, evict_start=layout.evict_start,
                                 append=layout.append)
    for state, want in (("front", prediction.front_cost), ("tail", prediction.tail_cost)):
        tokens, positions = layout.expected(state)
        assert tokens == layout.evicted + layout.append
        assert cost.c_lin * tokens + positions == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize(("context", "message"), [(1000, "not a whole number of 64-token pages"),
                                                  (256, "cannot evict")])
def test_bad_layouts_are_refused(context, message):
    with pytest.raises(UsageError, match=message):
        script.Layout.at(context, 8)


def test_a_short_run_through_the_server(tmp_path):
    out = tmp_path / "curve.json"
    rc = script.main(["--out", str(out), "--contexts", "2048", "--prefill", "512", "1024", "--repeats", "2"])
    assert rc == 0
    report = json.loads(out.read_text())
    [row] = report["eviction"]
    assert (row["context"], row["evicted"], row["evict_start"], row["append"]) == (2048, 640, 256, 64)
    assert len(row["front_s"]) == len(row["tail_s"]) == 2 and all(t > 0 for t in row["front_s"] + row["tail_s"])
    cost = CostModel(get_model(scale_model_config(8).to_hf()))
    assert report["c_lin"] == cost.c_lin == 2944
    assert row["predicted_speedup"] == predict_speedup(cost, 2048, evicted=640, evict_start=256,
                                                       append=64).predicted_speedup
    assert [p["tokens"] for p in report["prefill"]] == [512, 1024]
    # The server is gone: its port no longer accepts connections.
    [server] = report["servers"]
    assert server["pool"] == 2048 + 5 * 64
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", int(server["url"].rsplit(":", 1)[1]))) != 0
