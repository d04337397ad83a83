"""The files a run of the GPU script writes in its output folder (none deeper), by name: the runner
removes exactly these before it starts, so that nothing of an earlier run is taken for this one's."""

from __future__ import annotations

from .points import POINTS_FILE

LOG_FILE = "run_gpu.log"
PLOT_FILE = "cost_curve.png"


def calibration_file(full: bool) -> str:
    return f"calibration_{'gpu' if full else 'reduced'}.json"


OUTPUT_FILES = (POINTS_FILE, LOG_FILE, PLOT_FILE, calibration_file(True), calibration_file(False))
