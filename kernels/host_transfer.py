"""Host <-> device transfers that never make the host wait for the GPU.

``upload`` moves a host array to the device through pinned memory with a non-blocking copy: the call
returns at once and the copy runs in stream order before any kernel queued after it. A copy from
pageable memory would make the CPU wait until the GPU has drained the stream.

``DeviceFlag`` is the other direction for a small int32 status that a kernel writes: its value is
copied into pinned host memory behind an event, so the host can read it later without blocking
(``poll``) or wait for it where it syncs anyway (``wait``).
"""

from __future__ import annotations

import numpy as np
import torch


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` as a tensor on ``device``: a non-blocking copy from pinned memory on CUDA, the
    array's own memory (no copy) on the CPU."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return host
    # pin_memory() comes from torch's caching host allocator, which keeps the block alive until
    # the copy queued on the current stream has completed.
    return host.pin_memory().to(device, non_blocking=True)


class DeviceFlag:
    """An int32 ``[1]`` tensor on ``device`` that kernels update, and its asynchronous read-back.

    ``value`` is the device tensor (initialised to ``initial`` in stream order). Call ``publish()``
    after the kernels that write it were queued; then ``poll()`` returns the value once the copy
    has landed (None before) and ``wait()`` blocks until it has.
    """

    def __init__(self, device: torch.device, initial: int):
        self.device = device
        self.value = torch.full((1,), initial, dtype=torch.int32, device=device)
        self._host: torch.Tensor | None = None
        self._event = None

    def publish(self) -> None:
        """Queue the copy of the value to the host (nothing to queue on the CPU)."""
        if self.device.type != "cuda":
            return
        self._host = torch.empty(1, dtype=torch.int32, pin_memory=True)
        self._host.copy_(self.value, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def poll(self) -> int | None:
        """The value if its copy has completed, else None; never blocks."""
        if self.device.type != "cuda":
            return int(self.value[0])
        if self._event is None or not self._event.query():
            return None
        return int(self._host[0])

    def wait(self) -> int:
        """The value, blocking until the kernels that write it and the copy have run."""
        if self.device.type != "cuda":
            return int(self.value[0])
        if self._event is None:
            self.publish()
        self._event.synchronize()
        return int(self._host[0])
