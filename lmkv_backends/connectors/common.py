"""What the torch connectors share: one-line argument checks and the wait for
asynchronous copies before chunk buffers change hands."""

from __future__ import annotations

import torch


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def sync(device: torch.device) -> None:
    """Wait for asynchronous copies on ``device`` (pinned-memory transfers)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
