"""Server defaults shared by the option parser and the session table.

A module of its own so that building ``lmkv server``'s options (and so
``lmkv --help``) imports no torch.
"""

from __future__ import annotations

#: Chunk buffers lent to a client and left unused this long are released
#: (shared-memory ones quarantined).
DEFAULT_HANDLE_TTL_S = 30.0
#: Quarantined buffers of a client the server cannot check are freed after
#: it has been silent this long.
DEFAULT_QUARANTINE_GRACE_S = 600.0

#: The server logs its listening and stopped lines at INFO, so that is its default
#: level, as ``lmkv server`` and as ``python -m lmkv.server``.
DEFAULT_LOG_LEVEL = "INFO"
