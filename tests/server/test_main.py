"""The options ``lmkv server`` takes (``add_server_arguments``), and shared-memory set-up."""

from __future__ import annotations

import argparse

import pytest

from lmkv.base.errors import LMKVError
from lmkv.config.model import load_config
from lmkv.server.main import (
    add_server_arguments,
    build_storage,
    endpoint_of,
    listen_endpoint,
)

pytestmark = pytest.mark.slow  # real lmkv server processes


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    return parser.parse_args(argv)


def test_by_default_the_server_listens_where_only_this_user_reaches(monkeypatch,
                                                                    tmp_path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    args = parse()
    assert args.config is None and args.max_request_bytes == 256 << 20
    assert listen_endpoint(args) == f"ipc://{tmp_path}/lmkv/server.sock"
    assert load_config(env={}).server.address == listen_endpoint(args)  # clients agree
    assert listen_endpoint(parse("--socket", "s.sock")).endswith("/s.sock")
    assert listen_endpoint(parse("--port", "7000")) == "tcp://127.0.0.1:7000"
    assert listen_endpoint(parse("--host", "127.0.0.2")) == "tcp://127.0.0.2:5555"
    assert endpoint_of("::1", 7) == "tcp://[::1]:7"
    with pytest.raises(LMKVError, match="two places to listen"):
        listen_endpoint(parse("--socket", "s.sock", "--port", "7000"))


def test_sizes_and_times_are_parsed_and_checked(capsys) -> None:
    args = parse("--max-request-bytes", "64MiB", "--session-timeout", "2.5", "--port", "0")
    assert (args.max_request_bytes, args.session_timeout, args.port) == (64 << 20, 2.5, 0)
    assert parse("--drain-timeout", "0").drain_timeout == 0  # 0: do not wait
    for bad in (["--max-request-bytes", "lots"], ["--port", "70000"],
                ["--session-timeout", "0"], ["--drain-timeout", "-1"]):
        with pytest.raises(SystemExit) as info:
            parse(*bad)
        assert info.value.code == 2
        assert bad[1] in capsys.readouterr().err


def test_the_memory_tier_gets_shared_memory_unless_the_config_says_otherwise() -> None:
    tiers = [{"type": "cpu", "options": {"max_bytes": "1MiB"}},
             {"type": "cpu", "options": {"max_bytes": "2MiB"}}]
    config = load_config(env={}, overrides={"tiers": tiers})
    storage = build_storage(config)
    try:
        first, second = storage.tiers
        assert first.shared_segment is not None and second.shared_segment is None
        assert [t.options for t in config.tiers] == [t["options"] for t in tiers]  # not edited
    finally:
        storage.close()
    explicit = load_config(env={}, overrides={"tiers": [
        {"type": "cpu", "options": {"max_bytes": "1MiB", "shared_memory": False}}]})
    storage = build_storage(explicit)
    try:
        assert storage.tiers[0].shared_segment is None
    finally:
        storage.close()


def test_without_room_for_a_segment_the_server_keeps_a_private_arena(monkeypatch,
                                                                      caplog) -> None:
    monkeypatch.setattr("lmkv.memory.shm._free_shm_bytes", lambda: 0)
    monkeypatch.setattr("lmkv.memory.shm.huge_pages", lambda: None)  # none reserved either
    config = load_config(env={}, overrides={"tiers": [{"type": "cpu",
                                                       "options": {"max_bytes": "1MiB"}}]})
    storage = build_storage(config)
    try:
        assert storage.tiers[0].shared_segment is None
        assert "the arena stays in private memory" in caplog.text
    finally:
        storage.close()
    demanded = load_config(env={}, overrides={"tiers": [
        {"type": "cpu", "options": {"max_bytes": "1MiB", "shared_memory": True}}]})
    with pytest.raises(LMKVError, match="shared memory"):
        build_storage(demanded)


def _wait_for(path, text: str, proc, timeout_s: float = 90.0) -> str:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log = path.read_text()
        if text in log or proc.poll() is not None:
            return log
        time.sleep(0.1)
    return path.read_text()


@pytest.mark.parametrize("command", [["-m", "lmkv", "server"], ["-m", "lmkv.server"]])
def test_server_takes_log_level_and_logs_listening_and_stopped(tmp_path, command) -> None:
    import os
    import subprocess
    import sys

    cfg = tmp_path / "c.yaml"
    cfg.write_text("tiers: [{type: cpu, options: {max_bytes: 16MiB, shared_memory: false}}]\n")
    sock = tmp_path / "run" / "s.sock"
    log = tmp_path / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMKV_")}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, *command, "--log-level", "DEBUG",
                                 "--config", str(cfg), "--socket", str(sock)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        text = _wait_for(log, "listening on", proc)
        (line,) = [x for x in text.splitlines() if "listening on" in x]
        assert f"listening on ipc://{sock}" in line
        assert "tiers: cpu (16.0 MiB); arena: 16.0 MiB, inline data path only" in line
        proc.terminate()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = log.read_text().splitlines()
    assert "Traceback" not in log.read_text()
    assert f"INFO lmkv.server.main: lmkv server ipc://{sock}: stopped" in lines


def test_server_log_level_defaults_to_info_and_rejects_nonsense() -> None:
    args = parse("--log-level", "debug")
    assert args.log_level == "DEBUG"
    assert not hasattr(parse(), "log_level")  # never hides `lmkv --log-level X server`
