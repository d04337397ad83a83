"""Compile figures of every Triton kernel per target, for the baseline comparison.

The figures (``kernels/compile_report.py``: registers, spill bytes, shared memory, tensor-core MMA
instructions, per kernel, target and pinned configuration) come from one run of the report in a
subprocess without ``TRITON_INTERPRET`` (compiles are CPU work: the same figures on any machine
with the same Triton). Each configuration is one result whose ``extra_info`` holds them under keys
``compare.py`` tracks as exact: ``registers``, ``spill_store_bytes``, ``spill_load_bytes``,
``stack_bytes``, ``shared_bytes``, ``mma_instructions``, ``loop_mma_instructions`` (the smallest
count of any loop). The timed function is empty: the compile's own duration is ``compile_seconds``
(not compared: it moves with the machine's load).

Run: ``pytest microbench/bench_compile_report.py --benchmark-json out.json`` (about 1-2 minutes).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Importing the package decorates the kernels: the other benchmarks of this session need the
# interpreter without a GPU (the report itself runs in a subprocess without it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from penelope.kernels.compile_report import pinned_entries  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

ENTRIES = pinned_entries()
# The report's figures each result records under the report's own names.
RECORDED = ("config", "registers", "spill_store_bytes", "spill_load_bytes", "stack_bytes", "shared_bytes",
            "mma_instructions", "mma_opcodes", "problems", "compile_seconds")


def _name(entry) -> str:
    lse = "-lse" if entry.return_lse else ""
    return f"{entry.kernel}-{entry.target}-{entry.shape}-{entry.dtype}{lse}"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile-report") / "report.json"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "penelope.kernels.compile_report", "--json", str(out), "--jobs", "2"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert out.exists(), done.stdout[-2000:] + done.stderr[-2000:]
    data = json.loads(out.read_text())
    return {_name_of(r["entry"]): (r, data["wall_seconds"]) for r in data["results"]}


def _name_of(entry: dict) -> str:
    lse = "-lse" if entry["return_lse"] else ""
    return f"{entry['kernel']}-{entry['target']}-{entry['shape']}-{entry['dtype']}{lse}"


@pytest.mark.parametrize("entry", ENTRIES, ids=_name)
def test_compile_figures(benchmark, report, entry):
    figures, wall = report[_name(entry)]
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    benchmark.extra_info.update(
        kernel=entry.kernel, target=entry.target, shape=entry.shape, dtype=entry.dtype,
        return_lse=entry.return_lse, loop_mma_instructions=min(figures["loop_mma"], default=0),
        report_wall_seconds=wall,
    )
    benchmark.extra_info.update({key: figures[key] for key in RECORDED})
    assert figures["problems"] == []
