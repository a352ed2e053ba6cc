from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import lmkv.memory

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _strict_refcounts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A double release is a bug: raise in tests instead of logging."""
    monkeypatch.setattr(lmkv.memory, "strict_refcounts", True)


@pytest.fixture(autouse=True)
def _no_lmkv_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests start from a clean environment: no LMKV_* settings from the shell."""
    for name in list(os.environ):
        if name.startswith("LMKV_"):
            monkeypatch.delenv(name)


def run_cli(*args: str, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m lmkv ARGS`` in a subprocess, as a user would."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("LMKV_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "lmkv", *args], capture_output=True,
                          text=True, env=full_env, cwd=cwd, timeout=300)
