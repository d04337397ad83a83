"""`penelope cost`: table, JSON, plot and one-line errors with exit code 2."""
import json
import subprocess
import sys

import pytest

from penelope.cli import main
from penelope.units import parse_size, parse_size_list


def test_table_and_json(tmp_path, capsys):
    out = tmp_path / "cost.json"
    rc = main(["cost", "--model", "qwen3-8b", "--contexts", "8K,16K,32K,64K,128K", "--evict-frac", "0.3",
               "--evict-start", "2K", "--append", "512", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "23,552" in text and "128K" in text
    payload = json.loads(out.read_text())
    assert payload["model"] == "qwen3-8b" and payload["c_lin"] == 23552
    contexts = [row["context"] for row in payload["rows"]]
    assert contexts == [8192, 16384, 32768, 65536, 131072]
    speedups = [row["predicted_speedup"] for row in payload["rows"]]
    assert speedups == sorted(speedups) and 2.8 < speedups[-1] < 2.95
    for row in payload["rows"]:
        assert row["predicted_speedup"] == pytest.approx(row["tail_cost"] / row["front_cost"])


def test_plot_is_written(tmp_path):
    png = tmp_path / "curve.png"
    assert main(["cost", "--contexts", "8K,32K", "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_model_from_config_path(tmp_path, capsys):
    from penelope.costmodel.hf_configs import BUILTIN_CONFIGS

    path = tmp_path / "config.json"
    path.write_text(json.dumps(BUILTIN_CONFIGS["qwen3-8b"]))
    assert main(["cost", "--model", str(path), "--contexts", "8K"]) == 0
    assert "23,552" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "nope"], "known models"),
        (["--evict-frac", "1.5"], "--evict-frac"),
        (["--evict-frac", "0"], "--evict-frac"),
        (["--contexts", "8K", "--evict-start", "9K"], "--evict-start 9216 is not inside a context of 8192 tokens"),
        (["--contexts", "0"], "positive"),
        (["--contexts=-8K"], "positive"),
        (["--contexts", "eight"], "cannot read"),
        (["--append=-1"], "non-negative"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    proc = subprocess.run([sys.executable, "-m", "penelope.cli", "cost", *args], capture_output=True, text=True)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("penelope: error:") and message in lines[0]
    assert "Traceback" not in proc.stderr


def test_sizes():
    assert parse_size("8K") == 8192 and parse_size("1M") == 1024**2 and parse_size("512") == 512
    assert parse_size("1.5K") == 1536
    # A list names each size once, in the order first given.
    assert parse_size_list("64K,32K,65536,64K") == [65536, 32768]
