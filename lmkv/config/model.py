"""lmkv's configuration: one pydantic model, from a file, env vars and dotted keys.

Precedence (later wins): defaults < config file (YAML, TOML or JSON) <
``LMKV_*`` environment variables < dotted ``lmkv.*`` keys (what vLLM's
``kv_connector_extra_config`` carries). Then every plugin the config names is
resolved in one step to its class and validated options (``LMKVConfig.plugins``).
Every bad value becomes one line naming the key, the value, what is allowed and
where it came from.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import stat
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretBytes,
    SecretStr,
    StrictBool,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from lmkv.base.errors import ConfigError, UnknownPluginError
from lmkv.base.logutil import LOG_LEVEL_ENV
from lmkv.base.private import default_server_address
from lmkv.base.redact import RedactedRepr, redact_value
from lmkv.base.strict_yaml import StrictYAMLError, load_strict_yaml
from lmkv.base.units import ByteCount
from lmkv.config.suggestions import (
    ENV_PREFIX,
    model_at,
    renamed_key,
    renamed_key_line,
    unknown_key_hint,
)
from lmkv.contracts.plugin import PluginOptions
from lmkv.keys.chunking import DEFAULT_CHUNK_SIZE
from lmkv.plugins.manager import DISABLE_ENV, LOAD_ENV
from lmkv.plugins.resolved import Resolved, ResolvedPlugins, ResolvedTier

if TYPE_CHECKING:
    from lmkv.contracts.connector import GPUConnector
    from lmkv.plugins.manager import PluginManager

logger = logging.getLogger(__name__)

P = TypeVar("P")

# Env vars that are not config keys.
CONFIG_ENV = "LMKV_CONFIG"
#: The GPU connector a config that names none gets, for each kind of engine KV
#: (``GPUConnector.kv_kind``): ``hf`` for transformers' per-layer tensors,
#: ``paged`` for vLLM's paged caches.
DEFAULT_CONNECTORS: dict[str, str] = {"hf": "hf", "paged": "paged"}
#: Read by ``lmkv_kernels`` (which copies run: auto, triton, torch), not a config key.
KERNELS_ENV = "LMKV_KERNELS"
RESERVED_ENV = frozenset({CONFIG_ENV, LOAD_ENV, DISABLE_ENV, LOG_LEVEL_ENV, KERNELS_ENV})
DOTTED_PREFIX = "lmkv."
CONFIG_FILE_KEY = "config_file"


# Strict: true, 1.5 or "12" are not counts (env and dotted values are parsed as JSON first).
PositiveInt = Annotated[int, Field(strict=True, gt=0)]

#: The most tokens a chunk (and a block) may hold: one chunk of a 70B model's KV at
#: this size is about 20 GiB, far past any tier's useful unit of reuse.
MAX_CHUNK_TOKENS = 1 << 16


def _chunk_tokens(value: int) -> int:
    if not 0 < value <= MAX_CHUNK_TOKENS:
        raise PydanticCustomError(
            "chunk_tokens", "must be a positive integer of at most {most} (tokens)",
            {"most": MAX_CHUNK_TOKENS})
    return value


ChunkTokens = Annotated[int, Field(strict=True), AfterValidator(_chunk_tokens)]


class _Model(RedactedRepr, BaseModel):  # its repr lands in logs: no secret goes with it
    model_config = ConfigDict(extra="forbid", validate_default=True,
                              coerce_numbers_to_str=True)


class PluginRef(_Model):
    """``{type: NAME, options: {...}}``; a bare string is shorthand for ``{type: NAME}``."""

    type: str = Field(min_length=1)
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        return {"type": value} if isinstance(value, str) else value


class TierConfig(PluginRef):
    """One storage tier: its backend, the backend's options and its eviction policy."""

    eviction: PluginRef = Field(default_factory=lambda: PluginRef(type="lru"))
    # Store a chunk in this tier only from its N-th sighting (lmkv.storage.admission); 1: always.
    admit_after: Annotated[int, Field(strict=True, ge=1)] = 1


