"""Read an lmkv metrics endpoint back (``lmkv stats --server http://HOST:PORT``).

The inverse of ``lmkv.metrics.exporter``: ``lmkv_*`` samples become the plain
figures of ``Totals.plain()`` and tier rows keyed like ``StorageManager.stats()``,
so ``lmkv stats`` shows a scraped process and an ``lmkv server``'s RPC stats alike.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

from lmkv.base.errors import LMKVError
from lmkv.base.redact import redact_url
from lmkv.metrics.catalog import BY_NAME, TIER_SOURCES

PREFIX = "lmkv_"


def scrape(url: str, timeout_s: float = 5.0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(figures, tier rows) of the endpoint at ``url`` (``/metrics`` added when the
    URL names no path); LMKVError, one line, when it does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    target = url if url.rstrip("/").count("/") > 2 else url.rstrip("/") + "/metrics"
    try:
        with urllib.request.urlopen(target, timeout=timeout_s) as reply:
            text = reply.read().decode()
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise LMKVError(f"no lmkv metrics endpoint answers at {redact_url(target)}: "
                       f"{reason}") from None
    counters: dict[str, float] = {}
    gauges: dict[str, float] = {}
    hists: dict[str, dict[str, Any]] = {}
    tiers: dict[tuple[str, str], dict[str, Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix(PREFIX)
            if name == sample.name:
                continue
            if family.type == "histogram":
                base = family.name.removeprefix(PREFIX)
                hist = hists.setdefault(base, {"count": 0, "sum": 0.0})
                if name == f"{base}_count":
                    hist["count"] = int(sample.value)
                elif name == f"{base}_sum":
                    hist["sum"] = sample.value
                continue
            if name.endswith("_created"):
                continue
            metric = BY_NAME.get(name)
            if metric is None:
                continue
            if name in TIER_SOURCES:
                key = (sample.labels.get("tier", ""), sample.labels.get("type", ""))
                row = tiers.setdefault(key, {"tier": _int(key[0]), "type": key[1]})
                row[TIER_SOURCES[name]] = int(sample.value)
            elif metric.kind == "counter":
                counters[name] = sample.value
            else:
                gauges[name] = sample.value
    rows = [tiers[k] for k in sorted(tiers, key=lambda k: (_int(k[0]), k[1]))]
    return {"counters": counters, "gauges": gauges, "histograms": hists}, rows


def _int(text: str) -> int | str:
    return int(text) if text.isdigit() else text
