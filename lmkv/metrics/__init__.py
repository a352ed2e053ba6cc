"""lmkv's figures: one catalog of names, one recorder per process.

Exporters read the recorder: vLLM's connector stats inside vLLM
(``lmkv.integrations.vllm``), Prometheus text outside it.
"""

from lmkv.metrics.catalog import BY_NAME, CATALOG, LATENCY_BUCKETS, Metric
from lmkv.metrics.recorder import Histogram, Recorder, Totals, recorder

__all__ = ["BY_NAME", "CATALOG", "LATENCY_BUCKETS", "Histogram", "Metric", "Recorder", "Totals",
           "recorder"]
