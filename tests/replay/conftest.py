"""Small traces written in the test: Mooncake records and token-id lists."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from lmkv.keys.chunking import KeyMeta

META = KeyMeta("replay-test")


@pytest.fixture
def mooncake(tmp_path: Path) -> Callable[[Sequence[Sequence[int]]], Path]:
    """Write one Mooncake record per request (its hash ids), return the path."""
    count = 0

    def write(requests: Sequence[Sequence[int]]) -> Path:
        nonlocal count
        count += 1
        path = tmp_path / f"mooncake{count}.jsonl"
        path.write_text("".join(
            json.dumps({"timestamp": i, "input_length": 512 * len(ids), "output_length": 1,
                        "hash_ids": list(ids)}) + "\n" for i, ids in enumerate(requests)))
        return path

    return write
