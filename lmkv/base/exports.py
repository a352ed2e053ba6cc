"""Lazy re-exports for a package's ``__init__``: names imported on first use.

A package whose public names pull in torch (the contracts, ``lmkv`` itself)
re-exports them through a module ``__getattr__``, so importing one small module
of it (``lmkv.contracts.plugin`` from the config) stays cheap.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, table: Mapping[str, str], namespace: dict[str, Any]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``table`` maps a public name to
    the module that defines it (``"module"``), or to a module and the name it
    has there (``"module:attr"``); a value found is kept in ``namespace`` (the
    package's globals), so later look-ups skip the function."""

    def __getattr__(name: str) -> Any:
        where = table.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attr = where.partition(":")
        value = getattr(importlib.import_module(module), attr or name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
