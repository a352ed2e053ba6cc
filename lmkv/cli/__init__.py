"""Layer 12: the ``lmkv`` command.

``main`` (argument parsing and the subcommands), ``demo`` (``lmkv demo``),
``migrate`` (``lmkv migrate``: an LMCache config as lmkv's). ``lmkv replay``
lives in ``lmkv.replay``.
"""

from lmkv.cli.main import main

__all__ = ["main"]
