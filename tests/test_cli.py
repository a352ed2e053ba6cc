from __future__ import annotations

import pytest

from tests.conftest import run_cli


def test_demo_runs_and_reports_identical_output() -> None:
    pytest.importorskip("transformers")
    result = run_cli("demo", "--preset", "tiny", "--prompts", "2", "--prefix-tokens", "512",
                     "--suffix-tokens", "64", "--new-tokens", "4")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "generated tokens identical    : yes" in out
    assert "reused KV vs computed KV      : bit-identical" in out
    assert "[warm 2/2]" in out and "reused 512 tokens" in out
    assert "speedup" in out


@pytest.mark.parametrize("args,expected", [
    (["demo", "--prompts", "0"], "--prompts = 0: must be a positive integer"),
    (["demo", "--preset", "tiny", "--heads", "3"], "--heads = 3 must be a multiple of"),
])
def test_bad_demo_arguments_are_one_line(args: list[str], expected: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("lmkv: error: ")
    assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_bad_log_level_env_is_one_line() -> None:
    result = run_cli("plugins", env={"LMKV_LOG_LEVEL": "verbose"})
    assert result.returncode == 2
    assert result.stderr.strip() == ("lmkv: error: LMKV_LOG_LEVEL = 'VERBOSE': allowed: DEBUG, "
                                     "INFO, WARNING, ERROR")


def test_bad_config_file_for_the_demo(tmp_path) -> None:
    cfg = tmp_path / "x.yaml"
    cfg.write_text("tiers: [{type: cpu, options: {max_bytes: -5}}]\n")
    result = run_cli("demo", "--preset", "tiny", "--config", str(cfg))
    assert result.returncode == 2
    assert "tiers.0.options.max_bytes" in result.stderr
    assert "Traceback" not in result.stderr


def test_stats_prints_every_counter_of_every_tier(tmp_path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("tiers: [{type: cpu, options: {max_bytes: 64MiB}}]\n")
    result = run_cli("stats", "--config", str(cfg))
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip()
    assert line.startswith("tier 0 (cpu): usage 0.0 MiB of 64.0 MiB, 0 entries;")
    for counter in ("hits", "misses", "puts", "bytes_in", "bytes_out", "evictions", "errors",
                    "dropped_writes", "corrupt_frames"):
        assert f"{counter}=0" in line
    as_json = run_cli("stats", "--config", str(cfg), "--json")
    assert '"capacity_bytes": 67108864' in as_json.stdout


def test_version() -> None:
    import lmkv

    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"lmkv {lmkv.__version__}"


def test_help_and_the_parser_import_no_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, lmkv.cli; lmkv.cli.build_parser(); "
            "heavy = [m for m in ('torch', 'transformers', 'numpy', 'zmq') if m in sys.modules]; "
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert run_cli("--help").returncode == 0


def test_public_names_still_import_from_lmkv() -> None:
    import lmkv
    from lmkv import CacheEngine, StorageManager, load_config  # noqa: F401
    from lmkv.engine import CacheEngine as Engine

    assert CacheEngine is Engine
    for name in lmkv.__all__:
        assert getattr(lmkv, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = lmkv.nope
