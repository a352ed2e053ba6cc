"""Options of the ``mooncake`` tier (``tiers.N.options`` in an lmkv config).

Addresses default to Mooncake's own environment variables (``MOONCAKE_MASTER``,
``MOONCAKE_TE_META_DATA_SERVER``, ``MOONCAKE_PROTOCOL``, ``MOONCAKE_DEVICE``,
``MOONCAKE_LOCAL_HOSTNAME``), so one deployment's settings serve every client;
lmkv's own ``LMKV_TIERS__N__OPTIONS__<FIELD>`` overrides work as for any tier.
Those defaults are validated like given values: a bad one is the usual one-line
error at start, naming the variable.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import (
    ByteSize,
    ConfigDict,
    Field,
    PositiveFloat,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from lmkv.contracts import ByteCount, RemoteTierOptions

__all__ = ["MooncakeOptions"]

#: ``host:port``, ``[v6]:port``; the master may also be ``etcd://...`` (HA masters).
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")
MIN_BUFFER_BYTES = 1 << 20
MIN_SEGMENT_BYTES = 16 << 20


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


#: What a ``mooncake_client`` (the real client) owns when ``client_address`` is set:
#: the option here, and the real client's flag that sets it instead.
REAL_CLIENT_FIELDS = {
    "master_address": "--master_server_address", "metadata_server": "--metadata_server",
    "local_hostname": "--host", "protocol": "--protocol", "device_name": "--device_names",
    "global_segment_size": "--global_segment_size",
}


class MooncakeOptions(RemoteTierOptions):
    """``key_prefix``, ``retry_after_s``, ``close_timeout_s`` and
    ``max_pending_bytes`` are every remote tier's (``RemoteTierOptions``; here
    ``retry_after_s`` must be above 0: it paces the setup retries too); the rest
    are the mooncake tier's own."""

    # Defaults are validated too: they come from Mooncake's environment variables.
    model_config = ConfigDict(validate_default=True)

    client_address: str = ""
    """``host:port`` of a ``mooncake_client`` (Mooncake's standalone real client)
    on this host. Set, this process is a thin client of it: the real client holds
    the segment and talks to the master and the other hosts, and this process
    moves frames through shared memory it hands to it (no TCP between the
    engines of one host, and the pool outlives an engine's restart). The
    connection options (``master_address``, ``metadata_server``,
    ``local_hostname``, ``protocol``, ``device_name``, ``global_segment_size``)
    are then the real client's flags, and setting them here is an error. Empty
    (the default): this process is its own client and may lend a segment."""
    master_address: str = Field(default_factory=lambda: _env("MOONCAKE_MASTER",
                                                             "127.0.0.1:50051"))
    """The master's RPC address, ``host:port`` (or ``etcd://host:port[;host:port]``
    for highly available masters). Default: ``$MOONCAKE_MASTER``."""
    metadata_server: str = Field(default_factory=lambda: _env(
        "MOONCAKE_TE_META_DATA_SERVER", "http://127.0.0.1:8080/metadata"))
    """Where transfer engines find each other's segments: the master's HTTP
    metadata server (``http://host:port/metadata``), ``etcd://host:port`` or
    ``P2PHANDSHAKE``. Default: ``$MOONCAKE_TE_META_DATA_SERVER``."""
    local_hostname: str = Field(default_factory=lambda: _env("MOONCAKE_LOCAL_HOSTNAME",
                                                             "127.0.0.1"))
    """The address other clients reach this one's segment at (an IP of this host
    on the cluster network). Default: ``$MOONCAKE_LOCAL_HOSTNAME``."""
    protocol: Literal["tcp", "rdma"] = Field(
        default_factory=lambda: _env("MOONCAKE_PROTOCOL", "tcp"))  # type: ignore[arg-type]
    """Transport between segments: ``tcp`` anywhere, ``rdma`` on InfiniBand/RoCE."""
    device_name: str = Field(default_factory=lambda: _env("MOONCAKE_DEVICE", ""))
    """RDMA device(s), comma-separated (``mlx5_0,mlx5_1``); empty for TCP or auto."""
    global_segment_size: ByteCount = Field(default=ByteSize(1 << 30), ge=0)
    """Memory this process contributes to the pool (its segment); 0 for a pure
    client of a pool that dedicated store processes hold."""
    local_buffer_size: ByteCount = Field(default=ByteSize(256 << 20), ge=MIN_BUFFER_BYTES)
    """Registered staging memory for frames in flight (the largest frame must fit).
    With ``client_address``, twice this is shared memory handed to the real
    client: the staging its tiers share, and Mooncake's own buffer."""
    replica_num: int = Field(default=1, ge=1, le=16)
    """Copies of each entry the store keeps (on different segments)."""
    register_arena: bool = True
    """Register lmkv's chunk arena with the store so puts read chunks in place
    (no staging copy; RDMA needs registered memory). Not with ``client_address``:
    a real client reaches only the shared memory it maps, so chunks are copied
    through the shared staging buffer."""
    connect_timeout_s: float = Field(default=5.0, ge=0)
    """How long start-up waits for the store to be set up; past it the tier
    answers misses until the master answers (setup goes on in the background)."""
    call_timeout_s: float = Field(default=5.0, ge=0)
    """The longest one call into the store (a batched lookup, put or get) may take;
    past it the tier answers misses (or drops the writes) and the master counts as
    unreachable: the breaker opens. 0: no limit. A transfer that timed out may
    still run: the buffers of a direct get are kept out of the arena (see
    ``quarantined_chunks``)."""
    retry_after_s: PositiveFloat = 1.0
    """After the master is found unreachable, answer misses without asking it for
    this long (growing to 4x while it stays down), then probe again."""

    @field_validator("client_address")
    @classmethod
    def _check_client(cls, value: str) -> str:
        match = _HOST_PORT.match(value)
        if value and (match is None or not 0 < int(match.group(2)) < 65536):
            raise ValueError("must be host:port (port 1-65535) of a mooncake_client on "
                             "this host, or empty")
        return value

    @model_validator(mode="before")
    @classmethod
    def _real_client_owns(cls, data: object) -> object:
        """With ``client_address``, an option the real client owns is an error at
        that option's own key (one per option given: in a file, an override or an
        ``LMKV_TIERS__N__OPTIONS__*`` variable; Mooncake's own variables only
        supply defaults, which stay unused)."""
        if not isinstance(data, dict) or not data.get("client_address"):
            return data
        owned = [name for name in REAL_CLIENT_FIELDS if name in data]
        if owned:
            raise ValidationError.from_exception_data(cls.__name__, [InitErrorDetails(
                type=PydanticCustomError(
                    "owned_by_real_client", "with client_address set, the mooncake_client's "
                    "{flag} sets this: set it there, not here",
                    {"flag": REAL_CLIENT_FIELDS[name]}),
                loc=(name,), input=data[name]) for name in owned])
        return data

    @model_serializer(mode="wrap")
    def _without_real_client_options(self, handler: SerializerFunctionWrapHandler
                                     ) -> dict[str, Any]:
        """A dump (``lmkv config check``) leaves out, with ``client_address`` set,
        the options the real client owns: unused, and refused if given back."""
        data = handler(self)
        if self.client_address and isinstance(data, dict):
            for name in REAL_CLIENT_FIELDS:
                data.pop(name, None)
        return data

    @field_validator("master_address")
    @classmethod
    def _check_master(cls, value: str) -> str:
        if value.startswith("etcd://"):
            return value
        match = _HOST_PORT.match(value)
        if match is None or not 0 < int(match.group(2)) < 65536:
            raise ValueError("must be host:port (port 1-65535) or etcd://host:port[;...]"
                             " (default: $MOONCAKE_MASTER)")
        return value

    @field_validator("metadata_server")
    @classmethod
    def _check_metadata(cls, value: str) -> str:
        scheme, sep, rest = value.partition("://")
        if value == "P2PHANDSHAKE" or (sep and rest and scheme in ("http", "https", "etcd")):
            return value
        raise ValueError("must be http://host:port/metadata, etcd://host:port or P2PHANDSHAKE"
                         " (default: $MOONCAKE_TE_META_DATA_SERVER)")

    @field_validator("protocol", mode="before")
    @classmethod
    def _check_protocol(cls, value: object) -> object:
        if value not in ("tcp", "rdma"):
            raise ValueError("must be tcp or rdma (default: $MOONCAKE_PROTOCOL)")
        return value

    @field_validator("device_name")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if any(c.isspace() for c in value):
            raise ValueError("must be RDMA device names, comma-separated, without "
                             "whitespace (default: $MOONCAKE_DEVICE)")
        return value

    @field_validator("global_segment_size")
    @classmethod
    def _check_segment(cls, size: ByteSize) -> ByteSize:
        if 0 < size < MIN_SEGMENT_BYTES:
            raise ValueError("must be 0 (a pure client) or at least 16MiB (Mooncake's "
                             "smallest segment)")
        return size

    @field_validator("local_hostname")
    @classmethod
    def _check_hostname(cls, value: str) -> str:
        if not value or any(c.isspace() for c in value):
            raise ValueError("must be a host name or IP address of this machine"
                             " (default: $MOONCAKE_LOCAL_HOSTNAME)")
        return value

    @field_validator("key_prefix")
    @classmethod
    def _check_prefix(cls, prefix: str) -> str:
        if any(c.isspace() for c in prefix):
            raise ValueError("must not contain whitespace")
        return prefix
