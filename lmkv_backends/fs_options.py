"""Options of the ``fs`` tier and how they become a place to store entries.

A local path (or ``file://`` URL) is served by ``fs_local`` with plain ``os``
calls; every other fsspec URL (``s3://bucket/prefix``, ...) by ``fs_remote``
through ``fsspec.filesystem(protocol, **storage_options)``. Secrets are
``SecretStr``: they never appear in a repr, a log line or an error message.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import fsspec
from pydantic import (
    ByteSize,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    SecretStr,
    field_serializer,
    field_validator,
)

from lmkv.errors import ConfigError
from lmkv.plugins.base import PluginOptions

LOCAL_PROTOCOLS = frozenset({None, "file", "local"})
S3_PROTOCOLS = frozenset({"s3", "s3a"})
DEFAULT_LOCAL_THREADS = 4
DEFAULT_REMOTE_THREADS = 16
# storage_options keys whose values are masked when the config is shown.
_SECRET_WORDS = ("secret", "password", "token", "key", "credential")


class FSOptions(PluginOptions):
    url: str = Field(min_length=1)
    """Where entries live: ``/var/cache/lmkv``, ``file:///...``, ``s3://bucket/prefix``."""
    max_bytes: ByteSize | None = None
    """The tier's byte budget (LRU-evicted past it); None: unbounded."""
    durable: bool = True
    """Local disk: a put completes only once its data is on disk (fdatasync)."""
    page_cache: bool = False
    """Local disk: keep entries in the OS page cache after reading or writing them.
    Off: the memory tier above holds those chunks already (no second copy)."""
    io_threads: PositiveInt | None = None
    """Parallel I/O per direction; default 4 on local disk, 16 for remote URLs."""
    endpoint_url: str | None = None
    """S3: the endpoint of an S3-compatible store (MinIO, Ceph, moto)."""
    region: str | None = None
    """S3: the region name."""
    key: SecretStr | None = None
    """S3: access key id (default: the usual AWS credential chain)."""
    secret: SecretStr | None = None
    """S3: secret access key."""
    connect_timeout_s: PositiveFloat = 2.0
    """Remote: seconds to wait for a connection."""
    read_timeout_s: PositiveFloat = 10.0
    """Remote: give up on a response that makes no progress for this long."""
    retries: NonNegativeInt = 1
    """Remote: retries of a failed request (after the first attempt)."""
    close_timeout_s: NonNegativeFloat = 2.0
    """``close()`` waits this long for puts in flight, then drops the rest (counted)."""
    storage_options: dict[str, Any] = Field(default_factory=dict, repr=False)
    """Passed to ``fsspec.filesystem`` as they are; win over the options above."""

    @field_validator("max_bytes")
    @classmethod
    def _positive_budget(cls, value: ByteSize | None) -> ByteSize | None:
        if value is not None and value <= 0:
            raise ValueError("must be a positive size such as 64GiB, or null for unbounded")
        return value

    @field_serializer("storage_options", when_used="json")
    def _mask_secrets(self, value: dict[str, Any]) -> dict[str, Any]:
        return _masked(value)

    @property
    def protocol(self) -> str | None:
        protocol, _ = fsspec.core.split_protocol(self.url)
        return protocol

    @property
    def is_local(self) -> bool:
        return self.protocol in LOCAL_PROTOCOLS

    @property
    def threads(self) -> int:
        if self.io_threads is not None:
            return self.io_threads
        return DEFAULT_LOCAL_THREADS if self.is_local else DEFAULT_REMOTE_THREADS


def _masked(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: "**********" if _is_secret_name(k) and v else _masked(v)
                for k, v in value.items()}
    return value


def _is_secret_name(name: object) -> bool:
    lowered = str(name).lower()
    return any(word in lowered for word in _SECRET_WORDS)


def display_url(url: str) -> str:
    """``url`` without any user:password part, for logs and errors."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


def check_s3_options(options: FSOptions, prefix: str) -> None:
    """The S3 settings are for s3:// URLs only; anything else is a config error.

    ``prefix`` is the options' config path, e.g. ``tiers.1.options``."""
    s3_only = [name for name in ("endpoint_url", "region", "key", "secret")
               if getattr(options, name) is not None]
    if s3_only and options.protocol not in S3_PROTOCOLS:
        raise ConfigError(f"config key '{prefix}.{s3_only[0]}': applies to s3:// URLs only, "
                          f"not {display_url(options.url)!r}; pass other filesystems' "
                          "settings in storage_options")


def local_root(options: FSOptions) -> str:
    _, path = fsspec.core.split_protocol(options.url)
    return os.path.abspath(os.path.expanduser(path))


@dataclass(frozen=True)
class RemoteLocation:
    fs: fsspec.AbstractFileSystem
    root: str  # path inside ``fs`` (``bucket/prefix``), no trailing slash


def open_remote(options: FSOptions, prefix: str) -> RemoteLocation:
    """The fsspec filesystem for a remote URL; ConfigError when it cannot be made."""
    protocol = options.protocol
    where = f"config key '{prefix}.url' = {display_url(options.url)!r}"
    check_s3_options(options, prefix)
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as exc:
        hint = " (pip install 'lmkv[s3]')" if protocol in S3_PROTOCOLS else ""
        raise ConfigError(f"{where}: {exc}{hint}") from None
    storage = _s3_options(options) if protocol in S3_PROTOCOLS else {}
    storage = _merged(storage, options.storage_options)
    storage.setdefault("skip_instance_cache", True)
    try:
        fs = cls(**storage)
    except Exception as exc:  # each filesystem validates its own arguments
        raise ConfigError(f"{where}: cannot open it: {type(exc).__name__}: "
                          f"{_without_secrets(str(exc), options)}") from None
    if protocol in S3_PROTOCOLS:
        # botocore retries (total_max_attempts) already; s3fs's own loop on top
        # of it would multiply the time a stopped endpoint costs.
        fs.retries = 1
    root = cls._strip_protocol(options.url).rstrip("/")
    return RemoteLocation(fs, root)


def _s3_options(options: FSOptions) -> dict[str, Any]:
    config = {
        "connect_timeout": options.connect_timeout_s,
        "read_timeout": options.read_timeout_s,
        "retries": {"total_max_attempts": options.retries + 1, "mode": "standard"},
        "max_pool_connections": max(10, 2 * options.threads),
    }
    storage: dict[str, Any] = {"config_kwargs": config, "use_listings_cache": False}
    if options.endpoint_url:
        storage["endpoint_url"] = options.endpoint_url
    if options.region:
        storage["client_kwargs"] = {"region_name": options.region}
    if options.key is not None:
        storage["key"] = options.key.get_secret_value()
    if options.secret is not None:
        storage["secret"] = options.secret.get_secret_value()
    return storage


def _merged(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for name, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(name), dict):
            out[name] = _merged(out[name], value)
        else:
            out[name] = value
    return out


def _without_secrets(text: str, options: FSOptions) -> str:
    secrets = [s.get_secret_value() for s in (options.key, options.secret) if s is not None]
    secrets += _secret_values(options.storage_options)
    for secret in secrets:
        if secret:
            text = text.replace(secret, "**********")
    return text


def _secret_values(value: Any) -> list[str]:
    if not isinstance(value, Mapping):
        return []
    found = []
    for name, item in value.items():
        if _is_secret_name(name) and isinstance(item, str):
            found.append(item)
        found += _secret_values(item)
    return found
