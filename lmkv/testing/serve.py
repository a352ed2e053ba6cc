"""``start_vllm_serve``: a real ``vllm serve`` process, as users run it.

Tests and benchmarks of served traffic need the whole stack a user runs: the
OpenAI API server, its engine-core process, the connector loaded from
``--kv-transfer-config``. This module starts ``python -m
vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs; the ``vllm``
script itself fails on the CPU build's missing package metadata) with the
docs/vllm.md recipe, waits for ``/health``, scrapes ``/metrics``, and stops
it the way a service manager does (SIGTERM), then checks that nothing was left
behind: no process of its group and no shared-memory segment an lmkv process
of it created (``lmkv-<pid>-...``, lmkv.memory.shm).

Nothing here imports vLLM: it only runs it, so the launcher works from any
Python that can reach a vLLM venv (``python=``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmkv.memory.shm import NAME_PREFIX

SHM_DIR = "/dev/shm"


def lmkv_kv_transfer_config(extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of docs/vllm.md with ``extra`` as
    ``kv_connector_extra_config`` (dotted ``lmkv.*`` keys)."""
    return {
        "kv_connector": "LMKVConnector",
        "kv_connector_module_path": "lmkv.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": dict(extra or {}),
    }


def build_model_dir(directory: str | os.PathLike, *, hidden_size: int = 256, num_layers: int = 2,
                    num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 64,
                    intermediate_size: int = 512, max_position_embeddings: int = 8192) -> str:
    """A random-weight Llama and its locally trained tokenizer saved together in
    ``directory`` (prompts can then be text). Returns the directory."""
    import torch

    from lmkv.integrations.hf_model import build_model, build_tokenizer
    path = os.fspath(directory)
    model = build_model(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                        num_kv_heads=num_kv_heads, head_dim=head_dim,
                        intermediate_size=intermediate_size,
                        max_position_embeddings=max_position_embeddings, dtype=torch.float32)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- Prometheus text ----------------------------------------------------------------------------

def parse_prometheus(text: str) -> dict[str, float]:
    """Each sample name of a Prometheus text page -> its value summed over labels
    (engines, tiers): ``{"vllm:prefix_cache_hits_total": 512.0, ...}``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


def scrape(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """``url``'s Prometheus page, parsed by :func:`parse_prometheus`."""
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return parse_prometheus(reply.read().decode())


# -- processes and shared memory ------------------------------------------------------------------

def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live descendant (from /proc)."""
    tree, out, todo = _children(), [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(tree.get(current, ()))
    return out


def group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (a server started in its own
    session leads one: its children stay in it unless they leave on purpose)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def lmkv_segments(pids: Sequence[int]) -> list[str]:
    """The /dev/shm segments lmkv created in any of ``pids`` (named ``lmkv-<pid>-...``)."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    prefixes = tuple(f"{NAME_PREFIX}{pid}-" for pid in pids)
    return sorted(n for n in names if n.startswith(prefixes))


