"""Testing helpers for plugin authors.

* ``StorageBackendConformance``: subclass it in a ``Test*`` class, set
  ``backend_class`` and ``backend_options()``, and pytest runs the storage
  contract against your tier built the way lmkv builds it: the load check,
  every built-in eviction policy, parents handed to the policy, and a storage
  manager made from a config that names it.
* ``EvictionPolicyConformance``: the same for an eviction policy
  (``policy_class``, ``policy_options()``): the load check, leaves only, no
  orphaned prefix through a real tier, pins and references respected,
  bounded memory, usage back to zero.
* ``GPUConnectorConformance``: the same for a GPU connector
  (``connector_class``, ``connector_options()``, and your engine's state:
  ``engine_state``, ``token_kv``): the load check, each token's KV where the
  spec's chunk order puts it, chunks loaded back bit for bit, and the chunk
  layout an engine names them by.
* Plugins built the way lmkv builds them (``lmkv.testing.building``):
  ``load_problem(cls)`` (why lmkv's load check would leave a class out; "" when
  it fits), ``build_plugin(cls, options, context)``, ``config_of(tiers,
  **keys)`` (a config as lmkv loads one, from its arguments alone),
  ``storage_from(tiers, **keys)`` (the storage manager lmkv builds from it),
  ``selectable(*classes)`` (classes selectable by name in a block),
  ``plugin_class(kind, name)`` (an installed class by its name).
* ``registered_plugin(obj)``: a context manager that registers a plugin in a
  fresh plugin manager for the length of a block.
* ``lmkv.testing.server.spawn_server(directory, tiers_yaml)``: a real ``lmkv
  server`` process on a free loopback port, for tests of server mode.
* ``lmkv.testing.serve.start_vllm_serve(model_dir, log_dir=...)``: a real
  ``vllm serve`` process (docs/vllm.md's recipe through
  ``lmkv_kv_transfer_config``), its ``/metrics`` parsed, and ``stop()``:
  SIGTERM, then what was left behind (processes, lmkv shared memory).
* ``lmkv.testing.engines.open_local_engine(config, spec, model_name=...)``:
  ``open_engine`` for a test that looks inside the in-process engine.
* ``lmkv.testing.tiers``: ``open_tier(name, options)`` (a tier as a config builds
  it), ``serializer(name)``, ``load_test_config(overrides)``, ``strict_refcounts()``.
* ``lmkv.testing.redis`` and ``lmkv.testing.mooncake``: real ``redis-server``
  (one, a cluster, TLS) and ``mooncake_master`` / ``mooncake_client`` processes
  on loopback ports (``lmkv.testing.processes``: their base, free ports).
* ``lmkv.testing.engine_worker.shared_between_processes(tier, directory)``: two
  engine processes, one after the other, share KV through ``tier``.
* pytest fixtures (loaded automatically through the ``pytest11`` entry point):
  ``lmkv_plugin_manager`` (a fresh manager for one test) and
  ``register_lmkv_plugin`` (register a plugin for one test).
"""

from lmkv.testing.building import (
    build_plugin,
    config_of,
    load_problem,
    plugin_class,
    selectable,
    storage_from,
)
from lmkv.testing.conformance import StorageBackendConformance
from lmkv.testing.connector_conformance import GPUConnectorConformance
from lmkv.testing.plugins import fresh_plugin_manager, registered_plugin
from lmkv.testing.policy_conformance import EvictionPolicyConformance

__all__ = ["EvictionPolicyConformance", "GPUConnectorConformance",
           "StorageBackendConformance", "build_plugin",
           "config_of", "fresh_plugin_manager", "load_problem", "plugin_class",
           "registered_plugin", "selectable", "storage_from"]
