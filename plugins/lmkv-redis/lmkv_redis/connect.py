"""Build a redis-py client (one server or a Redis Cluster) from ``RedisOptions``.

Every client fails fast: short connect and socket timeouts, and no retries
inside redis-py (its default retries with exponential backoff would hold the
engine for seconds while a server is down). Reconnection needs no retry: the
pool checks a connection when it hands it out and reconnects a dead one, so
the first command after a server restart already works.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import parse_url
from redis.retry import Retry

from lmkv_redis.options import RedisOptions
from lmkv_redis.wire import POOL_CLASS

logger = logging.getLogger(__name__)

Client = redis.Redis | RedisCluster


def _no_retry() -> Retry:
    return Retry(NoBackoff(), 0)


def connection_kwargs(options: RedisOptions) -> dict[str, Any]:
    """Keyword arguments of redis-py's connection pool, from the URL and the options."""
    kwargs: dict[str, Any] = parse_url(options.url)
    if options.password is not None:
        kwargs["password"] = options.password.get_secret_value()
    kwargs.update(
        socket_connect_timeout=options.connect_timeout_s,
        socket_timeout=options.socket_timeout_s,
        socket_keepalive=True,
        max_connections=options.max_connections,
        client_name="lmkv",
        protocol=2,  # RESP2: every server speaks it; lmkv needs nothing from RESP3
    )
    if "path" in kwargs:  # unix:// sockets know no connect timeout or keepalive
        kwargs.pop("socket_connect_timeout")
        kwargs.pop("socket_keepalive")
    if options.is_tls:
        kwargs.update(
            ssl_ca_certs=options.tls_ca_file,
            ssl_certfile=options.tls_cert_file,
            ssl_keyfile=options.tls_key_file,
            ssl_cert_reqs="required" if options.tls_verify else "none",
            ssl_check_hostname=options.tls_verify,
        )
    return kwargs


def make_client(options: RedisOptions) -> Client:
    """A client for ``options``. A cluster client contacts the cluster at once
    (to learn its slots) and raises a redis error when it cannot."""
    kwargs = connection_kwargs(options)
    if not options.cluster:
        return redis.Redis(connection_pool=POOL_CLASS(retry=_no_retry(), **kwargs))
    # RedisCluster builds every node's pool from its URL (which is how it takes
    # connection_pool_class) and lets the URL's fields win over keyword
    # arguments: hand it the URL without credentials, and those separately.
    for key in ("host", "port", "db", "connection_class"):
        kwargs.pop(key, None)
    return RedisCluster(url=_without_credentials(options.url), connection_pool_class=POOL_CLASS,
                        retry=_no_retry(), **kwargs)


def _without_credentials(url: str) -> str:
    parts = urlsplit(url)
    netloc = parts.hostname or ""
    if ":" in netloc:
        netloc = f"[{netloc}]"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
