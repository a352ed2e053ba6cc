"""What an unknown config key could have been: the allowed keys and the nearest one.

A typo must say how to fix it, at every level: top-level keys, a section's keys,
a plugin's options, and ``LMKV_*`` variables (the prefix is reserved for lmkv).
"""

from __future__ import annotations

import difflib
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
        close = difflib.get_close_matches(name, allowed, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return f"{hint}allowed: {', '.join(allowed)}"
    # Compared without the shared stem, which would make every variable look alike.
    candidates = {key.upper(): env_stem + key.upper() for key in allowed}
    top_level = env_stem == ENV_PREFIX
    if top_level:
        candidates.update({var[len(ENV_PREFIX):]: var for var in env_only})
    close = difflib.get_close_matches(name.upper(), list(candidates), n=1)
    hint = f"did you mean {candidates[close[0]]}? " if close else ""
    line = f"{hint}allowed: {', '.join(allowed)}"
    if top_level:
        line += (f"; the {ENV_PREFIX} prefix is reserved for lmkv: every {ENV_PREFIX}* "
                 f"variable is a config key or one of {', '.join(sorted(env_only))}")
    return line
