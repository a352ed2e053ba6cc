"""benchmarks/bench_gpu.py where no GPU is: it says so and exits 0, and its
``--dry-run`` runs every section on CPU tensors (Triton interpreted), so the
script itself is exercised. Its figures are never asserted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # the benchmark in a process

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gpu.py"


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the script measures")
def test_without_a_gpu_it_says_so_and_exits_0() -> None:
    out = bench("--sections", "kernels")
    assert out.returncode == 0, out.stderr
    assert "needs a CUDA GPU" in out.stdout and "GB/s" not in out.stdout


def test_the_dry_run_runs_every_section_and_the_kernels_match() -> None:
    pytest.importorskip("triton", reason="Triton is not installed (scripts/setup.sh "
                                          "installs it)")
    out = bench("--dry-run")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MISMATCH" not in out.stdout
    for heading in ("== transfer", "== kernels", "== layerwise"):
        assert heading in out.stdout
    for layout in ("flash ", "flashinfer ", "cpu ", "mla ", "vllm "):
        assert f"\n  {layout}" in out.stdout
