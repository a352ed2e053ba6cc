"""A process of its own that stores chunks through one tier, then exits:

    python -m lmkv.testing.tier_worker SPEC_FILE

``SPEC_FILE`` (JSON, owner-only: it may hold the tier's credentials) names the
tier (``{"type", "options", "serializer"}``), the keys (``CacheKey`` strings)
and the chunks' ``shape``, ``dtype`` and ``seeds``: chunk ``i`` is
``chunk_data(seeds[i], shape, dtype)``, which the reading side recomputes.
It prints ``{"stored": N}`` and exits 0 once the tier has every put and is
closed; a put that did not store is exit 1. The conformance kit's
cross-process test (``lmkv.testing.cross_process``) runs it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

import torch

from lmkv.keys.chunking import CacheKey
from lmkv.memory import tensor_obj
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


def main(spec_file: str) -> int:
    with open(spec_file, encoding="utf-8") as f:
        spec = json.load(f)
    tier_spec = spec["tier"]
    keys = [CacheKey.from_string(text) for text in spec["keys"]]
    dtype = dtype_named(spec["dtype"])
    objs = [tensor_obj(chunk_data(seed, spec["shape"], dtype)) for seed in spec["seeds"]]
    tier = open_tier(tier_spec["type"], tier_spec["options"],
                     serializer_name=tier_spec["serializer"])
    try:
        stored = tier.batched_submit_put(keys, objs).result(timeout=PUT_TIMEOUT_S)
    finally:
        for obj in objs:
            obj.ref_down()
        tier.close()
    print(json.dumps({"stored": stored}), flush=True)
    return 0 if stored == len(keys) else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
