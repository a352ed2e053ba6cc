from __future__ import annotations

from pathlib import Path

import pytest

from lmkv.lookup import LookupEndpoints, default_runtime_dir


def test_ipc_endpoints_follow_the_documented_scheme(tmp_path: Path) -> None:
    endpoints = LookupEndpoints.ipc("eng-7", 2, tmp_path)
    assert endpoints.requests == (f"ipc://{tmp_path}/lmkv-lookup-eng-7-0.sock",
                                  f"ipc://{tmp_path}/lmkv-lookup-eng-7-1.sock")
    assert endpoints.responses == f"ipc://{tmp_path}/lmkv-lookup-eng-7-responses.sock"
    assert endpoints.world_size == 2
    assert LookupEndpoints.ipc("e", 1, "relative").requests[0].startswith("ipc:///")


def test_the_default_runtime_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_runtime_dir() == tmp_path / "lmkv"
    assert LookupEndpoints.ipc("e", 1).responses.startswith(f"ipc://{tmp_path}/lmkv/")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_runtime_dir().name.startswith("lmkv-")


def test_tcp_endpoints_use_consecutive_ports() -> None:
    endpoints = LookupEndpoints.tcp(2, base_port=7000, host="10.0.0.5")
    assert endpoints.requests == ("tcp://10.0.0.5:7000", "tcp://10.0.0.5:7001")
    assert endpoints.responses == "tcp://10.0.0.5:7002"


@pytest.mark.parametrize("make,message", [
    (lambda: LookupEndpoints.ipc("a/b", 1, "/tmp"), "engine_id 'a/b'"),
    (lambda: LookupEndpoints.ipc("e", 0, "/tmp"), "world_size 0"),
    (lambda: LookupEndpoints.ipc("e", 1, "/tmp/" + "d" * 120), "unix sockets allow"),
    (lambda: LookupEndpoints.tcp(2, base_port=65535), "needs 3 ports"),
    (lambda: LookupEndpoints(("udp://x:1",), "tcp://h:1"), "ipc:// or tcp://"),
    (lambda: LookupEndpoints(("tcp://host",), "tcp://h:1"), "need a port"),
    (lambda: LookupEndpoints((), "tcp://h:1"), "at least one worker"),
])
def test_bad_addresses_are_refused_with_a_reason(make, message) -> None:
    with pytest.raises(ValueError, match=message):
        make()
