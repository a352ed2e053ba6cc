"""The KV-aware router's parts: which instance holds which prefix (``index``)."""
