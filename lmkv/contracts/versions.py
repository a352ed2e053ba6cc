"""The plugin API's version, one per plugin kind, and what lmkv calls of each kind.

A kind's contract is versioned ``major.minor``, apart from lmkv's own version:
the minor grows when lmkv starts handing a plugin something new it may use
(a context field, an optional method), the major when a plugin written for the
old contract would break (a method lmkv calls with other arguments, a new
abstract method, another constructor). Each change is a section of
docs/migrating-plugins.md.

A plugin class declares the contract it was written for::

    class HelloBackend(StorageBackend):
        name = "hello"
        api_version = "2.0"

lmkv takes a class written for its own major and a minor up to its own; a class
for another major, or for a later minor than this lmkv knows, is left out at
load with one line (``lmkv.plugins.contract``). A class that declares nothing
is taken, with one warning, until lmkv 0.3.

``CALLS`` lists, per kind, how lmkv calls a plugin: the constructor and every
method and property it uses. The load check binds each call's arguments to the
class's own signatures (``inspect.signature``), so a method lmkv would call with
arguments the plugin does not take is found at load, not in the engine's step.
"""

from __future__ import annotations

from dataclasses import dataclass

#: lmkv's version of each kind's contract (``major.minor``). API 1 is lmkv 0.1's.
API_VERSIONS: dict[str, str] = {
    "storage_backend": "2.3",
    "eviction_policy": "2.2",
    "offload_policy": "2.0",
    "serializer": "2.0",
    "gpu_connector": "2.2",
}
#: The lmkv release that stops taking a class without ``api_version``.
UNDECLARED_UNTIL = "0.3"
#: What a plugin author reads when a contract changes.
MIGRATION_GUIDE = "docs/migrating-plugins.md"


@dataclass(frozen=True)
class Call:
    """How lmkv calls one member of a plugin class.

    ``kind`` is ``"method"`` (called on an instance with ``args`` positionally
    and ``kwargs`` by keyword), ``"property"`` (read as an attribute of an
    instance: a property, not a method), ``"constructor"`` (``cls(*args)``) or
    ``"final"`` (a method of lmkv's base class that a plugin must not replace:
    lmkv calls it and it calls the plugin's hooks). ``engine_state``: the call
    also passes the engine's own keyword arguments, which each plugin names
    itself (a GPU connector's ``kv=``, ``kv_caches=``, ``block_ids=``).
    """

    name: str
    args: tuple[str, ...] = ()
    kwargs: tuple[str, ...] = ()
    kind: str = "method"
    engine_state: bool = False
    #: The contract version that added the call: a class written for an earlier
    #: one may have a member of that name of its own, which lmkv neither checks
    #: nor calls ("": since the major's first version).
    since: str = ""

    def shape(self) -> str:
        """The call as lmkv makes it, for messages: ``contains(key, pin=...)``."""
        if self.kind == "property":
            return f"property {self.name}"
        parts = [*self.args, *(f"{k}=..." for k in self.kwargs)]
        if self.engine_state:
            parts.append("**engine_state")
        name = "cls" if self.kind == "constructor" else self.name
        return f"{name}({', '.join(parts)})"


_CONSTRUCTOR = Call("__init__", ("options", "context"), kind="constructor")

