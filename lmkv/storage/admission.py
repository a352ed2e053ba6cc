"""``admit_after``: a tier stores a chunk only from its N-th sighting.

A sighting is one offer of the chunk to that tier for storing, made by the
storage manager: a put (each request that computed the chunk) for the first
tier, a promotion of a lower-tier hit into the first tier, a write-through for
a lower tier. Chunks computed once and never again (most of a long tail of
one-off prompts) then never displace chunks that are reused: the reuse gate
vLLM's offloading has. A chunk offered while the tier holds it is offered for
nothing, so it counts as a sighting and costs nothing else.

Counts are kept per key hash (a 64-bit hash: a collision admits a chunk one
sighting early) in an LRU-bounded map: at most four times the tier's capacity
in chunks (from the first chunk's size; between 1,024 and 1,048,576 keys;
65,536 for a tier without a byte budget), so a count older than that many
distinct offers is forgotten and starts again. A rejected chunk also rejects
the rest of its prompt in the same put (they would be stored without their
head): a chunk is admitted when its count reached N and its parent is not a
rejected chunk of the same offer.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TypeVar

from lmkv.keys.chunking import CacheKey

T = TypeVar("T")

MIN_TRACKED = 1 << 10
MAX_TRACKED = 1 << 20
UNBOUNDED_TIER_TRACKED = 1 << 16


def tracked_keys(capacity_bytes: int | None, chunk_bytes: int) -> int:
    """How many keys' counts a gate keeps for a tier of ``capacity_bytes``."""
    if not capacity_bytes or chunk_bytes <= 0:
        return UNBOUNDED_TIER_TRACKED
    return max(MIN_TRACKED, min(MAX_TRACKED, 4 * (capacity_bytes // chunk_bytes)))


class AdmissionGate:
    """Counts sightings of keys for one tier and admits from the ``after``-th."""

    def __init__(self, after: int, capacity_bytes: int | None = None,
                 max_tracked: int | None = None) -> None:
        if isinstance(after, bool) or not isinstance(after, int) or after < 1:
            raise ValueError(f"admit_after must be an integer >= 1, got {after!r}")
        self.after = after
        self.capacity_bytes = capacity_bytes
        self.max_tracked = max_tracked  # None: sized from the first chunk offered
        self._counts: OrderedDict[int, int] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._counts)

    def admit(self, keys: Sequence[CacheKey], objs: Sequence[T],
              parents: Sequence[CacheKey | None] | None, chunk_bytes: int = 0,
              ) -> tuple[list[CacheKey], list[T], list[CacheKey | None] | None, int]:
        """Count one sighting of each key; the admitted keys, objs and parents
        (None stays None), and how many were rejected."""
        if self.after <= 1:
            return list(keys), list(objs), None if parents is None else list(parents), 0
        kept_keys: list[CacheKey] = []
        kept_objs: list[T] = []
        kept_parents: list[CacheKey | None] = []
        rejected: set[CacheKey] = set()
        with self._lock:
            if self.max_tracked is None:
                self.max_tracked = tracked_keys(self.capacity_bytes, chunk_bytes)
            counts, bound = self._counts, self.max_tracked
            for i, (key, obj) in enumerate(zip(keys, objs, strict=True)):
                parent = parents[i] if parents is not None else None
                h = hash(key)
                seen = min(counts.pop(h, 0) + 1, self.after)
                counts[h] = seen  # the most recent end
                if seen < self.after or (parent is not None and parent in rejected):
                    rejected.add(key)
                    continue
                kept_keys.append(key)
                kept_objs.append(obj)
                kept_parents.append(parent)
            while len(counts) > bound:
                counts.popitem(last=False)
        return (kept_keys, kept_objs, None if parents is None else kept_parents,
                len(rejected))
