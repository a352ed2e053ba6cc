"""lmkv's built-in tiers, serializer and GPU connectors.

Registered through the ``lmkv`` entry-point group (``lmkv_backends.plugin``),
exactly as a third-party plugin would be; the core never imports this package.
"""
