"""A process of its own that stores chunks through one tier, then exits:

    python -m lmkv.testing.tier_worker SPEC_FILE

``SPEC_FILE`` (JSON, owner-only: it may hold the tier's credentials) names the
tier (``{"type", "options", "serializer", "class"}``: ``class`` the tier's
``module:qualname`` when it can be imported, so an uninstalled one is used), the
keys (``CacheKey`` strings)
and the chunks' ``shape``, ``dtype`` and ``seeds``: chunk ``i`` is
``chunk_data(seeds[i], shape, dtype)``, which the reading side recomputes.
It prints ``{"stored": N}`` and exits 0 once the tier has every put and is
closed; a put that did not store is exit 1. The conformance kit's
cross-process test (``lmkv.testing.cross_process``) runs it.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Sequence

import torch

from lmkv.keys.chunking import CacheKey
from lmkv.memory import tensor_obj
from lmkv.testing.building import selectable
from lmkv.testing.tiers import open_tier

#: How long the worker waits for its puts (a liveness bound).
PUT_TIMEOUT_S = 60.0


def chunk_data(seed: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The chunk stored for ``seed``: the same bytes in every process."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=gen).to(dtype)


def dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def class_path(cls: type) -> str | None:
    """``module:qualname`` of a class another process can import, else None (a
    class defined inside a function)."""
    if "<locals>" in cls.__qualname__ or cls.__module__ == "__main__":
        return None
    return f"{cls.__module__}:{cls.__qualname__}"


def importable(path: str | None) -> list[type]:
    """The class ``class_path`` named, as a one-item list (empty for None)."""
    if not path:
        return []
    module, _, qualname = path.partition(":")
    found: object = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    assert isinstance(found, type), path
    return [found]


def main(spec_file: str) -> int:
    with open(spec_file, encoding="utf-8") as f:
        spec = json.load(f)
    tier_spec = spec["tier"]
    keys = [CacheKey.from_string(text) for text in spec["keys"]]
    dtype = dtype_named(spec["dtype"])
    objs = [tensor_obj(chunk_data(seed, spec["shape"], dtype)) for seed in spec["seeds"]]
    with selectable(*importable(tier_spec.get("class"))):
        tier = open_tier(tier_spec["type"], tier_spec["options"],
                         serializer_name=tier_spec["serializer"])
    try:
        parents = [None, *keys[:-1]]  # one prompt's chunks, as lmkv stores them
        stored = tier.batched_submit_put(keys, objs, parents=parents).result(
            timeout=PUT_TIMEOUT_S)
    finally:
        for obj in objs:
            obj.ref_down()
        tier.close()
    print(json.dumps({"stored": stored}), flush=True)
    return 0 if stored == len(keys) else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
