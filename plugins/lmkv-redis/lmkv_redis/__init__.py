"""lmkv-redis: a Redis / Redis Cluster storage tier for lmkv.

Installed, it registers the tier ``redis`` through the ``lmkv`` entry-point
group; a config selects it with ``tiers: [{type: cpu}, {type: redis,
options: {url: ...}}]``. See docs/tiers/redis.md.
"""

from lmkv_redis.backend import RedisBackend
from lmkv_redis.options import RedisOptions, redact_url

__all__ = ["RedisBackend", "RedisOptions", "redact_url"]
__version__ = "0.1.0"
