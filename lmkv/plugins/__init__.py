"""lmkv's plugin system, in two minutes.

A plugin is an importable module (or object) with ``@hookimpl`` functions that
return classes. Publish it under the ``lmkv`` entry-point group::

    # pyproject.toml of "lmkv-hello"
    [project.entry-points.lmkv]
    lmkv-hello = "lmkv_hello.plugin"

    # lmkv_hello/plugin.py
    from lmkv.contracts import hookimpl
    from lmkv_hello.backend import HelloBackend

    @hookimpl
    def lmkv_storage_backends():
        return [HelloBackend]

After ``pip install lmkv-hello``, ``lmkv plugins`` lists ``hello`` and a
config selects it with ``tiers: [{type: hello, options: {...}}]``.

Hooks (see ``lmkv.contracts.hooks``): ``lmkv_storage_backends``,
``lmkv_eviction_policies``, ``lmkv_offload_policies``, ``lmkv_serializers``,
``lmkv_gpu_connectors``. Each class declares ``name``, an ``Options``
pydantic model (subclass ``lmkv.contracts.PluginOptions``; unknown keys are
errors) and the contract version it was written for (``api_version``); every
class is checked against its contract at load (``lmkv.plugins.contract``) and
one that does not fit is left out with one line per plugin.
lmkv builds every kind the same way, ``cls(options, context)``: validated
options and a small frozen dataclass of what lmkv hands that kind
(``BackendContext``, ``EvictionContext``, ``OffloadContext``,
``SerializerContext``, ``ConnectorContext``). A config's plugins are resolved
once, when it is loaded (``LMKVConfig.plugins``); ``PluginManager`` has one
typed look-up per kind (``storage_backend(name)``, ...).

``LMKV_LOAD_PLUGINS=a,b`` loads only the named entry points (or
distributions); ``LMKV_DISABLE_PLUGINS=a,b`` skips them. A plugin that fails
to import, or returns a class that breaks the rules, is recorded (``lmkv plugins``
shows the error; never fatal to other plugins) and becomes an error
only when a config selects a name it would have provided. Plugin authors
import from ``lmkv.contracts``; this package is lmkv's side of the contract.
"""

from lmkv.contracts.hooks import ENTRY_POINT_GROUP, hookimpl, hookspec
from lmkv.contracts.plugin import NoOptions, Plugin, PluginOptions
from lmkv.plugins.manager import PluginManager, get_plugin_manager, reset_plugin_manager
from lmkv.plugins.registry import KINDS, KNOWN_PLUGINS, Registry

__all__ = [
    "ENTRY_POINT_GROUP",
    "KINDS",
    "KNOWN_PLUGINS",
    "NoOptions",
    "Plugin",
    "PluginManager",
    "PluginOptions",
    "Registry",
    "get_plugin_manager",
    "hookimpl",
    "hookspec",
    "reset_plugin_manager",
]
