"""The ``fs`` tier against a hostile directory: special files, crafted frames, modes."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from lmkv.base.errors import ConfigError
from lmkv.contracts.serde import write_header
from lmkv.keys.chunking import CacheKey
from lmkv.memory import MemoryAllocator, tensor_obj
from lmkv_backends.serde.naive import NaiveSerializer
from lmkv_backends.serde.zstd import ZstdSerializer
from lmkv_backends.tiers.fs import FSBackend
from lmkv_backends.tiers.fs_index import entry_name
from tests.backends.test_fs import chunk, key, make_fs, put, read

# Bounds a read that a FIFO would block: liveness, not timing.
READ_DEADLINE_S = 10.0


def special(kind: str, path: Path, tmp_path: Path) -> None:
    """Put a ``kind`` of non-entry under ``path``."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
        (path / "inner").write_bytes(b"x" * 4096)
    elif kind == "symlink to a valid frame":
        target = tmp_path.parent / f"{tmp_path.name}-outside.lmkv"
        target.write_bytes(NaiveSerializer().frame_bytes(tensor_obj(chunk(99)), key(7)))  # bound,
        # but not key 7's KV
        path.symlink_to(target)
    elif kind == "symlink to a fifo":
        target = tmp_path.parent / f"{tmp_path.name}-outside.fifo"
        os.mkfifo(target)
        path.symlink_to(target)
    elif kind == "socket":
        os.mknod(path, stat.S_IFSOCK | 0o600)  # a bound socket's name is too long here
    else:
        raise AssertionError(kind)


def read_within_deadline(backend: FSBackend, i: int) -> torch.Tensor | None:
    result: list[torch.Tensor | None] = []
    thread = threading.Thread(target=lambda: result.append(read(backend, i)), daemon=True)
    thread.start()
    thread.join(READ_DEADLINE_S)
    assert not thread.is_alive(), "a read blocked on a special file"
    return result[0]


@pytest.fixture
def arena() -> Iterator[MemoryAllocator]:
    arena = MemoryAllocator(16 << 20)
    yield arena
    assert arena.live_objects == 0, "a chunk buffer was leaked"


@pytest.fixture
def make(tmp_path: Path, arena: MemoryAllocator) -> Iterator[Callable[..., FSBackend]]:
    made: list[FSBackend] = []

    def factory(**options: object) -> FSBackend:
        options.setdefault("url", str(tmp_path / "tier"))
        backend = make_fs(arena=arena, **options)
        made.append(backend)
        return backend

    yield factory
    for backend in made:
        backend.close()


SPECIALS = ["fifo", "directory", "symlink to a valid frame", "symlink to a fifo", "socket"]


