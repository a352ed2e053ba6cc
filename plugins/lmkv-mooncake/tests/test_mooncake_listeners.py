"""What a Mooncake client of this process listens on.

The master's listeners are bound to loopback by the tests (``lmkv.testing.mooncake``).
The client's own transfer engine (its RPC port and the TcpTransport data port)
binds as Mooncake 0.3.13 decides: every interface, whatever ``local_hostname``
or ``MC_TCP_BIND_ADDRESS`` say (setting it to 127.0.0.1 changes neither
listener). docs/security.md says so; this test fails
(strict xfail) the day Mooncake binds them to ``local_hostname``, so the docs
and the tier can then say "closed by default".
"""

from __future__ import annotations

import sys

import pytest

from lmkv.testing.processes import listening_addresses, off_loopback

pytestmark = pytest.mark.slow  # a real mooncake_master


def test_listening_addresses_sees_a_loopback_listener() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert ("127.0.0.1", s.getsockname()[1]) in listening_addresses()
        assert off_loopback([("127.0.0.1", 1), ("::1", 2), ("0.0.0.0", 3), ("::", 4)]) == [
            ("0.0.0.0", 3), ("::", 4)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")
@pytest.mark.xfail(strict=True, reason="Mooncake 0.3.13 binds the transfer engine's "
                   "listeners to every interface (docs/security.md)")
def test_a_client_listens_on_loopback_only(mooncake_master: object,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from mooncake_helpers import new_tier

    from lmkv_mooncake.client import join_closing

    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    before = set(listening_addresses())
    tier = new_tier(mooncake_master, global_segment_size="16MiB")  # its own client
    try:
        assert tier.link.wait_ready(30)
        opened = sorted(set(listening_addresses()) - before)
    finally:
        tier.close()
        join_closing(30)
    assert opened, "no listener found: the check itself is broken"
    assert off_loopback(opened) == [], f"listening beyond loopback: {opened}"
