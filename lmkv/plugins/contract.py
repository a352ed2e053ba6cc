"""Each plugin class checked against its kind's contract before anything uses it.

The registry runs ``check`` on every class a hook returns. What it finds is
why the class is left out, in one phrase: the contract version it was written
for (``api_version``, ``lmkv.contracts.versions``), an abstract method left
unimplemented, a constructor or a method that cannot be called the way lmkv
calls it (its arguments bound to the class's own signature), a property lmkv
reads that is a method, or a final method of lmkv's base class replaced. Only
``inspect`` looks at the class: nothing of the plugin runs.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

from lmkv.contracts.versions import (
    API_VERSIONS,
    CALLS,
    MIGRATION_GUIDE,
    UNDECLARED_UNTIL,
    Call,
    declared_version,
    is_lmkv_class,
    parse_version,
)

_ARG = object()  # stands in for every argument of a trial binding
_MISSING = object()  # what getattr_static answers for a name the class lacks


@dataclass(frozen=True)
class Verdict:
    """What the check found: ``problem`` (why the class is left out; "" when it
    fits) and ``undeclared`` (it fits but declares no ``api_version``)."""

    problem: str = ""
    undeclared: bool = False


def check(kind: str, cls: type, base: type) -> Verdict:
    """Check ``cls``, a subclass of ``base``, against the ``kind`` contract."""
    problem = _version_problem(kind, cls, base)
    if problem:
        return Verdict(problem)
    if inspect.isabstract(cls):
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        return Verdict(f"abstract method{'s' if len(missing) > 1 else ''} not implemented: "
                       f"{', '.join(missing)}")
    declared = parse_version(declared_version(cls, base))
    for call in CALLS[kind]:
        if call.since and (declared is None or declared < parse_version(call.since)):  # type: ignore[operator]
            continue  # added later than the class was written for: its own, if any
        problem = _call_problem(cls, base, call)
        if problem:
            return Verdict(problem)
    return Verdict(undeclared=declared is None)


def _version_problem(kind: str, cls: type, base: type) -> str:
    declared = declared_version(cls, base)
    if declared is None:
        return ""
    ours = API_VERSIONS[kind]
    mine, theirs = parse_version(ours), parse_version(declared)
    assert mine is not None
    if theirs is None:
        return (f"api_version = {declared!r} is not a version; allowed: 'major.minor' "
                f"for this lmkv's API {ours}, e.g. {ours!r}")
    if theirs[0] != mine[0]:
        return (f"written for the {_title(kind)} API {theirs[0]}.{theirs[1]}, this lmkv "
                f"has {ours}: see {MIGRATION_GUIDE} for what to change")
    if theirs[1] > mine[1]:
        return (f"written for the {_title(kind)} API {theirs[0]}.{theirs[1]}, newer than "
                f"this lmkv's {ours}: upgrade lmkv")
    return ""


def _call_problem(cls: type, base: type, call: Call) -> str:
    if call.kind == "constructor":
        return _constructor_problem(cls, call)
    found = inspect.getattr_static(cls, call.name, _MISSING)
    owner = _owner(cls, call.name)
    if call.kind == "final":
        if owner is not None and not is_lmkv_class(owner):
            return (f"overrides {base.__name__}.{call.name}, which lmkv calls and a plugin "
                    f"must not replace (implement the on_* methods it calls instead)")
        return ""
    if found is _MISSING:
        use = "reads" if call.kind == "property" else "calls"
        return f"has no {call.shape()}, which lmkv {use}"
    if owner is not None and is_lmkv_class(owner):
        return ""  # lmkv's own implementation: it fits by construction
    if call.kind == "property":
        if isinstance(found, (property, functools.cached_property)) or not callable(found):
            return ""  # a property, or a plain value (``capacity_bytes = None``)
        return (f"{call.name} is a method; lmkv reads it as a property "
                f"(decorate it with @property)")
    return _method_problem(cls, found, call)


def _constructor_problem(cls: type, call: Call) -> str:
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        return ""  # a signature inspect cannot read (C code): nothing to hold against it
    if _binds(signature, call, skip_self=False):
        return ""
    return (f"its constructor cannot be called as {call.shape()} (lmkv builds every "
            f"plugin that way); its signature is {cls.__name__}{_shown(signature)}")


def _method_problem(cls: type, found: Any, call: Call) -> str:
    function = found.__func__ if isinstance(found, (classmethod, staticmethod)) else found
    if isinstance(found, property) or not callable(function):
        return f"{call.name} is not a method; lmkv calls {call.shape()}"
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return ""
    if _binds(signature, call, skip_self=not isinstance(found, staticmethod)):
        return ""
    return (f"{call.name}{_shown(signature)} cannot be called as {call.shape()}, "
            f"which lmkv calls")


def _binds(signature: inspect.Signature, call: Call, skip_self: bool) -> bool:
    args = [_ARG] * (len(call.args) + (1 if skip_self else 0))
    kwargs = dict.fromkeys(call.kwargs, _ARG)
    if call.engine_state:  # the engine's own keywords, whatever the plugin names them
        params = list(signature.parameters.values())
        after = [p for p in params[len(args):] if p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                            p.KEYWORD_ONLY)]
        kwargs.update((p.name, _ARG) for p in after if p.default is p.empty)
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _owner(cls: type, name: str) -> type | None:
    return next((k for k in cls.__mro__ if name in vars(k)), None)


def _shown(signature: inspect.Signature) -> str:
    """A signature without annotations, for one line: ``(self, key, pin=False)``."""
    plain = signature.replace(
        parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
        return_annotation=inspect.Signature.empty)
    return str(plain)


def _title(kind: str) -> str:
    return kind.replace("_", " ")


def undeclared_note(count: int) -> str:
    """The end of the one warning line for a plugin whose classes declare no
    ``api_version``."""
    return (f"accepted until lmkv {UNDECLARED_UNTIL}: declare api_version on "
            f"{'each class' if count > 1 else 'the class'} (see {MIGRATION_GUIDE})")
