"""Two engine processes, each with its own cpu tier, share KV through one Redis."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmkv.testing.engine_worker import shared_between_processes
from lmkv.testing.redis import RedisServer

pytestmark = pytest.mark.slow  # a real redis-server


def test_kv_stored_by_one_process_is_retrieved_by_another(redis_server: RedisServer,
                                                          tmp_path: Path) -> None:
    shared_between_processes({"type": "redis", "options": {
        "url": redis_server.url, "key_prefix": "procs:", "part_bytes": 4096}}, tmp_path)
