"""``config check`` masks secrets and nothing else: a public-key path or a plugin
option merely named ``key`` is shown; a password (option or URL) never is."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import yaml

from lmkv.config.model import load_config
from lmkv.contracts.plugin import PluginOptions
from lmkv.plugins import hookimpl
from lmkv.testing.plugins import registered_plugin
from lmkv_policies.lru import LRUPolicy
from tests.conftest import run_cli


def test_config_check_shows_public_key_paths_and_masks_passwords(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "mode: server\n"
        "server:\n"
        "  address: tcp://127.0.0.1:5555\n"
        "  curve: {secret_key: /home/u/engine.key_secret, server_key: /home/u/server.key,\n"
        "          authorized_keys: /home/u/clients}\n"
        "tiers:\n"
        "  - type: cpu\n"
        "    options: {max_bytes: 64MiB}\n"
        "  - type: redis\n"
        "    options: {url: 'redis://:hunter2pw@127.0.0.1:6379/0', password: s3cretpw,\n"
        "              key_prefix: 'lmkv:', tls_cert_file: /etc/lmkv/client.crt,\n"
        "              tls_key_file: /etc/lmkv/client.pem}\n")
    done = run_cli("config", "check", str(config))
    assert done.returncode == 0, done.stderr
    shown = yaml.safe_load(done.stdout)
    curve = shown["server"]["curve"]
    assert curve["server_key"] == "/home/u/server.key"     # a public key's file
    assert curve["authorized_keys"] == "/home/u/clients"
    assert curve["secret_key"] == "***"                    # named a secret: masked
    redis = shown["tiers"][1]["options"]
    assert redis["url"] == "redis://:***@127.0.0.1:6379/0"
    assert redis["password"] == "***"
    assert redis["key_prefix"] == "lmkv:"
    assert redis["tls_key_file"] == "/etc/lmkv/client.pem"  # where the key is, not the key
    for secret in ("hunter2pw", "s3cretpw"):
        assert secret not in done.stdout + done.stderr


class KeyedPolicy(LRUPolicy):
    """An eviction policy whose options include one merely named ``key``."""

    name: ClassVar[str] = "keyed"

    class Options(PluginOptions):
        key: str = "tenant"
        password: str | None = None


class KeyedPlugin:
    @hookimpl
    def lmkv_eviction_policies(self) -> list[type]:
        return [KeyedPolicy]


def test_a_plugin_option_named_key_is_shown_and_a_password_masked() -> None:
    with registered_plugin(KeyedPlugin()) as manager:
        config = load_config(env={}, plugin_manager=manager, overrides={"lmkv.tiers": [
            {"type": "cpu", "options": {"max_bytes": "64MiB"},
             "eviction": {"type": "keyed", "options": {"key": "tenant-a",
                                                       "password": "pw-in-options"}}}]})
        dumped = config.resolved_dump()
    assert dumped["tiers"][0]["eviction"]["options"] == {"key": "tenant-a", "password": "***"}


def test_storage_options_keep_an_s3_key_pair_masked(tmp_path: Path) -> None:
    """In a mapping handed to a storage library as it is, ``key`` beside ``secret`` is
    s3fs's access key id: masked with its secret."""
    config = load_config(env={}, overrides={"lmkv.tiers": [
        {"type": "cpu", "options": {"max_bytes": "64MiB"}},
        {"type": "fs", "options": {"url": "s3://bucket/p", "storage_options": {
            "key": "AKIDEXAMPLE", "secret": "SKEXAMPLE", "anon": False,
            "client_kwargs": {"region_name": "eu-west-1"}}}}]})
    options = config.resolved_dump()["tiers"][1]["options"]["storage_options"]
    assert options == {"key": "***", "secret": "***", "anon": False,
                       "client_kwargs": {"region_name": "eu-west-1"}}
