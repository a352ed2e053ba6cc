"""scripts/typecheck.py: mypy held to a baseline that may only shrink (real mypy
on a small project of its own)."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "typecheck.py"
_spec = importlib.util.spec_from_file_location("typecheck", _PATH)
assert _spec is not None and _spec.loader is not None
typecheck = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(typecheck)

MYPY_OUTPUT = """\
lmkv/a.py:12: error: Name "f" already defined on line 3  [no-redef]
lmkv/a.py:40:5: error: Item "None" of "X | None" has no attribute "y"  [union-attr]
lmkv/a.py:41: note: Left operand is of type "int | None"
lmkv/a.py:90: error: Item "None" of "X | None" has no attribute "y"  [union-attr]
lmkv/b.py:1: error: invalid syntax
"""


def test_errors_are_keyed_without_line_numbers_and_repeats_kept() -> None:
    errors = typecheck.parse(MYPY_OUTPUT)
    assert errors == {
        'lmkv/a.py: no-redef: Name "f" already defined on line N': 1,
        'lmkv/a.py: union-attr: Item "None" of "X | None" has no attribute "y"': 2,
        "lmkv/b.py: misc: invalid syntax": 1,
    }


def _project(root: Path, body: str) -> None:
    (root / "pyproject.toml").write_text('[tool.mypy]\nfiles = ["pkg"]\n')
    (root / "pkg").mkdir(exist_ok=True)
    (root / "pkg" / "__init__.py").write_text(textwrap.dedent(body))


ONE_ERROR = """
    def f(x: int | None) -> int:
        return x + 1
"""
TWO_ERRORS = ONE_ERROR + """
    def g(x: str | None) -> int:
        return len(x)
"""


@pytest.mark.slow  # runs mypy five times
def test_only_new_errors_fail_and_the_baseline_only_shrinks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--root", str(tmp_path), "--baseline", "baseline.txt"]
    baseline = tmp_path / "baseline.txt"
    _project(tmp_path, ONE_ERROR)
    assert typecheck.main([*args, "--update"]) == 0
    assert "pkg/__init__.py: operator: " in baseline.read_text()
    assert typecheck.main(args) == 0

    _project(tmp_path, TWO_ERRORS)
    kept = baseline.read_text()
    assert typecheck.main(args) == 1
    out = capsys.readouterr().out
    assert "1 mypy error(s) not in baseline.txt" in out
    assert 'pkg/__init__.py:6: error: Argument 1 to "len"' in out
    assert "return x + 1" not in out and ":3: error" not in out  # the known one is not news
    assert typecheck.main([*args, "--update"]) == 1
    assert baseline.read_text() == kept  # never grows

    _project(tmp_path, "def f(x: int) -> int:\n    return x + 1\n")
    assert typecheck.main(args) == 0
    assert "1 error(s) of baseline.txt are gone; shrink it" in capsys.readouterr().out
    assert typecheck.main([*args, "--update"]) == 0
    assert typecheck.parse(baseline.read_text()) == {}
    assert typecheck.read_baseline(baseline) == {}
