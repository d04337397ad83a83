"""What a stage is handed: where its points go, which shapes it runs, on which device, until when."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from .points import PointLog

# Exit status of a stage: every check passed / a check failed / no CUDA GPU where one is needed.
PASSED, CHECK_FAILED, NO_GPU = 0, 1, 3


@dataclass
class StageContext:
    """``full``: the GPU experiment's shapes on CUDA; otherwise reduced shapes on the CPU with the
    kernels interpreted (the code paths, not the figures). ``deadline``: ``time.monotonic()`` by
    which the stage should have finished (its limit less a margin; the runner kills it at the limit)."""

    log: PointLog
    out: Path
    full: bool
    deadline: float

    @property
    def device(self):
        # Imported here: a stage that needs no torch starts without it.
        import torch

        return torch.device("cuda" if self.full else "cpu")

    def left(self) -> float:
        """Seconds until the deadline."""
        return self.deadline - time.monotonic()
