"""Layer 7: the storage manager and what it is made of.

``manager`` (``StorageManager``: tiers in order, write-through, tiered lookup
and prefetch, promotion), ``writethrough`` (the bounded queue to each lower
tier), ``prefetch`` (the weighted semaphore and the per-lookup tasks),
``admission`` (the per-tier ``admit_after`` gate).
"""

from lmkv.storage.manager import StorageManager, chain_parents

__all__ = ["StorageManager", "chain_parents"]
