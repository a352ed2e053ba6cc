"""Options from Mooncake's environment variables are checked like given ones:
a bad value is one line at start (through the real CLI), naming the variable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a real mooncake_master

CONFIG = "tiers: [{type: cpu, options: {max_bytes: 1MiB}}, {type: mooncake}]\n"


@pytest.mark.parametrize(("variable", "value", "field"), [
    ("MOONCAKE_PROTOCOL", "udp", "protocol"),
    ("MOONCAKE_MASTER", "garbage", "master_address"),
    ("MOONCAKE_TE_META_DATA_SERVER", "10.0.0.1:8080", "metadata_server"),
    ("MOONCAKE_LOCAL_HOSTNAME", "a host", "local_hostname"),
    ("MOONCAKE_DEVICE", "mlx5_0 mlx5_1", "device_name"),
])
def test_a_bad_mooncake_variable_is_one_line_at_start(
        tmp_path: Path, variable: str, value: str, field: str) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMKV_", "MOONCAKE_"))}
    env[variable] = value
    done = subprocess.run([sys.executable, "-m", "lmkv", "config", "check", str(config)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"'tiers.1.options.{field}'" in lines[0] and f"${variable}" in lines[0]


def test_a_bad_default_fails_in_python_too(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    from lmkv_mooncake import MooncakeOptions

    monkeypatch.setenv("MOONCAKE_PROTOCOL", "udp")
    with pytest.raises(ValidationError, match="MOONCAKE_PROTOCOL"):
        MooncakeOptions()
    assert MooncakeOptions(protocol="rdma").protocol == "rdma"  # a given value wins


@pytest.mark.parametrize("required", [False, True])
def test_a_missing_mooncake_skips_or_under_lmkv_require_mooncake_fails(
        monkeypatch: pytest.MonkeyPatch, required: bool) -> None:
    import lmkv.testing.mooncake

    monkeypatch.setattr(lmkv.testing.mooncake, "mooncake_available", lambda: False)
    if required:
        monkeypatch.setenv("CI_REQUIRE_MOONCAKE", "1")
    else:
        monkeypatch.delenv("CI_REQUIRE_MOONCAKE", raising=False)
    expected = pytest.fail.Exception if required else pytest.skip.Exception
    with pytest.raises(expected, match="not installed"):
        lmkv.testing.mooncake.require_mooncake()


def test_ci_requires_mooncake() -> None:
    ci = (Path(__file__).parents[3] / ".ci" / "run").read_text()
    assert "export CI_REQUIRE_MOONCAKE=1" in ci


class RefusingStore:
    """A Mooncake store whose setup always fails (no master is reached)."""

    def setup(self, *args: object) -> int:
        return -900

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("answering", "said"), [
    (False, "does not answer"),  # the start-up line names the silent address
    (True, "setting up with master"),  # the setup retries are logged
])
def test_credentials_in_addresses_are_never_printed(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        answering: bool, said: str) -> None:
    import logging
    import time

    import lmkv_mooncake.client
    from lmkv.contracts import BackendContext
    from lmkv.testing.tiers import serializer
    from lmkv_mooncake import MooncakeBackend, MooncakeOptions

    monkeypatch.setattr(lmkv_mooncake.client, "store_class", lambda: RefusingStore)
    monkeypatch.setattr(lmkv_mooncake.client, "answers", lambda address: answering)
    caplog.set_level(logging.INFO)
    options = MooncakeOptions(
        master_address="etcd://admin:S3cretPw1@127.0.0.1:2379",
        metadata_server="http://admin:S3cretPw2@127.0.0.1:1/metadata",
        connect_timeout_s=0.3, retry_after_s=0.05)
    tier = MooncakeBackend(options, BackendContext(serializer=serializer("naive")))
    try:
        assert tier.batched_async_contains("l", [_key()]) == 0  # not connected: a miss
        tier.faults.fault("get", OSError(f"failed for {options.metadata_server}"), "miss")
        time.sleep(0.2)
        shown = "\n".join([repr(tier), tier.faults.where, repr(options),
                           *(r.getMessage() for r in caplog.records)])
    finally:
        tier.close()
    assert said in shown
    assert "S3cretPw" not in shown, shown


def _key() -> object:
    from lmkv.contracts import CacheKey, KeyMeta

    return CacheKey(KeyMeta("m", 1, 0, "float16", "l2thd"), bytes(32))
