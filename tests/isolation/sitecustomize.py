"""Loaded at start-up by every Python process of lmkv's test session (this folder
is put first on PYTHONPATH by the root conftest.py when there is something to
hide): the ``lmkv`` entry points of the distributions named in
``_LMKV_TESTS_HIDDEN_DISTS`` (comma-separated) are not seen.

lmkv's own tests are about lmkv: a third-party plugin installed in the same venv
(a broken one warns in every command) must not change what they see. A test that
wants a third-party plugin writes its own distribution, which is not hidden.
"""

from __future__ import annotations

import importlib.metadata as _metadata
import os

HIDDEN_ENV = "_LMKV_TESTS_HIDDEN_DISTS"


def hidden() -> frozenset[str]:
    return frozenset(n for n in os.environ.get(HIDDEN_ENV, "").split(",") if n)


def _distribution(ep: _metadata.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return None if dist is None else dist.metadata["Name"]


def install() -> None:
    """Filter ``importlib.metadata.entry_points`` (once per process)."""
    if getattr(_metadata.entry_points, "_lmkv_tests_filter", False):
        return
    original = _metadata.entry_points

    def entry_points(**params):  # type: ignore[no-untyped-def]
        found = original(**params)
        names = hidden()
        if not names or params.get("group") != "lmkv":
            return found
        return _metadata.EntryPoints(ep for ep in found if _distribution(ep) not in names)

    entry_points._lmkv_tests_filter = True  # type: ignore[attr-defined]
    _metadata.entry_points = entry_points


install()