class CurveConfig(_Model):
    """ZMQ CURVE key files for a TCP socket (docs/security.md; ``lmkv keygen`` writes them)."""

    # This process's key pair (a ``.key_secret`` file, owner-only).
    secret_key: str = Field(min_length=1)
    # The public key of the server this process connects to (a ``.key`` file).
    server_key: str | None = Field(default=None, min_length=1)
    # Public keys allowed to connect: one ``.key`` file or a directory of them.
    authorized_keys: str | None = Field(default=None, min_length=1)


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface only. Host names other
    than ``localhost`` count as not loopback: what they resolve to can change."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class LookupConfig(_Model):
    """The async lookup channel between a scheduler and its workers (docs/lookup.md)."""

    transport: Literal["ipc", "tcp"] = "ipc"
    runtime_dir: str | None = None
    host: str = "127.0.0.1"
    base_port: Annotated[int, Field(strict=True, gt=0, lt=65536)] | None = None
    timeout_ms: PositiveInt = 3000
    backoff_ms: Annotated[int, Field(strict=True, ge=0)] = 10
    # tcp only: the key pair the scheduler and its workers share (docs/security.md).
    curve: CurveConfig | None = None
    insecure: StrictBool = False
    # The longest prompt a lookup may name (vLLM passes max_model_len); longer
    # requests are answered 0 unread, so a peer cannot make a worker allocate.
    max_tokens: PositiveInt = 1 << 20

    @model_validator(mode="after")
    def _tcp_needs_a_port(self) -> LookupConfig:
        if self.transport == "tcp" and self.base_port is None:
            raise ValueError("transport 'tcp' needs base_port")
        return self

    @model_validator(mode="after")
    def _closed_beyond_loopback(self) -> LookupConfig:
        if self.transport == "tcp" and self.curve is None and not self.insecure \
                and not is_loopback_host(self.host):
            raise ValueError(f"host {self.host!r} is not loopback: set lookup.curve "
                             "(docs/security.md), or lookup.insecure: true to accept that "
                             "anyone who reaches it can read and answer lookups")
        return self


class ServerConnection(_Model):
    """The ``lmkv server`` an engine uses in server mode (docs/server.md)."""

    # Old key -> new key: a config that still says the old one is told the new name.
    renamed_keys: ClassVar[dict[str, str]] = {"transport": "data_path"}

    # Default: an ipc socket in this user's private runtime directory (what ``lmkv
    # server`` listens on without --host/--port/--socket).
    address: str = Field(default_factory=default_server_address, min_length=1)
    timeout_ms: PositiveInt = 250
    data_path: Literal["auto", "inline"] = "auto"
    # CURVE keys: this process's key pair and the server's public key (docs/security.md).
    # ``lmkv server`` reads its own key pair and ``authorized_keys`` from here too.
    curve: CurveConfig | None = None
    # Read by ``lmkv server``: what one client session may hold at once, its
    # quarantined buffers included (docs/server.md); bytes None: half the arena.
    session_max_bytes: Annotated[ByteCount, Field(gt=0)] | None = None
    session_max_handles: PositiveInt = 256


class MetricsConfig(_Model):
    """The Prometheus endpoint of a process that opens an engine (docs/metrics.md)."""

    # None: no endpoint. Worker r of a vLLM instance serves port + r.
    port: Annotated[int, Field(strict=True, ge=0, lt=65536)] | None = None
    # Closed by default: loopback unless another address is given here.
    host: str = Field(default="127.0.0.1", min_length=1)


