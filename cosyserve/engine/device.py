"""Where the engine's GPU work stands: what the loop waits on (a kind's ``device``)."""

from __future__ import annotations

import torch


def work_done_event(device: torch.device) -> torch.cuda.Event | None:
    """An event that completes when the work launched so far on ``device`` has run (None on the
    CPU, where it has)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def synchronize(device: torch.device) -> None:
    """Wait for the work launched on ``device`` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
