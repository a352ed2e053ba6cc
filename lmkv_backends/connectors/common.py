"""What the torch connectors share: one-line argument checks (their copies wait
through ``lmkv.memory.transfer_stream`` before chunk buffers change hands)."""

from __future__ import annotations


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
