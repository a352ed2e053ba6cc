"""An engine process for the server tests: ``python -m tests.server.worker MODE ...``.

``loop ADDRESS DATA_PATH WORKER OUT STOP_FILE ITERATIONS TIMEOUT_MS``: look up, retrieve
(checking every byte) and store prompts, own and shared, until ITERATIONS are done
or STOP_FILE exists; one JSON line per iteration goes to OUT, then a summary line.
Any exception escapes (non-zero exit): the tests require none.

``hold ADDRESS``: take a prefetch, a staged store and a retrieve lease, print
"held", then sleep until killed.

``hog ADDRESS STORES``: a misbehaving client. Ask for shared-memory buffers for
STORES prompts, naming process 1 (which never exits) as its own, commit none,
print one JSON line (chunks granted, stores refused, error replies), then stay
silent until killed.

``stall-retrieve ADDRESS PROMPT PAUSE_S`` / ``stall-store ADDRESS PROMPT PAUSE_S``:
retrieve (store) PROMPT through shared memory; inside the copy callback print
"copying", sleep PAUSE_S (the test freezes the process there), then check (write)
the bytes, and print one JSON line with the outcome.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

from lmkv.rpc import protocol as p
from lmkv.rpc.client import ServerClient
from lmkv.rpc.liveness import process_identity
from tests.server.procs import chunk_ends, chunk_for, prompt_keys, same_bytes

SHARED_PROMPTS = (900, 901, 902)


def loop(address: str, data_path: str, worker: int, out: Path, stop_file: Path,
         iterations: int, timeout_ms: int) -> None:
    prompts = [1000 + worker * 10 + i for i in range(4)] + list(SHARED_PROMPTS)
    rng = random.Random(worker)
    mismatches = 0
    client = ServerClient(address, data_path=data_path, timeout_ms=timeout_ms)
    with out.open("w") as log:
        for i in range(iterations):
            if stop_file.exists():
                break
            prompt = rng.choice(prompts)
            keys = prompt_keys(prompt)
            lookup_id = f"{worker}-{i}"
            hit = client.lookup(keys, chunk_ends(keys), lookup_id=lookup_id)
            got = client.retrieve(keys, lookup_id=lookup_id)
            bad = sum(not same_bytes(t, chunk_for(k)) for t, k in zip(got, keys, strict=False))
            mismatches += bad
            stored = 0
            if len(got) < len(keys):
                stored = client.store(keys, [chunk_for(k) for k in keys])
            log.write(json.dumps({"t": time.time(), "prompt": prompt, "hit": hit,
                                  "got": len(got), "bad": bad, "stored": stored,
                                  "shm": client.shared_memory}) + "\n")
            log.flush()
        log.write(json.dumps({"summary": True, "mismatches": mismatches,
                              "counters": asdict(client.counters)}) + "\n")
    client.close()


def hold(address: str) -> None:
    client = ServerClient(address, timeout_ms=5000)
    keys = prompt_keys(700)
    chunks = [chunk_for(k) for k in keys]
    assert client.store(keys, chunks) == len(keys)
    assert client.lookup(keys, chunk_ends(keys), lookup_id="held") > 0
    staged = prompt_keys(701)
    store = p.Store(**p.key_fields(staged), shapes=[list(c.shape) for c in chunks],
                    dtype="bfloat16", data_path="shm", process=process_identity())
    assert client._call(store, p.StoreReply) is not None
    assert client._call(p.Retrieve(**p.key_fields(keys), data_path="shm",
                                   process=process_identity()),
                        p.RetrieveReply) is not None
    print("held", flush=True)
    time.sleep(600)


def hog(address: str, stores: int) -> None:
    client = ServerClient(address, timeout_ms=5000)
    assert client.ping() is not None and client.shared_memory
    shape = list(chunk_for(prompt_keys(800)[0]).shape)
    with open("/proc/1/stat") as f:  # pid 1, named the way a client names itself
        stat = f.read()
    host, namespace = process_identity().split("|")[:2]
    pid_1 = f"{host}|{namespace}|1|{stat[stat.rfind(')') + 2:].split()[19]}"
    granted = refused = 0
    for i in range(stores):
        keys = prompt_keys(800 + i)
        store = p.Store(**p.key_fields(keys), shapes=[shape] * len(keys), dtype="bfloat16",
                        data_path="shm", process=pid_1)
        got = client._call(store, p.StoreReply)
        if got is None:
            refused += 1
        else:
            granted += len(got[0].chunks)
    print(json.dumps({"granted": granted, "refused": refused,
                      "error_replies": client.counters.error_replies}), flush=True)
    client.close_connection()  # silent from now on; its session is not ended
    time.sleep(600)


def stall(mode: str, address: str, prompt: int, pause_s: float) -> None:
    client = ServerClient(address, timeout_ms=5000)
    keys = prompt_keys(prompt)
    outcome: dict[str, int] = {}

    def consume(views) -> None:
        print("copying", flush=True)
        time.sleep(pause_s)
        outcome["got"] = len(views)
        outcome["bad"] = sum(not same_bytes(v, chunk_for(k))
                             for v, k in zip(views, keys, strict=False))

    def fill(first: int, buffers) -> None:
        print("copying", flush=True)
        time.sleep(pause_s)
        for buf, key in zip(buffers, keys[first:], strict=False):
            buf.copy_(chunk_for(key))
        outcome["filled"] = len(buffers)

    if mode == "stall-retrieve":
        client.retrieve_into(keys, consume)
    else:
        chunk = chunk_for(keys[0])
        outcome["stored"] = client.store_from(keys, [chunk.shape] * len(keys), chunk.dtype,
                                              fill)
    assert client.shared_memory
    print(json.dumps(outcome), flush=True)
    client.close()


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode.startswith("stall-"):
        stall(mode, args[0], int(args[1]), float(args[2]))
    elif mode == "hog":
        hog(args[0], int(args[1]))
    elif mode == "loop":
        address, data_path, worker, out, stop, iterations, timeout_ms = args
        loop(address, data_path, int(worker), Path(out), Path(stop), int(iterations),
             int(timeout_ms))
    else:
        hold(args[0])