class LMKVConfig(_Model):
    """Every key is documented in docs/configuration.md."""

    model_name: str | None = Field(default=None, min_length=1)
    chunk_size: ChunkTokens = DEFAULT_CHUNK_SIZE
    block_size: ChunkTokens | None = None
    # Booleans are strict, as counts are: 'yes', 'on' or 1 is an error, not true.
    save_partial_chunk: StrictBool = False
    tiers: list[TierConfig] = Field(
        default_factory=lambda: [TierConfig(type="cpu")], min_length=1)
    serializer: PluginRef = Field(default_factory=lambda: PluginRef(type="naive"))
    gpu_connector: PluginRef | None = None
    write_through_queue_chunks: PositiveInt = 1024
    lookup: LookupConfig = Field(default_factory=LookupConfig)
    mode: Literal["in_process", "server"] = "in_process"
    async_load: StrictBool = False
    # vLLM connector: load and store layer by layer beside the forward (docs/vllm.md).
    layerwise: StrictBool = False
    # vLLM connector: store the KV of generated tokens too (docs/vllm.md).
    store_decode: StrictBool = False
    server: ServerConnection = Field(default_factory=ServerConnection)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    lazy_offload: StrictBool = False
    lazy_offload_policy: PluginRef = Field(default_factory=lambda: PluginRef(type="FIFO"))
    lazy_offload_threshold: PositiveInt = 100
    lazy_offload_select_count: PositiveInt = 10
    _sources: dict[str, str] = PrivateAttr(default_factory=dict)
    @model_validator(mode="after")
    def _block_divides_chunk(self) -> LMKVConfig:
        if self.block_size is not None and self.chunk_size % self.block_size:
            raise ValueError(f"block_size {self.block_size} must divide chunk_size "
                             f"{self.chunk_size} (hits are matched in blocks inside chunks)")
        return self

    # What the plugin references resolved to, and the references they were resolved
    # from: a copy or an edit of the config that changes them resolves again.
    _plugins: tuple[str, ResolvedPlugins] | None = PrivateAttr(default=None)

    def __eq__(self, other: object) -> bool:
        """Equal keys make equal configs (what they resolved to, and where each key
        came from, follow from the keys)."""
        if not isinstance(other, LMKVConfig):
            return NotImplemented
        return type(self) is type(other) and self.__dict__ == other.__dict__

    @property
    def plugins(self) -> ResolvedPlugins:
        """Every plugin this config selects, as typed classes with validated options.

        ``load_config`` resolves them once, as it loads; a config built in code is
        resolved on first use (with the process-wide plugin manager).
        """
        if self._plugins is None or self._plugins[0] != self._plugin_refs():
            self._plugins = (self._plugin_refs(), resolve_plugins(self))
        return self._plugins[1]

    def _plugin_refs(self) -> str:
        return json.dumps([self.model_dump(mode="json", include={
            "tiers", "serializer", "gpu_connector", "lazy_offload_policy"})],
            sort_keys=True)

    def startup_warnings(self) -> list[str]:
        """One line per option that is valid but will not work on this machine now
        (``PluginOptions.startup_warnings``: a cpu tier larger than the memory
        available), naming its key; ``config check`` prints them."""
        lines = []
        for path, resolved in self._resolved_plugins():
            try:
                warnings = resolved.options.startup_warnings()
            except Exception as exc:  # the plugin's: said, never a traceback
                lines.append(f"config key {path + '.options'!r}: its plugin could not say "
                             f"what will not work here ({type(exc).__name__}: {exc})")
                continue
            for name, why in warnings.items():
                key = f"{path}.options.{name}"
                lines.append(f"config key {key!r}{_source_for(key, self._sources)}: {why}")
        return lines

    def _resolved_plugins(self) -> list[tuple[str, Resolved[Any]]]:
        """Every plugin this config selects, with the key it sits at."""
        plugins = self.plugins
        chosen: list[tuple[str, Resolved[Any] | None]] = [
            ("serializer", plugins.serializer), ("gpu_connector", plugins.gpu_connector),
            ("lazy_offload_policy", plugins.offload_policy)]
        for i, tier in enumerate(plugins.tiers):
            chosen += [(f"tiers.{i}", tier.backend), (f"tiers.{i}.eviction", tier.eviction)]
        return [(path, resolved) for path, resolved in chosen if resolved is not None]

    def resolved_dump(self) -> dict[str, Any]:
        """The config as plain data, plugin options filled with their defaults;
        secrets masked (this is what ``config check`` prints)."""
        data = self.model_dump(mode="json")
        for path, resolved in self._resolved_plugins():
            _set_path(data, [*path.split("."), "options"],
                      resolved.options.model_dump(mode="json"))
        return redact_value(data)


# -- plugin resolution -------------------------------------------------------

