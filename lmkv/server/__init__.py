"""The lmkv server: one process that owns the tiers and serves several engine processes.

Modules: ``protocol`` (the messages), ``server`` (the ZMQ loop), ``service``
(the request handlers), ``sessions`` (what each client holds), ``shm`` (the
shared-memory arena), ``client`` (``ServerClient``, used by engines),
``channel`` (the client's socket) and ``main`` (``python -m lmkv.server``).
The protocol is documented in docs/server.md.

Importing this package imports nothing else: the cpu tier imports ``shm``.
"""
