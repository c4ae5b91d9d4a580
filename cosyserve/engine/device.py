"""Waiting for the engine's GPU work (a kind's ``device``)."""

from __future__ import annotations

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the work launched on ``device`` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
