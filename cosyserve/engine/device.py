"""The engine's device (a kind's ``device``) on its threads, waiting for its GPU work, and PCM back to the
host without waiting."""

from __future__ import annotations

import time

import numpy as np
import torch

COPY_POLL_S = 0.0002  # HostCopy.wait's polling interval


def make_current(device: torch.device) -> None:
    """``device`` as the calling thread's current CUDA device (a new thread's is device 0): graph
    captures and the current stream are the current device's."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def synchronize(device: torch.device) -> None:
    """Wait for the work launched on ``device`` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HostCopy:
    """Tensors (any shape, one dtype, one device) on their way to the host as flat arrays. On a GPU
    the copy is launched into one pinned buffer behind the work queued so far, and an event marks
    its end: the host goes on launching work while it runs. On the CPU it is there at once."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._sizes = [t.numel() for t in tensors]
        flat = torch.cat([t.detach().reshape(-1) for t in tensors]) if tensors else torch.zeros(0)
        self._event: torch.cuda.Event | None = None
        if flat.device.type == "cuda":
            self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = flat

    def ready(self) -> bool:
        """Whether the copy is done (never waits)."""
        return self._event is None or self._event.query()

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the copy (polling: a CUDA event has no timed wait); whether it is done."""
        deadline = time.perf_counter() + timeout_s
        while not self.ready():
            left = deadline - time.perf_counter()
            if left <= 0:
                return False
            time.sleep(min(left, COPY_POLL_S))
        return True

    def arrays(self) -> list[np.ndarray]:
        """The tensors' values, flat, in order (waits for the copy; raises the GPU's error if its
        work failed)."""
        if self._event is not None:
            self._event.synchronize()
        return np.split(self._host.numpy(), np.cumsum(self._sizes)[:-1])
