"""``lmkv replay`` end to end: the table, --json, --plot, progress, one-line errors."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from lmkv.cli.commands import main
from lmkv.replay import report
from tests.conftest import run_cli

Writer = Callable[[Sequence[Sequence[int]]], Path]
REQUESTS = [[1, 2, 3], [1, 2, 4], [5, 6], [1, 2, 3], [5, 6, 7], [1, 9]]  # 8 unique chunks


def test_json_rows_per_policy_and_capacity(mooncake: Writer,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = mooncake(REQUESTS)
    assert main(["replay", str(path), "--capacity", "34%,100%", "--policies", "lru",
                 "--bytes-per-token", "1KiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["format"], out["requests"], out["unique_chunks"], out["chunk_requests"]) \
        == ("mooncake", 6, 8, 16)
    assert out["model"] == {"bytes_per_token": 1024, "chunk_bytes": 512 * 1024}
    assert [(r["policy"], r["capacity"], r["capacity_chunks"]) for r in out["rows"]] \
        == [("lru", "34%", 2), ("lru", "100%", 8)]
    full = out["rows"][1]
    assert full["hits"] == 16 - 8 and full["belady_hits"] == 16 - 8
    assert full["hit_ratio"] == pytest.approx(8 / 16) and full["of_optimum"] == 1.0
    (tier,) = full["tiers"]
    assert tier["type"] == "cpu" and tier["chunks_written"] == 8
    assert tier["bytes_written"] == 8 * 512 * 1024
    assert tier["bytes_read"] == 8 * 512 * 1024
    small = out["rows"][0]
    assert small["belady_hit_ratio"] >= small["hit_ratio"]


def test_every_installed_policy_by_default(mooncake: Writer,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    from lmkv.plugins.manager import get_plugin_manager

    installed = get_plugin_manager().registry.names("eviction_policy")
    assert main(["replay", str(mooncake(REQUESTS)), "--capacity", "50%", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["policy"] for r in rows] == installed


def test_the_table_names_the_scaling(mooncake: Writer,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(mooncake(REQUESTS)), "--capacity", "50%,1GiB",
                 "--policies", "LRU"]) == 0
    out = capsys.readouterr().out
    assert "128 KiB a token; a chunk is 64 MiB (the tiers ran on 4 KiB chunks" in out
    header = next(line for line in out.splitlines() if line.startswith("POLICY"))
    assert "BELADY" in header and "OF OPTIMUM" in header and "T0 cpu WRITTEN" in header
    rows = [line.split() for line in out.splitlines() if line.startswith("lru ")]
    assert [r[1] for r in rows] == ["50%", "1GiB"]
    assert rows[1][2] == "16"  # 1 GiB holds 16 chunks of 64 MiB


def test_token_traces_take_the_chunk_size_flag(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("[1, 2, 3, 4, 5, 6, 7, 8]\n[1, 2, 3, 4, 9, 9, 9, 9]\n")
    assert main(["replay", str(path), "--chunk-size", "4", "--capacity", "100%",
                 "--policies", "lru", "--layers", "2", "--kv-heads", "1", "--head-dim", "4",
                 "--dtype", "float32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["format"] == "tokens" and out["tokens_per_chunk"] == 4
    assert out["model"]["bytes_per_token"] == 2 * 1 * 4 * 2 * 4
    assert out["rows"][0]["hits"] == 1 and out["rows"][0]["chunk_requests"] == 4


def test_plot_writes_a_png(mooncake: Writer, tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "hits.png"
    assert main(["replay", str(mooncake(REQUESTS)), "--capacity", "20%,50%,100%",
                 "--policies", "lru", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {png}" in capsys.readouterr().out


def test_plot_without_matplotlib_names_the_extra(
        mooncake: Writer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(report.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else object())
    assert main(["replay", str(mooncake(REQUESTS)), "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["lmkv: error: --plot needs matplotlib, which is not installed: "
                   "pip install 'lmkv[plot]'"]


@pytest.mark.slow  # the lmkv command in a process
def test_a_real_process_keeps_stdout_json_only(mooncake: Writer) -> None:
    done = run_cli("replay", str(mooncake(REQUESTS)), "--capacity", "50%", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rows"]
    assert "Traceback" not in done.stderr


def test_help_says_how_bytes_are_scaled() -> None:
    done = run_cli("replay", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "4 KiB chunks" in text and "model's size" in text and "lmkv[plot]" in text


def test_a_policy_that_cannot_be_built_is_skipped_the_others_finish(
        mooncake: Writer, capsys: pytest.CaptureFixture[str]) -> None:
    from lmkv.contracts import PluginOptions, hookimpl
    from lmkv.testing import plugin_class, registered_plugin

    lru = plugin_class("eviction_policy", "lru")

    class Boom(lru):  # type: ignore[misc, valid-type]
        name, api_version = "boom", "2.0"

        def __init__(self, options=None, context=None):
            raise RuntimeError("no")

    class PickyOptions(PluginOptions):
        period: int

    class Picky(lru):  # type: ignore[misc, valid-type]
        name, api_version, Options = "picky", "2.0", PickyOptions

    class Plugin:
        @hookimpl
        def lmkv_eviction_policies(self):
            return [Boom, Picky]

    with registered_plugin(Plugin()):
        assert main(["replay", str(mooncake(REQUESTS)), "--capacity", "50%", "--json",
                     "--policies", "boom,lru,picky"]) == 0
    out = capsys.readouterr()
    assert [r["policy"] for r in json.loads(out.out)["rows"]] == ["lru"]
    skipped = [line for line in out.err.splitlines() if "skipped" in line]
    assert len(skipped) == 2 and "RuntimeError: no" in skipped[0]
    assert "'tiers.0.eviction.options.period': required" in skipped[1]
