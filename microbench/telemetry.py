"""GPU telemetry through NVML (the ``nvidia-ml-py`` package, imported as ``pynvml``).

A benchmark's figures only mean something next to the state of the GPU that produced them: a
throttled clock or a hot chip explains a slow run. ``GpuTelemetry`` reads, for one GPU:

- once: ``name``, ``driver``, ``index``, ``power_limit_w``, ``max_sm_clock_mhz``, ``max_mem_clock_mhz``;
- per sample: ``sm_clock_mhz``, ``mem_clock_mhz``, ``power_w``, ``temperature_c``,
  ``utilization_pct`` and ``clock_event_reasons`` (NVML's bit mask of why clocks are held down:
  power cap, thermal, ...; 0 or 1 (idle) when nothing limits them).

Without pynvml, without the NVML library or without a GPU, ``GpuTelemetry.open()`` returns
None; a field the GPU does not report is None. Nothing here raises NVML errors to the caller.
"""

from __future__ import annotations

import importlib
import os
from typing import Any


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _visible_index() -> int:
    """NVML index of the first GPU CUDA uses: CUDA_VISIBLE_DEVICES renumbers devices, NVML does not."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


class GpuTelemetry:
    """An open NVML session on one GPU. Use ``open()``; call ``close()`` when done."""

    def __init__(self, nvml, handle, index: int) -> None:
        self._nvml = nvml
        self._handle = handle
        self.index = index

    @classmethod
    def open(cls, index: int | None = None) -> GpuTelemetry | None:
        """Telemetry of GPU ``index`` (default: the first one CUDA sees), or None when NVML or a
        GPU is unavailable."""
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError:
            return None
        index = _visible_index() if index is None else index
        try:
            nvml.nvmlInit()
        except Exception:
            # NVMLError_LibraryNotFound, DriverNotLoaded, ...: no GPU to report on.
            return None
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:
            nvml.nvmlShutdown()
            return None
        return cls(nvml, handle, index)

    def _read(self, name: str, *args, scale: float = 1.0):
        """One NVML query on this GPU; None when the query is unsupported or fails."""
        try:
            value = getattr(self._nvml, name)(self._handle, *args)
        except Exception:
            return None
        return value / scale if scale != 1.0 else value

    def static(self) -> dict[str, Any]:
        """What does not change during a run: name, driver, index, power limit (W), maximum clocks (MHz)."""
        try:
            driver = _text(self._nvml.nvmlSystemGetDriverVersion())
        except Exception:
            driver = None
        name = self._read("nvmlDeviceGetName")
        return {
            "name": _text(name) if name is not None else None,
            "driver": driver,
            "index": self.index,
            "power_limit_w": self._read("nvmlDeviceGetEnforcedPowerLimit", scale=1000.0),
            "max_sm_clock_mhz": self._read("nvmlDeviceGetMaxClockInfo", self._nvml.NVML_CLOCK_SM),
            "max_mem_clock_mhz": self._read("nvmlDeviceGetMaxClockInfo", self._nvml.NVML_CLOCK_MEM),
        }

    def sample(self) -> dict[str, Any]:
        """Clocks (MHz), power (W), temperature (C), utilization (%) and clock event reasons now."""
        nvml = self._nvml
        utilization = self._read("nvmlDeviceGetUtilizationRates")
        reasons = self._read("nvmlDeviceGetCurrentClocksEventReasons")
        if reasons is None:
            reasons = self._read("nvmlDeviceGetCurrentClocksThrottleReasons")
        return {
            "sm_clock_mhz": self._read("nvmlDeviceGetClockInfo", nvml.NVML_CLOCK_SM),
            "mem_clock_mhz": self._read("nvmlDeviceGetClockInfo", nvml.NVML_CLOCK_MEM),
            "power_w": self._read("nvmlDeviceGetPowerUsage", scale=1000.0),
            "temperature_c": self._read("nvmlDeviceGetTemperature", nvml.NVML_TEMPERATURE_GPU),
            "utilization_pct": getattr(utilization, "gpu", None),
            "clock_event_reasons": reasons,
        }

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:
            pass


def gpu_record(telemetry: GpuTelemetry | None, before: dict | None, after: dict | None) -> dict | None:
    """The ``extra_info["gpu"]`` entry: static fields plus the samples before and after the
    benchmark, or None without telemetry."""
    if telemetry is None:
        return None
    return {**telemetry.static(), "before": before, "after": after}
