"""The async lookup channel between an engine's scheduler and its workers.

The scheduler's ``LookupClient`` hashes a prompt once and asks every worker's
``LookupResponder`` how much of it is stored; each worker starts prefetching the
hit chunks (pinned while planned, then held for the engine's retrieve) and
answers with its hit tokens; the client keeps the minimum. ZMQ PUSH/PULL
carries msgspec msgpack messages (``messages``) over ``ipc://`` sockets under a
runtime directory or ``tcp://`` (``sockets``; the ZMQ transport is config
``lookup.transport``). Guide: docs/lookup.md.
"""

from lmkv.lookup.client import LookupClient
from lmkv.lookup.messages import LookupCleanup, LookupRequest, LookupResponse
from lmkv.lookup.responder import LookupResponder
from lmkv.lookup.sockets import LookupEndpoints, default_runtime_dir

__all__ = [
    "LookupCleanup",
    "LookupClient",
    "LookupEndpoints",
    "LookupRequest",
    "LookupResponder",
    "LookupResponse",
    "default_runtime_dir",
]