def resolve_plugins(config: LMKVConfig, manager: PluginManager | None = None
                    ) -> ResolvedPlugins:
    """Resolve every plugin ``config`` names, in one step: ConfigError with one line per
    bad reference (key, value, what is allowed) when any is off."""
    from lmkv.plugins.manager import get_plugin_manager

    manager = manager or get_plugin_manager()
    resolver = _Resolver(config._sources)
    tiers = tuple(
        ResolvedTier(resolver.resolve(manager.storage_backend, tier, f"tiers.{i}"),
                     resolver.resolve(manager.eviction_policy, tier.eviction,
                                      f"tiers.{i}.eviction"))
        for i, tier in enumerate(config.tiers))
    serializer = resolver.resolve(manager.serializer, config.serializer, "serializer")
    connector = None if config.gpu_connector is None else \
        resolver.resolve(manager.gpu_connector, config.gpu_connector, "gpu_connector")
    offload = resolver.resolve(manager.offload_policy, config.lazy_offload_policy,
                               "lazy_offload_policy")
    resolver.refuse_repeated_tiers(tiers)
    if resolver.errors:
        raise ConfigError("\n".join(resolver.errors))
    defaults: dict[str, Resolved[GPUConnector] | str] = {}
    if connector is None:  # the integration's kind of KV picks one of these
        for kind, name in DEFAULT_CONNECTORS.items():
            quiet = _Resolver(config._sources)
            found = quiet.resolve(manager.gpu_connector, PluginRef(type=name), "gpu_connector")
            defaults[kind] = quiet.errors[0] if quiet.errors else found
    return ResolvedPlugins(tiers, serializer, offload, connector, defaults)


class _Resolver:
    """Collects every bad reference, so one run reports all of them. References that
    are unknown because LMKV_LOAD_PLUGINS / LMKV_DISABLE_PLUGINS skipped plugins share
    one line: the first, the env lists' note once, then the others by key."""

    def __init__(self, sources: Mapping[str, str]) -> None:
        self.sources = sources
        self._lines: list[str] = []
        self._by_env: list[tuple[str, UnknownPluginError]] = []
        self._env_slot = -1  # where that one line goes among the others

    @property
    def errors(self) -> list[str]:
        lines = list(self._lines)
        if self._by_env:
            (first, exc), others = self._by_env[0], self._by_env[1:]
            line = f"{first}: {exc.short}; {exc.env_note}"
            if others:
                line += ("; unresolved for the same reason: "
                         + ", ".join(key for key, _ in others))
            lines.insert(self._env_slot, line)
        return lines

    def resolve(self, lookup: Callable[[str], type[P]], ref: PluginRef, path: str
                ) -> Resolved[P]:
        try:
            cls = lookup(ref.type)
        except UnknownPluginError as exc:
            key = f"{path}.type = {ref.type!r}"
            if exc.env_note:
                if not self._by_env:
                    self._env_slot = len(self._lines)
                self._by_env.append((key, exc))
            else:
                self._lines.append(f"{key}: {exc}")
            return _UNRESOLVED
        options_model = cls.Options  # type: ignore[attr-defined]
        not_bools = [
            f"config key '{path}.options.{name}' = {_short(redact_value(value, name))}"
            f"{_source_for(f'{path}.options.{name}', self.sources)}: must be true or false"
            for name, value in ref.options.items()
            if not isinstance(value, bool) and value is not None
            and _is_bool_field(options_model, name)]
        if not_bools:
            self._lines.extend(not_bools)
            return _UNRESOLVED
        try:
            options = options_model.model_validate(ref.options)
        except ValidationError as exc:
            self._lines.append(_format_errors(exc, f"{path}.options", self.sources,
                                              options_model))
            return _UNRESOLVED
        return Resolved(cls, options)

    def refuse_repeated_tiers(self, tiers: Sequence[ResolvedTier]) -> None:
        """Two tiers of one backend with the same options hold the same chunks twice
        (or, on disk, write the same files): a copy-paste slip, never a plan."""
        for i, tier in enumerate(tiers):
            if tier.backend is _UNRESOLVED:
                continue
            for j in range(i):
                other = tiers[j].backend
                if other.cls is tier.backend.cls and other.options == tier.backend.options:
                    self._lines.append(
                        f"config key 'tiers.{i}'{_source_for(f'tiers.{i}', self.sources)}: "
                        f"the same tier as tiers.{j} (type {tier.backend.cls.name!r}, the "
                        f"same options); allowed: tiers that differ in type or options "
                        f"(remove tiers.{i}, or change its options)")
                    break


