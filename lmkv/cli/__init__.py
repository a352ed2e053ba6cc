"""Layer 12: the ``lmkv`` command.

``commands`` (argument parsing and the subcommands; ``main`` is the entry
point), ``demo`` (``lmkv demo``), ``migrate`` (``lmkv migrate``: an LMCache
config as lmkv's). ``lmkv replay`` lives in ``lmkv.replay``.
"""

from lmkv.cli.commands import main

__all__ = ["main"]
