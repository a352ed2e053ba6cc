"""Which instance of a static fleet owns a chunk: rendezvous (highest random
weight) hashing of the chunk's key over the instances' addresses.

Every instance computes the same owner from the same list, whatever its
order, with no directory; when an instance joins or leaves, only the chunks
it owns (or would own) move. The weight of ``(instance, key)`` is xxh3-64 of
the instance's address and the key's digest (``CacheKey.digest``: model,
identity, geometry and chunk hash), so a chunk's owner does not depend on
who asks.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from lmkv.keys.chunking import CacheKey


class Rendezvous:
    def __init__(self, members: Sequence[str]) -> None:
        if not members:
            raise ValueError("a fleet needs at least one member")
        self.members = tuple(dict.fromkeys(members))  # (duplicates once)
        self._seeds = [m.encode() + b"\0" for m in self.members]

    def owner(self, key: CacheKey) -> str:
        """The member that owns ``key``."""
        digest = key.digest()
        best, best_weight = 0, -1
        for i, seed in enumerate(self._seeds):
            weight = xxhash.xxh3_64_intdigest(seed + digest)
            if weight > best_weight:
                best, best_weight = i, weight
        return self.members[best]

    def pick(self, candidates: Sequence[str], key: CacheKey) -> str:
        """Of ``candidates`` (some of the members), the one the same weights put
        first for ``key``: readers of one key spread over its holders alike."""
        digest = key.digest()
        return max(candidates, key=lambda m: xxhash.xxh3_64_intdigest(m.encode() + b"\0"
                                                                      + digest))

    def runs(self, keys: Sequence[CacheKey]) -> list[tuple[str, int, int]]:
        """``keys`` cut into runs of one owner: ``(owner, start, stop)`` in order."""
        out: list[tuple[str, int, int]] = []
        for i, key in enumerate(keys):
            owner = self.owner(key)
            if out and out[-1][0] == owner:
                out[-1] = (owner, out[-1][1], i + 1)
            else:
                out.append((owner, i, i + 1))
        return out
