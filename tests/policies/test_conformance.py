"""Every built-in eviction policy passes the policy conformance suite, and so does
a deliberately bad one: the base hands tiers leaves only, whatever a policy ranks."""

from __future__ import annotations

from lmkv.contracts.policy import EvictionPolicy
from lmkv.testing import EvictionPolicyConformance
from lmkv_policies.arc import ARCPolicy
from lmkv_policies.lfu import LFUPolicy
from lmkv_policies.lru import LRUPolicy
from lmkv_policies.s3fifo import S3FIFOPolicy


class TestLRU(EvictionPolicyConformance):
    policy_class = LRUPolicy


class TestLFU(EvictionPolicyConformance):
    policy_class = LFUPolicy

    def policy_options(self):
        return {"decay_period": 50}  # ages often: the rebuild is exercised


class TestARC(EvictionPolicyConformance):
    policy_class = ARCPolicy


class TestS3FIFO(EvictionPolicyConformance):
    policy_class = S3FIFOPolicy


class HeadsFirst(EvictionPolicy):
    """Ranks the oldest keys first, heads of prompts included, and ignores parents:
    what the cpu tier's LRU did before eviction knew about prefixes."""

    name = "heads-first"

    def __init__(self, options=None, context=None):
        super().__init__(options, context)
        self.order: dict = {}

    def on_insert(self, key, parent):
        self.order[key] = None

    def on_access(self, key):
        pass

    def on_remove(self, key):
        del self.order[key]

    def victims(self):
        return iter(self.order)


class TestABadPolicyStillCannotOrphan(EvictionPolicyConformance):
    policy_class = HeadsFirst
