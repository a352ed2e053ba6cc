"""Layer 2: what a chunk is called.

``chunking``: tokens into chunk keys (``CacheKey``, ``KeyMeta``, ``Identity``,
``TokenChunker``, ``prefix_hashes``); ``aliases``: a chunk's leading blocks
under keys of their own. Plugin authors take these names from
``lmkv.contracts``.
"""
