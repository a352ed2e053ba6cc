"""Constants of ``lmkv replay``, in a module that imports nothing: ``lmkv --help``
reads them and must stay light (no numpy, no pydantic)."""

from __future__ import annotations

FORMATS: tuple[str, ...] = ("mooncake", "tokens")
MOONCAKE_BLOCK_SIZE = 512  # tokens per Mooncake hash id
PHYSICAL_CHUNK_BYTES = 4096  # what one chunk takes in a tier during a replay
DTYPE_BYTES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4, "float8": 1,
                               "int8": 1}
DEFAULT_CAPACITIES = "1%,5%,10%,20%"
