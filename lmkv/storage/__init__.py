"""Layer 7: the storage manager and what it is made of.

``manager`` (``StorageManager``: tiers in order, write-through, tiered lookup
and prefetch, synchronous reads), ``build`` (the config's tiers, the one that
holds memory first), ``promotion`` (lower-tier chunks a read collects for the
first tier), ``writethrough`` (the bounded queue to each lower tier),
``prefetch`` (the weighted semaphore and the per-lookup tasks), ``admission``
(the per-tier ``admit_after`` gate). The names below are imported on first
use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmkv.base.exports import lazy_exports

_LAZY: dict[str, str] = {
    "StorageManager": "lmkv.storage.manager",
    "chain_parents": "lmkv.storage.manager",
}

if TYPE_CHECKING:
    from lmkv.storage.manager import StorageManager, chain_parents

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())

__all__ = ["StorageManager", "chain_parents"]