# Stands in for a reference that failed, so the others are still checked.
_UNRESOLVED: Resolved[Any] = Resolved(object, PluginOptions())


def _is_bool_field(model: type[BaseModel], name: str) -> bool:
    """Whether option ``name`` takes a boolean (``bool`` or ``bool | None``): lmkv's
    config reads only true and false as one, in plugin options as in its own keys."""
    field = model.model_fields.get(name)
    if field is None:
        return False
    annotation = field.annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = set(typing.get_args(annotation)) - {type(None)}
        return args == {bool}
    return annotation is bool


# -- loading -----------------------------------------------------------------

def load_config(path: str | os.PathLike | None = None, *,
                overrides: Mapping[str, Any] | None = None,
                env: Mapping[str, str] | None = None,
                plugin_manager: PluginManager | None = None) -> LMKVConfig:
    """Build the config from ``path``, ``LMKV_*`` env vars and dotted ``overrides``.

    ``overrides`` keys may carry the ``lmkv.`` prefix; ``lmkv.config_file``
    names the file when ``path`` is not given (then ``LMKV_CONFIG``). Every plugin
    the config selects is resolved here (``LMKVConfig.plugins``), with
    ``plugin_manager`` or else the process-wide one.
    """
    env = os.environ if env is None else env
    dotted = {_strip_prefix(k): v for k, v in (overrides or {}).items()}
    given = path or dotted.pop(CONFIG_FILE_KEY, None) or None
    dotted.pop(CONFIG_FILE_KEY, None)
    path = _config_path(given, env.get(CONFIG_ENV) or None)

    data: dict[str, Any] = LMKVConfig().model_dump(mode="python")
    sources: dict[str, str] = {}
    if path:
        file_data = read_config_file(path)
        data.update(file_data)
        for key in file_data:
            sources[key] = f"from {path}"
    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or name in RESERVED_ENV:
            continue
        key_path = name[len(ENV_PREFIX):].lower().split("__")
        _apply(data, key_path, _parse_scalar(raw), f"from env {name}", sources)
    for key, value in dotted.items():
        if isinstance(value, str):  # '"512"' from a JSON string reads as the env form would
            value = _parse_scalar(value)
        _apply(data, key.split("."), value, f"from lmkv.{key}", sources)
    try:
        config = LMKVConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, "", sources, LMKVConfig)) from None
    config._sources = sources
    config._plugins = (config._plugin_refs(), resolve_plugins(config, plugin_manager))
    return config


def _config_path(given: str | os.PathLike | None, from_env: str | None
                 ) -> str | os.PathLike | None:
    """The config file to read: the one given (a path, ``lmkv.config_file``) wins over
    ``LMKV_CONFIG``, as a command line wins over the environment. ``LMKV_CONFIG`` is
    checked all the same: one naming no file is an error even beside a given file (a
    stale variable means the user's picture of the config is wrong), and one naming
    another file is said in a warning, since it is not read."""
    if from_env is None or given is None:
        return given or from_env  # alone, LMKV_CONFIG is read, and its errors said there
    if not os.path.isfile(from_env):
        kind = "a directory" if os.path.isdir(from_env) else "no such file"
        raise ConfigError(f"{CONFIG_ENV} = {from_env!r}: cannot read it ({kind}), and it "
                          f"is checked even when a config file is given ({given}); "
                          f"allowed: a config file (.yaml, .toml or .json), or "
                          f"{CONFIG_ENV} unset")
    if os.path.abspath(given) != os.path.abspath(from_env):
        logger.warning("lmkv: %s=%s is not read: the config file given, %s, wins over it",
                       CONFIG_ENV, from_env, given)
    return given


