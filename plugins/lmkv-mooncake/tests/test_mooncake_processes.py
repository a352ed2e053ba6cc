"""Two engine processes, each with its own cpu tier, share KV through one
Mooncake pool (``open_local_engine``, the tier found through its entry point)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmkv.testing.engine_worker import shared_between_processes
from lmkv.testing.mooncake import MooncakeMaster

pytestmark = pytest.mark.slow  # a real mooncake_master


def test_kv_stored_by_one_process_is_retrieved_by_another(
        mooncake_master: MooncakeMaster, shared_client: None, tmp_path: Path) -> None:
    # shared_client: this process holds the pool's memory (one 64 MiB segment).
    shared_between_processes({"type": "mooncake", "options": mooncake_master.options(
        key_prefix="procs:", global_segment_size=0)}, tmp_path)
