"""A worker process for the lookup tests: its own LocalEngine with a cpu tier,
served by one LookupResponder per endpoint, driven over a multiprocessing pipe."""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

import torch

import lmkv.memory
from lmkv import KVSpec, load_config
from lmkv.engines.local import LocalEngine
from lmkv.lookup import LookupResponder
from lmkv.testing.engines import open_local_engine

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16)


def make_engine(chunk_size: int, max_bytes: int, rank: int) -> LocalEngine:
    # Hits in blocks of 8 inside chunks (a client without block_size asks whole chunks).
    config = load_config(env={}, overrides={"lmkv.chunk_size": chunk_size,
                                            "lmkv.block_size": 8,
                                            "lmkv.tiers.0.options.max_bytes": max_bytes})
    return open_local_engine(config, SPEC, model_name="lookup-test", world_size=2,
                                   worker_id=rank)


def hf_kv(total: int, spec: KVSpec = SPEC) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (1, spec.num_kv_heads, total, spec.head_dim)
    return [(torch.randn(shape).to(spec.dtype), torch.randn(shape).to(spec.dtype))
            for _ in range(spec.num_layers)]


def state(engine: LocalEngine, responders: list[LookupResponder]) -> dict[str, Any]:
    """Pins and references held on the cpu tier's entries beyond the tier's own."""
    tier = engine.storage.tiers[0]
    entries = tier.entry_refs()
    return {
        "entries": len(entries),
        "pins": sum(pins for _, pins in entries),
        "extra_refs": sum(refs - 1 for refs, _ in entries),
        "live_objects": tier.allocator.live_objects,
        "lookups_held": len(engine.storage.events),
        "tier_hits": tier.counters.hits,
        "responders": [s.stats() for s in responders],
    }


def serve(conn: Connection, rank: int, endpoints: list[tuple[str, str]], chunk_size: int,
          max_bytes: int = 1 << 24) -> None:
    """``endpoints``: (request endpoint to bind, response endpoint to connect) per responder."""
    lmkv.memory.strict_refcounts = True  # a double release is a bug: crash the worker
    engine = make_engine(chunk_size, max_bytes, rank)
    responders = [LookupResponder(engine, req, resp, rank=rank) for req, resp in endpoints]
    conn.send([s.request_endpoint for s in responders])
    while True:
        command, *args = conn.recv()
        if command == "store":
            (tokens,) = args
            conn.send(engine.store(tokens, kv=hf_kv(len(tokens))))
        elif command == "state":
            conn.send(state(engine, responders))
        elif command == "retrieve":
            tokens, lookup_id = args
            conn.send(engine.retrieve(tokens, lookup_id=lookup_id).num_tokens)
        elif command == "stop":
            for responder in responders:
                responder.close()
            engine.close()
            conn.send("stopped")
            return
