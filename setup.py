"""Only the optional C accelerator lives here; everything else is in pyproject.toml.

The extension is optional: where it cannot be compiled, lmkv falls back to
pure Python (same results, slower hashing of token lists).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("lmkv._ext._tokens", ["lmkv/_ext/tokens.c"], optional=True)])
