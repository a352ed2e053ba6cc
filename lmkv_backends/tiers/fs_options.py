"""Options of the ``fs`` tier and how they become a place to store entries.

A local path (or ``file://`` URL) is served by ``fs_local`` with plain ``os``
calls; every other fsspec URL (``s3://bucket/prefix``, ...) by ``fs_remote``
through ``fsspec.filesystem(protocol, **storage_options)``. Secrets (``key``,
``secret``, secret-named ``storage_options``, credentials in ``endpoint_url``)
never appear in a repr, a log line or an error message (``lmkv.base.redact``).

Remote timeouts are a cache's: a call gives up within seconds (connect 1 s,
no progress for 2 s, one retry), since a miss costs a recompute and a hung
call would hold a lookup or a writer thread.
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
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    SecretStr,
    field_serializer,
    field_validator,
    model_validator,
)

from lmkv.base.errors import ConfigError
from lmkv.base.redact import Redactor, redact_url, redact_value, secrets_in
from lmkv.base.units import ByteCount
from lmkv.contracts.plugin import PluginOptions

LOCAL_PROTOCOLS = frozenset({None, "file", "local"})
S3_PROTOCOLS = frozenset({"s3", "s3a"})
DEFAULT_LOCAL_THREADS = 4
DEFAULT_REMOTE_THREADS = 16
# Owner read and write, and what a group (or others, read only) may be given;
# never execute (entries are data) and never write for others (planted KV).
DEFAULT_MODE = 0o600
_ALLOWED_MODE_BITS = 0o664
_MODE_HELP = ('must be an octal file mode with owner read and write, no execute bits and '
              'no write for others, such as "0600" (default) or "0640"')


class FSOptions(PluginOptions):
    # A timeout, TTL or retry delay of inf (or nan) never ends: only finite numbers.
    model_config = ConfigDict(allow_inf_nan=False)

    url: str = Field(min_length=1)
    """Where entries live: ``/var/cache/lmkv``, ``file:///...``, ``s3://bucket/prefix``."""
    max_bytes: ByteCount | None = None
    """The tier's byte budget (LRU-evicted past it); None: unbounded."""
    durable: bool = False
    """Local disk. On: a put completes only once its data is on disk (fdatasync).
    Off (the default): once it is in the OS page cache, which outlives the
    process; a power cut may lose recent entries, and a damaged one fails its
    checksum when read (a miss)."""
    page_cache: bool = True
    """Local disk: keep entries in the OS page cache after reading or writing them,
    so another process (a restarted engine, a second one) reads them from memory.
    Off: pages are handed back (the memory tier above holds those chunks already);
    a write's pages go only once on disk, so each write then waits for it."""
    direct_reads: bool = True
    """Local disk: an engine whose KV is in host memory (vLLM's CPU build) reads
    entries straight into its KV, a few MiB at a time through a small buffer of
    its own, verified as they go (``lmkv.contracts.direct_chunk``), instead of into the memory
    tier's arena first; such reads are not promoted into the tier above. Off:
    every read goes through a chunk buffer and is promoted."""
    mapped_reads: bool = True
    """Local disk, with ``direct_reads``: read an entry's payload through a memory
    mapping of its file (no copy into the staging buffer), under lmkv's SIGBUS
    guard (``lmkv.contracts.mapped_file``: an entry that shrinks while mapped is
    a failed read, never a crash). Off, or where the guard is not built: ``pread``."""
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
    connect_timeout_s: PositiveFloat = 1.0
    """Remote: seconds to wait for a connection."""
    read_timeout_s: PositiveFloat = 2.0
    """Remote: give up on a response that makes no progress for this long."""
    retries: NonNegativeInt = 1
    """Remote: retries of a failed request (after the first attempt)."""
    mode: int | str = DEFAULT_MODE
    """Local disk: permissions of entry files (``"0600"``; ``"0640"`` shares them with
    the directory's group on purpose); directories get the matching execute bits."""
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

    @field_validator("mode", mode="before")
    @classmethod
    def _check_mode(cls, value: object) -> int:
        return parse_mode(value)

    @model_validator(mode="after")
    def _settings_fit_the_url(self) -> FSOptions:
        problem = url_settings_problem(self)
        if problem:  # config check says so too, not only start-up
            raise ValueError(problem)
        return self

    @field_serializer("storage_options", when_used="json")
    def _mask_secrets(self, value: dict[str, Any]) -> dict[str, Any]:
        return redact_value(value)

    @field_serializer("endpoint_url", when_used="json")
    def _mask_endpoint(self, value: str | None) -> str | None:
        return redact_url(value) if value else value

    @field_serializer("mode", when_used="json")
    def _octal_mode(self, value: int) -> str:
        return f"{value:04o}"

    @property
    def file_mode(self) -> int:
        return int(self.mode)

    @property
    def dir_mode(self) -> int:
        """``mode`` plus execute wherever it grants read (to list the directory)."""
        mode = int(self.mode)
        return mode | (mode & 0o444) >> 2

    def redactor(self) -> Redactor:
        """Masks every secret these options hold, in any text (exception messages)."""
        return Redactor([self.key, self.secret, *secrets_in(self.endpoint_url or ""),
                         *secrets_in(self.storage_options)])

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


def parse_mode(value: object) -> int:
    """``"0640"``, ``"0o640"``, ``"640"`` or an int such as ``0o640`` (416)."""
    if isinstance(value, bool):
        raise ValueError(_MODE_HELP)
    if isinstance(value, str):
        text = value.strip().lower().removeprefix("0o")
        if not text or any(c not in "01234567" for c in text):
            raise ValueError(_MODE_HELP)
        value = int(text, 8)
    if not isinstance(value, int) or value & ~_ALLOWED_MODE_BITS \
            or value & DEFAULT_MODE != DEFAULT_MODE:
        raise ValueError(_MODE_HELP)
    return value


def display_url(url: str) -> str:
    """``url`` without any user:password part, for logs and errors."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "<unparsable url>"
    if parts.username is None and parts.password is None:
        return redact_url(url)
    host = parts.hostname or ""
    if port:
        host = f"{host}:{port}"
    return redact_url(urlunsplit((parts.scheme, host, parts.path, parts.query,
                                  parts.fragment)))


def url_settings_problem(options: FSOptions) -> str | None:
    """Why a setting does not fit the URL (the S3 settings are for s3:// URLs only,
    ``mode`` for local directories only); None when all fit."""
    s3_only = [name for name in ("endpoint_url", "region", "key", "secret")
               if getattr(options, name) is not None]
    if s3_only and options.protocol not in S3_PROTOCOLS:
        return (f"{s3_only[0]} applies to s3:// URLs only, not {display_url(options.url)!r}; "
                "pass other filesystems' settings in storage_options")
    if not options.is_local and "mode" in options.model_fields_set:
        return (f"mode applies to local directories only, not {display_url(options.url)!r} "
                "(object stores keep their own permissions)")
    return None


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
                          f"{options.redactor()(exc)}") from None
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