def stop_process(proc: subprocess.Popen, *, pids: Sequence[int] = (),
                 timeout_s: float = 60.0, what: str = "process") -> list[str]:
    """SIGTERM ``proc``, wait for it, and return what it left behind: its exit
    code if not 0, processes of ``pids`` (taken before the signal; default: its
    tree now) or of its process group still alive (killed), lmkv shared-memory
    segments they created. Kills a process that does not
    end within ``timeout_s`` (and reports it)."""
    pids = list(pids) or process_tree(proc.pid)
    problems: list[str] = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait(30)
        problems.append(f"{what} ignored SIGTERM for {timeout_s:.0f} s and was killed")
    if rc != 0:
        problems.append(f"{what} exited {rc} after SIGTERM")
    def leftovers() -> list[int]:
        return sorted(({p for p in pids if alive(p)} | set(group_members(proc.pid)))
                      - {proc.pid})

    deadline = time.monotonic() + 10  # children exit shortly after their parent
    while (left := leftovers()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        problems.append(f"{what} left process {pid} running")
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if segments := lmkv_segments(pids):
        problems.append(f"{what} left shared-memory segments {segments}")
    return problems


# -- vllm serve ---------------------------------------------------------------------------------

class ServeStartError(RuntimeError):
    """``vllm serve`` exited or did not answer at start; ``log_path`` holds its output."""

    def __init__(self, message: str, log_path: str) -> None:
        super().__init__(message)
        self.log_path = log_path


# An exception's last traceback line, bare or behind vLLM's "(Proc pid=N) ERROR ... [file:line] ".
_ERROR_LINE = re.compile(r"^(?:\(.*?\) ERROR .*?\] )?\s*"
                         r"((?:[A-Z][\w.]*)?(?:Error|Exception)): (.+)")


def start_error_line(log_text: str) -> str:
    """The one line of a failed start's log that says why: its first exception
    message other than vLLM's "Engine core initialization failed" wrapper."""
    for line in log_text.splitlines():
        match = _ERROR_LINE.match(line)
        if match and "Engine core initialization failed" not in match[2]:
            return f"{match[1]}: {match[2].strip()}"
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


@dataclass
class VllmServe:
    """A running ``vllm serve``: its OpenAI base URL (``url`` + ``/v1``), its
    served model name, the log file. Stop it with :meth:`stop`."""

    proc: subprocess.Popen
    url: str
    model: str
    log_path: str
    problems: list[str] = field(default_factory=list)

    @property
    def api_base(self) -> str:
        return f"{self.url}/v1"

    def metrics(self) -> dict[str, float]:
        """``/metrics`` now, summed over labels (:func:`parse_prometheus`)."""
        return scrape(f"{self.url}/metrics")

    def post(self, path: str) -> Any:
        """POST ``path`` (a dev endpoint such as ``/reset_prefix_cache``); its JSON."""
        request = urllib.request.Request(f"{self.url}{path}", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=60) as reply:
            body = reply.read()
        return json.loads(body) if body else None

    def log_tail(self, lines: int = 40) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def stop(self, timeout_s: float = 90.0) -> list[str]:
        """SIGTERM, wait; returns what was left behind (empty: a clean stop)."""
        self.problems = stop_process(self.proc, timeout_s=timeout_s, what="vllm serve")
        return self.problems

    def __enter__(self) -> VllmServe:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.stop()


def vllm_env(*, kvcache_gib: int = 1, threads_bind: str | None = None,
             env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a vLLM CPU run: the KV cache size (GiB) and the OpenMP
    threads' CPUs pinned (default: every CPU of this machine)."""
    out = dict(os.environ if env is None else env)
    out["VLLM_CPU_KVCACHE_SPACE"] = str(kvcache_gib)
    out["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind or f"0-{(os.cpu_count() or 1) - 1}"
    return out


def start_vllm_serve(model_dir: str, *, log_dir: str | os.PathLike,
                     kv_transfer_config: Mapping[str, Any] | None = None,
                     args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                     python: str = sys.executable, timeout_s: float = 600.0,
                     name: str = "serve") -> VllmServe:
    """Start ``vllm serve model_dir`` on a free 127.0.0.1 port and wait for
    ``/health``. ``kv_transfer_config`` (e.g. :func:`lmkv_kv_transfer_config`)
    goes in as ``--kv-transfer-config JSON``; ``args`` are further flags;
    ``env`` the whole environment (:func:`vllm_env`). The log goes to
    ``log_dir/<name>-<port>.log``. Raises :class:`ServeStartError` (with the
    log's tail) when the server exits or does not answer within ``timeout_s``."""
    port = free_port()
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--host", "127.0.0.1", "--port", str(port), *args]
    if kv_transfer_config is not None:
        command += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    log_path = os.path.join(os.fspath(log_dir), f"{name}-{port}.log")
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(env) if env is not None else vllm_env(),
                                start_new_session=True)
    handle = VllmServe(proc, f"http://127.0.0.1:{port}", model_dir, log_path)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise ServeStartError(f"vllm serve exited {proc.returncode} at start "
                                  f"(log {log_path}):\n{handle.log_tail()}", log_path)
        try:
            with urllib.request.urlopen(f"{handle.url}/health", timeout=5) as reply:
                if reply.status == 200:
                    return handle
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            handle.stop()
            raise ServeStartError(f"vllm serve did not answer /health in {timeout_s:.0f} s "
                                  f"(log {log_path}):\n{handle.log_tail()}", log_path)
        time.sleep(0.5)
