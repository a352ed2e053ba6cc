"""benchmarks/before_after.py reads each benchmark's figures under distinct names."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "before_after.py"
_spec = importlib.util.spec_from_file_location("before_after", _PATH)
before_after = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(before_after)

PAGED = """
[cpu layout, 512 tokens, 4 MiB, 128-token blocks] ms (memcpy time / time)
  consecutive block table: memcpy 0.31, one contiguous copy per chunk and layer 0.41 (0.75)
    to_chunks  : before   0.87 (0.36)  after   0.54 (0.57)  1.6x faster
  shuffled block table: memcpy 0.31, one contiguous copy per chunk and layer 0.41 (0.76)
    to_chunks  : before   0.86 (0.36)  after   0.52 (0.58)  1.6x faster

[cpu layout, 2048 tokens, 16 MiB, 128-token blocks] ms (memcpy time / time)
  consecutive block table: memcpy 1.61, one contiguous copy per chunk and layer 1.75 (0.92)
    to_chunks  : before   3.42 (0.47)  after   1.92 (0.84)  1.8x faster
"""

CORE = """
[small model] 2048 chunks of 0.25 MiB (2, 2, 256, 2, 64) bf16
  torch copy_ baseline :   6.12 GB/s      23329 chunks/s
  store (alloc+copy+put):   5.91 GB/s      22538 chunks/s  ratio 0.97

[lookup] 128 chunks (32,768 tokens) in the cpu tier (target < 1 ms)
  keys already hashed   : median 0.012 ms
"""


def test_nested_and_named_figures_get_their_own_names() -> None:
    found = before_after.figures(PAGED)
    small = "[cpu layout, 512 tokens, 4 MiB, 128-token blocks]"
    assert found[f"{small} consecutive block table / to_chunks after"] == (0.54, "ms")
    assert found[f"{small} shuffled block table / to_chunks after"] == (0.52, "ms")
    assert found[f"{small} consecutive block table / to_chunks before"] == (0.87, "ms")
    big = "[cpu layout, 2048 tokens, 16 MiB, 128-token blocks]"
    assert found[f"{big} consecutive block table / to_chunks after"] == (1.92, "ms")


def test_plain_figure_lines_keep_their_names() -> None:
    found = before_after.figures(CORE)
    assert found["[small model] torch copy_ baseline"] == (6.12, "GB/s")
    assert found["[small model] store (alloc+copy+put)"] == (5.91, "GB/s")
    assert found["[small model] store (alloc+copy+put) (ratio)"] == (0.97, "x")
    assert found["[lookup] keys already hashed"] == (0.012, "ms")


READ = """
[read path, cpu] StorageManager, 32 chunks of 0.25 MiB; median per call
  get                        : median     231.2 us  ratio 0.33
"""


def test_the_numbers_describing_a_section_are_not_figures() -> None:
    assert before_after.figures(READ) == {"[read path, cpu] get": (231.2, "us"),
                                          "[read path, cpu] get (ratio)": (0.33, "x")}
    assert set(before_after.figures(CORE)) == {
        "[small model] torch copy_ baseline", "[small model] store (alloc+copy+put)",
        "[small model] store (alloc+copy+put) (ratio)", "[lookup] keys already hashed"}
