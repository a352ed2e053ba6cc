"""Model-scale bytes, the small physical chunks the tiers really hold, and capacities.

A replay computes nothing, and real payloads cannot be held: one 512-token chunk
of Llama-3-8B in bf16 is 64 MiB, and a trace has tens of thousands of unique
chunks. So the tiers run on small physical chunks (``PHYSICAL_CHUNK_BYTES``) with
every capacity scaled by the same factor: a tier holds exactly as many chunks as
it would at the model's size, and every byte figure is reported at the model's
size (chunks x model chunk bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lmkv.base.errors import LMKVError
from lmkv.base.units import ACCEPTED_FORMS, parse_byte_size
from lmkv.replay.defaults import DTYPE_BYTES


@dataclass(frozen=True)
class ModelShape:
    """The KV one token takes: layers x KV heads x head dim x 2 (K and V) x dtype
    bytes, unless ``bytes_per_token`` is given outright."""

    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    bytes_per_token_override: int | None = None

    @property
    def bytes_per_token(self) -> int:
        if self.bytes_per_token_override is not None:
            return self.bytes_per_token_override
        return self.layers * self.kv_heads * self.head_dim * 2 * DTYPE_BYTES[self.dtype]

    def chunk_bytes(self, tokens_per_chunk: int) -> int:
        return self.bytes_per_token * tokens_per_chunk

    def describe(self) -> str:
        if self.bytes_per_token_override is not None:
            return f"{human_bytes(self.bytes_per_token)} a token (--bytes-per-token)"
        return (f"{self.layers} layers x {self.kv_heads} KV heads x {self.head_dim} head dim "
                f"x 2 (K, V) x {DTYPE_BYTES[self.dtype]} B ({self.dtype}) = "
                f"{human_bytes(self.bytes_per_token)} a token")


@dataclass(frozen=True)
class Capacity:
    """One capacity of ``--capacity``: as written, and in chunks."""

    label: str
    chunks: int


def parse_capacities(text: str, unique_chunks: int, chunk_bytes: int) -> list[Capacity]:
    """``1%,5%,40GiB``: percents of the trace's unique chunks, or sizes at the model's
    scale (whole chunks: a size is rounded down to the chunks it holds). Under one
    chunk is an error."""
    out: list[Capacity] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            raise LMKVError(f"--capacity {text!r}: an empty item; give a comma-separated "
                            "list of percents of the unique chunks (5%) or sizes (40GiB)")
        if item.endswith("%"):
            try:
                percent = float(item[:-1])
            except ValueError:
                percent = math.nan
            if not math.isfinite(percent) or percent <= 0:
                raise LMKVError(f"--capacity {item!r}: a percent must be a positive number "
                                "(e.g. 5%)")
            chunks = math.floor(unique_chunks * percent / 100)
            if chunks < 1:
                share = unique_chunks * percent / 100
                raise LMKVError(f"--capacity {item}: under one chunk ({percent:g}% of "
                                f"{unique_chunks} unique chunks is {share:.2g})")
        else:
            try:
                size = parse_byte_size(item)
            except ValueError:
                raise LMKVError(f"--capacity {item!r}: not a percent (5%) or a size: "
                                f"{ACCEPTED_FORMS}") from None
            chunks = size // chunk_bytes
            if chunks < 1:
                raise LMKVError(f"--capacity {item}: under one chunk (a chunk is "
                                f"{human_bytes(chunk_bytes)} at the model's size)")
        out.append(Capacity(item, chunks))
    return out


def human_bytes(n: float) -> str:
    """``134217728`` -> ``128 MiB``; three significant digits at most."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
