"""Options, URL forms (password, ACL user, db number, unix socket, TLS) and redaction."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from redis_helpers import chunk, get, key, keys_of, put

from lmkv.contracts import ConfigError, tensor_obj
from lmkv.testing.redis import RedisServer
from lmkv.testing.tiers import load_test_config
from lmkv_redis import RedisBackend, RedisOptions, redact_url

pytestmark = pytest.mark.slow  # a real redis-server

MakeTier = Callable[..., RedisBackend]


def test_defaults() -> None:
    options = RedisOptions()
    assert options.url == "redis://127.0.0.1:6379/0"
    assert options.key_prefix == "lmkv:" and options.ttl_s is None and not options.cluster
    assert options.connect_timeout_s == options.socket_timeout_s == 2.0


@pytest.mark.parametrize(("options", "message"), [
    ({"url": "http://host:6379"}, "has no redis://, rediss:// or unix:// scheme"),
    ({"key_prefix": "a{b}:"}, "hash tags"),
    ({"cluster": True, "url": "redis://h:7000/3"}, "only database 0"),
    ({"cluster": True, "url": "unix:///tmp/r.sock"}, "over TCP"),
    ({"part_bytes": 10}, "greater than or equal to 1024"),
    ({"ttl_s": 0}, "positive"),
    ({"tls_cert_file": "c.pem"}, "go together"),
    ({"colour": "red"}, "unknown key"),
])
def test_bad_options_fail_at_start_up_naming_the_key(options: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_test_config({"lmkv.tiers.1": {"type": "redis", "options": options}})
    assert "tiers.1.options" in str(err.value) and message in str(err.value)


def test_passwords_never_show() -> None:
    url = "rediss://kv:s3cret-pw@cache.example:6380/2"
    assert redact_url(url) == "rediss://kv:***@cache.example:6380/2"
    options = RedisOptions(url=url, password="other-s3cret")
    for text in (repr(options), str(options), str(options.model_dump(mode="json"))):
        assert "s3cret" not in text
    config = load_test_config({"lmkv.tiers.1": {"type": "redis",
                                                             "options": {"url": url}}})
    assert "s3cret" not in str(config.resolved_dump())
    assert options.url == url and options.password.get_secret_value() == "other-s3cret"


@pytest.fixture
def password_server(tmp_path: Path) -> RedisServer:
    server = RedisServer(tmp_path / "pw", args=["--requirepass", "s3cret-pw"]).start()
    yield server
    server.stop()


def test_password_in_the_url(password_server: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(f"redis://:s3cret-pw@127.0.0.1:{password_server.port}/0")
    (data,) = put(tier, [1])
    assert torch.equal(get(tier, 1), data)


def test_password_option(password_server: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(f"redis://127.0.0.1:{password_server.port}/0", password="s3cret-pw")
    put(tier, [1])
    assert tier.contains(key(1))


def test_wrong_password_is_misses_and_never_logged(password_server: RedisServer,
                                                   make_tier: MakeTier,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    tier = make_tier(f"redis://:wrong-pw-123@127.0.0.1:{password_server.port}/0",
                     retry_after_s=0)
    assert tier.batched_submit_put([key(1)], [_obj(1)]).result(timeout=10) == 0
    assert not tier.contains(key(1)) and get(tier, 1) is None
    assert tier.stats()["errors"] >= 2
    assert caplog.records and "wrong-pw-123" not in caplog.text
    assert "wrong-pw-123" not in repr(tier)


def test_acl_user_limited_to_the_prefix(password_server: RedisServer,
                                        make_tier: MakeTier) -> None:
    admin = password_server.client(password="s3cret-pw")
    admin.execute_command("ACL", "SETUSER", "kv", "on", ">kv-pw", "resetkeys", "~tenant1:*",
                          "+@all")
    url = f"redis://kv:kv-pw@127.0.0.1:{password_server.port}/0"
    tier = make_tier(url, key_prefix="tenant1:", part_bytes=1024)
    (data,) = put(tier, [1])  # every part is under the prefix, or the ACL would refuse it
    assert torch.equal(get(tier, 1), data)
    assert len(keys_of(admin, "tenant1:*")) == 9
    outsider = make_tier(url, key_prefix="tenant2:", retry_after_s=0)
    assert outsider.batched_submit_put([key(1)], [_obj(1)]).result(timeout=10) == 0
    assert outsider.stats()["dropped_writes"] == 1 and get(outsider, 1) is None


def test_database_number(redis_server: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(redis_server.url.replace("/0", "/5"), key_prefix="db-test:")
    put(tier, [1])
    assert keys_of(redis_server.client(db=5), "db-test:*")
    assert not keys_of(redis_server.client(db=0), "db-test:*")
    assert tier.remove(key(1))


def test_unix_socket(tmp_path: Path, make_tier: MakeTier) -> None:
    path = tmp_path / "redis.sock"
    server = RedisServer(tmp_path / "unix", args=["--unixsocket", str(path)]).start()
    try:
        tier = make_tier(f"unix://{path}?db=2")
        (data,) = put(tier, [1])
        assert torch.equal(get(tier, 1), data)
        assert keys_of(server.client(db=2))
    finally:
        server.stop()


def test_tls(tls_server: tuple[RedisServer, Path], make_tier: MakeTier) -> None:
    server, ca = tls_server
    tier = make_tier(server.url, tls_ca_file=str(ca), part_bytes=4096)
    (data,) = put(tier, [1])
    assert torch.equal(get(tier, 1), data)
    unverified = make_tier(server.url, tls_verify=False)
    assert unverified.contains(key(1), pin=False) is False  # another key prefix
    put(unverified, [2])
    assert get(unverified, 2) is not None


def test_tls_with_an_untrusted_certificate_is_misses(tls_server: tuple[RedisServer, Path],
                                                     make_tier: MakeTier) -> None:
    server, _ = tls_server
    tier = make_tier(server.url)  # the system's CAs do not know the test's certificate
    assert tier.batched_submit_put([key(1)], [_obj(1)]).result(timeout=10) == 0
    assert get(tier, 1) is None and tier.stats()["errors"] >= 1


def test_plain_client_on_a_tls_port_is_misses(tls_server: tuple[RedisServer, Path],
                                              make_tier: MakeTier) -> None:
    server, _ = tls_server
    tier = make_tier(server.url.replace("rediss://", "redis://"), socket_timeout_s=0.5)
    assert not tier.contains(key(1)) and tier.stats()["errors"] == 1


def _obj(seed: int):
    return tensor_obj(chunk(seed))
