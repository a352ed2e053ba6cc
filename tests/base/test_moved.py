"""lmkv 0.1's module paths still import, as the very modules they became, with one
DeprecationWarning each naming where to import from instead."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lmkv.base.moved import MOVED

pytestmark = pytest.mark.slow  # a fresh interpreter

CODE = """
import importlib, json, sys, warnings
from lmkv.base.moved import MOVED
out = {}
for old, new in MOVED.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = importlib.import_module(old)
        again = importlib.import_module(old)  # warned once per path
    out[old] = {"same": first is sys.modules[new] and again is first,
                "name": first.__spec__.name,
                "warnings": [(w.category.__name__, str(w.message), w.filename)
                             for w in caught if issubclass(w.category, DeprecationWarning)]}
print(json.dumps(out))
"""


@pytest.mark.slow  # a fresh interpreter
def test_every_old_path_is_its_new_module_and_warns_once() -> None:
    result = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert set(found) == set(MOVED)
    for old, seen in found.items():
        assert seen["same"], f"{old} is not {MOVED[old]}"
        assert seen["name"] == MOVED[old], "the module's own spec must stay its own"
        moved = [w for w in seen["warnings"] if old in w[1]]
        assert len(moved) == 1, f"{old}: {seen['warnings']}"
        assert "docs/migrating-plugins.md" in moved[0][1]
        assert moved[0][2] == "<string>", f"{old}: the warning points at {moved[0][2]}"


def test_plugin_facing_paths_point_to_the_contracts_root() -> None:
    from lmkv.base.moved import advice

    assert advice("lmkv.backend").endswith(
        "import from lmkv.contracts instead (see docs/migrating-plugins.md)")
    assert "import from lmkv.storage.prefetch instead" in advice("lmkv.prefetch")


def test_the_warning_points_at_the_importing_line(tmp_path) -> None:
    """A plugin author sees the warning at their own import line (Python shows a
    DeprecationWarning from __main__ by default)."""
    script = tmp_path / "plug.py"
    script.write_text("import lmkv.backend\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"{script}:1: DeprecationWarning: lmkv.backend moved to lmkv.contracts.tier" \
        in result.stderr