# A config is a few KiB; this leaves ample room and bounds what a parse can cost.
MAX_CONFIG_BYTES = 1 << 20


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    try:
        info = p.stat()
        # A FIFO would block the read forever and /dev/zero never end: files only.
        if not stat.S_ISREG(info.st_mode):
            kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise ConfigError(f"config file {p}: cannot read it ({kind}); give a "
                              ".yaml, .toml or .json file")
        if info.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {p}: {info.st_size} bytes; a config file is at "
                              f"most {MAX_CONFIG_BYTES >> 20} MiB")
        text = p.read_text(encoding="utf-8-sig")  # a BOM (Windows editors) is no key
    except OSError as exc:
        raise ConfigError(f"config file {p}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {p}: not UTF-8 text") from None
    suffix = p.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            data = load_strict_yaml(text)
        elif suffix == ".toml":
            data = _toml_loads(text)  # TOML itself forbids duplicate keys
        elif suffix == ".json":
            data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
        else:
            raise ConfigError(
                f"config file {p}: unknown format {suffix or '(none)'!r}; "
                "allowed: .yaml, .yml, .toml, .json")
    except ConfigError:
        raise
    except (StrictYAMLError, _DuplicateKeyError) as exc:
        raise ConfigError(f"config file {p}: {exc}") from None
    except Exception as exc:  # each parser has its own error type
        detail = " ".join(str(exc).split())
        raise ConfigError(f"config file {p}: not valid {suffix[1:].upper()}: {detail}") from None
    if data is None or data == {}:
        raise ConfigError(f"config file {p}: empty (it sets no keys); write at least one key, "
                          "or leave the file out to use the defaults")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p}: top level must be a mapping of keys, "
                          f"got {type(data).__name__}")
    if set(data) == {"lmkv"} and isinstance(data["lmkv"], (dict, type(None))):
        data = data["lmkv"]  # an [lmkv] table / lmkv: section is accepted too
        if not data:
            raise ConfigError(f"config file {p}: its lmkv section is empty (it sets no keys)")
    return data


