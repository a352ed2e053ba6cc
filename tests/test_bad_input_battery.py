"""A battery of bad configs, env vars, flags and plugins, run through the real CLI.

Every case must end the way a user can act on: the documented exit code, ONE line
on stderr that names the offending key, variable, flag or plugin and what is
allowed, no traceback, no secret. A bad plugin must be listed by ``lmkv plugins``
in one line and leave every other plugin (and a cpu-only config) working.

Speed: the config, env and flag cases run in one subprocess that imports lmkv
once and forks a child per case (each child is a fresh ``lmkv`` process from the
CLI's point of view: its own argv, env, stdout, stderr and exit code). The plugin
cases need entry points on ``PYTHONPATH`` and run ``python -m lmkv`` for real.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli
from tests.plugins.plugin_fixtures import write_dist, write_hello_plugin

pytestmark = pytest.mark.slow  # each case runs an lmkv command in a process

SECRET = "Sup3rSecretValue"

# Runs in a subprocess: reads cases (argv, env) as JSON on stdin, runs each through
# lmkv.cli.commands in a forked child with its own fds, prints the results as JSON.
RUNNER = r"""
import json, os, signal, sys, tempfile, time, traceback

import lmkv.cli.commands, lmkv.config, lmkv.plugins.manager, yaml  # noqa: F401  paid once
lmkv.plugins.manager.get_plugin_manager()

results = []
for case in json.load(sys.stdin):
    out = tempfile.TemporaryFile()
    err = tempfile.TemporaryFile()
    sys.stdout.flush()
    sys.stderr.flush()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        for name in [n for n in os.environ if n.startswith(("LMKV_", "LMCACHE_"))]:
            del os.environ[name]
        os.environ.update(case["env"])
        if any(n in case["env"] for n in ("LMKV_LOAD_PLUGINS", "LMKV_DISABLE_PLUGINS")):
            lmkv.plugins.manager.reset_plugin_manager()
        signal.alarm(60)
        try:
            rc = lmkv.cli.commands.main(case["argv"])
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            rc = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc or 0)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    out.seek(0)
    err.seek(0)
    results.append({"rc": code, "stdout": out.read().decode(errors="replace"),
                    "stderr": err.read().decode(errors="replace"),
                    "seconds": round(time.monotonic() - started, 2)})
