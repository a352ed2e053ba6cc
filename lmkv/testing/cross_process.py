"""The conformance kit's cross-process test: what a tier stored outlives the
process that stored it, and another process reads it back, each chunk its own.

Another process (``lmkv.testing.tier_worker``) opens the tier the kit's
backend is (its registered name, the options it was given, its serializer),
stores a few chunks, closes it and exits; this process then opens the same
tier afresh (an engine restarted, or a second one) and reads every chunk
back. A tier whose storage is its process's memory cannot pass it: its kit
says so (``outlives_process = False``, with ``per_process_reason``) and the
test is skipped with that reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Protocol

import pytest
import torch
from pydantic_core import to_jsonable_python

from lmkv.contracts.plugin import PluginOptions
from lmkv.contracts.tier import StorageBackend
from lmkv.keys.chunking import CacheKey
from lmkv.testing.building import selectable
from lmkv.testing.tier_worker import chunk_data, class_path
from lmkv.testing.tiers import open_tier

#: The worker's whole life, torch's import included (a liveness bound).
WORKER_TIMEOUT_S = 180.0
#: Key numbers no other test of the kit stores.
IDS = (70, 71, 72)


class Kit(Protocol):
    """What the test asks of the storage kit (``StorageBackendConformance``)."""

    outlives_process: bool
    per_process_reason: str
    chunk_shape: tuple[int, ...]
    dtype: torch.dtype

    def key(self, i: int) -> CacheKey: ...

    def process_options(self, backend: StorageBackend) -> dict[str, Any]: ...


def given_options(options: PluginOptions) -> dict[str, Any]:
    """The options a backend was given (not its defaults, which the other process
    derives alike), secrets in the clear: what opens the same tier elsewhere."""
    given: dict[str, Any] = {}
    for name in sorted(options.model_fields_set):
        value = getattr(options, name)
        if hasattr(value, "get_secret_value"):
            value = value.get_secret_value()
        given[name] = to_jsonable_python(value)
    return given


def tier_spec(kit: Kit, backend: StorageBackend) -> dict[str, Any]:
    serializer = backend.context.serializer
    return {"type": backend.name, "options": kit.process_options(backend),
            "serializer": serializer.name if serializer is not None else "naive",
            # the very class under test, installed or not (else the name's)
            "class": class_path(type(backend))}


def check_read_across_processes(kit: Kit, backend: StorageBackend,
                                directory: Path) -> None:
    """Store through ``backend``'s tier in another process, then read here."""
    if not kit.outlives_process:
        pytest.skip(kit.per_process_reason or "this tier's storage is its process's memory")
    tier = tier_spec(kit, backend)
    keys = [kit.key(i) for i in IDS]
    spec = {"tier": tier, "keys": [k.to_string() for k in keys], "seeds": list(IDS),
            "shape": list(kit.chunk_shape), "dtype": str(kit.dtype).removeprefix("torch.")}
    path = directory / "tier-spec.json"
    # Owner-only: the options may carry the tier's credentials.
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(spec, f)
    done = subprocess.run([sys.executable, "-m", "lmkv.testing.tier_worker", str(path)],
                          capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    assert done.returncode == 0, (f"the storing process failed ({done.returncode}): "
                                  f"{done.stdout[-1000:]}{done.stderr[-3000:]}")
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"stored": len(keys)}

    with selectable(type(backend)):
        reader = open_tier(tier["type"], tier["options"], serializer_name=tier["serializer"])
    try:
        assert reader.batched_async_contains("cross-process", keys) == len(keys), \
            "what another process stored is not there once it exited"
        for key, seed in zip(keys, IDS, strict=True):
            obj = reader.get_blocking(key)
            assert obj is not None, f"key {seed}, stored by another process, does not read"
            try:
                assert torch.equal(obj.tensor, chunk_data(seed, kit.chunk_shape, kit.dtype)), \
                    f"key {seed} read back other bytes than the other process stored"
            finally:
                obj.ref_down()
    finally:
        reader.close()
