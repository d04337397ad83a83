"""compare.py tracks the compile report's figures as exact: a register more, a spilled byte or a
lost MMA instruction is a regression; compile times are not compared."""

import importlib.util
import sys
from pathlib import Path

import pytest

COMPARE_PATH = Path(__file__).resolve().parents[2] / "microbench" / "compare.py"
_spec = importlib.util.spec_from_file_location("microbench_compare_figures", COMPARE_PATH)
compare = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = compare
_spec.loader.exec_module(compare)

FIGURES = dict(registers=180, spill_store_bytes=0, spill_load_bytes=0, stack_bytes=0, shared_bytes=99328,
               mma_instructions=24, loop_mma_instructions=12, compile_seconds=0.8, machine_kind="cpu")


def results(**changes):
    info = FIGURES | changes
    return {"benchmarks": [{"fullname": "microbench/bench_compile_report.py::test_compile_figures[x]",
                            "extra_info": info}]}


@pytest.mark.parametrize("key", ["registers", "spill_store_bytes", "spill_load_bytes", "stack_bytes", "shared_bytes",
                                 "mma_instructions", "loop_mma_instructions"])
def test_compile_figures_are_exact(key):
    assert compare.figure_kind(key, FIGURES[key]) == "exact"
    changed = results(**{key: FIGURES[key] + 4})
    rows = [row for row in compare.compare(results(), changed) if row.figure == key]
    assert [row.status for row in rows] == [compare.REGRESSION]
    assert all(row.status == compare.OK for row in compare.compare(results(), results()))


def test_compile_time_is_not_compared():
    assert compare.figure_kind("compile_seconds", 0.8) is None
    assert not [row for row in compare.compare(results(), results(compile_seconds=9.0)) if row.status != compare.OK]
