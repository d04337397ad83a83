"""Telemetry and environment recording of the microbenchmarks (microbench/telemetry.py, conftest.py)."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

MICROBENCH = Path(__file__).resolve().parents[2] / "microbench"
_spec = importlib.util.spec_from_file_location("microbench_telemetry", MICROBENCH / "telemetry.py")
telemetry = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = telemetry
_spec.loader.exec_module(telemetry)


class FakeNvmlError(Exception):
    pass


def _fake_nvml(init_fails=False, power_fails=False):
    calls = []

    def record(name, value):
        def fn(*args):
            calls.append(name)
            if isinstance(value, Exception):
                raise value
            return value

        return fn

    module = types.SimpleNamespace(
        NVMLError=FakeNvmlError,
        NVML_CLOCK_SM=0,
        NVML_CLOCK_MEM=2,
        NVML_TEMPERATURE_GPU=0,
        nvmlInit=record("init", FakeNvmlError("no library") if init_fails else None),
        nvmlShutdown=record("shutdown", None),
        nvmlDeviceGetHandleByIndex=record("handle", "h0"),
        nvmlSystemGetDriverVersion=record("driver", b"570.86"),
        nvmlDeviceGetName=record("name", "NVIDIA H200"),
        nvmlDeviceGetEnforcedPowerLimit=record("limit", 700_000),
        nvmlDeviceGetPowerUsage=record("power", FakeNvmlError("unsupported") if power_fails else 312_500),
        nvmlDeviceGetTemperature=record("temp", 41),
        nvmlDeviceGetUtilizationRates=record("util", types.SimpleNamespace(gpu=97, memory=40)),
        nvmlDeviceGetCurrentClocksEventReasons=record("reasons", 4),
    )
    module.nvmlDeviceGetClockInfo = lambda handle, clock: {0: 1980, 2: 3201}[clock]
    module.nvmlDeviceGetMaxClockInfo = lambda handle, clock: {0: 1980, 2: 3201}[clock] + 10
    return module, calls


def test_telemetry_reads_nvml(monkeypatch):
    fake, calls = _fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    gpu = telemetry.GpuTelemetry.open()
    assert gpu is not None and gpu.index == 3
    before = gpu.sample()
    assert before == {
        "sm_clock_mhz": 1980,
        "mem_clock_mhz": 3201,
        "power_w": 312.5,
        "temperature_c": 41,
        "utilization_pct": 97,
        "clock_event_reasons": 4,
    }
    record = telemetry.gpu_record(gpu, before, {**before, "temperature_c": 55})
    assert record["name"] == "NVIDIA H200" and record["driver"] == "570.86" and record["power_limit_w"] == 700.0
    assert (record["max_sm_clock_mhz"], record["max_mem_clock_mhz"]) == (1990, 3211)
    assert record["before"]["temperature_c"] == 41 and record["after"]["temperature_c"] == 55
    gpu.close()
    assert calls[-1] == "shutdown"


def test_unsupported_field_is_none(monkeypatch):
    fake, _ = _fake_nvml(power_fails=True)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sample = telemetry.GpuTelemetry.open().sample()
    assert sample["power_w"] is None and sample["sm_clock_mhz"] == 1980


def test_no_nvml_library_or_no_package_gives_none(monkeypatch):
    fake, _ = _fake_nvml(init_fails=True)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert telemetry.GpuTelemetry.open() is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert telemetry.GpuTelemetry.open() is None
    assert telemetry.gpu_record(None, None, None) is None


DEMO_BENCH = '''
def test_cpu_thing(benchmark):
    benchmark(sum, range(10))
    benchmark.extra_info["device_name"] = "mine"

def test_gpu_thing(benchmark):
    benchmark(sum, range(10))

def test_not_a_benchmark():
    assert True
'''


@pytest.mark.parametrize("gpu_only", [False, True])
def test_conftest_records_environment(tmp_path, gpu_only):
    for name in ("conftest.py", "machine.py", "telemetry.py"):
        shutil.copy(MICROBENCH / name, tmp_path / name)
    (tmp_path / "bench_demo.py").write_text(DEMO_BENCH)
    out = tmp_path / "out.json"
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "bench_demo.py"),
            f"--benchmark-json={out}", f"--bench-out={tmp_path / 'results'}", "--rootdir", str(tmp_path)]
    if gpu_only:
        args.append("--gpu-only")
    # A parallel suite's worker marks its environment; pytest-benchmark in the nested run would take
    # itself for a worker too and write nothing.
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_XDIST")}
    result = subprocess.run(args, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    benches = {b["name"]: b["extra_info"] for b in json.loads(out.read_text())["benchmarks"]}
    if gpu_only:
        assert set(benches) == {"test_gpu_thing"}
        assert "2 deselected" in result.stdout
        return
    assert set(benches) == {"test_cpu_thing", "test_gpu_thing"}
    info = benches["test_gpu_thing"]
    assert {"torch", "pytest-benchmark", "penelope-kv"} <= set(info["versions"])
    if torch.cuda.is_available():
        assert info["machine_kind"].startswith("nvidia") and (info["gpu"] is None or "before" in info["gpu"])
    else:
        assert info["machine_kind"] == "cpu" and info["gpu"] is None
    assert isinstance(info["commit"], str) and info["torch_threads"] >= 1
    # A benchmark's own value wins over the environment's.
    assert benches["test_cpu_thing"]["device_name"] == "mine"
