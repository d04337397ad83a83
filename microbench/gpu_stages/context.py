"""What a stage is handed: where its points go, which shapes it runs, on which device, until when."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .points import PointLog

# Exit status of a stage: every check passed / a check failed / no CUDA GPU where one is needed /
# a required package is installed but does not import.
PASSED, CHECK_FAILED, NO_GPU, BROKEN = 0, 1, 3, 5


@dataclass
class StageContext:
    """``full``: the GPU experiment's shapes on CUDA; otherwise reduced shapes on the CPU with the
    kernels interpreted (the code paths, not the figures). ``deadline``: ``clock()`` by which the
    stage should have finished (its limit less a margin; the runner kills it at the limit).

    Every stage asks ``has_time`` before each point it measures (the first included), with what the
    last point says the next one needs (``expected_seconds``), so that a stage skips what would not
    finish rather than being killed in it."""

    log: PointLog
    out: Path
    full: bool
    deadline: float
    clock: Callable[[], float] = field(default=time.monotonic)

    @property
    def device(self):
        # Imported here: a stage that needs no torch starts without it.
        import torch

        return torch.device("cuda" if self.full else "cpu")

    def left(self) -> float:
        """Seconds until the deadline."""
        return self.deadline - self.clock()

    def has_time(self, seconds: float, **point) -> bool:
        """Whether work expected to take ``seconds`` ends before the deadline (nothing does once it
        has passed); if not, a ``skipped`` point with ``point``'s fields says what and why."""
        left = self.left()
        if left > 0 and seconds <= left:
            return True
        self.log.write("skipped", **point, reason=f"about {seconds:.1f} s needed, {max(left, 0.0):.1f} s left "
                                                  "before the stage's deadline")
        return False


def expected_seconds(last_seconds: float, last_work: float, work: float) -> float:
    """Seconds the next point should take: the last point's, scaled by how much more work it has
    (never less: a point's fixed costs do not shrink with its work). 0 before the first point."""
    if last_work <= 0:
        return last_seconds
    return last_seconds * max(1.0, work / last_work)


class Pace:
    """The seconds and the work of a stage's last point, so that ``has_time`` can say whether the
    next point fits before the deadline; ``done`` after each point measured."""

    def __init__(self, ctx: StageContext):
        self.ctx = ctx
        self.seconds, self.work = 0.0, 0.0
        self._began, self._work = 0.0, 0.0

    def has_time(self, work: float = 1.0, **point) -> bool:
        """``ctx.has_time`` for a point of ``work`` (any unit, the same for every point)."""
        self._began, self._work = self.ctx.clock(), work
        return self.ctx.has_time(expected_seconds(self.seconds, self.work, work), **point)

    def done(self) -> None:
        self.seconds, self.work = self.ctx.clock() - self._began, self._work
