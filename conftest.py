"""The test session sees lmkv and its own plugins only, whatever else is installed.

A third-party lmkv plugin installed in the venv is someone else's: lmkv's tests
(and every process they start) run as if it were not there
(``tests/isolation/sitecustomize.py``), so a broken one's warning line or a
healthy one's extra names change nothing they check. Tests that want a
third-party plugin write a distribution of their own, which stays visible.
"""

from __future__ import annotations

import os
from importlib.metadata import entry_points
from pathlib import Path

ISOLATION = Path(__file__).resolve().parent / "tests" / "isolation"
OURS = frozenset({"lmkv", "lmkv-redis", "lmkv-mooncake"})


def pytest_configure(config: object) -> None:
    foreign = sorted({ep.dist.metadata["Name"] for ep in entry_points(group="lmkv")
                      if ep.dist is not None and ep.dist.metadata["Name"] not in OURS})
    if not foreign:
        return
    os.environ["_LMKV_TESTS_HIDDEN_DISTS"] = ",".join(foreign)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ISOLATION), *filter(None, [os.environ.get("PYTHONPATH")])])
    # This process too (it started before the variable was set): by path, so that a
    # sitecustomize of the interpreter's own, if any, is left as it is.
    import importlib.util

    spec = importlib.util.spec_from_file_location("_lmkv_tests_isolation",
                                                  ISOLATION / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))

    from lmkv.plugins.manager import reset_plugin_manager

    reset_plugin_manager()