CALLS: dict[str, tuple[Call, ...]] = {
    "storage_backend": (
        _CONSTRUCTOR,
        # Both shapes of a call with a keyword the ABC defaults: lmkv makes both.
        Call("contains", ("key",)),
        Call("contains", ("key",), ("pin",)),
        Call("batched_submit_put", ("keys", "objs")),
        Call("batched_submit_put", ("keys", "objs"), ("parents",)),
        Call("get_blocking", ("key",)),
        Call("pin", ("key",)),
        Call("unpin", ("key",)),
        Call("remove", ("key",)),
        Call("batched_async_contains", ("lookup_id", "keys")),
        Call("batched_async_contains", ("lookup_id", "keys"), ("pin",)),
        Call("batched_get_non_blocking", ("lookup_id", "keys")),
        Call("batched_get_direct", ("lookup_id", "keys")),
        Call("allocate", ("shape", "dtype")),
        Call("stats"),
        Call("close"),
        Call("usage_bytes", kind="property"),
        Call("capacity_bytes", kind="property"),
    ),
    "eviction_policy": (
        _CONSTRUCTOR,
        Call("on_insert", ("key", "parent")),
        Call("on_access", ("key",)),
        Call("on_remove", ("key",)),
        Call("on_extended", ("key",)),
        Call("on_leaf", ("key",)),
        Call("on_insert_many", ("keys", "parents"), since="2.2"),
        Call("on_access_many", ("keys",), since="2.2"),
        Call("victims"),
        Call("insert", kind="final"),
        Call("insert_many", kind="final", since="2.2"),
        Call("access", kind="final"),
        Call("access_many", kind="final", since="2.2"),
        Call("forget", kind="final"),
        Call("candidates", kind="final"),
        Call("watch", kind="final"),
        Call("order_slots", kind="final"),
        Call("use_slots"),
    ),
    "offload_policy": (
        _CONSTRUCTOR,
        Call("add", ("meta", "block_hashes")),
        Call("mark_req_finished", ("req_id",)),
        Call("pop_items_for_offload", ("count",)),
        Call("__len__"),
        Call("ready_count", kind="property"),
    ),
    "serializer": (
        _CONSTRUCTOR,
        Call("serialize", ("obj", "key")),
        Call("deserialize", ("frame", "allocate", "key")),
    ),
    "gpu_connector": (
        _CONSTRUCTOR,
        Call("to_chunks", ("spans",), ("after",), engine_state=True),
        Call("from_chunks", ("spans",), ("after",), engine_state=True),
        Call("from_checked_chunks", ("spans", "checksums"), engine_state=True, since="2.2"),
    ),
}


def api_summary() -> str:
    """The plugin API in a few words: ``plugin API 2.0`` when every kind has the
    same version, else the version most kinds have and the others by name
    (``plugin API 2.1, storage_backend 2.2, offload_policy 2.0, serializer 2.0``)."""
    versions = list(API_VERSIONS.values())
    common = max(versions, key=versions.count)
    others = [f"{kind} {v}" for kind, v in API_VERSIONS.items() if v != common]
    return ", ".join([f"plugin API {common}", *others])


def parse_version(text: object) -> tuple[int, int] | None:
    """``(major, minor)`` of a ``"major.minor"`` string; None when it is not one."""
    if not isinstance(text, str):
        return None
    major, dot, minor = text.strip().partition(".")
    if not dot or not major.isdigit() or not minor.isdigit():
        return None
    return int(major), int(minor)


#: Modules of lmkv's own: its core and its built-in plugins.
_LMKV_MODULES = ("lmkv.", "lmkv_backends", "lmkv_policies", "lmkv_kernels")


def is_lmkv_class(klass: type) -> bool:
    """Whether ``klass`` is lmkv's own (its core's or a built-in plugin's) or Python's."""
    module = getattr(klass, "__module__", None)
    return isinstance(module, str) and (module.startswith(_LMKV_MODULES)
                                        or module == "builtins")


def declared_version(cls: type, base: type) -> object:
    """The ``api_version`` ``cls`` or a class of the plugin's own declares; None when
    there is none. A class of lmkv's (its base classes, a built-in plugin a
    plugin extends) never lends its declaration to a subclass: a subclass of
    the built-in ``cpu`` tier written for 2.0 must not pass for 3.0 once lmkv's
    tier says 3.0."""
    for klass in cls.__mro__:
        if klass is base or (klass is not cls and is_lmkv_class(klass)):
            break
        if "api_version" in vars(klass):
            return vars(klass)["api_version"]
    return None
