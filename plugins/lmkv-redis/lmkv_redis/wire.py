"""Large values on the wire without extra copies.

redis-py's defaults copy a large value several times: its pure-Python reader
collects a reply in a BytesIO and slices it out (four copies of a 32 MiB
chunk), and with ``hiredis`` installed the command packer turns every
memoryview into bytes and joins the whole command (two copies). KV chunks are
tens of MiB, so this module plugs two small pieces into redis-py's public
connection parameters (``parser_class``, ``command_packer``):

* ``BulkValue``: one bulk-string argument made of several buffers (the frame
  header and a view of the chunk's memory), sent back to back with ``sendall``;
* a RESP2 reader that receives a large bulk string with ``recv_into`` straight
  into one uninitialised buffer.

Both sit on redis-py internals that have been stable since redis-py 5
(``redis._parsers``). If they ever move, ``WIRE_AVAILABLE`` is False and the
tier falls back to redis-py's own reader and packer (slower, same results).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np
import redis

logger = logging.getLogger(__name__)

#: Bulk replies at least this large are received straight into their own buffer.
DIRECT_READ_BYTES = 1 << 16

try:
    from redis._parsers.encoders import Encoder
    from redis._parsers.resp2 import _RESP2Parser
    from redis._parsers.socket import SERVER_CLOSED_CONNECTION_ERROR, SocketBuffer
    from redis.connection import PythonRespSerializer
    from redis.utils import SENTINEL

    WIRE_AVAILABLE = True
except ImportError:  # a redis-py that reorganised its internals: use its defaults
    WIRE_AVAILABLE = False


class BulkValue(tuple):
    """One bulk-string argument made of several buffers, sent without joining them."""

    __slots__ = ()

    @property
    def nbytes(self) -> int:
        return sum(memoryview(b).nbytes for b in self)


def bulk(buffers: Sequence[bytes | memoryview]) -> BulkValue | bytes:
    """The argument to pass for a value made of ``buffers``."""
    if WIRE_AVAILABLE:
        return BulkValue(buffers)
    return b"".join(buffers)


if WIRE_AVAILABLE:

    class BulkPacker(PythonRespSerializer):
        """redis-py's pure-Python packer (never copies a large argument), plus
        ``BulkValue`` arguments."""

        def __init__(self) -> None:
            super().__init__(6000, Encoder("utf-8", "strict", False).encode)

        def pack(self, *args: Any) -> list[bytes | memoryview]:
            if not any(isinstance(a, BulkValue) for a in args):
                return super().pack(*args)
            if isinstance(args[0], str):
                args = (*args[0].encode().split(), *args[1:])
            output: list[bytes | memoryview] = []
            head = b"*%d\r\n" % len(args)
            for arg in args:
                if isinstance(arg, BulkValue):
                    output.append(head + b"$%d\r\n" % arg.nbytes)
                    output.extend(arg)
                    head = b"\r\n"
                else:
                    data = self.encode(arg)
                    head += b"$%d\r\n%s\r\n" % (len(data), data)
            output.append(head)
            return output

    class DirectSocketBuffer(SocketBuffer):
        """Reads a large bulk string with ``recv_into`` into one fresh buffer."""

        def read(self, length: int, timeout: Any = SENTINEL) -> Any:
            if length < DIRECT_READ_BYTES:
                return super().read(length, timeout)
            total = length + 2  # the value and its \r\n
            out = np.empty(total, dtype=np.uint8)  # no zero-fill: recv overwrites it all
            view = out.data
            got = self._buffer.readinto(view)
            sock = self._sock
            custom_timeout = timeout is not SENTINEL
            if custom_timeout:
                sock.settimeout(timeout)
            try:
                while got < total:
                    n = sock.recv_into(view[got:])
                    if not n:
                        raise redis.ConnectionError(SERVER_CLOSED_CONNECTION_ERROR)
                    got += n
            except TimeoutError:
                raise redis.TimeoutError("Timeout reading from socket") from None
            finally:
                if custom_timeout:
                    sock.settimeout(self.socket_timeout)
            return view[:length]

    class DirectParser(_RESP2Parser):
        """redis-py's RESP2 parser over ``DirectSocketBuffer``."""

        def on_connect(self, connection: Any) -> None:
            super().on_connect(connection)
            if self._sock is None:  # redis-py connects the socket before this
                raise redis.ConnectionError("lmkv-redis: no socket to read from")
            self._buffer = DirectSocketBuffer(
                self._sock, self.socket_read_size, connection.socket_timeout)

    _PACKER = BulkPacker()

    class _DirectWire:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["protocol"] = 2  # the parser above speaks RESP2 (every server does)
            kwargs["parser_class"] = DirectParser
            kwargs["command_packer"] = _PACKER
            super().__init__(*args, **kwargs)

    @cache
    def _direct_class(base: type) -> type:
        return type(f"Direct{base.__name__}", (_DirectWire, base), {})

    class DirectConnectionPool(redis.ConnectionPool):
        """A pool whose connections (plain or TLS) use the direct reader and packer."""

        def __init__(self, connection_class: type = redis.Connection, **kwargs: Any) -> None:
            if not issubclass(connection_class, _DirectWire):
                # A class is hashable: mypy's cache stub reads a bare type as not.
                connection_class = _direct_class(connection_class)  # type: ignore[arg-type]
            kwargs["protocol"] = 2
            super().__init__(connection_class=connection_class, **kwargs)

    POOL_CLASS: type[redis.ConnectionPool] = DirectConnectionPool
else:
    logger.info("lmkv-redis: redis-py %s internals differ; using its default wire path",
                redis.__version__)
    POOL_CLASS = redis.ConnectionPool
