"""lmkv-mooncake: a Mooncake Store storage tier for lmkv.

Installed, it registers the tier ``mooncake`` through the ``lmkv`` entry-point
group; a config selects it with ``tiers: [{type: cpu}, {type: mooncake,
options: {master_address: ..., metadata_server: ...}}]``. See
docs/tiers/mooncake.md.
"""

from lmkv_mooncake.backend import MooncakeBackend
from lmkv_mooncake.options import MooncakeOptions

__all__ = ["MooncakeBackend", "MooncakeOptions"]
__version__ = "0.1.0"
