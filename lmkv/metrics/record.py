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
    metrics = recorder()
    metrics.add("lookups_total")
    metrics.add("lookup_hit_tokens_total", hit)
    metrics.add("lookup_miss_tokens_total", max(0, asked - hit))
    metrics.observe("lookup_seconds", time.perf_counter() - start)


def record_load(tokens: int, nbytes: int, start: float) -> None:
    """A load that brought ``tokens`` tokens (``nbytes`` bytes of KV)."""
    metrics = recorder()
    metrics.add("loads_total")
    metrics.add("loaded_tokens_total", max(0, tokens))
    metrics.add("load_bytes_total", nbytes)
    metrics.observe("load_seconds", time.perf_counter() - start)


def record_store(tokens: int, nbytes: int, start: float) -> None:
    """A store that handed ``tokens`` tokens (``nbytes`` bytes of KV) to the tiers."""
    metrics = recorder()
    metrics.add("stores_total")
    metrics.add("stored_tokens_total", tokens)
    metrics.add("store_bytes_total", nbytes)
    metrics.observe("store_seconds", time.perf_counter() - start)
