"""What one lookup, load or store adds to the recorder, written once.

The lmkv server's handlers and the local engine (outside vLLM) call these;
inside vLLM the connector records in vLLM's terms instead (tokens put into
vLLM's cache), and its engine is opened with ``record_metrics=False`` so no
figure is counted twice.
"""

from __future__ import annotations

import time

from lmkv.metrics.recorder import recorder


def record_lookup(asked: int, hit: int, start: float) -> None:
    """A lookup of ``asked`` tokens that found ``hit``; ``start``: its
    ``time.perf_counter()`` when asked."""
    recorder().record((("lookups_total", 1), ("lookup_hit_tokens_total", hit),
                       ("lookup_miss_tokens_total", max(0, asked - hit))),
                      "lookup_seconds", time.perf_counter() - start)


def record_load(tokens: int, nbytes: int, start: float) -> None:
    """A load that brought ``tokens`` tokens (``nbytes`` bytes of KV)."""
    recorder().record((("loads_total", 1), ("loaded_tokens_total", max(0, tokens)),
                       ("load_bytes_total", nbytes)),
                      "load_seconds", time.perf_counter() - start)


def record_store(tokens: int, nbytes: int, start: float) -> None:
    """A store that handed ``tokens`` tokens (``nbytes`` bytes of KV) to the tiers."""
    recorder().record((("stores_total", 1), ("stored_tokens_total", tokens),
                       ("store_bytes_total", nbytes)),
                      "store_seconds", time.perf_counter() - start)
