"""``lmkv.contracts.remote``: the options and the fault policy every remote tier
shares (the redis and mooncake tiers run them against real servers)."""

from __future__ import annotations

import logging

import pytest
from pydantic import PositiveFloat, ValidationError, field_validator

from lmkv.contracts import (
    CacheKey,
    KeyMeta,
    RemoteTierOptions,
    TierCounters,
    TierUnavailable,
    remote_faults,
)


class HelloOptions(RemoteTierOptions):
    """A tier's options: its own field, one shared field's bounds tightened."""

    url: str = "hello://127.0.0.1"
    retry_after_s: PositiveFloat = 1.0

    @field_validator("key_prefix")
    @classmethod
    def _no_spaces(cls, prefix: str) -> str:
        if " " in prefix:
            raise ValueError("must not contain spaces")
        return prefix


def test_the_shared_options_have_one_name_and_default_everywhere() -> None:
    options = HelloOptions()
    assert (options.key_prefix, options.retry_after_s, options.close_timeout_s,
            int(options.max_pending_bytes)) == ("lmkv:", 1.0, 2.0, 1 << 30)
    assert list(options.model_dump())[:4] == ["key_prefix", "retry_after_s",
                                              "close_timeout_s", "max_pending_bytes"]
    assert HelloOptions(max_pending_bytes="64MiB").max_pending_bytes == 64 << 20
    key = CacheKey(KeyMeta("m", 1, 0, "float16", "l2thd"), bytes(32))
    assert HelloOptions(key_prefix="kv/").store_key(key) == "kv/" + key.to_string()


@pytest.mark.parametrize(("field", "value"), [
    ("close_timeout_s", float("inf")), ("close_timeout_s", -1), ("retry_after_s", 0),
    ("max_pending_bytes", -1), ("key_prefix", "a b"), ("hostname", "x")])
def test_bad_values_are_refused_at_their_field(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as info:
        HelloOptions(**{field: value})
    assert info.value.errors()[0]["loc"] == (field,)
    # The base allows what a subclass narrowed.
    if (field, value) == ("retry_after_s", 0):
        assert RemoteTierOptions(retry_after_s=0).retry_after_s == 0


def test_the_fault_policy_masks_secrets_and_backs_off_from_the_options(
        caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("lmkv_hello.backend")
    faults = remote_faults(TierCounters(), "hello tier (hello://h)",
                           HelloOptions(retry_after_s=0.5), absorbed=(OSError,),
                           unreachable=(ConnectionError,), longest_backoff_s=2.0,
                           secrets=["S3cret-pw", None], log=log)
    assert (faults.breaker.first_backoff_s, faults.breaker.longest_backoff_s) == (0.5, 2.0)
    with caplog.at_level(logging.WARNING, logger="lmkv_hello.backend"), \
            faults.guard("get", "answering misses"):
        raise OSError("refused for user:S3cret-pw")
    assert faults.counters.errors == 1 and not faults.breaker.is_open
    with faults.guard("get", "answering misses"):
        raise TierUnavailable("gone")
    assert faults.breaker.is_open
    record = next(r for r in caplog.records if r.name == "lmkv_hello.backend")
    assert "hello tier (hello://h)" in record.getMessage()
    assert "S3cret" not in record.getMessage() and "***" in record.getMessage()
    with pytest.raises(KeyError), faults.guard("get", "answering misses"):
        raise KeyError("bug")  # not a storage fault: a bug shows
    same = remote_faults(TierCounters(), "t", HelloOptions(), absorbed=(OSError,),
                         unreachable=(ConnectionError,))
    assert same.breaker.longest_backoff_s == same.breaker.first_backoff_s == 1.0
