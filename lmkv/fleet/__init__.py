"""A fleet of lmkv instances sharing KV peer to peer: the peer protocol, the
endpoint that serves an instance's memory tier to its peers, and the ``peer``
tier that reads from them (docs/tiers/peer.md)."""
