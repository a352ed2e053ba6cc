"""The client heartbeat under load: renew requests and "handles lost" warnings.

    python benchmarks/bench_heartbeat.py [--seconds 60] [--clients 4]

Starts an ``lmkv server`` (64 MiB cpu tier, default timeouts) and CLIENTS
processes that look up, retrieve (shared memory) and store prompts for SECONDS;
prints, over all clients, the renew requests the heartbeats sent, the "the
server no longer holds N of M handles" warnings they would have logged (counted
before the rate limit), the iterations done, and the handles the server really
expired. With default timeouts every transfer is far shorter than the renew
interval (7.5 s), so the right figures are 0, 0, and 0: a warning without an
expiry is a false one, a renewal of a short transfer a needless request.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_client(address: str, seconds: float, worker: int) -> None:
    sys.path.insert(0, str(REPO))
    from lmkv.rpc import heartbeat
    from lmkv.rpc import protocol as p
    from lmkv.rpc.channel import Channel
    from lmkv.rpc.client import ServerClient
    from tests.server.procs import chunk_ends, chunk_for, prompt_keys

    counts = {"renews": 0, "lost_warnings": 0}
    request = Channel.request

    def counting_request(channel: Channel, message: p.Request, *args, **kwargs):
        if isinstance(message, p.Renew) and message.handles:
            counts["renews"] += 1
        return request(channel, message, *args, **kwargs)

    class CountingLog:
        def __init__(self, inner) -> None:
            self.inner = inner

        def warning(self, key: str, *args: object) -> None:
            counts["lost_warnings"] += key == "lost"
            self.inner.warning(key, *args)

        def __getattr__(self, name: str):
            return getattr(self.inner, name)

    Channel.request = counting_request
    heartbeat._log = CountingLog(heartbeat._log)
    client = ServerClient(address, timeout_ms=2000)
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        keys = prompt_keys(5000 + (worker * 7 + i) % 40)
        client.lookup(keys, chunk_ends(keys), lookup_id=f"{worker}-{i}")
        if len(client.retrieve(keys, lookup_id=f"{worker}-{i}")) < len(keys):
            client.store(keys, [chunk_for(k) for k in keys])
        i += 1
    client.close()
    print(json.dumps({**counts, "iterations": i}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--client", nargs=2, metavar=("ADDRESS", "WORKER"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        run_client(args.client[0], args.seconds, int(args.client[1]))
        return
    sys.path.insert(0, str(REPO))
    from lmkv.rpc.client import ServerClient

    tmp = Path(tempfile.mkdtemp(prefix="lmkv-bench-heartbeat-"))
    config = tmp / "lmkv.yaml"
    config.write_text("tiers: [{type: cpu, options: {max_bytes: 64MiB}}]\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    with (tmp / "server.log").open("w") as log:
        server = subprocess.Popen([sys.executable, "-m", "lmkv.server", "--config",
                                   str(config), "--port", str(port)], stdout=log,
                                  stderr=subprocess.STDOUT, cwd=REPO)
    clients: list[subprocess.Popen] = []
    try:
        with ServerClient(address, timeout_ms=500) as probe:
            deadline = time.monotonic() + 60
            while probe.ping() is None:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not start; see {tmp / 'server.log'}")
                time.sleep(0.2)
        clients = [subprocess.Popen([sys.executable, __file__, "--seconds", str(args.seconds),
                                     "--client", address, str(w)], stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True, cwd=REPO)
                   for w in range(args.clients)]
        totals: dict[str, int] = {}
        for proc in clients:
            out, _ = proc.communicate(timeout=args.seconds + 120)
            for key, value in json.loads(out.strip().splitlines()[-1]).items():
                totals[key] = totals.get(key, 0) + value
        with ServerClient(address, timeout_ms=5000) as probe:
            stats = probe.stats()
        totals["server_expired_handles"] = stats.server.expired_handles if stats else -1
        print(json.dumps(totals))
    finally:
        for proc in clients:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        server.send_signal(signal.SIGTERM)
        server.wait(60)


if __name__ == "__main__":
    main()
