"""What a result says about the machine and the code that produced it: package versions, the
commit (or, in a copy of the tree without ``.git``, a fingerprint of its files), the CPU model.

No imports of the measured packages: versions come from their metadata.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("torch", "triton", "penelope-kv", "sglang", "numpy", "pytest-benchmark", "nvidia-ml-py")
# The files whose content makes the figures: a copy without .git is identified by them.
FINGERPRINTED = ("penelope", "kernels", "integration", "microbench")


def versions(packages=PACKAGES) -> dict[str, str]:
    """Installed versions of ``packages`` (those not installed are left out)."""
    found = {}
    for name in packages:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def git(*args: str) -> str | None:
    """``git args`` in the repository, stripped; None when git or the repository is missing, and
    when the tree is a copy without ``.git`` inside some other repository (whose commit is not the
    tree's): the repository git finds must have this tree as its root."""
    top = _git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != REPO.resolve():
        return None
    return _git(*args)


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def tree_fingerprint(root: Path = REPO) -> str:
    """sha1 over the paths and contents of the ``*.py`` files under ``FINGERPRINTED`` and
    ``pyproject.toml``: the same on any copy of the same tree, with or without ``.git``."""
    digest = hashlib.sha1()
    files = [root / "pyproject.toml", *sorted(p for folder in FINGERPRINTED for p in (root / folder).rglob("*.py"))]
    for path in files:
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def host_memory() -> dict[str, int]:
    """``MemTotal`` and ``MemAvailable`` of ``/proc/meminfo`` in bytes (empty where it is missing)."""
    found = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                found[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return found


def gpu_kind(device_name: str | None) -> str | None:
    """The simulator's GPU key (``h100``, ``h200``) of a CUDA device name, or None."""
    name = (device_name or "").lower()
    return next((kind for kind in ("h100", "h200") if kind in name), None)
