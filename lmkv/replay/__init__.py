"""``lmkv replay``: a request trace through the real storage manager and tiers,
against Belady's offline optimum (docs/replay.md)."""
