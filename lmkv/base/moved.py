"""Old module paths of lmkv 0.1, kept importable for one minor release.

lmkv 0.2 grouped its modules into one package per layer (``lmkv.contracts``,
``lmkv.keys``, ``lmkv.base``, ...). A plugin written against 0.1 that imports
``lmkv.backend`` or ``lmkv.tokens`` still gets the very module it used to
(the same objects, so ``isinstance`` and subclassing hold), with one
``DeprecationWarning`` per old path naming the new one. ``lmkv/__init__.py``
installs the finder; lmkv 0.3 removes it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
import warnings
from types import FrameType, ModuleType

#: Old module -> the module it became.
MOVED: dict[str, str] = {
    "lmkv.errors": "lmkv.base.errors",
    "lmkv.affinity": "lmkv.base.affinity",
    "lmkv.units": "lmkv.base.units",
    "lmkv.redact": "lmkv.base.redact",
    "lmkv.private": "lmkv.base.private",
    "lmkv.logutil": "lmkv.base.logutil",
    "lmkv.strict_yaml": "lmkv.base.strict_yaml",
    "lmkv.stats": "lmkv.metrics.tier_text",
    "lmkv.transfer_stream": "lmkv.memory.transfer_stream",
    "lmkv.tokens": "lmkv.keys.chunking",
    "lmkv.aliases": "lmkv.keys.aliases",
    "lmkv.plugin_base": "lmkv.contracts.plugin",
    "lmkv.plugins.hookspecs": "lmkv.contracts.hooks",
    "lmkv.backend": "lmkv.contracts.tier",
    "lmkv.policy": "lmkv.contracts.policy",
    "lmkv.serde": "lmkv.contracts.serde",
    "lmkv.gpu": "lmkv.contracts.connector",
    "lmkv.faults": "lmkv.contracts.faults",
    "lmkv.put_queue": "lmkv.contracts.put_queue",
    "lmkv.direct": "lmkv.contracts.direct_chunk",
    "lmkv.config_keys": "lmkv.config.suggestions",
    "lmkv.lmcache_map": "lmkv.config.lmcache",
    "lmkv.writethrough": "lmkv.storage.writethrough",
    "lmkv.prefetch": "lmkv.storage.prefetch",
    "lmkv.admission": "lmkv.storage.admission",
    "lmkv.auth": "lmkv.rpc.auth",
    "lmkv.engines.direct": "lmkv.engines.direct_loads",
    "lmkv.demo": "lmkv.cli.demo",
    "lmkv.migrate": "lmkv.cli.migrate",
}
#: Where a plugin author reads what to import instead.
GUIDE = "docs/migrating-plugins.md"
#: Plugin-facing paths: their names now come from one root, ``lmkv.contracts``.
_CONTRACTS = {"lmkv.backend", "lmkv.policy", "lmkv.serde", "lmkv.gpu", "lmkv.plugin_base",
              "lmkv.tokens", "lmkv.faults", "lmkv.put_queue", "lmkv.errors", "lmkv.units",
              "lmkv.redact", "lmkv.affinity", "lmkv.direct"}

_warned: set[str] = set()
_lock = threading.Lock()


def advice(old: str) -> str:
    """The one line an old path's warning says."""
    new = MOVED[old]
    instead = "lmkv.contracts" if old in _CONTRACTS else new
    return (f"{old} moved to {new} in lmkv 0.2 and goes away in 0.3; import from "
            f"{instead} instead (see {GUIDE})")


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module it became (the same object)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._own_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system gave the module the old path's spec: give its own back.
        module.__spec__ = self._own_spec


class MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        with _lock:
            first = fullname not in _warned
            _warned.add(fullname)
        if first:
            warnings.warn(advice(fullname), DeprecationWarning, stacklevel=_caller_level())
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def _caller_level() -> int:
    """The ``stacklevel`` that points a warning at the code that imported the old
    path. ``warnings`` itself skips the import system's frozen frames; this skips
    the rest between here and the importer (this module, ``importlib``'s
    ``import_module``)."""
    frame: FrameType | None = sys._getframe(2)  # find_spec's caller
    level = 2
    while frame is not None:
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:
            frame = frame.f_back  # not counted: warnings skips it too
            continue
        if name == __file__ or name.endswith(("importlib/__init__.py",)):
            level += 1
            frame = frame.f_back
            continue
        break
    return level


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