print(json.dumps(results))
"""


@dataclass
class Case:
    """One bad input. ``files``: name -> text (or bytes) written into the case's
    directory; ``{dir}`` in argv and env values is that directory."""

    id: str
    argv: list[str]
    expect: list[str]  # substrings of the one stderr line
    files: dict[str, str | bytes] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    rc: int = 2
    xfail: str | None = None


def check(args: str | list[str], *, expect: list[str], files: dict[str, str | bytes] | None
          = None, env: dict[str, str] | None = None, id: str, xfail: str | None = None,
          rc: int = 2) -> Case:
    argv = args.split() if isinstance(args, str) else args
    return Case(id, argv, expect, files or {}, env or {}, rc, xfail)


def cfg(text: str | bytes, *, expect: list[str], id: str, name: str = "c.yaml",
        env: dict[str, str] | None = None, xfail: str | None = None,
        command: str = "config check") -> Case:
    """``lmkv config check FILE`` (or ``lmkv stats --config FILE`` ...) on ``text``."""
    argv = [*command.split(), *([] if command == "config check" else ["--config"]),
            f"{{dir}}/{name}"]
    return check(argv, expect=expect, files={name: text}, env=env, id=id, xfail=xfail)


def env(variables: dict[str, str], *, expect: list[str], id: str, text: str | None = None,
        xfail: str | None = None) -> Case:
    """``lmkv config check`` with ``variables`` set (on ``text`` when given)."""
    if text is None:
        return check("stats --server tcp://127.0.0.1:1 --config {dir}/cpu.yaml",
                     files={"cpu.yaml": "chunk_size: 256\n"}, env=variables,
                     expect=expect, id=id, xfail=xfail)
    return cfg(text, env=variables, expect=expect, id=id, xfail=xfail)


def lmcache(text: str | bytes, *, expect: list[str], id: str,
            env: dict[str, str] | None = None) -> Case:
    """``lmkv migrate {dir}/l.yaml`` on the LMCache config ``text``."""
    return check("migrate {dir}/l.yaml", files={"l.yaml": text}, env=env, expect=expect,
                 id=id)


def replay(trace: str | bytes, *, expect: list[str], id: str, args: str = "",
           files: dict[str, str | bytes] | None = None) -> Case:
    """``lmkv replay {dir}/t.jsonl ARGS`` on the trace ``trace``."""
    return check(["replay", "{dir}/t.jsonl", *args.split()], expect=expect,
                 files={"t.jsonl": trace, **(files or {})}, id=id)


FIFO = "<fifo>"  # a files value: make a named pipe; "->TARGET": a symbolic link
CPU = "tiers: [{type: cpu, options: {max_bytes: 64MiB}}]\n"
SIZE_FORMS = "512MiB"  # every byte-size error lists the accepted forms, with this example

CASES: list[Case] = [
    # -- wrong types at every level ------------------------------------------------
    cfg("tiers: cpu\n", expect=["'tiers'", "list"], id="tiers-not-a-list"),
    cfg("tiers: {type: cpu}\n", expect=["'tiers'", "list"], id="tiers-a-mapping"),
    cfg("tiers: []\n", expect=["'tiers'", "at least 1"], id="tiers-empty"),
    cfg("tiers: [[cpu]]\n", expect=["'tiers.0'"], id="tier-a-list"),
    cfg("tiers: [5]\n", expect=["'tiers.0'"], id="tier-a-number"),
    cfg("tiers: [null]\n", expect=["'tiers.0'"], id="tier-null"),
    cfg("tiers: [{options: {}}]\n", expect=["'tiers.0.type'", "required"], id="tier-no-type"),
    cfg("tiers: [{type: ''}]\n", expect=["'tiers.0.type'", "at least 1"], id="tier-type-empty"),
    cfg("tiers: [{type: [cpu]}]\n", expect=["'tiers.0.type'"], id="tier-type-a-list"),
    cfg("tiers: [{type: cpu, options: [1, 2]}]\n",
        expect=["'tiers.0.options'", "dictionary"], id="options-a-list"),
    cfg("tiers: [{type: cpu, options: 64MiB}]\n",
        expect=["'tiers.0.options'", "dictionary"], id="options-a-string"),
    cfg("tiers: [{type: cpu, eviction: {type: lru, options: [x]}}]\n",
        expect=["'tiers.0.eviction.options'", "dictionary"], id="eviction-options-a-list"),
    cfg("serializer: 5\n", expect=["'serializer'"], id="serializer-a-number"),
    cfg("lookup: tcp\n", expect=["'lookup'"], id="section-a-string"),
    cfg("chunk_size: '256'\n", expect=["'chunk_size'", "must be an integer"],
        id="count-as-string"),
    cfg("chunk_size: 1.5\n", expect=["'chunk_size'", "must be an integer"], id="count-float"),
    cfg("chunk_size: 0\n", expect=["'chunk_size'", "positive integer"], id="count-zero"),
    cfg("chunk_size: -256\n", expect=["'chunk_size'", "positive integer"], id="count-negative"),
    cfg("chunk_size: .nan\n", expect=["'chunk_size'", "must be an integer"], id="count-nan"),
    cfg("chunk_size: .inf\n", expect=["'chunk_size'", "must be an integer"], id="count-inf"),
    cfg("chunk_size: true\n", expect=["'chunk_size'", "must be an integer"], id="count-bool"),
    cfg("save_partial_chunk: maybe\n", expect=["'save_partial_chunk'", "true or false"],
        id="bool-maybe"),
    cfg("save_partial_chunk: 2\n", expect=["'save_partial_chunk'", "true or false"],
        id="bool-two"),
    cfg("mode: cluster\n", expect=["'mode'", "in_process", "server"], id="literal-unknown"),
    cfg("lookup: {base_port: 70000, transport: tcp}\n",
        expect=["'lookup.base_port'", "65536"], id="port-too-large"),
    cfg("lookup: {transport: tcp}\n", expect=["lookup", "base_port"], id="tcp-without-port"),
    cfg("lookup: {transport: tcp, base_port: 5000, host: 10.1.2.3}\n",
        expect=["lookup", "not loopback", "curve"], id="lookup-open-host"),
    cfg("server: {address: ''}\n", expect=["'server.address'", "at least 1"],
        id="empty-address"),
    cfg("model_name: " + "m" * 100_000 + "\nchunk_size: x\n",
        expect=["'chunk_size'", "must be an integer"], id="very-long-string-elsewhere"),
    cfg("chunk_size: " + "9" * 5000 + "x\n", expect=["'chunk_size'", "..."],
        id="very-long-bad-value-is-cut"),
    # -- byte sizes ------------------------------------------------------------------
    cfg("tiers: [{type: cpu, options: {max_bytes: lots}}]\n",
        expect=["'tiers.0.options.max_bytes'", SIZE_FORMS], id="size-words"),
    cfg("tiers: [{type: cpu, options: {max_bytes: 1e9}}]\n",
        expect=["'tiers.0.options.max_bytes'", SIZE_FORMS], id="size-exponent"),
    cfg("tiers: [{type: cpu, options: {max_bytes: 64 MiB/s}}]\n",
        expect=["'tiers.0.options.max_bytes'", SIZE_FORMS], id="size-trailing"),
    cfg("tiers: [{type: cpu, options: {max_bytes: 64  MiB}}]\n",
        expect=["'tiers.0.options.max_bytes'", SIZE_FORMS], id="size-two-spaces"),
    cfg("tiers: [{type: cpu, options: {max_bytes: 64XB}}]\n",
        expect=["'tiers.0.options.max_bytes'", SIZE_FORMS], id="size-unknown-unit"),
    cfg("tiers: [{type: cpu, options: {max_bytes: '-64MiB'}}]\n",
        expect=["'tiers.0.options.max_bytes'", SIZE_FORMS], id="size-negative-text"),
    cfg("tiers: [{type: cpu, options: {max_bytes: -1}}]\n",
        expect=["'tiers.0.options.max_bytes'", SIZE_FORMS], id="size-negative"),
    cfg("tiers: [{type: cpu, options: {max_bytes: 0}}]\n",
        expect=["'tiers.0.options.max_bytes'", "4096"], id="size-zero"),
    cfg("tiers: [{type: cpu, options: {max_bytes: .nan}}]\n",
        expect=["'tiers.0.options.max_bytes'", SIZE_FORMS], id="size-nan"),
    cfg("tiers: [{type: cpu, options: {max_bytes: .inf}}]\n",
        expect=["'tiers.0.options.max_bytes'", SIZE_FORMS], id="size-inf"),
    cfg("tiers: [{type: cpu, options: {max_bytes: true}}]\n",
        expect=["'tiers.0.options.max_bytes'", SIZE_FORMS], id="size-bool"),
    cfg("tiers: [{type: cpu, options: {max_bytes: [1]}}]\n",
        expect=["'tiers.0.options.max_bytes'", SIZE_FORMS], id="size-list"),
    cfg("tiers: [{type: cpu, options: {max_bytes: \uff16\uff14MiB}}]\n",
        expect=["'tiers.0.options.max_bytes'", SIZE_FORMS], id="size-fullwidth-digits"),
    cfg("tiers: [{type: cpu, options: {max_bytes: \u0666\u0664MiB}}]\n",
        expect=["'tiers.0.options.max_bytes'", SIZE_FORMS], id="size-arabic-digits"),
    cfg("tiers: [{type: cpu, options: {max_bytes: 1000000PiB}}]\n",
        expect=["'tiers.0.options.max_bytes'", "at most 64.0PiB"], id="size-huge"),
    cfg("tiers: [{type: fs, options: {url: '{dir}/fs', max_bytes: 0}}]\n",
        expect=["'tiers.0.options.max_bytes'", "positive size"], id="fs-size-zero"),
    cfg("tiers: [{type: fs, options: {url: '{dir}/fs', mode: '0777'}}]\n",
        expect=["'tiers.0.options.mode'", "0600"], id="fs-mode-open"),
    cfg("tiers: [{type: fs, options: {url: '{dir}/fs', mode: rw}}]\n",
        expect=["'tiers.0.options.mode'", "0600"], id="fs-mode-words"),
    cfg("tiers: [{type: fs, options: {url: '{dir}/fs', io_threads: 0}}]\n",
        expect=["'tiers.0.options.io_threads'", "positive integer"], id="fs-threads-zero"),
    cfg("tiers: [{type: fs, options: {url: '{dir}/fs', connect_timeout_s: .nan}}]\n",
        expect=["'tiers.0.options.connect_timeout_s'"], id="fs-timeout-nan"),
    cfg("tiers: [{type: fs, options: {url: '{dir}/fs', close_timeout_s: .inf}}]\n",
        expect=["'tiers.0.options.close_timeout_s'", "finite"], id="fs-timeout-inf"),
    cfg("tiers: [{type: fs}]\n", expect=["'tiers.0.options.url'", "required"], id="fs-no-url"),
    cfg("serializer: {type: zstd, options: {level: 99}}\n",
        expect=["'serializer.options.level'", "22"], id="zstd-level"),
    cfg("serializer: {type: int8, options: {granularity: block}}\n",
        expect=["'serializer.options.granularity'", "token", "channel"], id="int8-literal"),
    cfg("tiers: [{type: redis, options: {ttl_s: .inf}}]\n",
        expect=["'tiers.0.options.ttl_s'", "finite"], id="redis-ttl-inf"),
    cfg("tiers: [{type: redis, options: {part_bytes: 10}}]\n",
        expect=["'tiers.0.options.part_bytes'", "1024"], id="redis-part-small"),
    cfg("tiers: [{type: redis, options: {url: 'http://localhost'}}]\n",
        expect=["'tiers.0.options.url'", "redis://"], id="redis-url-scheme"),
    cfg("tiers: [{type: mooncake, options: {master_address: nohost}}]\n",
        expect=["'tiers.0.options.master_address'", "host:port"], id="mooncake-master"),
    cfg("tiers: [{type: mooncake, options: {protocol: udp}}]\n",
        expect=["'tiers.0.options.protocol'", "tcp", "rdma"], id="mooncake-protocol"),
    cfg("tiers: [{type: mooncake, options: {global_segment_size: 1MiB}}]\n",
        expect=["'tiers.0.options.global_segment_size'", "16MiB"], id="mooncake-segment"),
    cfg("tiers: [{type: mooncake, options: {master: '127.0.0.1:1'}}]\n",
        expect=["'tiers.0.options.master'"], id="mooncake-unknown-key"),
    # -- unknown names and keys at each depth ------------------------------------
    cfg("tier: [cpu]\n", expect=["'tier'", "did you mean 'tiers'", "allowed:"],
        id="unknown-top-key"),
    cfg("t\u00efers: [cpu]\n", expect=["'t\u00efers'", "did you mean 'tiers'"],
        id="unknown-unicode-key"),
    cfg("tiers: [{type: cpu, evicton: lru}]\n",
        expect=["'tiers.0.evicton'", "did you mean 'eviction'"], id="unknown-tier-key"),
    cfg("tiers: [{type: cpu, options: {max_byte: 1MiB}}]\n",
        expect=["'tiers.0.options.max_byte'", "did you mean 'max_bytes'"],
        id="unknown-option-key"),
    cfg("lookup: {timeout: 5}\n", expect=["'lookup.timeout'", "did you mean 'timeout_ms'"],
        id="unknown-section-key"),
    cfg("server: {curve: {secret_key: k, secret: x}}\n",
        expect=["'server.curve.secret'", "did you mean 'secret_key'"],
        id="unknown-nested-section-key"),
    cfg("tiers: [{type: cpu, eviction: {type: lru, options: {size: 1}}}]\n",
        expect=["'tiers.0.eviction.options.size'", "allowed: none"],
        id="unknown-key-of-optionless-plugin"),
    cfg("tiers: [{type: cpuu}]\n", expect=["tiers.0.type = 'cpuu'", "unknown storage backend",
                                           "available: cpu"], id="unknown-backend"),
    cfg("tiers: [{type: cpuu}]\n", expect=["did you mean 'cpu'"],
        id="unknown-backend-suggests"),
    cfg("tiers: [{type: cpu, eviction: lfu2}]\n",
        expect=["tiers.0.eviction.type = 'lfu2'", "unknown eviction policy",
                "available: arc, lfu, lru, s3fifo"],
        id="unknown-eviction"),
    cfg("tiers: [{type: cpu, eviction: {type: arc, options: {p: 1}}}]\n",
        expect=["'tiers.0.eviction.options.p'", "allowed: none"], id="arc-takes-no-options"),
    cfg("tiers: [{type: cpu, eviction: {type: lfu, options: {decay_factor: 0}}}]\n",
        expect=["'tiers.0.eviction.options.decay_factor' = 0", "greater than or equal to 0.01"],
        id="lfu-decay-factor-zero"),
    cfg("tiers: [{type: cpu, eviction: {type: lfu, options: {decay_period: 1.5}}}]\n",
        expect=["'tiers.0.eviction.options.decay_period' = 1.5", "integer"],
        id="lfu-decay-period-float"),
    cfg("tiers: [{type: cpu, eviction: {type: lfu, options: {decay: 2}}}]\n",
        expect=["'tiers.0.eviction.options.decay'", "allowed: decay_factor, decay_period"],
        id="lfu-unknown-option"),
    cfg("tiers: [{type: cpu, eviction: {type: s3fifo, options: {small_ratio: 1}}}]\n",
        expect=["'tiers.0.eviction.options.small_ratio' = 1", "less than or equal to 0.9"],
        id="s3fifo-small-ratio-too-big"),
    cfg("tiers: [{type: cpu, eviction: {type: s3fifo, options: {max_frequency: 0}}}]\n",
        expect=["'tiers.0.eviction.options.max_frequency' = 0", "greater than or equal to 1"],
        id="s3fifo-max-frequency-zero"),
    cfg("tiers: [{type: cpu, admit_after: 0}]\n",
        expect=["'tiers.0.admit_after' = 0", "greater than or equal to 1"],
        id="admit-after-zero"),
    cfg("tiers: [{type: cpu, admit_after: '2'}]\n",
        expect=["'tiers.0.admit_after' = '2'", "must be an integer"], id="admit-after-string"),
    cfg("serializer: zstdd\n", expect=["serializer.type = 'zstdd'", "unknown serializer",
                                       "available: int8, naive, zstd"], id="unknown-serializer"),
    cfg("lazy_offload_policy: LIFO\n", expect=["lazy_offload_policy.type = 'LIFO'", "FIFO"],
        id="unknown-offload-policy"),
    cfg("gpu_connector: nvlink\n", expect=["gpu_connector.type = 'nvlink'",
                                           "unknown GPU connector"],
        id="unknown-gpu-connector"),
    # -- secrets never echoed ------------------------------------------------------
    cfg("tiers: [{type: redis, options: {url: 'redis://:" + SECRET + "@h:99999/0'}}]\n",
        expect=["'tiers.0.options.url'"], id="secret-in-bad-redis-url"),
    cfg("tiers: [{type: redis, options: {password: [" + SECRET + "]}}]\n",
        expect=["'tiers.0.options.password'"], id="secret-password-wrong-type"),
    cfg("tiers: [{type: redis, options: {password: " + SECRET + ", ttl_s: x}}]\n",
        expect=["'tiers.0.options.ttl_s'"], id="secret-beside-bad-value"),
    cfg("tiers: [{type: fs, options: {url: '{dir}/fs', secret: " + SECRET + "}}]\n",
        expect=["'tiers.0.options", "s3://"], id="secret-in-model-level-error"),
    cfg("tiers: [{type: fs, options: {url: 's3://b/p', endpoint_url: 'http://u:" + SECRET
        + "@h:1', retries: -1}}]\n", expect=["'tiers.0.options.retries'"],
        id="secret-in-endpoint-beside-bad-value"),
    cfg("tiers: [{type: fs, options: {url: 's3://b/p', storage_options: {password: "
        + SECRET + "}, mode: '0600'}}]\n", expect=["'tiers.0.options", "mode"],
        id="secret-in-storage-options"),
    cfg("tiers: [{type: fs, options: {url: 'https://u:" + SECRET + "@h/x', retries: x}}]\n",
        expect=["'tiers.0.options.retries'"], id="secret-in-url-beside-bad-value"),
    cfg("tiers: [{type: redis, options: {passwrd: " + SECRET + "}}]\n",
        expect=["'tiers.0.options.passwrd'", "did you mean 'password'"],
        id="secret-under-misspelled-key"),
    # -- YAML and file formats -----------------------------------------------------
    cfg("tiers:\n\t- cpu\n", expect=["not valid YAML"], id="yaml-tab"),
    cfg("chunk_size: 256\nchunk_size: 512\n", expect=["line 2", "duplicate key 'chunk_size'"],
        id="yaml-duplicate-key"),
    cfg("tiers:\n  - type: cpu\n    options: {max_bytes: 1MiB, max_bytes: 2MiB}\n",
        expect=["line 3", "duplicate key 'max_bytes'"], id="yaml-duplicate-nested-key"),
    cfg("a: &x {type: cpu}\ntiers: [*x]\n", expect=["anchors and aliases"], id="yaml-anchor"),
    cfg("chunk_size: !!python/object/apply:os.system [echo hi]\n", expect=["not valid YAML"],
        id="yaml-python-tag"),
    cfg("chunk_size: 256\x00\n", expect=["not valid YAML"], id="yaml-null-byte"),
    cfg(b"\xff\xfe\x00\x01garbage\x80\x81", expect=["not UTF-8"], id="binary-garbage"),
    cfg("", expect=["empty"], id="empty-file"),
    cfg("# only a comment\n", expect=["empty"], id="comments-only"),
    cfg("lmkv:\n", expect=["empty"], id="empty-lmkv-section"),
    cfg("- cpu\n", expect=["top level must be a mapping", "list"], id="top-level-list"),
    cfg("hello\n", expect=["top level must be a mapping", "str"], id="top-level-scalar"),
    cfg("{1: 2}\n", expect=["line 1", "key '1' reads as int", "quote it"], id="yaml-int-key"),
    cfg("tiers: [{type: cpu, options: {on: 1}}]\n", expect=["line 1", "key 'on' reads as bool"],
        id="yaml-bool-key"),
    cfg("chunk_size: 256\n" + ("# padding\n" * 100_000) + "tier: x\n",
        expect=["'tier'", "did you mean 'tiers'"], id="large-file-under-the-bound"),
    cfg("chunk_size: 256\n" + ("# padding\n" * 110_000), expect=["at most 1 MiB"],
        id="huge-file"),
    cfg("a: " + "[" * 5000 + "]" * 5000 + "\n", expect=["not valid YAML"], id="yaml-deep-nesting"),
    cfg('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", name="c.json",
        expect=["not valid JSON"], id="json-deep-nesting"),
    cfg('{"' + "k" * 100_000 + '": 1}', name="c.json", expect=["unknown key"],
        id="very-long-key"),
    cfg("\ufeffchunk_size: 128\ntier: x\n", expect=["'tier'", "did you mean"], id="yaml-bom"),
    cfg('\ufeff{"tier": 1}', name="c.json", expect=["'tier'", "did you mean"], id="json-bom"),
    cfg("\ufefftier = 1\n", name="c.toml", expect=["'tier'", "did you mean"], id="toml-bom"),
    cfg("chunk_size: 128\r\ntier: x\r\n", expect=["'tier'", "did you mean"], id="crlf"),
    cfg("[tiers\n", name="c.toml", expect=["not valid TOML"], id="toml-syntax"),
    cfg("chunk_size = '256'\n", name="c.toml", expect=["'chunk_size'", "must be an integer"],
        id="toml-wrong-type"),
    cfg("chunk_size = 1\nchunk_size = 2\n", name="c.toml", expect=["not valid TOML"],
        id="toml-duplicate-key"),
    cfg('{"chunk_size": 1, "chunk_size": 2}', name="c.json", expect=["duplicate key"],
        id="json-duplicate-key"),
    cfg('{"chunk_size": NaN}', name="c.json", expect=["'chunk_size'"], id="json-nan"),
    cfg("[1, 2]", name="c.json", expect=["top level must be a mapping"], id="json-list"),
    cfg("{", name="c.json", expect=["not valid JSON"], id="json-syntax"),
    cfg("chunk_size = 256\n", name="c.ini", expect=["unknown format", ".yaml"],
        id="unknown-extension"),
    cfg("chunk_size: 256\n", name="config", expect=["unknown format", ".yaml"],
        id="no-extension"),
    check("config check {dir}", expect=["cannot read it", "directory"], id="directory-as-config"),
    check("config check {dir}/fifo.yaml", files={"fifo.yaml": FIFO},
          expect=["cannot read it", "not a regular file"], id="fifo-as-config"),
    check("config check {dir}/zero.yaml", files={"zero.yaml": "->/dev/zero"},
          expect=["cannot read it", "not a regular file"], id="device-as-config"),
    check("config check {dir}/loop.yaml", files={"loop.yaml": "->loop.yaml"},
          expect=["cannot read it", "symbolic links"], id="symlink-loop"),
    check("config check {dir}/missing.yaml", expect=["cannot read it", "No such file"],
          id="missing-file"),
    check("stats --config {dir}/missing.yaml", expect=["cannot read it"],
          id="stats-missing-file"),
    cfg("tiers: [{type: cpuu}]\n", command="stats --server tcp://127.0.0.1:1",
        expect=["tiers.0.type = 'cpuu'"], id="stats-bad-config"),
    cfg("tiers: [{type: cpu, options: {max_bytes: '1,5GiB'}}]\n", command="server",
        expect=["'tiers.0.options.max_bytes'", SIZE_FORMS], id="server-bad-config"),
    cfg("lookup: {transport: tcp}\n", command="demo --preset tiny",
        expect=["base_port"], id="demo-bad-config"),
    cfg("tiers: [{type: cpu, options: {max_bytes: 1PiB, allow_overcommit: true}}]\n",
        command="stats",
        expect=["'tiers.0.options.max_bytes'", "allocate"], id="stats-arena-cannot-be-made"),
    cfg("tiers: [{type: cpu, options: {max_bytes: 1PiB, allow_overcommit: true}}]\n",
        command="server --socket {dir}/s.sock",
        expect=["'tiers.0.options.max_bytes'", "allocate"], id="server-arena-cannot-be-made"),
    cfg("tiers: [{type: cpu, eviction: null}]\n", expect=["'tiers.0.eviction'"],
        id="eviction-null"),
    cfg("tiers: [{type: cpu, options: null}]\n", expect=["'tiers.0.options'"],
        id="options-null"),
    cfg("serializer: null\n", expect=["'serializer'"], id="serializer-null"),
    cfg("lookup: null\n", expect=["'lookup'"], id="section-null"),
    cfg("gpu_connector: {type: paged, options: {bogus: 1}}\n",
        expect=["'gpu_connector.options.bogus'", "unknown key"], id="connector-unknown-option"),
    cfg("lmkv: {lmkv: {chunk_size: 1}}\n", expect=["'lmkv'", "unknown key"],
        id="lmkv-section-twice"),
    cfg("server: {curve: {secret_key: ''}}\n", expect=["'server.curve.secret_key'"],
        id="curve-empty-key"),
    cfg("server: {curve: {secret_key: '{dir}/none.key_secret', authorized_keys: '{dir}'}}\n",
        command="server --socket {dir}/s.sock", expect=["none.key_secret"],
        id="server-config-curve-missing"),
    check("server --socket {dir}/" + "d" * 120 + "/s.sock",
          expect=["cannot listen on ipc://", "File name too long"],
          id="server-socket-path-too-long"),
    check("server --socket /proc/nope/s.sock", expect=["/proc/nope"],
          id="server-socket-dir-cannot-be-made"),
    check(["server", "--host", "not a host", "--port", "0"],
          expect=["--host not a host", "cannot be resolved"], id="server-host-garbage"),
    check(["server", "--host", "", "--port", "0"], expect=["--host"], id="server-host-empty"),
    check("server --metrics-port 70000", expect=["--metrics-port", "0-65535"],
          id="server-metrics-port-too-big"),
    check("server --metrics-port nine", expect=["--metrics-port", "0-65535"],
          id="server-metrics-port-a-word"),
    check("server --socket {dir}/s.sock --metrics-host 127.0.0.1",
          expect=["--metrics-host needs --metrics-port"], id="server-metrics-host-alone"),
    check("stats --watch 0", expect=["--watch", "0.1"], id="stats-watch-zero"),
    check("stats --watch soon", expect=["--watch", "seconds"], id="stats-watch-a-word"),
    check("stats --server http://127.0.0.1:1", expect=["no lmkv metrics endpoint answers",
                                                       "127.0.0.1:1/metrics"],
          id="stats-metrics-endpoint-unreachable"),
    cfg("metrics: {port: 70000}\n", expect=["'metrics.port'", "less than 65536"],
        id="metrics-port-too-big"),
    cfg("metrics: {port: '9100'}\n", expect=["'metrics.port'", "integer"],
        id="metrics-port-a-string"),
    cfg("metrics: {prt: 9100}\n", expect=["'metrics.prt'", "did you mean 'port'"],
        id="metrics-key-typo"),
    check("keygen --dir {dir}/f", files={"f": "x"}, expect=["cannot write", "Not a directory"],
          id="keygen-dir-is-a-file"),
    check("keygen --dir {dir} --name ../escape", expect=["key name '../escape'", "letters"],
          id="keygen-name-with-a-path"),
    check(["keygen", "--dir", "{dir}", "--name", ""], expect=["key name ''", "letters"],
          id="keygen-name-empty"),
    check("demo --preset tiny --threads 0", expect=["--threads"], id="demo-threads-zero"),
    # -- env vars ------------------------------------------------------------------
    env({"LMKV_CHUNKSIZE": "5"}, expect=["LMKV_CHUNKSIZE", "did you mean LMKV_CHUNK_SIZE",
                                        "reserved"], id="env-unknown"),
    env({"LMKV_HELLO_GREETING": "hi"}, expect=["LMKV_HELLO_GREETING", "reserved"],
        id="env-plugin-own-variable"),
    env({"LMKV_TIERS__X__TYPE": "cpu"}, expect=["LMKV_TIERS__X__TYPE", "list index"],
        id="env-index-not-a-number"),
    env({"LMKV_TIERS__99__TYPE": "cpu"}, expect=["LMKV_TIERS__99__TYPE", "skips entries"],
        id="env-index-too-far"),
    env({"LMKV_TIERS__-1__TYPE": "cpu"}, expect=["LMKV_TIERS__-1__TYPE", "list index"],
        id="env-index-negative"),
    env({"LMKV_TIERS____TYPE": "cpu"}, expect=["LMKV_TIERS____TYPE", "empty key segment"],
        id="env-empty-segment"),
    env({"LMKV_": "1"}, expect=["LMKV_", "empty key segment"], id="env-prefix-only"),
    env({"LMKV_CHUNK_SIZE": ""}, expect=["LMKV_CHUNK_SIZE", "must be an integer"],
        id="env-empty-value"),
    env({"LMKV_CHUNK_SIZE": "abc"}, expect=["LMKV_CHUNK_SIZE", "must be an integer"],
        id="env-word-for-count"),
    env({"LMKV_CHUNK_SIZE": "1.5"}, expect=["LMKV_CHUNK_SIZE", "must be an integer"],
        id="env-float-for-count"),
    env({"LMKV_CHUNK_SIZE": "NaN"}, expect=["LMKV_CHUNK_SIZE", "must be an integer"],
        id="env-nan"),
    env({"LMKV_CHUNK_SIZE__X": "1"}, expect=["LMKV_CHUNK_SIZE__X", "cannot set 'x'"],
        id="env-nesting-below-a-scalar"),
    env({"LMKV_TIERS": "cpu"}, expect=["'tiers'", "LMKV_TIERS", "list"], id="env-tiers-a-word"),
    env({"LMKV_TIERS": "[{"}, expect=["'tiers'", "LMKV_TIERS"], id="env-broken-json"),
    env({"LMKV_TIERS__0__OPTIONS": "[1]"}, expect=["'tiers.0.options'", "dictionary"],
        id="env-options-a-list"),
    env({"LMKV_TIERS__0__OPTIONS__MAX_BYTES": "8GB!"},
        expect=["'tiers.0.options.max_bytes'", "LMKV_TIERS__0__OPTIONS__MAX_BYTES", SIZE_FORMS],
        id="env-bad-size"),
    env({"LMKV_TIERS__0__OPTIONS__MAX_BYTES": "1MiB", "LMKV_TIERS__0__TYPE": "nope"},
        expect=["tiers.0.type = 'nope'", "unknown storage backend"], id="env-unknown-backend"),
    env({"LMKV_TIERS__0__OPTIONS__PASSWORD": SECRET},
        expect=["'tiers.0.options.password'", "unknown key"], id="env-secret-for-wrong-tier"),
    env({"LMKV_SERIALIZER__OPTIONS__LEVEL": "99", "LMKV_SERIALIZER__TYPE": "zstd"},
        text="serializer: naive\n", expect=["'serializer.options.level'", "22"],
        id="env-over-bare-plugin-name"),
    env({"LMKV_TIERS__0__OPTIONS__MAX_BYTES": "\uff11GiB"},
        expect=["'tiers.0.options.max_bytes'", SIZE_FORMS], id="env-fullwidth-size"),
    env({"LMKV_TIERS__0": '{"type": "cpu", "options": "x"}'},
        expect=["'tiers.0.options'", "dictionary"], id="env-json-tier-bad-options"),
    env({"LMKV_DISABLE_PLUGINS": "lmkv-redis"}, text="tiers: [redis]\n",
        expect=["tiers.0.type = 'redis'", "skipped by LMKV_LOAD_PLUGINS/LMKV_DISABLE_PLUGINS"],
        id="env-disabled-plugin-selected"),
    env({"LMKV_MODE": "cluster"}, expect=["'mode'", "LMKV_MODE", "in_process"],
        id="env-literal"),
    env({"LMKV_ASYNC_LOAD": "maybe"}, expect=["'async_load'", "true or false"],
        id="env-bool"),
    env({"LMKV_\u00c7HUNK_SIZE": "1"}, expect=["LMKV_\u00c7HUNK_SIZE"], id="env-unicode-name"),
    check("stats --server tcp://127.0.0.1:1", env={"LMKV_CONFIG": "{dir}/missing.yaml"},
          expect=["missing.yaml", "cannot read it"], id="env-config-missing"),
    check("stats --server tcp://127.0.0.1:1", env={"LMKV_CONFIG": "{dir}"},
          expect=["cannot read it"], id="env-config-directory"),
    env({"LMKV_LOG_LEVEL": "loud"}, expect=["LMKV_LOG_LEVEL", "DEBUG"], id="env-log-level"),
    env({"LMKV_LOAD_PLUGINS": "no-such-plugin"},
        expect=["tiers.0.type = 'cpu'", "LMKV_LOAD_PLUGINS"], text=CPU,
        id="env-load-list-excludes-builtins"),
    env({"LMKV_LOAD_PLUGINS": ",,,"}, text=CPU, expect=["LMKV_LOAD_PLUGINS", "no plugin"],
        id="env-load-list-of-nothing"),
    env({"LMKV_DISABLE_PLUGINS": "lmkv"}, text=CPU, expect=["LMKV_DISABLE_PLUGINS", "lmkv"],
        id="env-disable-the-builtins"),
    # -- flags -----------------------------------------------------------------------
    check("--log-level loud plugins", expect=["--log-level", "DEBUG"], id="flag-log-level"),
    check("nonsense", expect=["invalid choice", "plugins"], id="flag-unknown-command"),
    check("config check", expect=["required", "file"], id="flag-missing-argument"),
    check("plugins --jsn", expect=["--jsn"], id="flag-unknown-option"),
    check("server --port 70000", expect=["--port", "0-65535"], id="server-port-too-large"),
    check("server --port \u0663", expect=["--port", "0-65535"], id="server-port-arabic-digit"),
    check("server --port -1", expect=["--port", "0-65535"], id="server-port-negative"),
    check("server --max-request-bytes 1,5GiB", expect=["--max-request-bytes", SIZE_FORMS],
          id="server-size-comma"),
    check("server --max-request-bytes 10", expect=["--max-request-bytes", "4096"],
          id="server-size-small"),
    check("server --session-timeout nan", expect=["--session-timeout", "positive number"],
          id="server-timeout-nan"),
    check("server --drain-timeout inf", expect=["--drain-timeout", "0 or more"],
          id="server-timeout-inf"),
    check("server --handle-ttl 0", expect=["--handle-ttl", "positive number"],
          id="server-timeout-zero"),
    check("server --socket {dir}/s.sock --host 127.0.0.1",
          expect=["--socket", "--host"], id="server-two-places"),
    check("server --host 10.9.8.7 --port 0", expect=["--host 10.9.8.7", "not loopback",
                                                     "--insecure"], id="server-open-host"),
    check("server --curve-authorized-keys {dir}", expect=["--curve-secret-key"],
          id="server-keys-without-secret"),
    check("server --curve-secret-key {dir}/missing.key_secret --curve-authorized-keys {dir}",
          expect=["missing.key_secret"], id="server-missing-secret-key"),
    check("stats --server nonsense", expect=["--server = 'nonsense'", "tcp://HOST:PORT"],
          id="stats-bad-address"),
    check("stats --server ftp://h:1", expect=["--server", "scheme 'ftp'",
                                               "http://HOST:PORT (a metrics endpoint)"],
          id="stats-bad-scheme"),
    cfg("server: {address: 'nowhere'}\n", command="stats",
        expect=["server.address = 'nowhere'", "tcp://HOST:PORT"], id="stats-bad-config-address"),
    check("stats --server tcp://127.0.0.1:99999", expect=["--server", "99999", "tcp://HOST"],
          id="stats-bad-port"),
    check("demo --prompts -2", expect=["--prompts = -2", "positive integer"],
          id="demo-negative-prompts"),
    check("demo --new-tokens many", expect=["--new-tokens", "invalid int value"],
          id="demo-word-for-count"),
    check("demo --preset huge", expect=["--preset", "tiny"], id="demo-unknown-preset"),
    # -- lmkv replay: traces and flags -------------------------------------------------
    replay('{"hash_ids": [1, 2]}\n{"hash_ids": [1,\n', expect=["t.jsonl line 2",
                                                           "malformed JSON"],
           id="replay-malformed-line"),
    replay('{"hash_ids": [1]}\n{"timestamp": 5, "input_length": 512}\n',
           expect=["line 2", "missing field 'hash_ids'"], id="replay-missing-field"),
    replay('{"hash_ids": "1,2"}\n', expect=["line 1", "'hash_ids' must be a list of integers",
                                            "string"], id="replay-wrong-type"),
    replay('{"hash_ids": [1, -2]}\n', expect=["line 1", "hash_ids[1] = -2", "[0, 2**64)"],
           id="replay-negative-hash-id"),
    replay('{"hash_ids": [1], "input_length": "long"}\n',
           expect=["line 1", "'input_length' must be a non-negative number"],
           id="replay-wrong-number-field"),
    replay('[1, 2, 3]\n[4, "5"]\n', expect=["line 2", "token 1", "integers in [0, 2**32)"],
           id="replay-token-not-an-int"),
    replay('"hello"\n', expect=["line 1", "neither a Mooncake record", "--format"],
           id="replay-unknown-record"),
    replay("\n\n", expect=["empty trace"], id="replay-empty-trace"),
    replay(b'{"hash_ids": [1]}\n\xff\n', expect=["line 2", "not UTF-8"],
           id="replay-not-utf8"),
    replay('{"hash_ids": [1]}\n', args="--format tokens",
           expect=["line 1", "missing field 'tokens'"], id="replay-forced-format"),
    replay('[1, 2]\n', expect=["no request spans a whole chunk"], id="replay-no-whole-chunk"),
    replay('{"hash_ids": [1, 2]}\n', args="--capacity 10%",
           expect=["--capacity 10%", "under one chunk", "2 unique chunks"],
           id="replay-capacity-under-a-chunk"),
    replay('{"hash_ids": [1, 2]}\n', args="--capacity 32MiB",
           expect=["--capacity 32MiB", "under one chunk", "64 MiB"],
           id="replay-size-under-a-chunk"),
    replay('{"hash_ids": [1, 2]}\n', args="--capacity lots",
           expect=["--capacity 'lots'", "percent", SIZE_FORMS], id="replay-capacity-words"),
    replay('{"hash_ids": [1, 2]}\n', args="--capacity 50%,,",
           expect=["--capacity", "empty item"], id="replay-capacity-empty-item"),
    replay('{"hash_ids": [1, 2]}\n', args="--capacity=-5%",
           expect=["--capacity '-5%'", "positive number"], id="replay-capacity-negative"),
    replay('{"hash_ids": [1, 2]}\n', args="--policies lru,nope",
           expect=["--policies", "unknown eviction policy 'nope'", "allowed: ", "lru"],
           id="replay-unknown-policy"),
    replay('{"hash_ids": [1, 2]}\n', args="--layers 0",
           expect=["--layers", "'0' is not a positive integer"], id="replay-layers-zero"),
    replay('{"hash_ids": [1, 2]}\n', args="--bytes-per-token 1,5KiB",
           expect=["--bytes-per-token", SIZE_FORMS], id="replay-bytes-per-token-comma"),
    replay('{"hash_ids": [1, 2]}\n', args="--dtype fp64",
           expect=["--dtype", "invalid choice", "bfloat16"], id="replay-unknown-dtype"),
    replay('{"hash_ids": [1, 2]}\n', args="--format csv",
           expect=["--format", "invalid choice", "mooncake"], id="replay-unknown-format"),
    check("replay {dir}/none.jsonl", expect=["cannot read trace", "No such file"],
          id="replay-missing-trace"),
    check("replay {dir}", expect=["cannot read trace", "directory"],
          id="replay-directory-as-trace"),
    replay('{"hash_ids": [1, 2]}\n', args="--config {dir}/c.yaml",
           files={"c.yaml": "tiers: [{type: cpuu}]\n"},
           expect=["tiers.0.type = 'cpuu'", "unknown storage backend"],
           id="replay-bad-config"),
    # -- lmkv migrate: an LMCache config ---------------------------------------------
    check("migrate {dir}/none.yaml", expect=["none.yaml", "cannot read it", "No such file"],
          id="migrate-missing-file"),
    check("migrate {dir}/a.yaml {dir}/b.yaml", expect=["unrecognized arguments"],
          id="migrate-two-files"),
    lmcache("chunk_size: [256\n", expect=["l.yaml", "not valid YAML"],
            id="migrate-bad-yaml"),
    lmcache("- chunk_size\n", expect=["l.yaml", "top level must be a mapping"],
            id="migrate-yaml-list"),
    lmcache("chunk_size: lots\n", expect=["LMCache option 'chunk_size' (from",
                                          "= 'lots'", "must be a positive integer"],
            id="migrate-count-words"),
    lmcache("max_local_cpu_size: [5]\n", expect=["'max_local_cpu_size'", "number of GB"],
            id="migrate-size-a-list"),
    lmcache("local_disk: 5\n", expect=["'local_disk'", "non-empty text"],
            id="migrate-path-a-number"),
    lmcache("chunk_size: 256\n", env={"LMCACHE_ENABLE_ASYNC_LOADING": "maybe"},
            expect=["LMCACHE_ENABLE_ASYNC_LOADING = 'maybe'", "true or false"],
            id="migrate-env-bool-maybe"),
    check("migrate", env={"LMCACHE_CONFIG_FILE": "{dir}/gone.yaml"},
          expect=["gone.yaml", "cannot read it"], id="migrate-config-file-env-missing"),
]


def _materialize(case: Case, root: Path) -> tuple[list[str], dict[str, str]]:
    case_dir = root / case.id
    case_dir.mkdir()
    for name, text in case.files.items():
        path = case_dir / name
        if text == FIFO:
            os.mkfifo(path)
        elif isinstance(text, str) and text.startswith("->"):
            path.symlink_to(text[2:])
        elif isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text.replace("{dir}", str(case_dir)), encoding="utf-8")
    argv = [a.replace("{dir}", str(case_dir)) for a in case.argv]
    variables = {k: v.replace("{dir}", str(case_dir)) for k, v in case.env.items()}
    return argv, variables


@pytest.fixture(scope="module")
def battery_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    """Every case of CASES run once, in one subprocess (one lmkv import, a fork each)."""
    root = tmp_path_factory.mktemp("battery")
    payload = []
    for case in CASES:
        argv, variables = _materialize(case, root)
        payload.append({"argv": argv, "env": variables})
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("LMKV_")}
    out = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(payload),
                         capture_output=True, text=True, env=full_env, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    return {case.id: result for case, result in zip(CASES, results, strict=True)}


def assert_one_line_error(rc: int, stderr: str, expect: list[str], want_rc: int = 2) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr[-3000:]
    (line,) = lines
    assert rc == want_rc, (rc, line)
    assert "error" in line, line
    for part in expect:
        assert part in line, (part, line)
    assert SECRET not in line, line
    assert len(line) < 4000, line[:300]
    return line


def _params() -> list[object]:
    marks = {c.id: pytest.mark.xfail(strict=True, reason=c.xfail) for c in CASES if c.xfail}
    return [pytest.param(c, id=c.id, marks=marks.get(c.id, ())) for c in CASES]


def test_case_ids_are_unique() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("case", _params())
def test_bad_input_is_one_line(case: Case, battery_results: dict[str, dict[str, object]]
                               ) -> None:
    result = battery_results[case.id]
    assert_one_line_error(result["rc"], result["stderr"], case.expect, case.rc)
    assert SECRET not in result["stdout"]


# -- bad plugins -------------------------------------------------------------------

def _plugin(body: str, hook: str = "lmkv_storage_backends", returns: str = "Bad") -> str:
    return ("from lmkv.plugins import hookimpl\n" + body
            + f"\n\n@hookimpl\ndef {hook}():\n    return {returns}\n")


CPU_CLASS = "from lmkv_backends.tiers.cpu import CPUBackend\n"
NAIVE_CLASS = "from lmkv_backends.serde.naive import NaiveSerializer\n"

# dist: (module source, what its one line in `lmkv plugins` says). All of them are
# installed together, beside a good plugin: none may hide another.
BAD_PLUGINS: dict[str, tuple[str, str]] = {
    "lmkv-import-raises": ("raise RuntimeError('boom at import\\nsecond line')\n",
                           "RuntimeError: boom at import second line"),
    "lmkv-hook-raises": (_plugin("", returns="1 / 0"), "ZeroDivisionError"),
    "lmkv-returns-int": (_plugin("", returns="42"), "returned 42"),
    "lmkv-returns-generator": (_plugin(CPU_CLASS, returns="(c for c in [CPUBackend])"),
                               "expected a subclass"),
    "lmkv-wrong-kind": (_plugin("from lmkv_policies.lru import LRUPolicy\n",
                                returns="LRUPolicy"),
                        "expected a subclass of lmkv.contracts.tier.StorageBackend"),
    "lmkv-options-dict": (_plugin(CPU_CLASS + "class Bad(CPUBackend):\n    name = 'od'\n"
                                  "    Options = dict\n"), "`Options` must be a pydantic"),
    "lmkv-options-loose": (_plugin(CPU_CLASS + "from pydantic import BaseModel, ConfigDict\n"
                                   "class Loose(BaseModel):\n"
                                   "    model_config = ConfigDict(extra='allow')\n"
                                   "class Bad(CPUBackend):\n    name = 'ol'\n"
                                   "    Options = Loose\n"), "extra='forbid'"),
    "lmkv-name-int": (_plugin(CPU_CLASS + "class Bad(CPUBackend):\n    name = 5\n"),
                      "has no `name`"),
    "lmkv-bool-id": (_plugin(NAIVE_CLASS + "class Bad(NaiveSerializer):\n    name = 'b'\n"
                             "    serializer_id = True\n", hook="lmkv_serializers"),
                     "serializer_id = True"),
    "lmkv-hook-takes-args": ("from lmkv.plugins import hookimpl\n\n@hookimpl\n"
                             "def lmkv_storage_backends(config):\n    return []\n",
                             "lmkv_storage_backends"),
    "lmkv-twins": (_plugin(CPU_CLASS + "class Bad(CPUBackend):\n    name = 'twin'\n"
                           "class Twin(CPUBackend):\n    name = 'TWIN'\n",
                           returns="[Bad, Twin]"), "registered twice"),
    "lmkv-shadows-lru": (_plugin("from lmkv_policies.lru import LRUPolicy\n"
                                 "class Bad(LRUPolicy):\n    name = 'Lru'\n",
                                 hook="lmkv_eviction_policies"), "the built-in wins"),
}
MISSING_ATTR = "lmkv-missing-attr"  # its entry point names an attribute that isn't there

# A plugin whose Options default fails validation loads; selecting it is one line.
BAD_DEFAULT = ("from pydantic import ConfigDict\nfrom lmkv.contracts.plugin import PluginOptions\n"
               + CPU_CLASS + "class O(PluginOptions):\n"
               "    model_config = ConfigDict(validate_default=True)\n"
               "    size: int = 'big'\n"
               "class Bad(CPUBackend):\n    name = 'baddefault'\n    Options = O\n")


def _site(root: Path, plugins: dict[str, str]) -> dict[str, str]:
    """Install ``plugins`` (dist -> source) and the good hello plugin under ``root``;
    the env that puts them on the path of a subprocess."""
    for dist, source in plugins.items():
        write_dist(root, dist, dist.replace("-", "_"), source)
    write_hello_plugin(root)
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path}


def _assert_others_work(site_env: dict[str, str], tmp_path: Path) -> dict[str, object]:
    """`lmkv plugins --json` lists the built-ins and hello; a cpu-only config and one
    selecting hello both pass `config check`. Returns the listing."""
    listing = run_cli("plugins", "--json", env=site_env)
    assert listing.returncode == 0, listing.stderr[-3000:]
    assert "Traceback" not in listing.stderr, listing.stderr[-3000:]
    data = json.loads(listing.stdout)
    names = {(p["kind"], p["name"]) for p in data["plugins"]}
    for wanted in [("storage_backend", "cpu"), ("storage_backend", "fs"),
                   ("storage_backend", "hello"), ("eviction_policy", "lru"),
                   ("serializer", "naive")]:
        assert wanted in names, wanted
    for text, name in [(CPU, "cpu.yaml"), ("tiers: [hello]\n", "hello.yaml")]:
        (tmp_path / name).write_text(text)
        check_run = run_cli("config", "check", str(tmp_path / name), env=site_env)
        assert check_run.returncode == 0, check_run.stderr[-3000:]
    return data


def _assert_server_starts_and_stops(site_env: dict[str, str], tmp_path: Path) -> None:
    """`lmkv server` on the cpu config logs that it listens, and stops on SIGTERM."""
    import selectors
    import signal

    env = {k: v for k, v in os.environ.items() if not k.startswith("LMKV_")}
    env.update(site_env)
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmkv", "server", "--config", str(tmp_path / "cpu.yaml"),
         "--socket", str(tmp_path / "srv" / "s.sock")],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    seen: list[str] = []
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stderr, selectors.EVENT_READ)
            while not any("listening on ipc://" in line for line in seen):
                assert sel.select(timeout=120), seen
                line = proc.stderr.readline()
                assert line, (proc.poll(), seen)
                seen.append(line)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not any("Traceback" in line for line in seen), seen


def test_bad_plugins_are_one_line_each_and_leave_the_others_working(tmp_path: Path) -> None:
    sources = {dist: source for dist, (source, _) in BAD_PLUGINS.items()}
    sources[MISSING_ATTR] = "X = 1\n"
    sources["lmkv-bad-default"] = _plugin(BAD_DEFAULT)
    site_env = _site(tmp_path / "site", sources)
    info = tmp_path / "site" / "lmkv_missing_attr-1.0.dist-info" / "entry_points.txt"
    info.write_text(f"[lmkv]\n{MISSING_ATTR} = lmkv_missing_attr.plugin:nothere\n")
    problems = {**{d: p for d, (_, p) in BAD_PLUGINS.items()}, MISSING_ATTR: "nothere"}

    data = _assert_others_work(site_env, tmp_path)
    errors: dict[str, list[str]] = {}
    for e in data["errors"]:
        errors.setdefault(e["distribution"], []).append(e["error"])
    for dist, problem in problems.items():
        assert len(errors.get(dist, [])) == 1, (dist, errors.get(dist))
        (error,) = errors[dist]
        assert problem in error and "\n" not in error, (dist, error)
    assert "lmkv-bad-default" not in errors

    table = run_cli("plugins", env=site_env)
    assert table.returncode == 0, table.stderr[-3000:]
    failed = table.stdout.split("plugins left out (see docs/migrating-plugins.md):")[1].splitlines()
    for dist, problem in problems.items():
        (line,) = [x for x in failed if f"({dist} 1.0)" in x]
        assert problem in line
    # What is logged while loading is one line per problem, too.
    for line in table.stderr.strip().splitlines():
        assert line.startswith("WARNING lmkv.plugins"), line

    # No server at the config's address: the config's tiers, opened in this process.
    stats = run_cli("stats", "--config", str(tmp_path / "cpu.yaml"),
                    env={**site_env, "LMKV_SERVER__ADDRESS": "tcp://127.0.0.1:1"})
    assert stats.returncode == 0, stats.stderr[-3000:]
    assert stats.stdout.startswith("tier 0 (cpu): usage 0.0 MiB of 64.0 MiB")
    _assert_server_starts_and_stops(site_env, tmp_path)

    chosen = tmp_path / "bad-default.yaml"
    chosen.write_text("tiers: [baddefault]\n")
    result = run_cli("config", "check", str(chosen), env=site_env)
    errors_only = "\n".join(x for x in result.stderr.splitlines() if not x.startswith("WARNING"))
    assert_one_line_error(result.returncode, errors_only,
                          ["'tiers.0.options.size'", "must be an integer"])


# Each of these gets a site of its own: done wrong, it takes every command down.
ISOLATED_PLUGINS = [
    pytest.param("lmkv-exits", "import sys\nsys.exit(3)\n", "SystemExit",
                 id="import-calls-sys-exit"),
    pytest.param("lmkv-prints", "print('hello from a plugin at import')\n", None,
                 id="import-prints-to-stdout"),
    pytest.param("lmkv-bad-str",
                 "class E(Exception):\n    def __str__(self):\n        raise ValueError\n"
                 "raise E()\n", "E", id="exception-whose-str-raises"),
    pytest.param("lmkv-hook-typo", "from lmkv.plugins import hookimpl\n\n@hookimpl\n"
                 "def lmkv_storage_backend():\n    return []\n", "lmkv_storage_backend",
                 id="misspelled-hook-name"),
]


@pytest.mark.parametrize("dist,source,problem", ISOLATED_PLUGINS)
def test_a_plugin_that_misbehaves_at_import_is_listed_and_harmless(
        dist: str, source: str, problem: str | None, tmp_path: Path) -> None:
    site_env = _site(tmp_path / "site", {dist: source})
    data = _assert_others_work(site_env, tmp_path)
    if problem is not None:
        (error,) = [e["error"] for e in data["errors"] if e["distribution"] == dist]
        assert problem in error and "\n" not in error


@pytest.mark.skipif(shutil.which("runuser") is None and os.geteuid() == 0,
                    reason="root reads any file and runuser is missing")
def test_an_unreadable_config_file_is_one_line(tmp_path: Path) -> None:
    """chmod 000: as root, run lmkv as nobody (root would read the file anyway)."""
    shared = Path(tempfile.mkdtemp(prefix="lmkv-battery-"))
    try:
        shared.chmod(0o755)
        cfg_file = shared / "locked.yaml"
        cfg_file.write_text(CPU)
        cfg_file.chmod(0)
        argv = [sys.executable, "-m", "lmkv", "config", "check", str(cfg_file)]
        if os.geteuid() == 0:
            argv = ["runuser", "-u", "nobody", "--", *argv]
            probe = subprocess.run([*argv[:4], sys.executable, "-c", "pass"],
                                   capture_output=True, text=True, timeout=60)
            if probe.returncode != 0:
                pytest.skip(f"user nobody cannot run this Python: {probe.stderr.strip()}")
        env = {k: v for k, v in os.environ.items() if not k.startswith("LMKV_")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO),
                                                          os.environ.get("PYTHONPATH")]))
        env["HOME"] = str(shared)
        result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=shared,
                                timeout=300)
        assert_one_line_error(result.returncode, result.stderr,
                              [str(cfg_file), "cannot read it", "Permission denied"])
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_debug_logging_echoes_no_secret(tmp_path: Path) -> None:
    """At --log-level DEBUG, libraries below lmkv (botocore: the endpoint URL with its
    credentials, the session token) stay at WARNING; lmkv's own lines redact."""
    cfg_file = tmp_path / "secrets.yaml"
    cfg_file.write_text(
        "tiers:\n"
        "  - {type: cpu, options: {max_bytes: 64MiB}}\n"
        "  - {type: redis, options: {url: 'redis://u:" + SECRET + "@127.0.0.1:1/0',"
        " connect_timeout_s: 0.2}}\n"
        "  - {type: fs, options: {url: 's3://bucket/p', key: AKIAEXAMPLE, secret: " + SECRET
        + ", endpoint_url: 'http://u:" + SECRET + "@127.0.0.1:1', connect_timeout_s: 0.2,"
        " read_timeout_s: 0.2, retries: 0, storage_options: {token: " + SECRET + "}}}\n")
    result = run_cli("--log-level", "DEBUG", "stats", "--config", str(cfg_file),
                     env={"LMKV_SERVER__ADDRESS": "tcp://127.0.0.1:1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "DEBUG lmkv" in result.stderr  # the level took effect for lmkv itself
    assert SECRET not in result.stderr and SECRET not in result.stdout
    checked = run_cli("config", "check", str(cfg_file))
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert SECRET not in checked.stdout and "***" in checked.stdout
