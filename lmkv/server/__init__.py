"""The lmkv server process: one process that owns the tiers and serves several
engine processes.

Modules: ``server`` (the ZMQ loop), ``service`` (the request handlers),
``drops`` (removing an entry a client found not to be the KV its key names),
``sessions`` (what each client holds), ``handles`` (chunk buffers lent to
clients), ``defaults`` and ``main`` (``python -m lmkv.server``, ``lmkv server``).
The protocol and the client side (``ServerClient``, its channel, heartbeat and
liveness) are in ``lmkv.rpc``; the shared-memory arena is ``lmkv.memory.shm``.
The protocol is documented in docs/server.md.

Importing this package imports nothing else.
"""
