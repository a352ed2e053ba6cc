"""End-to-end check of lmkv under ``vllm serve``, driven as users drive it.

Run with the vLLM venv: ``.venv-vllm/bin/python tests/vllm/e2e_serve.py`` (a
step of .ci/run, after e2e_vllm.py). Every server is a real ``vllm serve``
process (lmkv.testing.serve) with docs/vllm.md's ``--kv-transfer-config``
recipe, a random-weight Llama and its tokenizer saved together, and is driven
through the OpenAI API by the ``openai`` client: streamed completions,
temperature 0. The prompts are text sharing a long prefix.

1. ``baseline``: vLLM without lmkv answers both prompts.
2. ``lmkv``: cpu tier over a disk (fs) tier. The first prompt is stored; vLLM's
   own prefix cache is reset (the dev endpoint ``/reset_prefix_cache``), so the
   second prompt's shared prefix can only come from lmkv: ``/metrics`` must
   show it loaded (``vllm:lmkv_loaded_tokens_total``), and both answers must
   equal the baseline's.
3. ``disk-reader``: a second ``vllm serve`` started afterwards with the same
   disk tier answers the second prompt from what the first stored.
4. ``server-writer`` / ``server-reader``: two ``vllm serve`` in lmkv server mode,
   one after the other, through one ``lmkv server``: the second loads what the
   first stored.
5. ``peer-a`` / ``peer-b``: two ``vllm serve`` running side by side, each pinned to
   its own CPU, each with its own cpu tier and the ``peer`` tier (a fleet of the
   two, private ipc sockets), nothing else: the first prompt goes to ``peer-a``,
   the second to ``peer-b``, which can only find the shared prefix in
   ``peer-a``'s memory (read from it, or pushed by it to ``peer-b`` as the
   owner). ``peer-b`` must load it, and both answers must equal the baseline's.
Every server (and the lmkv server) is stopped with SIGTERM and must exit 0
leaving no process and no lmkv shared-memory segment behind.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable

from lmkv.testing.serve import (
    VllmServe,
    build_model_dir,
    lmkv_kv_transfer_config,
    start_vllm_serve,
    stop_process,
    vllm_env,
)
from lmkv.testing.server import spawn_server

CHUNK = 256
MAX_TOKENS = 16
SERVE_ARGS = ("--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
              "--max-num-seqs", "4", "--seed", "0")
#: lmkv's own figure in vLLM's /metrics: the proof that lmkv served the tokens, not a
#: stand-in.
LOADED = "vllm:lmkv_loaded_tokens_total"


def log_line(serve: VllmServe, *parts: str, wait_s: float = 25.0) -> str | None:
    """The first line of the server's log holding every one of ``parts`` (vLLM
    logs its stats, connector figures included, every 10 s by default)."""
    deadline = time.monotonic() + wait_s
    while True:
        with open(serve.log_path, errors="replace") as f:
            for line in f:
                if all(p in line for p in parts):
                    return line.strip()
        if time.monotonic() > deadline:
            return None
        time.sleep(1)


def prompts() -> tuple[str, str]:
    from lmkv.integrations.hf_model import synthetic_text
    prefix = synthetic_text(500, seed=11)  # ~700 tokens: two whole chunks and more
    return (prefix + " " + synthetic_text(40, seed=12),
            prefix + " " + synthetic_text(60, seed=13))


def complete(serve: VllmServe, prompt: str) -> str:
    """A streamed greedy completion through the OpenAI client."""
    import openai
    client = openai.OpenAI(base_url=serve.api_base, api_key="unused", timeout=300)
    stream = client.completions.create(model=serve.model, prompt=prompt, max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)


def loaded_tokens(serve: VllmServe, wait_s: float = 20.0) -> tuple[str, float]:
    """The tokens lmkv loaded into this server, from lmkv's counter in its
    ``/metrics`` (0 when vLLM does not export it). vLLM publishes connector stats
    with its periodic stats, so wait for them."""
    deadline = time.monotonic() + wait_s
    while True:
        value = serve.metrics().get(LOADED, 0.0)
        if value > 0 or time.monotonic() > deadline:
            return LOADED, value
        time.sleep(1)


def main() -> int:
    failures: list[str] = []

    def check(ok: bool, message: str) -> None:
        print(("ok: " if ok else "FAIL: ") + message, flush=True)
        if not ok:
            failures.append(message)

    first, second = prompts()
    with tempfile.TemporaryDirectory(prefix="lmkv-e2e-serve-") as tmp:
        model_dir = build_model_dir(os.path.join(tmp, "model"), max_position_embeddings=2048)
        env = vllm_env(kvcache_gib=1)
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache
        disk = [{"type": "cpu", "options": {"max_bytes": "256MiB"}},
                {"type": "fs", "options": {"url": os.path.join(tmp, "disk")}}]

        def serve(name: str, extra: dict | None, body: Callable[[VllmServe], None]) -> None:
            config = None if extra is None else lmkv_kv_transfer_config(
                {"lmkv.chunk_size": CHUNK, **extra})
            started = time.monotonic()
            handle = start_vllm_serve(model_dir, log_dir=tmp, kv_transfer_config=config,
                                      args=SERVE_ARGS, env=env, name=name)
            print(f"{name}: up in {time.monotonic() - started:.0f} s at {handle.url}", flush=True)
            try:
                body(handle)
            finally:
                problems = handle.stop()
                check(not problems, f"{name}: SIGTERM stops it cleanly {problems or ''}")
                if problems:
                    print(handle.log_tail(), flush=True)

        base: list[str] = []
        serve("baseline", None, lambda s: base.extend([complete(s, first), complete(s, second)]))
        print("baseline outputs:", base, flush=True)
        check(base[0] != base[1], "baseline: the two prompts' answers differ (a wrong prefix "
                                  "or tail would show)")

        def with_lmkv(s: VllmServe) -> None:
            out = [complete(s, first)]
            check(s.post("/reset_prefix_cache") == {"success": True},
                  "lmkv: vLLM's prefix cache was reset")
            out.append(complete(s, second))
            check(out == base, f"lmkv: greedy outputs equal the baseline's {out}")
            name, value = loaded_tokens(s)
            check(value > 0, f"lmkv: the repeated prefix was loaded from lmkv ({name} = {value:g})")
            line = log_line(s, "KV Transfer metrics: ", "loaded_tokens=")
            check(line is not None, f"lmkv: vLLM's periodic log line carries lmkv's figures "
                                    f"({line!r})")

        serve("lmkv", {"lmkv.tiers": disk}, with_lmkv)

        def reader(label: str) -> Callable[[VllmServe], None]:
            def body(s: VllmServe) -> None:
                out = complete(s, second)
                check(out == base[1], f"{label}: output equals the baseline's {out!r}")
                name, value = loaded_tokens(s)
                check(value > 0, f"{label}: loaded what the first server stored "
                                 f"({name} = {value:g})")
            return body

        serve("disk-reader", {"lmkv.tiers": disk}, reader("disk-reader"))

        fleet = [f"ipc://{tmp}/fleet/a.sock", f"ipc://{tmp}/fleet/b.sock"]

        def peer_tiers(me: str) -> list[dict]:
            return [{"type": "cpu", "options": {"max_bytes": "256MiB"}},
                    {"type": "peer", "options": {"listen": me, "peers": fleet}}]

        def start_peer(name: str, me: str, cpu: str) -> VllmServe:
            config = lmkv_kv_transfer_config({"lmkv.chunk_size": CHUNK,
                                              "lmkv.tiers": peer_tiers(me)})
            pinned = vllm_env(kvcache_gib=1, threads_bind=cpu, env=env)
            started = time.monotonic()
            handle = start_vllm_serve(model_dir, log_dir=tmp, kv_transfer_config=config,
                                      args=SERVE_ARGS, env=pinned, name=name)
            print(f"{name}: up in {time.monotonic() - started:.0f} s at {handle.url}",
                  flush=True)
            return handle

        peers: list[VllmServe] = []
        try:
            peers.append(start_peer("peer-a", fleet[0], "0"))
            peers.append(start_peer("peer-b", fleet[1], str(min(1, (os.cpu_count() or 1) - 1))))
            a, b = peers
            check(complete(a, first) == base[0], "peer-a: output equals the baseline's")
            out = complete(b, second)
            check(out == base[1], f"peer-b: output equals the baseline's {out!r}")
            name, value = loaded_tokens(b)
            check(value >= CHUNK, f"peer-b: loaded the shared prefix from peer-a's memory "
                                  f"({name} = {value:g})")
        finally:
            for handle in reversed(peers):
                problems = handle.stop()
                check(not problems, f"{os.path.basename(handle.log_path)}: SIGTERM stops it "
                                    f"cleanly {problems or ''}")
                if problems:
                    print(handle.log_tail(), flush=True)

        server, address = spawn_server(
            tmp, "tiers:\n  - type: cpu\n    options: {max_bytes: 256MiB}\n", env=env)
        try:
            mode = {"lmkv.mode": "server", "lmkv.server.address": address}
            serve("server-writer", mode,
                  lambda s: check(complete(s, first) == base[0], "server-writer: output equals "
                                                                 "the baseline's"))
            serve("server-reader", mode, reader("server-reader"))
        finally:
            problems = stop_process(server, what="lmkv server")
            check(not problems, f"lmkv server: SIGTERM stops it cleanly {problems or ''}")
    print("PASS" if not failures else f"FAILED: {len(failures)} check(s)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
