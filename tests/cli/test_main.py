from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.slow  # lmkv commands in processes, the demo's model


def test_demo_runs_and_reports_identical_output() -> None:
    pytest.importorskip("transformers")
    result = run_cli("demo", "--preset", "tiny", "--prompts", "2", "--prefix-tokens", "512",
                     "--suffix-tokens", "64", "--new-tokens", "4")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "generated tokens identical    : yes" in out
    assert "reused KV vs computed KV      : bit-identical" in out
    assert "[warm 2/2]" in out and "reused 560 tokens" in out  # 35 whole 16-token blocks
    assert "speedup" in out


@pytest.mark.parametrize("args,expected", [
    (["demo", "--prompts", "0"], "--prompts = 0: must be a positive integer"),
    (["demo", "--preset", "tiny", "--heads", "3"], "--heads = 3 must be a multiple of"),
    (["demo", "--preset", "tiny", "--kv-heads", "0"], "--kv-heads = 0: must be a positive"),
    (["demo", "--preset", "tiny", "--layers", "-1"], "--layers = -1: must be a positive"),
    (["demo", "--preset", "tiny", "--hidden-size", "7"],
     "--hidden-size = 7 must be a multiple of --heads = 4"),
    (["demo", "--preset", "tiny", "--head-dim", "3"], "--head-dim = 3: must be even"),
])
def test_bad_demo_arguments_are_one_line(args: list[str], expected: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("lmkv: error: ")
    assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_demo_with_prompts_shorter_than_a_chunk_reuses_their_whole_blocks() -> None:
    pytest.importorskip("transformers")
    result = run_cli("demo", "--preset", "tiny", "--prompts", "1", "--prefix-tokens", "200",
                     "--suffix-tokens", "8", "--new-tokens", "2")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "[warm 1/1]" in result.stdout and "reused 192 tokens" in result.stdout  # 12 blocks
    assert "generated tokens identical    : yes" in result.stdout


def test_demo_with_prompts_of_one_block_runs_and_says_so() -> None:
    pytest.importorskip("transformers")
    result = run_cli("demo", "--preset", "tiny", "--prompts", "1", "--prefix-tokens", "10",
                     "--suffix-tokens", "6", "--new-tokens", "2")
    assert result.returncode == 0, result.stderr
    assert "prompts of 16 tokens are no longer than a block of 16 tokens" in result.stdout
    assert "[warm 1/1]" in result.stdout and "reused 0 tokens" in result.stdout
    assert "generated tokens identical    : yes" in result.stdout


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
    nowhere = {"LMKV_SERVER__ADDRESS": "tcp://127.0.0.1:1"}  # the config's tiers, opened here
    result = run_cli("stats", "--config", str(cfg), env=nowhere)
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip()
    assert line.startswith("tier 0 (cpu): usage 0.0 MiB of 64.0 MiB, 0 entries;")
    for counter in ("hits", "misses", "puts", "bytes_in", "bytes_out", "evictions", "errors",
                    "dropped_writes", "corrupt_frames"):
        assert f"{counter}=0" in line
    as_json = run_cli("stats", "--config", str(cfg), "--json", env=nowhere)
    assert '"capacity_bytes": 67108864' in as_json.stdout


def test_version() -> None:
    """The package's version (the changelog's latest release, pyproject's) and the
    plugin API."""
    import re

    import tomllib

    import lmkv

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert lmkv.__version__ == project["version"]
    released = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", (root / "CHANGELOG.md").read_text(),
                          flags=re.M)
    assert released and released[0] == lmkv.__version__
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == \
        f"lmkv {lmkv.__version__} (plugin API 2.2, storage_backend 2.3, offload_policy 2.0, " \
        "serializer 2.0)"


def test_help_and_the_parser_import_no_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, lmkv.cli; lmkv.cli.commands.build_parser(); "
            "heavy = [m for m in ('torch', 'transformers', 'numpy', 'zmq') if m in sys.modules]; "
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert run_cli("--help").returncode == 0


def test_public_names_still_import_from_lmkv() -> None:
    import lmkv
    from lmkv import Engine, StorageManager, load_config, open_engine  # noqa: F401
    from lmkv.engines import Engine as EngineProtocol
    from lmkv.engines import open_engine as open_engine_here

    assert Engine is EngineProtocol and open_engine is open_engine_here
    for name in lmkv.__all__:
        assert getattr(lmkv, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = lmkv.nope


def test_stats_asks_a_running_server_for_live_figures(tmp_path) -> None:
    import json
    import signal

    from tests.server.procs import chunk_for, prompt_keys, start_server

    srv = start_server(tmp_path)
    try:
        keys = prompt_keys(7, chunks=3)
        with srv.client() as client:
            assert client.store(keys, [chunk_for(k) for k in keys]) == 3
        result = run_cli("stats", "--server", srv.address, "--json")
        assert result.returncode == 0, result.stderr
        data = json.loads(result.stdout)
        assert data["live"] is True and data["server"] == srv.address
        (tier,) = data["tiers"]
        assert (tier["type"], tier["entries"], tier["puts"]) == ("cpu", 3, 3)
        assert data["server_stats"]["requests"] >= 1

        cfg = tmp_path / "points-at-it.yaml"  # the default address is the config's
        cfg.write_text(f"server: {{address: '{srv.address}'}}\n")
        table = run_cli("stats", "--config", str(cfg))
        assert table.returncode == 0, table.stderr
        assert table.stdout.startswith(f"server {srv.address}: sessions=")
        assert "tier 0 (cpu):" in table.stdout and "3 entries" in table.stdout
        assert table.stderr == ""
    finally:
        assert srv.stop(signal.SIGTERM) == 0


def test_stats_of_a_server_named_on_the_command_line_that_is_not_there_is_one_line(
        tmp_path) -> None:
    from tests.server.procs import free_port

    cfg = tmp_path / "c.yaml"
    cfg.write_text("tiers: [{type: cpu, options: {max_bytes: 64MiB}}]\n")
    address = f"tcp://127.0.0.1:{free_port()}"
    result = run_cli("stats", "--config", str(cfg), "--server", address)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == f"lmkv: error: no lmkv server answers at {address}"
    assert result.stdout == ""  # no tier figures of anything else in its place


def test_stats_says_in_one_line_when_nothing_live_answers_at_the_configs_address(
        tmp_path) -> None:
    from tests.server.procs import free_port

    cfg = tmp_path / "c.yaml"
    address = f"tcp://127.0.0.1:{free_port()}"
    cfg.write_text("tiers: [{type: cpu, options: {max_bytes: 64MiB}}]\n"
                   f"server: {{address: '{address}'}}\n")
    result = run_cli("stats", "--config", str(cfg))
    assert result.returncode == 0, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"lmkv: no lmkv server answers at {address}: "
                           "nothing live to show")
    assert result.stdout.startswith("tier 0 (cpu): usage 0.0 MiB of 64.0 MiB, 0 entries;")