@pytest.mark.parametrize("kind", SPECIALS)
@pytest.mark.parametrize("raw", [True, False])
def test_a_special_file_under_an_entry_name_is_never_a_hit(
        kind: str, raw: bool, make: Callable[..., FSBackend], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(NaiveSerializer, "raw_payload", raw)
    backend = make()
    root = tmp_path / "tier"
    special(kind, root / entry_name(key(7)), tmp_path)
    assert not backend.contains(key(7))
    assert backend.batched_async_contains("l", [key(7), key(8)]) == 0
    assert read_within_deadline(backend, 7) is None
    assert backend.stats()["special_files"] >= 1
    assert backend.stats()["hits"] == 0
    assert os.path.lexists(root / entry_name(key(7)))  # left alone
    # A put under that name is dropped (not ours to replace), the rest works.
    assert put(backend, [7, 8]) == 1
    assert torch.equal(read(backend, 8), chunk(8))


@pytest.mark.parametrize("kind", SPECIALS)
def test_special_files_found_at_start_are_skipped_and_counted(
        kind: str, make: Callable[..., FSBackend], tmp_path: Path) -> None:
    root = tmp_path / "tier"
    root.mkdir(mode=0o700)
    special(kind, root / entry_name(key(7)), tmp_path)
    backend = make()
    assert len(backend.index) == 0 and backend.stats()["special_files"] == 1
    assert backend.batched_async_contains("l", [key(7)]) == 0


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink to a valid frame"])
def test_an_indexed_entry_replaced_by_a_special_file_stops_hitting(
        kind: str, make: Callable[..., FSBackend], tmp_path: Path) -> None:
    backend = make()
    put(backend, [7])
    path = tmp_path / "tier" / entry_name(key(7))
    path.unlink()
    special(kind, path, tmp_path)
    assert read_within_deadline(backend, 7) is None  # the index still named it
    for _ in range(3):  # never again, not "hits forever"
        assert not backend.contains(key(7))
        assert backend.batched_async_contains("l", [key(7)]) == 0
        assert read_within_deadline(backend, 7) is None
    assert backend.stats()["special_files"] >= 1 and backend.stats()["hits"] == 0


# -- crafted frames ---------------------------------------------------------------------

CRAFTED_SHAPES = [
    (2**40, 2**40, 0),  # zero elements, numel overflows a view
    (0,),
    (2**62, 0),
    (3, 0, 5),
    (2**63 - 1, 0, 2**63 - 1),
]


def crafted_frame(serializer: object, shape: tuple[int, ...], dtype: torch.dtype,
                  under: CacheKey) -> bytes:
    """A frame bound to ``under`` whose header checksums are right, with an absurd shape."""
    payload = b"\x01" if serializer.name == "zstd" else b""
    header = write_header(serializer.serializer_id, dtype, shape, payload, len(payload), under)
    return header + payload


@pytest.mark.parametrize("serializer_cls", [NaiveSerializer, ZstdSerializer])
@pytest.mark.parametrize("raw", [True, False])
def test_crafted_frames_never_leak_arena_blocks(serializer_cls: type, raw: bool,
                                                tmp_path: Path, arena: MemoryAllocator,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(NaiveSerializer, "raw_payload", raw)
    from lmkv.contracts.tier import BackendContext
    from lmkv_policies.lru import LRUPolicy

    serializer = serializer_cls()
    backend = FSBackend(FSBackend.Options(url=str(tmp_path / "tier"), durable=False),
                        BackendContext(serializer=serializer, eviction_policy=LRUPolicy(),
                                       allocate=arena.allocate))
    root = tmp_path / "tier"
    baseline = (arena.live_objects, arena.used_bytes)
    n = 2000
    for i in range(n):
        shape = CRAFTED_SHAPES[i % len(CRAFTED_SHAPES)]
        (root / entry_name(key(10_000 + i))).write_bytes(
            crafted_frame(serializer, shape, torch.float16, key(10_000 + i)))
    got = backend.batched_get_non_blocking("l", [key(10_000 + i) for i in range(n)])
    assert got.result(timeout=60) == []
    for i in range(n):
        assert read(backend, 10_000 + i) is None
    assert (arena.live_objects, arena.used_bytes) == baseline
    assert backend.stats()["corrupt_frames"] == n  # each removed at its first read
    assert not any(p.name.endswith(".lmkv") for p in root.iterdir())
    # The arena still serves a legitimate chunk.
    obj = tensor_obj(chunk(1))
    assert backend.batched_submit_put([key(1)], [obj]).result(timeout=30) == 1
    assert torch.equal(read(backend, 1), chunk(1))
    backend.close()


# -- permissions ---------------------------------------------------------------------------

def modes(root: Path) -> tuple[int, int]:
    entry = next(p for p in root.iterdir() if p.name.endswith(".lmkv"))
    return stat.S_IMODE(root.stat().st_mode), stat.S_IMODE(entry.stat().st_mode)


@pytest.fixture(params=[0o022, 0], ids=["umask 022", "umask 0"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def test_directories_are_0700_and_files_0600_by_default(
        umask: int, make: Callable[..., FSBackend], tmp_path: Path) -> None:
    url = tmp_path / "a" / "b" / "tier"
    put(make(url=str(url)), [1])
    assert modes(url) == (0o700, 0o600)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o700


def test_an_existing_directory_more_open_than_the_tier_is_reported(
        make: Callable[..., FSBackend], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """An older, looser directory is left as it is (it may be shared on purpose), and
    the start says what it exposes."""
    import logging

    root = tmp_path / "tier"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger="lmkv_backends"):
        make(url=str(root))
    assert "mode 0755, more open than the tier's 0700" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lmkv_backends"):
        make(url=str(tmp_path / "fresh"))
    assert "more open" not in caplog.text


@pytest.mark.parametrize(("mode", "expected"), [
    ("0640", (0o750, 0o640)), (0o660, (0o770, 0o660)), ("0o644", (0o755, 0o644)),
])
def test_the_mode_option_shares_on_purpose(mode: object, expected: tuple[int, int],
                                           umask: int, make: Callable[..., FSBackend],
                                           tmp_path: Path) -> None:
    put(make(mode=mode), [1])
    assert modes(tmp_path / "tier") == expected


@pytest.mark.parametrize("mode", ["0666x", "0777", "0604" + "0", "0400", "0646", True, 0o1600,
                                  "rw-r-----"])
def test_a_bad_mode_is_one_line_naming_the_key(mode: object) -> None:
    from lmkv.config.model import load_config

    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={"lmkv.tiers": [
            {"type": "cpu"}, {"type": "fs", "options": {"url": "/tmp/x", "mode": mode}}]})
    text = str(info.value)
    assert "\n" not in text and "tiers.1.options.mode" in text and '"0640"' in text


def test_mode_applies_to_local_directories_only() -> None:
    """Refused by the config itself, so ``lmkv config check`` says so too."""
    from lmkv.config.model import load_config
    with pytest.raises(ConfigError, match=r"tiers\.0\.options'.*mode applies to local"):
        load_config(env={}, overrides={"lmkv.tiers": [
            {"type": "fs", "options": {"url": "s3://bucket/p", "mode": "0640"}}]})


# -- secrets ---------------------------------------------------------------------------------

SECRET = "wJalrXUtnFEMI-s3cr3t"


def test_endpoint_credentials_never_show(arena: MemoryAllocator,
                                         caplog: pytest.LogCaptureFixture) -> None:
    """userinfo in endpoint_url, secret storage_options: not in a repr, a dump, a
    log line (the endpoint is down: botocore's message names the URL) or an error."""
    import logging
    import socket as socket_

    with socket_.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    endpoint = f"http://AKIDUSER:{SECRET}@127.0.0.1:{port}"
    options = FSBackend.Options(url="s3://bucket/p", endpoint_url=endpoint,
                                storage_options={"token": SECRET, "client_kwargs": {
                                    "aws_secret_access_key": SECRET}},
                                connect_timeout_s=0.5, read_timeout_s=0.5, retries=0)
    text = repr(options) + options.model_dump_json()
    assert SECRET not in text and "***" in text
    with caplog.at_level(logging.DEBUG):
        backend = make_fs("s3://bucket/p", arena, endpoint_url=endpoint, key="AKIDUSER",
                          secret=SECRET, connect_timeout_s=0.5, read_timeout_s=0.5, retries=0)
        try:
            assert not backend.contains(key(1))
            assert read(backend, 1) is None
        finally:
            backend.close()
    assert backend.counters.errors >= 1
    # lmkv's own lines (botocore's DEBUG logging prints its endpoint: not ours to mend)
    ours = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("lmkv"))
    assert "failed" in ours and SECRET not in ours


@pytest.mark.slow  # lmkv commands in processes
def test_config_errors_and_config_check_never_echo_secrets(tmp_path: Path) -> None:
    import subprocess
    import sys

    from lmkv.config.model import load_config

    for options in ({"url": "s3://b/p", "secret": 1234567890123456789},
                    {"url": "s3://b/p", "storage_options": {"password": SECRET}, "mode": 7},
                    {"url": "s3://b/p", "endpoint_url": f"http://u:{SECRET}@h", "retries": -1},
                    {"url": "s3://b/p", "key": ["AKIDSECRETLIST"]}):
        with pytest.raises(ConfigError) as info:
            load_config(env={}, overrides={"lmkv.tiers": [{"type": "cpu"},
                                                          {"type": "fs", "options": options}]})
        text = str(info.value)
        assert SECRET not in text and "1234567890123456789" not in text
        assert "AKIDSECRETLIST" not in text
    config = tmp_path / "lmkv.yaml"
    config.write_text(
        "tiers:\n  - type: cpu\n  - type: fs\n    options:\n      url: s3://b/p\n"
        f"      endpoint_url: http://AKID:{SECRET}@minio:9000\n      secret: {SECRET}\n"
        f"      storage_options: {{token: {SECRET}}}\n")
    proc = subprocess.run([sys.executable, "-m", "lmkv", "config", "check", str(config)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert SECRET not in proc.stdout + proc.stderr and "***" in proc.stdout


def test_a_serializer_that_skips_the_key_check_still_never_serves_a_moved_frame(
        tmp_path: Path, arena: MemoryAllocator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames are bound by the tier (``decode_frame``), not by each serializer's care:
    a third-party serializer that parses frames its own way is bound all the same."""
    class Careless(NaiveSerializer):
        raw_payload = False  # decoded through decode_frame

        def open_frame(self, frame, asked):  # type: ignore[no-untyped-def]
            return super().open_frame(frame, key(1))  # checks some key, not the one asked

    from lmkv.contracts.tier import BackendContext
    from lmkv_policies.lru import LRUPolicy
    backend = FSBackend(FSBackend.Options(url=str(tmp_path / "tier"), durable=False),
                        BackendContext(serializer=Careless(), eviction_policy=LRUPolicy(),
                                       allocate=arena.allocate))
    try:
        assert put(backend, [1, 2]) == 2
        root = tmp_path / "tier"
        (root / entry_name(key(2))).write_bytes((root / entry_name(key(1))).read_bytes())
        assert read(backend, 2) is None
        assert backend.stats()["corrupt_frames"] == 1
        assert torch.equal(read(backend, 1), chunk(1))
    finally:
        backend.close()
