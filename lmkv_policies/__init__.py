"""lmkv's built-in eviction and lazy-offload policies.

Registered through the ``lmkv`` entry-point group (``lmkv_policies.plugin``),
exactly as a third-party plugin would be; the core never imports this package.
"""