class _DuplicateKeyError(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise _DuplicateKeyError(f"duplicate key {key!r}")
        data[key] = value
    return data


def _toml_loads(text: str) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads(text)


def _strip_prefix(key: str) -> str:
    return key[len(DOTTED_PREFIX):] if key.startswith(DOTTED_PREFIX) else key


def _parse_scalar(raw: str) -> Any:
    """Env values: JSON numbers, booleans, lists and objects; anything else is text."""
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    return raw if value is None or isinstance(value, str) else value


def _apply(data: dict[str, Any], key_path: list[str], value: Any, source: str,
           sources: dict[str, str]) -> None:
    dotted = ".".join(key_path)
    if not all(key_path):
        raise ConfigError(f"config key {dotted!r} ({source}): empty key segment")
    try:
        _set_path(data, key_path, value, _is_plugin_ref)
    except (KeyError, IndexError, TypeError) as exc:
        raise ConfigError(f"config key {dotted!r} ({source}): {exc.args[0]}") from None
    sources[dotted] = source


def _is_plugin_ref(key_path: list[str]) -> bool:
    model = model_at(LMKVConfig, key_path)
    return model is not None and issubclass(model, PluginRef)


def _set_path(data: Any, key_path: list[str], value: Any,
              is_plugin_ref: Callable[[list[str]], bool] | None = None) -> None:
    """Set ``value`` at ``key_path``, creating mappings (and appending a list item) on
    the way. With ``is_plugin_ref``, a bare plugin name on the way (``serializer:
    naive``) becomes ``{type: naive}`` so ``serializer.type`` can be set beneath it."""
    node = data
    for i, part in enumerate(key_path):
        last = i == len(key_path) - 1
        if (not last and is_plugin_ref is not None and isinstance(node, (dict, list))
                and _child(node, part) is not None and isinstance(_child(node, part), str)
                and is_plugin_ref(key_path[:i + 1])):
            node[int(part) if isinstance(node, list) else part] = {"type": _child(node, part)}
        if isinstance(node, list):
            if not part.isdigit():
                raise KeyError(f"{part!r} is not a list index")
            index = int(part)
            if index > len(node):
                raise IndexError(f"index {index} skips entries (the list has {len(node)})")
            if index == len(node):
                node.append({})
            if last:
                node[index] = value
            else:
                if node[index] is None:
                    node[index] = {}
                node = node[index]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                if node.get(part) is None:
                    node[part] = {}
                node = node[part]
        else:
            raise TypeError(f"cannot set {part!r} inside a value of type {type(node).__name__}")


def _child(node: dict[str, Any] | list[Any], part: str) -> Any:
    if isinstance(node, list):
        return node[int(part)] if part.isdigit() and int(part) < len(node) else None
    return node.get(part)


def _format_errors(exc: ValidationError, prefix: str, sources: Mapping[str, str],
                   model: type[BaseModel]) -> str:
    lines = []
    for err in exc.errors(include_url=False):
        loc = [str(p) for p in err["loc"]]
        key = ".".join(filter(None, [prefix, *loc])) or "(top level)"
        where = _source_for(key, sources)
        shown = _clip(key)  # an unknown key is whatever the file says, however long
        if err["type"] == "extra_forbidden":
            parent = model_at(model, loc[:-1])
            new = renamed_key(parent, loc[-1]) if parent is not None else None
            if new is not None:
                lines.append(renamed_key_line(parent, shown, key[:-len(loc[-1])] + new, where))
                continue
            lines.append(f"config key {shown!r}{where}: unknown key"
                         f"{_unknown_key_hint(model, loc, key, where)}")
            continue
        if err["type"] == "missing":
            lines.append(f"config key {shown!r}{where}: required")
            continue
        # pydantic echoes the input: a password, a URL with credentials, or (for a
        # model-level check) the whole options mapping with its secrets.
        value = ("'***'" if _typed_secret(model, loc) else
                 _short(redact_value(err.get("input"), loc[-1] if loc else None)))
        lines.append(f"config key {shown!r} = {value}{where}: {_allowed(err)}")
    return "\n".join(lines)


def _typed_secret(model: type[BaseModel], loc: list[str]) -> bool:
    """Whether the field at ``loc`` is typed as a secret (``SecretStr``): masked
    whatever its name (the fs tier's ``key`` is an access key id)."""
    parent = model_at(model, loc[:-1]) if loc else None
    field = parent.model_fields.get(loc[-1]) if parent is not None else None
    if field is None:
        return False
    return any(isinstance(t, type) and issubclass(t, (SecretStr, SecretBytes))
               for t in (field.annotation, *typing.get_args(field.annotation)))


def _unknown_key_hint(model: type[BaseModel], loc: list[str], key: str, where: str) -> str:
    parent = model_at(model, loc[:-1])
    if parent is None:
        return ""
    env_stem = None
    if where.startswith(" (from env "):
        # Suggest a variable only when this variable spelled the key out.
        env_path = where[len(" (from env "):-1][len(ENV_PREFIX):].lower().split("__")
        key_path = key.split(".")
        if env_path[:len(key_path)] == key_path:
            env_stem = ENV_PREFIX + "".join(f"{p.upper()}__" for p in key_path[:-1])
    allowed = parent.model_fields
    return "; " + unknown_key_hint(loc[-1], allowed, env_stem=env_stem, env_only=RESERVED_ENV)


def _allowed(err: Mapping[str, Any]) -> str:
    msg = err["msg"]
    if err["type"] in ("int_parsing", "int_type", "int_from_float"):
        msg = "must be an integer"
    elif (err["type"] == "greater_than" and err.get("ctx", {}).get("gt") == 0
          and isinstance(err.get("input"), int)):
        msg = "must be a positive integer"
    elif err["type"] in ("bool_parsing", "bool_type"):
        msg = "must be true or false"
    return msg[0].lower() + msg[1:] if msg else msg


def _source_for(key: str, sources: Mapping[str, str]) -> str:
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        source = sources.get(".".join(parts[:n]))
        if source:
            return f" ({source})"
    # An unknown key can come from a variable or dotted key that goes deeper
    # (LMKV_HELLO__X makes 'hello'): name that one.
    below = sorted(k for k in sources if k.startswith(key + "."))
    return f" ({sources[below[0]]})" if below else ""


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
