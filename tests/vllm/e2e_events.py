"""lmkv's KV events in the stream a real ``vllm serve`` publishes.

Run with the vLLM venv: ``.venv-vllm/bin/python tests/vllm/e2e_events.py`` (a
step of .ci/run). It starts ``vllm serve`` (the api_server module: the ``vllm``
CLI fails on the CPU build) with a tiny random Llama, vLLM's prefix caching,
``--kv-events-config`` (ZMQ publisher on a loopback TCP port) and lmkv with a
cpu tier of three chunks over a disk tier. A subscriber (bound to the port:
vLLM's publisher connects to a host address) with ``zmq`` and
vLLM's own ``KVEventBatch`` decoder reads the published stream while three
prompts of 2.5 chunks each run through the OpenAI completions API. Checks:

* lmkv's ``BlockStored`` (medium ``lmkv:cpu``, then ``lmkv:fs`` once the
  write-through landed: after each prompt the test waits for those, short
  requests bringing the engine steps that carry them) carry exactly vLLM's
  own block hashes of each prompt (vLLM's GPU events for the same blocks), the
  prompt's token ids, the parent hash chain and vLLM's block size;
* the later prompts evict the first from the cpu tier: ``BlockRemoved``
  (``lmkv:cpu``) for each of its blocks, none from ``lmkv:fs`` (unbounded).

Then the same with vLLM's prefix caching off (a fresh server and disk tier):
vLLM publishes nothing of its own, and lmkv's events must name the blocks
exactly as the first server's vLLM did.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_vllm import build

CHUNK, BLOCK = 256, 128  # vLLM's CPU block size
PROMPT = 640  # 2.5 chunks, 5 blocks
CHUNK_BYTES = 2 * 2 * 2 * 64 * CHUNK * 4  # layers x (K, V) x KV heads x head dim x fp32
START_TIMEOUT_S = 600
SETTLE_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subscriber:
    """Every event of the published stream, decoded with vLLM's classes."""

    def __init__(self, endpoint: str) -> None:
        import zmq
        self.events: list = []
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVTIMEO, 200)
        # vLLM's publisher connects to a host address (it binds only ``*``): the
        # subscriber binds, on loopback, before vLLM starts, so nothing is missed.
        self._sub.bind(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._stop.is_set():
            try:
                _topic, _seq, payload = self._sub.recv_multipart()
            except zmq.Again:
                continue
            self.events.extend(decoder.decode(payload).events)

    def blocks_stored(self, medium: str) -> int:
        """Distinct blocks ``BlockStored`` in ``medium`` so far."""
        from vllm.distributed.kv_events import BlockStored
        return len({h for e in list(self.events)
                    if isinstance(e, BlockStored) and e.medium == medium
                    for h in e.block_hashes})

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sub.close(0)
        self._ctx.term()


def complete(port: int, model: str, tokens: list[int], max_tokens: int = 4) -> None:
    body = json.dumps({"model": model, "prompt": tokens, "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        assert response.status == 200, response.status


def settle(port: int, model: str, subscriber: Subscriber, fs_blocks: int) -> None:
    """Wait (bounded) until the disk tier's ``BlockStored`` name ``fs_blocks`` blocks.

    The write-through to the disk lands after the request's steps, and its events
    go out with the next engine step: short requests (under a block: lmkv stores
    nothing of them, vLLM publishes nothing) bring those steps. While the disk
    writes the prompt's chunks, they are held in the three-chunk cpu tier, and
    the next prompt would find no room there: its store would be cut short
    (lmkv never waits for a slower tier; it gives up writes that have not
    started, not one in progress)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline:
        if subscriber.blocks_stored("lmkv:fs") >= fs_blocks:
            return
        complete(port, model, [11, 12, 13], max_tokens=1)
        time.sleep(0.2)
    raise RuntimeError(f"the disk tier announced {subscriber.blocks_stored('lmkv:fs')} "
                       f"blocks within {SETTLE_TIMEOUT_S} s, not {fs_blocks}")


def wait_ready(port: int, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"vllm serve exited {server.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except OSError:
            time.sleep(2)
    raise RuntimeError("vllm serve did not become ready")


def serve(model_dir: str, tmp: str, port: int, events_port: int,
          prefix_caching: bool) -> subprocess.Popen:
    extra = {"lmkv.chunk_size": CHUNK,
             "lmkv.lookup.runtime_dir": os.path.join(tmp, "run"),
             "lmkv.tiers": [{"type": "cpu", "options": {"max_bytes": 3 * CHUNK_BYTES}},
                            {"type": "fs", "options": {"url": os.path.join(tmp, "disk")}}]}
    transfer = {"kv_connector": "LMKVConnector",
                "kv_connector_module_path": "lmkv.integrations.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": extra}
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://127.0.0.1:{events_port}"}
    cpus = f"0-{(os.cpu_count() or 1) - 1}"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": cpus}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--enforce-eager", "--max-model-len", "2048",
           "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
           "--max-num-seqs", "4", "--seed", "0",
           "--kv-transfer-config", json.dumps(transfer),
           "--kv-events-config", json.dumps(events)]
    log = open(os.path.join(tmp, "serve.log"), "a")  # noqa: SIM115 (the child's stdout)
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def check(events: list, prompts: list[list[int]], reference: list) -> list[str]:
    """Problems with lmkv's events in ``events``; vLLM's own block hashes are
    those of its own events in ``reference`` (the same prompts)."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    problems: list[str] = []
    stored: dict[str, list] = {}
    removed: dict[str, set] = {}
    for e in events:
        if isinstance(e, BlockStored):
            stored.setdefault(e.medium or "", []).append(e)
        elif isinstance(e, BlockRemoved):
            removed.setdefault(e.medium or "", set()).update(e.block_hashes)
    print("media stored:", {m: sum(len(e.block_hashes) for e in es) for m, es in stored.items()},
          "removed:", {m: len(hs) for m, hs in removed.items()})
    references: dict[str, list] = {}
    for e in reference:
        if isinstance(e, BlockStored) and not (e.medium or "").startswith("lmkv:"):
            references.setdefault(e.medium or "", []).append(e)
    if not references:
        return ["vLLM published none of its own BlockStored events"]

    def blocks(events_of: dict[str, list], media: list[str]) -> dict:
        """block hash -> (tokens, parent, block size) over the events of ``media``."""
        out = {}
        for m in media:
            for e in events_of.get(m, []):
                n = len(e.block_hashes)
                for i, h in enumerate(e.block_hashes):
                    parent = e.block_hashes[i - 1] if i else e.parent_block_hash
                    out[h] = (tuple(e.token_ids[i * e.block_size:(i + 1) * e.block_size]),
                              parent, e.block_size, n)
        return out

    vllm_blocks = blocks(references, list(references))
    by_tokens = {v[0]: h for h, v in vllm_blocks.items()}
    for medium in ("lmkv:cpu", "lmkv:fs"):
        ours = blocks(stored, [medium])
        for p, prompt in enumerate(prompts):
            chain = [by_tokens.get(tuple(prompt[i * BLOCK:(i + 1) * BLOCK]))
                     for i in range(PROMPT // BLOCK)]
            if None in chain:
                problems.append(f"vLLM's own events lack a block of prompt {p}")
                continue
            for i, h in enumerate(chain):
                got = ours.get(h)
                want = (vllm_blocks[h][0], chain[i - 1] if i else None, BLOCK)
                if got is None:
                    problems.append(f"{medium}: no BlockStored for block {i} of prompt {p}")
                elif got[:3] != want:
                    problems.append(f"{medium}: block {i} of prompt {p} stored as "
                                    f"(parent {got[1]}, block size {got[2]}), "
                                    f"vLLM says (parent {want[1]}, block size {BLOCK}), "
                                    f"tokens equal: {got[0] == want[0]}")
        if medium == "lmkv:cpu":
            first = [by_tokens.get(tuple(prompts[0][i * BLOCK:(i + 1) * BLOCK]))
                     for i in range(PROMPT // BLOCK)]
            missing = [i for i, h in enumerate(first) if h not in removed.get(medium, set())]
            if missing:
                problems.append(f"lmkv:cpu: no BlockRemoved for blocks {missing} of the "
                                "first prompt, evicted by the later ones")
    if removed.get("lmkv:fs"):
        problems.append("lmkv:fs removed blocks, but it is unbounded")
    return problems


def stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after a minute."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # exited already
    server.wait()


def published(model_dir: str, tmp: str, prompts: list[list[int]],
              prefix_caching: bool) -> list:
    """The events a fresh ``vllm serve`` (a fresh disk tier) publishes for ``prompts``."""
    tmp = os.path.join(tmp, f"pc{int(prefix_caching)}")  # short: it holds unix sockets
    os.makedirs(tmp)
    port, events_port = free_port(), free_port()
    subscriber = Subscriber(f"tcp://127.0.0.1:{events_port}")
    server = serve(model_dir, tmp, port, events_port, prefix_caching)
    try:
        wait_ready(port, server)
        for n, prompt in enumerate(prompts, 1):
            complete(port, model_dir, prompt)
            settle(port, model_dir, subscriber, n * (PROMPT // BLOCK))
        time.sleep(3)  # the last step's batch reaches the subscriber
    except Exception:
        print("--- vllm serve log (tail) ---")
        print(Path(tmp, "serve.log").read_text()[-6000:])
        raise
    finally:
        stop(server)
        subscriber.close()
    for line in Path(tmp, "serve.log").read_text().splitlines():
        if "lmkv" in line and ("KV events" in line or "Traceback" in line):
            print("serve:", line)
    return subscriber.events


def main() -> int:
    rng = random.Random(7)
    prompts = [[rng.randrange(10, 8000) for _ in range(PROMPT)] for _ in range(3)]
    with tempfile.TemporaryDirectory(prefix="lmkv-events-") as tmp:
        model_dir = os.path.join(tmp, "model")
        build(model_dir)
        try:
            with_cache = published(model_dir, tmp, prompts, prefix_caching=True)
            # vLLM publishes nothing of its own without prefix caching, but still
            # hashes the blocks (a connector is set): lmkv's events name them the
            # same (sha256 block hashes are the same in every process).
            without = published(model_dir, tmp, prompts, prefix_caching=False)
        except Exception as exc:
            print(f"FAIL: {exc!r}")
            return 1
    problems = []
    for label, events in (("prefix caching on", with_cache), ("prefix caching off", without)):
        print(label, end=": ")
        problems += [f"{label}: {p}" for p in check(events, prompts, with_cache)]
    for problem in problems:
        print("FAIL:", problem)
    print("PASS" if not problems else "FAILED")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
