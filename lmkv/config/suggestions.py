"""What an unknown config key could have been: the allowed keys and the nearest one.

A typo must say how to fix it, at every level: top-level keys, a section's keys,
a plugin's options, and ``LMKV_*`` variables (the prefix is reserved for lmkv).
A wrong suggestion is worse than none (``lookup.port`` is not ``transport``), so
a key is suggested only when it is plausibly what was meant (``nearest``).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel

ENV_PREFIX = "LMKV_"


def model_at(model: type[BaseModel], loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The model whose fields sit at ``loc`` below ``model``, or None when ``loc``
    leads into free-form data or stops at a list (``tiers``, not ``tiers.0``)."""
    current: type[BaseModel] | None = model
    awaiting_index = False
    for part in loc:
        if current is None:
            return None
        if isinstance(part, int) or str(part).isdigit():
            if not awaiting_index:
                return None
            awaiting_index = False
            continue
        if awaiting_index:
            return None
        field = current.model_fields.get(str(part))
        if field is None:
            return None
        awaiting_index = typing.get_origin(_unwrap_optional(field.annotation)) is list
        current = _model_in(field.annotation)
    return None if awaiting_index else current


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (list, tuple, typing.Union, types.UnionType,
                                         typing.Annotated):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def renamed_key(model: type[BaseModel] | None, name: str) -> str | None:
    """The key ``name`` became, when ``model`` lists it in ``renamed_keys``."""
    renamed: dict[str, str] = getattr(model, "renamed_keys", None) or {}
    return renamed.get(name)


def renamed_key_line(model: type[BaseModel], old: str, new: str, where: str) -> str:
    """``config key 'server.transport' was renamed 'server.data_path'; allowed: ...``
    (``old``, ``new``: full dotted keys; the values the new key takes, when fixed)."""
    field = model.model_fields.get(new.rsplit(".", 1)[-1])
    values = typing.get_args(field.annotation) if field is not None else ()
    allowed = (f"; allowed values: {', '.join(map(str, values))}"
               if values and typing.get_origin(field.annotation) is typing.Literal else "")
    return f"config key {old!r}{where} was renamed {new!r}{allowed}"


def nearest(name: str, allowed: Iterable[str]) -> str | None:
    """The allowed key ``name`` most plausibly meant, or None when none is plausible.

    Plausible, in this order of preference (case and ``_`` aside):

    1. the same letters (``chunksize``: ``chunk_size``), or one whole word of one key
       only (``port``: ``base_port``; ``timeout``: ``timeout_ms``);
    2. one edit away, or two for names of five letters or more: a letter added,
       dropped, changed, or two neighbours swapped (``tier``, ``evicton``, ``layuot``);
    3. an abbreviation: the key's first letter, then the rest of the name in order,
       covering at least half the key (``opts``: ``options``).

    Letters shared in passing make nothing plausible: ``port`` is not ``transport``.
    """
    plain = _letters(name)
    if not plain:
        return None
    keys = sorted(set(allowed))
    same = [key for key in keys if plain == _letters(key)]
    if same:
        return same[0]
    holding = [key for key in keys if plain in _words(key)]
    if len(holding) == 1:
        return holding[0]
    limit = 1 if len(plain) < 5 else 2
    scored = sorted((_edits(plain, _letters(key)), key) for key in keys)
    if scored and scored[0][0] <= limit:
        return scored[0][1]
    for key in keys:
        target = _letters(key)
        if (len(plain) >= 3 and 2 * len(plain) >= len(target) and plain[0] == target[0]
                and _in_order(plain[1:], target[1:])):
            return key
    return None


def _letters(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


def _words(name: str) -> list[str]:
    return [w for w in name.lower().replace("-", "_").split("_") if w]


def _edits(a: str, b: str) -> int:
    """Letters added, dropped, changed or swapped with a neighbour to make ``b`` of ``a``
    (optimal string alignment distance)."""
    if abs(len(a) - len(b)) > 2:
        return 3  # more than any limit: not worth the table
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[-1]


def _in_order(letters: str, text: str) -> bool:
    rest = iter(text)
    return all(letter in rest for letter in letters)


def unknown_key_hint(name: str, allowed: Iterable[str], *, env_stem: str | None = None,
                     env_only: Iterable[str] = ()) -> str:
    """``did you mean ...? allowed: ...`` for an unknown key ``name``.

    ``env_stem``: when an ``LMKV_*`` variable named it, the variable up to the
    key (``LMKV_TIERS__0__``), so the suggestion is a variable too; ``env_only``:
    the variables that are not keys.
    """
    allowed = sorted(allowed)
    if not allowed:
        return "this takes no keys (allowed: none)"
    if env_stem is None:
        close = nearest(name, allowed)
        hint = f"did you mean {close!r}? " if close else ""
        return f"{hint}allowed: {', '.join(allowed)}"
    # Compared without the shared stem, which would make every variable look alike.
    candidates = {key.upper(): env_stem + key.upper() for key in allowed}
    top_level = env_stem == ENV_PREFIX
    if top_level:
        candidates.update({var[len(ENV_PREFIX):]: var for var in env_only})
    close = nearest(name.upper(), candidates)
    hint = f"did you mean {candidates[close]}? " if close else ""
    line = f"{hint}allowed: {', '.join(allowed)}"
    if top_level:
        line += (f"; the {ENV_PREFIX} prefix is reserved for lmkv: every {ENV_PREFIX}* "
                 f"variable is a config key or one of {', '.join(sorted(env_only))}")
    return line
