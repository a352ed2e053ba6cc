from __future__ import annotations

import os
import pwd
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmkv.base.errors import ConfigError
from lmkv.config.model import LookupConfig
from lmkv.engines.local import LocalEngine
from lmkv.lookup import LookupClient, LookupEndpoints, LookupResponder, default_runtime_dir
from tests.lookup.conftest import CHUNK
from tests.lookup.worker_proc import make_engine


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


# -- closed by default: the runtime directory and the socket files -------------

def _nobody_uid() -> int:
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return 65534


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A private directory with a short path (unix socket paths are short)."""
    path = Path(tempfile.mkdtemp(prefix="lmkv-t-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def engine() -> Iterator[LocalEngine]:
    engine = make_engine(CHUNK, 1 << 20, rank=0)
    yield engine
    engine.close()


def test_a_new_runtime_dir_is_owner_only_and_so_are_the_sockets(short_dir: Path,
                                                                 engine) -> None:
    runtime_dir = short_dir / "new" / "lmkv"
    endpoints = LookupEndpoints.ipc("closed", 1, runtime_dir)
    with LookupResponder.for_rank(engine, endpoints, 0), LookupClient(endpoints):
        assert stat.S_IMODE(runtime_dir.stat().st_mode) == 0o700
        sockets = sorted(runtime_dir.iterdir())
        assert [p.name for p in sockets] == ["lmkv-lookup-closed-0.sock",
                                             "lmkv-lookup-closed-responses.sock"]
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in sockets)


@pytest.mark.parametrize("setup,problem", [
    (lambda d: d.chmod(0o777), "mode 0777: writable by group or others"),
    (lambda d: d.chmod(0o1777), "mode 1777: writable by group or others"),
    (lambda d: d.chmod(0o720), "mode 0720: writable by group or others"),
    (lambda d: os.chown(d, _nobody_uid(), -1), "is owned by uid"),
])
def test_a_runtime_dir_someone_else_could_control_is_refused(short_dir: Path, engine, setup,
                                                             problem) -> None:
    runtime_dir = short_dir / "precreated"
    runtime_dir.mkdir(mode=0o700)
    setup(runtime_dir)  # as a second local user would have made it, first
    endpoints = LookupEndpoints.ipc("victim", 1, runtime_dir)
    for start in (lambda: LookupResponder.for_rank(engine, endpoints, 0),
                  lambda: LookupClient(endpoints)):
        with pytest.raises(ConfigError, match=problem) as refused:
            start()
        message = str(refused.value)
        assert "\n" not in message and str(runtime_dir) in message
    assert list(runtime_dir.iterdir()) == []  # nothing was bound there


def test_a_runtime_dir_that_is_a_link_or_a_file_is_refused(short_dir: Path) -> None:
    target = short_dir / "elsewhere"
    target.mkdir(mode=0o700)
    (short_dir / "link").symlink_to(target)
    (short_dir / "file").write_text("")
    for name, problem in (("link", "symbolic link"), ("file", "not a directory")):
        with pytest.raises(ConfigError, match=problem):
            LookupClient(LookupEndpoints.ipc("e", 1, short_dir / name))


def test_the_client_refuses_to_connect_into_a_foreign_dir(short_dir: Path) -> None:
    mine, theirs = short_dir / "mine", short_dir / "theirs"
    mine.mkdir(mode=0o700)
    theirs.mkdir(mode=0o700)
    os.chown(theirs, _nobody_uid(), -1)
    endpoints = LookupEndpoints((f"ipc://{theirs}/w0.sock",), f"ipc://{mine}/r.sock")
    with pytest.raises(ConfigError, match="is owned by uid"):
        LookupClient(endpoints)


def test_tcp_binds_loopback_by_default() -> None:
    assert LookupEndpoints.tcp(1, base_port=7000).requests == ("tcp://127.0.0.1:7000",)
    config = LookupConfig(transport="tcp", base_port=7000)
    assert LookupEndpoints.from_config(config, "e", 1).responses == "tcp://127.0.0.1:7001"
