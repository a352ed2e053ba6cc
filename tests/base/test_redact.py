from __future__ import annotations

import pytest

from lmkv.base.redact import Redactor, is_secret_name, redact_text, redact_url, redact_value


@pytest.mark.parametrize(("name", "secret"), [
    ("password", True), ("key", False), ("secret_key", True), ("aws_access_key_id", True),
    ("server_key", False), ("public_key", False), ("api_key", True), ("password_file", False),
    ("token", True), ("client_secret", True), ("key_prefix", False), ("tls_key_file", False),
    ("url", False), ("max_bytes", False),
])
def test_secret_names(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://u:pw1234@h:6379/0", "redis://u:***@h:6379/0"),
    ("redis://:pw1234@h", "redis://:***@h"),
    ("redis://h:6379/0?password=pw1234&db=2", "redis://h:6379/0?password=***&db=2"),
    ("http://AKID:pw1234@[::1]:9000/b", "http://AKID:***@[::1]:9000/b"),
    ("redis://:pw1234@h:notaport", "<unparsable url>"),
    ("s3://bucket/prefix", "s3://bucket/prefix"),
])
def test_urls(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_text_values_and_known_secrets() -> None:
    text = 'Could not connect to "http://AKID:pw1234@minio:9000/b/k": refused'
    assert redact_text(text) == 'Could not connect to "http://AKID:***@minio:9000/b/k": refused'
    assert redact_text("use redis://host[:port][/db] or unix://") == \
        "use redis://host[:port][/db] or unix://"
    assert Redactor(["pw1234"])("auth pw1234 failed") == "auth *** failed"
    assert redact_value({"storage_options": {"token": "t0k3n", "anon": False},
                         "endpoint_url": "http://a:b1234@h", "key_prefix": "lmkv:"}) == {
        "storage_options": {"token": "***", "anon": False},
        "endpoint_url": "http://a:***@h", "key_prefix": "lmkv:"}


def test_a_config_repr_never_shows_a_secret() -> None:
    """A config lands in logs and tracebacks whole (repr and str)."""
    from lmkv.config.model import load_config

    config = load_config(env={}, overrides={"lmkv.tiers": [
        {"type": "cpu", "options": {"max_bytes": "64MiB"}},
        {"type": "fs", "options": {"url": "s3://b/p", "endpoint_url": "http://AK:SKinURL@m:9",
                                   "secret": "SKfield", "storage_options": {"token": "TOK1"}}}]})
    for text in (repr(config), str(config), repr(config.tiers[1])):
        assert "***" in text
        for secret in ("SKinURL", "SKfield", "TOK1"):
            assert secret not in text
