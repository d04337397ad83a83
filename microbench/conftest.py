"""Shared set-up of the microbenchmarks: environment and GPU telemetry in every result.

Every benchmark's ``extra_info`` gets, before the benchmark runs (so a benchmark may overwrite a
key with its own value):

- ``versions``: installed versions of torch, triton, penelope-kv, sglang, numpy, pytest-benchmark
  and nvidia-ml-py (packages that are not installed are left out);
- ``commit`` (``git rev-parse HEAD``) and ``commit_dirty`` (uncommitted changes in the tree);
- ``device_name`` (the CUDA device, or the CPU model), ``python``, ``torch_threads``,
  ``triton_interpret`` (kernels interpreted on CPU);

and after it has run:

- ``machine_kind``: ``cpu`` or the GPU's name as a slug (``nvidia-h200``): the baseline a result
  is compared with (``microbench/baselines/<machine_kind>.json``, see ``compare.py``);
- ``gpu``: NVML telemetry (``telemetry.py``: name, driver, clocks, power, temperature before and
  after the benchmark), or None without a GPU or without nvidia-ml-py.

Files named ``bench_*.py`` are collected, so ``pytest microbench`` runs them all. Options:
``--bench-out DIR`` (where benchmarks write plots and JSON besides pytest-benchmark's
own; default ``results/<cpu|gpu>``) and ``--gpu-only`` (run only the ``test_gpu*`` benchmarks,
so CPU figures are not re-measured on a GPU machine).
"""

from __future__ import annotations

import os
import platform
import re
import sys
from pathlib import Path

# pytest imports test files by path (--import-mode=importlib): the benchmarks' shared modules
# (machine, timing, telemetry, ...) are found from this folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402
import torch  # noqa: E402
from machine import REPO, cpu_name, git, versions  # noqa: E402
from telemetry import GpuTelemetry, gpu_record  # noqa: E402


def pytest_addoption(parser):
    group = parser.getgroup("penelope microbenchmarks")
    group.addoption("--bench-out", default=None, help="folder for plots and result JSON (default results/<cpu|gpu>)")
    group.addoption("--gpu-only", action="store_true", help="run only the test_gpu* benchmarks")


def pytest_collect_file(file_path, parent):
    """Collect ``bench_*.py`` (pytest's default pattern is ``test_*.py``), so ``pytest microbench``
    runs every benchmark; a file named on the command line is collected by pytest itself."""
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--gpu-only"):
        return
    keep = [item for item in items if getattr(item, "originalname", item.name).startswith("test_gpu")]
    dropped = [item for item in items if item not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def machine_kind() -> str:
    """``cpu`` without CUDA, else the first GPU's name as a lowercase slug (``nvidia-h200``)."""
    if not torch.cuda.is_available():
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-")


@pytest.fixture(scope="session")
def bench_environment() -> dict:
    """The environment entries added to every result (computed once per session)."""
    status = git("status", "--porcelain", "--untracked-files=no")
    cuda = torch.cuda.is_available()
    return {
        "versions": versions(),
        "commit": git("rev-parse", "HEAD") or "unknown",
        "commit_dirty": bool(status) if status is not None else None,
        "device_name": torch.cuda.get_device_name(0) if cuda else cpu_name(),
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
    }


@pytest.fixture(scope="session")
def gpu_telemetry():
    """An open NVML session on the benchmarked GPU, or None."""
    telemetry = GpuTelemetry.open() if torch.cuda.is_available() else None
    yield telemetry
    if telemetry is not None:
        telemetry.close()


@pytest.fixture(scope="session")
def bench_out(request) -> Path:
    """Folder for the plots and result JSON that benchmarks write besides pytest-benchmark's."""
    chosen = request.config.getoption("--bench-out")
    default = REPO / "results" / ("gpu" if torch.cuda.is_available() else "cpu")
    folder = Path(chosen) if chosen else default
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(autouse=True)
def _record_environment(request, bench_environment, gpu_telemetry):
    """Add the environment and GPU telemetry to the ``extra_info`` of every benchmark."""
    if "benchmark" not in request.fixturenames:
        yield
        return
    benchmark = request.getfixturevalue("benchmark")
    benchmark.extra_info.update(bench_environment)
    before = gpu_telemetry.sample() if gpu_telemetry is not None else None
    yield
    after = gpu_telemetry.sample() if gpu_telemetry is not None else None
    benchmark.extra_info["gpu"] = gpu_record(gpu_telemetry, before, after)
    benchmark.extra_info["machine_kind"] = machine_kind()
