"""Byte sizes in config and flags: ``4096``, ``512MiB``, ``1.5 GiB``, ``10GB``.

pydantic's ``ByteSize`` matches only a prefix, so ``"8GB!"`` reads as 8 GB and
``"1,5GiB"`` as one byte. Every byte-size field and flag uses :data:`ByteCount`
instead, which accepts the whole text or nothing.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, ByteSize
from pydantic_core import PydanticCustomError

UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "pib": 1 << 50,
}
ACCEPTED_FORMS = ("a byte count or a number (decimal point allowed), optional space and a "
                  "unit: B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB (e.g. 4096, "
                  "512MiB, 1.5 GiB)")
# ASCII only: \d alone would take "\uff16\uff14MiB" (full-width digits) as 64 MiB.
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?) ?([A-Za-z]+)?", re.ASCII)


def parse_byte_size(value: Any) -> int:
    """The size ``value`` names, in bytes; ValueError naming the accepted forms."""
    if isinstance(value, bool):
        raise ValueError(ACCEPTED_FORMS)
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        match = _SIZE.fullmatch(value.strip())
        if match:
            number, unit = match.groups()
            scale = UNITS.get((unit or "b").lower())
            if scale is not None:
                return int(float(number) * scale) if "." in number else int(number) * scale
    raise ValueError(ACCEPTED_FORMS)


def _validate_byte_size(value: Any) -> int:
    try:
        return parse_byte_size(value)
    except ValueError:
        raise PydanticCustomError("byte_size", "must be " + ACCEPTED_FORMS) from None


# A ByteSize (an int, with human_readable()) parsed strictly; bounds go in Field().
ByteCount = Annotated[ByteSize, BeforeValidator(_validate_byte_size)]
