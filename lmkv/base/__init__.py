"""Layer 0: what every other layer uses and that uses nothing of lmkv's.

Errors (``errors``), byte sizes (``units``), secret redaction (``redact``),
owner-only paths (``private``), rate-limited logs (``logutil``), the strict
YAML loader (``strict_yaml``), the CPUs lmkv's threads run on (``affinity``),
lazy re-exports (``exports``) and the old module paths kept for one release
(``moved``). Only the standard library and pydantic-free code live here.
"""
