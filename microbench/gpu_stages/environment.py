"""Stage 1: the machine and the code, before anything is measured: driver, clocks, versions, commit.

First what needs neither torch nor a GPU (Python, the packages' versions from their metadata, the
commit, the CPU, host memory, NVML's static figures and a sample of its clocks, power and
temperature (``telemetry.py``), ``nvidia-smi``'s view of the same): the ``environment`` point. Then
the required packages are imported, and the ``device`` point has torch's, CUDA's and cuDNN's
versions and the device's properties. A package that is installed but does not import (a torch
whose CUDA libraries are missing) is an ``error`` point and exit status ``BROKEN``: every other
stage would fail on it. The copy of the tree on the GPU machine may have no ``.git``: then
``commit`` is null and ``tree_fingerprint`` identifies the files (``machine.tree_fingerprint``, the
same on a checkout of the same commit).
"""

from __future__ import annotations

import importlib
import os
import platform
import subprocess

from machine import cpu_name, git, host_memory, tree_fingerprint, versions
from telemetry import GpuTelemetry

from .context import BROKEN, NO_GPU, PASSED, StageContext

# What the stages import: torch and Triton for the kernels, numpy for the fits.
REQUIRED = ("torch", "triton", "numpy")
PACKAGES = ("torch", "triton", "numpy", "pytest", "pytest-benchmark", "hypothesis", "nvidia-ml-py", "matplotlib",
            "sglang", "flashinfer-python", "setuptools", "wheel")
SMI_FIELDS = ("name", "driver_version", "pstate", "clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem",
              "power.limit", "temperature.gpu", "mig.mode.current")


def nvidia_smi() -> dict | str | None:
    """``nvidia-smi``'s fields of the first GPU (None without it; its error text when it fails)."""
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return (done.stdout + done.stderr).strip()[:500]
    values = [value.strip() for value in done.stdout.splitlines()[0].split(",")]
    return dict(zip(SMI_FIELDS, values, strict=False))


def cuda_device(torch) -> dict | None:
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    return {"name": props.name, "capability": list(torch.cuda.get_device_capability(0)),
            "multiprocessors": props.multi_processor_count, "memory_bytes": total, "free_bytes": free,
            "device_count": torch.cuda.device_count()}


def nvml() -> dict | None:
    """NVML's static figures and one sample (None without NVML or a GPU)."""
    telemetry = GpuTelemetry.open()
    if telemetry is None:
        return None
    try:
        return {**telemetry.static(), "sample": telemetry.sample()}
    finally:
        telemetry.close()


def run(ctx: StageContext) -> int:
    status = git("status", "--porcelain", "--untracked-files=no")
    ctx.log.write(
        "environment",
        shapes="full" if ctx.full else "reduced",
        python=platform.python_version(), platform=platform.platform(), packages=versions(PACKAGES),
        commit=git("rev-parse", "HEAD"), commit_dirty=bool(status) if status is not None else None,
        tree_fingerprint=tree_fingerprint(),
        cpu=cpu_name(), cpu_count=os.cpu_count(), host_memory=host_memory(),
        triton_interpret=os.environ.get("TRITON_INTERPRET") == "1",
        nvml=nvml(), nvidia_smi=nvidia_smi(),
    )
    modules = {}
    for name in REQUIRED:
        try:
            modules[name] = importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - whatever a broken install raises, it is named
            ctx.log.write("error", error=f"{name} does not import: {type(error).__name__}: {error}"[:1000])
            print(f"environment: {name} does not import: {type(error).__name__}: {error}", flush=True)
            return BROKEN
    torch = modules["torch"]
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    ctx.log.write("device", torch=torch.__version__, torch_cuda=torch.version.cuda, cudnn=cudnn,
                  triton=modules["triton"].__version__, numpy=modules["numpy"].__version__,
                  cuda_available=torch.cuda.is_available(), cuda_device=cuda_device(torch))
    return NO_GPU if ctx.full and not torch.cuda.is_available() else PASSED
