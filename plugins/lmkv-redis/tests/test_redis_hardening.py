"""The redis tier against crafted values, bad URLs, hung servers; secrets never print."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from redis_helpers import chunk, get, key, put

from lmkv.contracts import ConfigError, KVSpec, MemoryAllocator, write_header
from lmkv.testing.engines import open_local_engine
from lmkv.testing.redis import RedisServer
from lmkv.testing.tiers import load_test_config
from lmkv_redis import RedisBackend, RedisOptions

pytestmark = pytest.mark.slow  # a real redis-server

MakeTier = Callable[..., RedisBackend]


def wait_for(condition: Callable[[], bool], deadline_s: float = 10.0) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


# -- empty and crafted values ----------------------------------------------------------

def test_an_empty_value_is_a_removed_counted_miss(redis_server: RedisServer,
                                                  make_tier: MakeTier) -> None:
    tier = make_tier(redis_server.url)
    server = redis_server.client()
    name = tier.connection.main_key(key(1))
    server.set(name, b"")
    assert tier.batched_async_contains("l", [key(1), key(2)]) == 0
    assert wait_for(lambda: not server.exists(name)), "the empty value stayed"
    # counted right after the delete, on the sweep's thread: wait for it too
    assert wait_for(lambda: tier.stats()["corrupt_frames"] == 1), tier.stats()
    put(tier, [1])
    assert torch.equal(get(tier, 1), chunk(1))


@pytest.mark.parametrize("value", [b"L", b"LMKV", b"LMKR", b"LMKR" + b"\0" * 12, b"\0" * 15])
def test_a_value_too_short_to_be_a_frame_is_a_removed_miss(
        value: bytes, redis_server: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(redis_server.url)
    server = redis_server.client()
    name = tier.connection.main_key(key(1))
    server.set(name, value)
    tier.batched_async_contains("l", [key(1)], pin=True)
    assert get(tier, 1) is None
    tier.unpin(key(1))
    assert not server.exists(name) and tier.stats()["corrupt_frames"] == 1


CRAFTED_SHAPES = [(2**40, 2**40, 0), (0,), (2**62, 0), (3, 0, 5)]


def test_crafted_frames_never_leak_arena_blocks(redis_server: RedisServer,
                                                make_tier: MakeTier,
                                                arena: MemoryAllocator) -> None:
    tier = make_tier(redis_server.url)
    server = redis_server.client()
    baseline = (arena.live_objects, arena.used_bytes)
    n = 2000
    pipe = server.pipeline(transaction=False)
    for i in range(n):
        shape = CRAFTED_SHAPES[i % len(CRAFTED_SHAPES)]
        name = tier.connection.main_key(key(10_000 + i))
        pipe.set(name, write_header(1, torch.float16, shape, b"", 0, key(10_000 + i)))
    pipe.execute()
    keys = [key(10_000 + i) for i in range(n)]
    for start in range(0, n, 100):  # prefix gets stop at the first miss: walk them all
        for k in keys[start:start + 100]:
            assert tier.get_blocking(k) is None
    assert tier.batched_get_non_blocking("l", keys).result(timeout=30) == []
    assert (arena.live_objects, arena.used_bytes) == baseline
    assert tier.stats()["corrupt_frames"] == n
    assert not server.keys(tier.options.key_prefix + "*")
    put(tier, [1])
    assert torch.equal(get(tier, 1), chunk(1))


# -- URLs --------------------------------------------------------------------------------

@pytest.mark.parametrize("url", [
    "redis://",
    "redis://:6379",
    "redis://host:99999/0",
    "redis://host:port/0",
    "redis://host:6379/db1",
    "redis://[::1/0",
    "unix://",
    "unix:///tmp/r.sock?db=x",
    "redis//host:6379",
    "http://host:6379",
])
def test_an_unusable_url_is_one_line_naming_the_key(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_test_config({"lmkv.tiers.1": {"type": "redis",
                                                        "options": {"url": url}}})
    text = str(info.value)
    assert "\n" not in text and "tiers.1.options.url" in text
    assert "redis://[[user]:password@]host[:port][/db]" in text


@pytest.mark.parametrize("url", ["redis://h", "redis://h:7000/3", "rediss://u:p@h:6380/0",
                                 "redis://[::1]:6379", "unix:///tmp/r.sock?db=2"])
def test_usable_urls_pass(url: str) -> None:
    assert RedisOptions(url=url).url == url


# -- secrets ------------------------------------------------------------------------------

SECRET = "hunter2-s3cr3t"


def test_passwords_never_show_in_reprs_dumps_or_config_errors() -> None:
    for url in (f"redis://user:{SECRET}@h:6379/0", f"redis://h:6379/0?password={SECRET}"):
        options = RedisOptions(url=url)
        text = repr(options) + options.model_dump_json() + str(options.model_dump(mode="json"))
        assert SECRET not in text and "***" in text
    bad = [{"url": f"redis://:{SECRET}@h:notaport/0"},
           {"url": f"redis://:{SECRET}@h:6379/0", "cluster": True, "tls_cert_file": "c"},
           {"password": 12345678901234, "url": "redis://h"},
           {"url": f"redis://h/0?password={SECRET}", "ttl_s": -1, "cluster": 3}]
    for options in bad:
        with pytest.raises(ConfigError) as info:
            load_test_config({"lmkv.tiers.1": {"type": "redis",
                                                            "options": options}})
        assert SECRET not in str(info.value) and "12345678901234" not in str(info.value)


def test_passwords_never_show_in_fault_logs(make_tier: MakeTier,
                                            caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    tier = make_tier(f"redis://user:{SECRET}@127.0.0.1:{port}/0?password={SECRET}",
                     retry_after_s=0)
    with caplog.at_level(logging.DEBUG):
        assert tier.batched_async_contains("l", [key(1)]) == 0
        assert get(tier, 1) is None
        tier.remove(key(1))
    assert tier.stats()["errors"] >= 1
    assert caplog.text and SECRET not in caplog.text and "***" in caplog.text


def test_config_check_and_stats_never_print_a_password(tmp_path: Path,
                                                       redis_server: RedisServer) -> None:
    url = redis_server.url.replace("redis://", f"redis://default:{SECRET}@")
    config = tmp_path / "lmkv.yaml"
    config.write_text(f"tiers:\n  - type: cpu\n  - type: redis\n    options:\n"
                      f"      url: {url}?password={SECRET}\n")
    for args in (["config", "check", str(config)], ["stats", "--config", str(config)]):
        proc = subprocess.run([sys.executable, "-m", "lmkv", *args], capture_output=True,
                              text=True, timeout=120)
        out = proc.stdout + proc.stderr
        assert SECRET not in out, args
    check = subprocess.run([sys.executable, "-m", "lmkv", "config", "check", str(config)],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and "***" in check.stdout


# -- a hung server never stalls a store ---------------------------------------------------

@pytest.fixture
def black_hole() -> Iterator[str]:
    """A redis URL whose server accepts connections and never answers."""
    sink = socket.socket()
    sink.bind(("127.0.0.1", 0))
    sink.listen(128)
    yield f"redis://127.0.0.1:{sink.getsockname()[1]}/0"
    sink.close()


def test_a_store_never_waits_on_a_hung_redis_tier(black_hole: str) -> None:
    config = load_test_config({"lmkv.chunk_size": 16, "lmkv.tiers": [
        {"type": "cpu", "options": {"max_bytes": 1 << 22}},
        {"type": "redis", "options": {"url": black_hole, "socket_timeout_s": 30,
                                      "connect_timeout_s": 30, "close_timeout_s": 0}}]})
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16)
    engine = open_local_engine(config, spec, model_name="hang-test")
    kv = [(torch.randn(1, 2, 64, 16).half(), torch.randn(1, 2, 64, 16).half())
          for _ in range(2)]
    stored: list[int] = []
    try:
        for _ in range(3):
            tokens = torch.randint(0, 50_000, (64,)).tolist()
            store = threading.Thread(target=lambda t=tokens: stored.append(
                engine.store(t, kv=kv)), daemon=True)
            store.start()
            store.join(timeout=2.0)  # against a 30 s hang
            assert not store.is_alive(), "a store waited on the hung redis tier"
        assert stored == [64, 64, 64]
    finally:
        engine.close()
