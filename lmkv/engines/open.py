"""``open_engine``: the engine a config asks for.

``mode: in_process`` gives a ``LocalEngine`` over the config's tiers;
``mode: server`` a ``RemoteEngine`` over the lmkv server at
``server.address``. Callers get an ``Engine`` and never name either class.

``metrics.port`` starts the process's Prometheus endpoint here, once per
process (``lmkv.metrics.exporter.serve_metrics``): the first engine a process
opens starts it, later ones find it running.
"""

from __future__ import annotations

import logging

from lmkv.config.model import LMKVConfig
from lmkv.contracts.connector import GPUConnector, KVSpec
from lmkv.engines.connector import resolve_connector
from lmkv.engines.local import LocalEngine
from lmkv.engines.protocol import Engine
from lmkv.engines.remote import RemoteEngine
from lmkv.storage.manager import StorageManager

logger = logging.getLogger(__name__)


def open_engine(config: LMKVConfig, spec: KVSpec, *, model_name: str,
                connector: GPUConnector | None = None, kv_kind: str | None = None,
                world_size: int = 1, worker_id: int = 0,
                block_size: int | None = None, record_metrics: bool = True,
                direct_reads: bool = False) -> Engine:
    """An engine for ``spec`` (the KV's geometry and dtype) under ``config``.

    ``connector``: a connector built by the caller (tests, benchmarks); without
    one it is resolved here (``resolve_connector``: ``config.gpu_connector``,
    else the default connector for ``kv_kind`` KV, checked to take that kind;
    ``kv_kind=None`` asserts no kind: the config's connector, else ``hf``).
    ``block_size``: the engine's block in tokens, the granularity of hits inside
    chunks unless ``config.block_size`` says otherwise (``hit_block_size``).
    ``record_metrics``: a local engine records its lookups, loads and stores
    (``lmkv.metrics``); False where the caller records them itself (the vLLM
    connector), so nothing counts twice. A remote engine's figures are the server's.
    ``direct_reads``: see ``LocalEngine`` (a remote engine reads through the server).
    """
    if config.metrics.port is not None:
        start_metrics(config, worker_id)
    if connector is None:
        connector = resolve_connector(config, spec, kv_kind)
    if config.mode == "server":
        return RemoteEngine(config, spec, model_name=model_name, connector=connector,
                            world_size=world_size, worker_id=worker_id,
                            block_size=block_size)
    return LocalEngine(config, spec, model_name=model_name, connector=connector,
                       storage=StorageManager.from_config(config), world_size=world_size,
                       worker_id=worker_id, block_size=block_size,
                       record_metrics=record_metrics, direct_reads=direct_reads)


def start_metrics(config: LMKVConfig, worker_id: int = 0) -> None:
    """The process's metrics endpoint of ``metrics.port`` (worker ``r``: port + r, so
    the workers of one vLLM instance do not collide; port 0: any free port)."""
    from lmkv.metrics.exporter import serve_metrics

    port = config.metrics.port
    assert port is not None
    if port and port + worker_id > 65535:
        from lmkv.base.errors import ConfigError

        raise ConfigError(f"metrics.port = {port}: worker {worker_id} would serve port "
                          f"{port + worker_id}; allowed: a port at most {65535 - worker_id}")
    served = serve_metrics(port + worker_id if port else 0, config.metrics.host)
    from lmkv.config.model import is_loopback_host

    if not is_loopback_host(served.host):
        logger.warning("lmkv: metrics served on %s (metrics.host is not loopback, as "
                       "configured): whoever reaches it reads the cache figures", served.url)
