"""Only the optional C accelerator lives here; everything else is in pyproject.toml.

The extension is optional: where it cannot be compiled, lmkv falls back to
pure Python (same results, slower hashing of token lists).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("lmkv._ext._tokens", ["lmkv/_ext/tokens.c"], optional=True),
    # SIGBUS-safe file mappings (lmkv.contracts.mapped_file): without it, entry
    # files are read with pread instead of mapped.
    # Chunk buffers' reference counts and an arena's free list (lmkv.memory):
    # without it, the same in Python (a few more microseconds a chunk).
    Extension("lmkv._ext._memory", ["lmkv/_ext/memory.c"], optional=True),
    # Cache keys numbered by slot (lmkv.keys.slots): without it, the same in Python.
    Extension("lmkv._ext._slots", ["lmkv/_ext/slots.c"], optional=True),
    Extension("lmkv._ext._busguard", ["lmkv/_ext/busguard.c"], optional=True),
    # Multi-threaded memcpy copies between host-memory paged caches and chunk
    # buffers (lmkv_kernels.host_impl): without it, torch's copies (torch_ref).
    Extension("lmkv_kernels._native._host", ["kernels/lmkv_kernels/_native/host.c"],
              optional=True),
])
