"""README.md's Python examples run as written, so they stay true."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def python_blocks(section: str) -> list[str]:
    """The ```python blocks under the README's ``## section`` heading."""
    part = re.split(r"^## ", README, flags=re.M)
    body = next(p for p in part if p.startswith(section + "\n"))
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


def test_the_python_example_opens_stores_looks_up_retrieves_and_closes() -> None:
    [block] = python_blocks("Use it from Python")
    for call in ("open_engine(", ".store(", ".lookup(", ".retrieve(", ".close()"):
        assert call in block
    module = types.ModuleType("readme_use_it_from_python")
    sys.modules[module.__name__] = module
    try:
        exec(compile(block, "README.md:Use it from Python", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    engine = module.__dict__["engine"]
    assert len(engine.storage.tiers[0]) == 0  # closed: the tier let go of its chunks
    assert module.__dict__["result"].num_tokens == 768


def test_the_architecture_page_shows_open_engine_with_its_model_name() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    calls = re.findall(r"open_engine\(([^)]*)\)", page)
    assert calls and all("model_name" in call for call in calls), calls


@pytest.mark.parametrize("section", ["Use it from transformers"])
def test_the_other_examples_at_least_compile(section: str) -> None:
    for block in python_blocks(section):
        compile(block, f"README.md:{section}", "exec")
