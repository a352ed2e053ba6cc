"""A third-party plugin package written to disk with a real ``.dist-info``.

importlib.metadata finds it on sys.path exactly as it finds a pip-installed
distribution, so entry-point discovery is exercised for real.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

#: The distributions of this repository. A plugin of any other distribution that
#: is installed in the venv is someone else's: tests that count or configure
#: every installed plugin count only these (plus what the test adds itself).
OUR_DISTRIBUTIONS = frozenset({"lmkv", "lmkv-redis", "lmkv-mooncake"})


class DictFrameEdits:
    """The storage kit's fault hooks for a tier that keeps its frames in a dict
    (``backend.frames``): the tutorial's and the ported legacy tier."""

    outlives_process = False

    def corrupt_entry(self, backend: Any, key: Any) -> bool:
        frame = bytearray(backend.frames[key])
        frame[-1] ^= 0x01
        backend.frames[key] = bytes(frame)
        return True

    def copy_entry(self, backend: Any, source: Any, target: Any) -> bool:
        backend.frames[target] = backend.frames[source]
        return True


def our_plugin_names(kind: str) -> list[str]:
    """The names of ``kind`` this repository's distributions provide."""
    from lmkv.plugins.manager import get_plugin_manager

    return sorted(e.name for e in get_plugin_manager().registry.entries()
                  if e.kind == kind and e.source.distribution in OUR_DISTRIBUTIONS)

PLUGIN_SOURCE = '''
from lmkv.contracts import EvictionPolicy, PluginOptions, hookimpl
from lmkv_backends.tiers.cpu import CPUBackend


class HelloOptions(PluginOptions):
    max_bytes: int = 1 << 20
    greeting: str = "hello"


class HelloBackend(CPUBackend):
    name = "hello"
    api_version = "2.0"
    Options = HelloOptions


class NewestFirst(EvictionPolicy):
    name = "newest-first"
    api_version = "2.0"

    def __init__(self, options=None, context=None):
        super().__init__(options, context)
        self.keys = []

    def on_insert(self, key, parent):
        self.keys.append(key)

    def on_access(self, key):
        pass

    def on_remove(self, key):
        self.keys.remove(key)

    def victims(self):
        return iter(reversed(self.keys))


@hookimpl
def lmkv_storage_backends():
    return [HelloBackend]


@hookimpl
def lmkv_eviction_policies():
    return NewestFirst
'''


def write_dist(root: Path, dist: str, module: str, source: str, version: str = "1.0") -> Path:
    """Write package ``module`` and a dist-info registering it in group ``lmkv``."""
    pkg = root / module
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "plugin.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[lmkv]\n{dist} = {module}.plugin\n")
    return root


def write_hello_plugin(root: Path) -> Path:
    return write_dist(root, "lmkv-hello", "lmkv_hello", PLUGIN_SOURCE)


def write_broken_plugin(root: Path) -> Path:
    return write_dist(root, "lmkv-broken", "lmkv_broken",
                      "import not_a_real_module_for_lmkv_tests\n")
