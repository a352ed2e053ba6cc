"""Options of the ``peer`` tier (``tiers.N.options`` in an lmkv config)."""

from __future__ import annotations

import re

from pydantic import ByteSize, ConfigDict, Field, PositiveInt, StrictBool, model_validator

from lmkv.base.redact import redact_url
from lmkv.base.units import ByteCount
from lmkv.config.model import CurveConfig
from lmkv.contracts.plugin import PluginOptions

ADDRESS_FORMS = "ipc:///path/to/socket or tcp://host:port"
_TCP = re.compile(r"^tcp://(\[[0-9a-fA-F:.]+\]|[^:/\[\]]+):(\d{1,5})$")


def address_problem(address: str) -> str:
    """Why ``address`` is not a peer address lmkv can use; "" when it is."""
    if address.startswith("ipc://"):
        return "" if len(address) > len("ipc://") and address[6] == "/" else \
            "an ipc:// address needs an absolute path"
    m = _TCP.match(address)
    if not m:
        return f"is not {ADDRESS_FORMS}"
    if not 0 < int(m.group(2)) < 65536:
        return "has a port outside 1-65535"
    return ""


class PeerOptions(PluginOptions):
    """The ``peer`` tier: the memory tiers of the other instances of a fleet."""

    model_config = ConfigDict(allow_inf_nan=False)

    peers: list[str] = Field(min_length=1)
    """Every instance of the fleet, by the address it serves on (this one's
    ``listen`` among them): the same list, in any order, everywhere."""
    listen: str | None = None
    """Where this instance serves its memory tier to the others; None: it serves
    nothing (it only reads)."""
    curve: CurveConfig | None = None
    """CURVE keys for tcp:// addresses (docs/security.md): ``secret_key`` (this
    instance's key pair), ``server_key`` (the peers' public key; default: this
    key pair's own, for a fleet that shares one key pair), ``authorized_keys``
    (who may connect; default: this key pair's own public key)."""
    insecure: StrictBool = False
    """Accept tcp:// addresses without CURVE: anyone who reaches the port can then
    read what this instance shares and send it KV."""
    timeout_ms: PositiveInt = 500
    """How long one request to a peer may take; past it the request is a miss
    and that peer is skipped for ``retry_after_s``."""
    retry_after_s: float = Field(default=1.0, ge=0)
    """After a peer failed to answer, treat it as missing for this long."""
    push_to_owner: StrictBool = True
    """Send each chunk this instance stores to its owner among the peers (rendezvous
    hashing of the chunk's key): the owner then serves it to the fleet."""
    accept_puts: StrictBool = True
    """Store chunks the peers push to this instance as their owner."""
    max_pending_bytes: ByteCount = Field(default=ByteSize(256 << 20), ge=0)
    """Bytes of pushes not yet sent; past it new pushes are dropped and counted."""
    max_request_bytes: ByteCount = Field(default=ByteSize(256 << 20), gt=0)
    """The largest message the endpoint takes (a bigger one disconnects its sender),
    and the most frame bytes one push carries."""
    max_reply_bytes: ByteCount = Field(default=ByteSize(256 << 20), gt=0)
    """The most frame bytes one answer carries (at least one frame)."""
    close_timeout_s: float = Field(default=2.0, ge=0)
    """``close()`` waits this long for pushes in flight, then drops them."""
    directory: str | None = None
    """A Redis the fleet runs (``redis://[[user]:password@]host[:port][/db]``,
    ``rediss://...``, ``unix:///path?db=N``), kept as a directory of who holds which
    chunk: each instance registers what it stores, a lookup reads from a holder.
    None: owners by rendezvous hashing, chunks pushed to them."""
    directory_ttl_s: float = Field(default=300.0, gt=0)
    """A registration expires this long after it was last made."""

    @model_validator(mode="after")
    def _addresses(self) -> PeerOptions:
        for where, address in [("listen", self.listen)] + [
                (f"peers.{i}", a) for i, a in enumerate(self.peers)]:
            if address is None:
                continue
            problem = address_problem(address)
            if problem:
                raise ValueError(f"{where}: {address!r} {problem}")
            if address.startswith("tcp://") and self.curve is None and not self.insecure:
                raise ValueError(
                    f"{where}: {address!r} is tcp:// without curve: every local user (and, "
                    "beyond loopback, anyone who reaches the port) could read this fleet's "
                    "KV and send it KV; set curve (docs/security.md), use ipc:// addresses "
                    "on one machine, or insecure: true to accept that")
        if self.directory is not None and not self.directory.startswith(
                ("redis://", "rediss://", "unix://")):
            raise ValueError(f"directory: {redact_url(self.directory)!r} is not a Redis URL "
                             "(redis://[[user]:password@]host[:port][/db], rediss://... or "
                             "unix:///path?db=N)")
        if self.listen is not None and self.listen not in self.peers:
            # Spelled otherwise here than in the others' lists, the instances would
            # not agree on who owns what.
            raise ValueError(f"listen: {self.listen!r} is not in peers: list every instance "
                             "(this one too) the same way in every instance's peers")
        return self

    def members(self) -> list[str]:
        """The fleet: ``peers``, each once."""
        return list(dict.fromkeys(self.peers))
