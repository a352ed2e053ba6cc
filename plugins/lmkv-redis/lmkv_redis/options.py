"""Options of the ``redis`` tier (``tiers.N.options`` in an lmkv config)."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlsplit

from pydantic import (
    ByteSize,
    Field,
    PositiveFloat,
    PositiveInt,
    SecretStr,
    field_serializer,
    field_validator,
    model_validator,
)

from lmkv.contracts import ByteCount, RemoteTierOptions, redact_url

__all__ = ["RedisOptions", "redact_url"]

SCHEMES = ("redis", "rediss", "unix")
MIN_PART_BYTES = 1024
URL_FORMS = ("redis://[[user]:password@]host[:port][/db], rediss://... (TLS) or "
             "unix:///path/to/socket[?db=N]")


def check_url(url: str) -> str:
    """Why ``url`` is not a Redis URL lmkv can use, or "" when it is."""
    try:
        parts = urlsplit(url)
        port = parts.port
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
    except ValueError as exc:
        return f"cannot be parsed ({exc})"
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES or "://" not in url:
        return "has no redis://, rediss:// or unix:// scheme"
    if scheme == "unix":
        if not parts.path:
            return "names no socket path"
    else:
        if not parts.hostname:
            return "names no host"
        if port is not None and not 0 < port < 65536:
            return f"has port {port}, outside 1-65535"
        db = parts.path.strip("/")
        if db and not db.isdigit():
            return f"has database {db!r}, not an integer"
    db_param = query.get("db")
    if db_param is not None and not db_param.isdigit():
        return "has a db= that is not an integer"
    return ""


class RedisOptions(RemoteTierOptions):
    """``key_prefix``, ``retry_after_s`` (the breaker: redis-py's pool reconnects
    on the probe), ``close_timeout_s`` and ``max_pending_bytes`` are every
    remote tier's (``RemoteTierOptions``); the rest are the redis tier's own."""

    url: str = "redis://127.0.0.1:6379/0"
    """``redis://[[user]:password@]host[:port][/db]``, ``rediss://...`` for TLS,
    ``unix:///path/to/socket?db=N``. Passwords are redacted wherever lmkv prints it."""
    password: SecretStr | None = None
    """Overrides a password in ``url`` (keeps it out of config files: set
    ``LMKV_TIERS__N__OPTIONS__PASSWORD`` in the environment)."""
    cluster: bool = False
    """Talk to a Redis Cluster (``url`` names any one node; db must be 0)."""
    ttl_s: PositiveFloat | None = None
    """Expire entries this long after they were written (None: never)."""
    part_bytes: ByteCount = Field(default=ByteSize(64 << 20), ge=MIN_PART_BYTES)
    """Values larger than this are split into parts of this size (same hash slot)."""
    connect_timeout_s: PositiveFloat = 2.0
    """Give up connecting after this long: a dead server never hangs the engine."""
    socket_timeout_s: PositiveFloat = 2.0
    """Give up on a read or write that makes no progress for this long."""
    max_connections: PositiveInt = 16
    """Connections per pool (per node with ``cluster``)."""
    pipeline_bytes: ByteCount = Field(default=ByteSize(64 << 20), ge=MIN_PART_BYTES)
    """Value bytes one pipeline carries; a larger batch goes in several (the server
    buffers a pipeline's replies whole: huge pipelines cost it page faults)."""
    tls_ca_file: str | None = None
    """CA bundle that signed the server's certificate (``rediss://``)."""
    tls_cert_file: str | None = None
    """Client certificate, for servers that require one (``tls-auth-clients yes``)."""
    tls_key_file: str | None = None
    """Private key of ``tls_cert_file``."""
    tls_verify: bool = True
    """Check the server's certificate and host name. Turn off only for testing."""

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        problem = check_url(url)
        if problem:
            raise ValueError(f"{problem}; use {URL_FORMS}")
        return url

    @field_validator("key_prefix")
    @classmethod
    def _check_prefix(cls, prefix: str) -> str:
        if "{" in prefix or "}" in prefix:
            raise ValueError("must not contain '{' or '}' (they mark Redis Cluster hash tags)")
        return prefix

    @model_validator(mode="after")
    def _check_cluster(self) -> RedisOptions:
        if self.cluster:
            if self.url.lower().startswith("unix://"):
                raise ValueError("cluster: a Redis Cluster is reached over TCP, not unix://")
            path = urlsplit(self.url).path.strip("/")
            if path not in ("", "0"):
                raise ValueError("cluster: a Redis Cluster has only database 0")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        return self

    @field_serializer("url")
    def _dump_url(self, url: str) -> str:
        return redact_url(url)

    def __repr_args__(self) -> Any:
        for name, value in super().__repr_args__():
            yield name, redact_url(value) if name == "url" else value

    @property
    def is_tls(self) -> bool:
        return self.url.lower().startswith("rediss://")
