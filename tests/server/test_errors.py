"""Bad input never stops the server: garbage, truncated and oversized requests get an
error reply with a reason; a bad config or address stops start-up with one line."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import msgspec
import pytest
import torch
import zmq

from lmkv.keys.chunking import KeyMeta
from lmkv.rpc import protocol as p
from lmkv.rpc.client import ServerClient
from tests.server.conftest import MAX_REQUEST_BYTES
from tests.server.procs import REPO, child_env, chunk_for, free_port, prompt_keys

pytestmark = pytest.mark.slow  # real lmkv server processes


def raw_request(address: str, frames: list[bytes], kind: int = zmq.DEALER) -> list[bytes]:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        assert sock.poll(5000), "no reply"
        return sock.recv_multipart()
    finally:
        sock.close()


def error_of(parts: list[bytes]) -> p.ErrorReply:
    reply = p.decode_reply(parts[-1])
    assert isinstance(reply, p.ErrorReply), reply
    return reply


def still_serving(server) -> None:
    with server.client() as client:
        assert client.ping() is not None


@pytest.mark.parametrize("frames,reason", [
    ([b"\xc1\x00garbage"], "undecodable"),
    ([p.encode(p.Ping(req_id=7))[:-3]], "truncated"),
    ([msgspec.msgpack.encode({"op": "nope", "req_id": 3})], "undecodable"),
    ([msgspec.msgpack.encode({"op": "lookup", "chunk_ends": "x"})], "undecodable"),
    ([b""], "empty message"),
    ([p.encode(p.Ping()), b"an unexpected data frame"], "unexpected data parts"),
    ([p.encode(p.Lookup(meta=KeyMeta("m"), chunk_hashes=[b"a"], chunk_ends=[1, 2]))],
     "do not make"),
    ([p.encode(p.Store(keys=[], meta=KeyMeta("m"), chunk_hashes=[], shapes=[],
                       dtype="bfloat16"))], "not both"),
    ([p.encode(p.Store(meta=KeyMeta("m"), chunk_hashes=[b"a"], shapes=[[4]],
                       dtype="complex128"))], "dtype"),
    ([p.encode(p.Store(meta=KeyMeta("m"), chunk_hashes=[b"a"], shapes=[[1 << 40]],
                       dtype="uint8"))], "larger than"),
])
def test_a_bad_request_gets_a_reason_and_the_server_goes_on(server, frames, reason) -> None:
    reply = error_of(raw_request(server.address, frames))
    assert reply.code == p.BAD_REQUEST and reason in reply.reason
    still_serving(server)


def test_the_req_id_of_an_invalid_request_is_echoed(server) -> None:
    frames = [msgspec.msgpack.encode({"op": "ping", "req_id": 41, "session": 5})]
    assert error_of(raw_request(server.address, frames)).req_id == 41


def test_a_req_socket_gets_its_error_reply_too(server) -> None:
    parts = raw_request(server.address, [b"garbage"], kind=zmq.REQ)
    assert error_of(parts).code == p.BAD_REQUEST


def test_oversized_requests_are_refused_with_a_reply(server) -> None:
    header = p.encode(p.StoreCommit(handle=1, req_id=9))
    reply = error_of(raw_request(server.address, [header, bytes(MAX_REQUEST_BYTES + 1)]))
    assert reply.code == p.TOO_LARGE and reply.req_id == 9
    assert str(MAX_REQUEST_BYTES) in reply.reason
    still_serving(server)


def test_a_chunk_too_large_for_a_request_is_dropped_and_its_buffer_released(server) -> None:
    keys = prompt_keys(200, chunks=1)
    big = [torch.zeros(MAX_REQUEST_BYTES, dtype=torch.uint8)]
    with server.client(data_path="inline") as client:
        assert client.store(keys, big) == 0
        assert client.counters.dropped_chunks == 1 and client.counters.error_replies == 1
        assert client.stats().server.staged_chunks == 0
        assert client.lookup(keys, [16]) == 0


def test_truncated_data_frames_are_refused_and_release_the_buffers(server) -> None:
    keys = prompt_keys(210, chunks=2)
    chunks = [chunk_for(k) for k in keys]
    with server.client(data_path="inline") as client:
        client.ping()
        store = p.Store(**p.key_fields(keys), shapes=[list(c.shape) for c in chunks],
                        dtype="bfloat16", data_path="inline")
        reply, _ = client._call(store, p.StoreReply)
        assert client.stats().server.staged_chunks == 2
        data = [c.reshape(-1).view(torch.uint8).numpy() for c in chunks]
        assert client._call(p.StoreCommit(handle=reply.handle), p.StoreCommitReply,
                            [data[0], data[1][:100]]) is None
        assert client.counters.error_replies == 1
        assert client.stats().server.staged_chunks == 0
        assert client.lookup(keys, [16, 32]) == 0  # nothing half-written was stored


def test_unknown_handles_are_an_error_reply(server) -> None:
    parts = raw_request(server.address, [p.encode(p.StoreCommit(handle=123456, req_id=2))])
    reply = error_of(parts)
    assert reply.code == p.UNKNOWN_HANDLE and reply.req_id == 2


def test_bytes_that_are_not_zmq_do_not_stop_the_server(server) -> None:
    for payload in (b"GET / HTTP/1.1\r\n\r\n", b"\xff" * 64 + b"\x00" * 1000, b"\x01"):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
            raw.sendall(payload)
    still_serving(server)


def test_an_unreachable_server_is_a_miss_not_an_exception() -> None:
    keys = prompt_keys(220, chunks=2)
    with ServerClient(f"tcp://127.0.0.1:{free_port()}", timeout_ms=100) as client:
        assert client.lookup(keys, [16, 32]) == 0
        assert client.lookup(keys, [16, 32], lookup_id="x") == 0
        assert client.retrieve(keys) == []
        assert client.store(keys, [chunk_for(k) for k in keys]) == 0
        assert client.prefetch_status("x") == 0
        assert client.stats() is None and client.end_session() is None
        assert client.counters.dropped_chunks == 2
        assert client.counters.unreachable >= 1


def run_server_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lmkv.server", *args], capture_output=True,
                          text=True, env=child_env(), cwd=REPO, timeout=60)


@pytest.mark.parametrize("config,expected", [
    ("tiers:\n  - type: cpu\n    options: {max_bytes: lots}\n",
     "config key 'tiers.0.options.max_bytes' = 'lots'"),
    ("tiers:\n  - type: nosuchtier\n", "tiers.0.type = 'nosuchtier'"),
])
def test_a_bad_config_is_one_line_and_exit_code_2(tmp_path, config, expected) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(config)
    result = run_server_cli("--config", str(path), "--port", str(free_port()))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmkv: error: ")
    assert expected in lines[0]


def test_an_address_in_use_is_one_line_and_exit_code_2(server, tmp_path) -> None:
    config = tmp_path / "small.yaml"
    config.write_text("tiers: [{type: cpu, options: {max_bytes: 1MiB}}]\n")
    result = run_server_cli("--config", str(config), "--port", str(server.port))
    errors = [ln for ln in result.stderr.splitlines() if "error" in ln]
    assert result.returncode == 2
    assert errors == [f"lmkv: error: cannot listen on {server.address}: "
                      "Address already in use"]
    assert "Traceback" not in result.stderr


def test_a_host_nothing_resolves_is_one_line_naming_it(tmp_path) -> None:
    result = run_server_cli("--host", "no-such-host.invalid", "--port", "0")
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("lmkv: error: --host no-such-host.invalid: cannot be resolved (")
    assert "No such device" not in line and "CURVE" not in line


@pytest.mark.parametrize("command", [["-m", "lmkv.server"], ["-m", "lmkv", "server"]])
def test_every_command_error_has_one_prefix(command) -> None:
    result = subprocess.run([sys.executable, *command, "--drain-timeout", "-1"],
                            capture_output=True, text=True, env=child_env(), cwd=REPO,
                            timeout=60)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("lmkv: error: argument --drain-timeout: '-1': must be a number "
                           "of seconds, 0 or more (see ")


def pipelined(address: str, requests: list[bytes]) -> list[p.ErrorReply]:
    """Send every request on one socket, then read every reply."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        for request in requests:
            sock.send(request)
        replies = []
        for _ in requests:
            assert sock.poll(10_000), "no reply"
            replies.append(error_of(sock.recv_multipart()))
        return replies
    finally:
        sock.close()


CRAFTED_SHAPES = [[1 << 40, 1 << 40, 0], [0], [4, 0, 4], [-1, 4], [-2, -32768],
                  [(1 << 64) - 1, 0], [1] * 20, [], [1 << 62, 1 << 62]]


def test_crafted_shapes_are_refused_and_leak_nothing(server) -> None:
    with server.client() as client:
        base = client.stats().server
        requests = []
        for i in range(4000):
            shape = CRAFTED_SHAPES[i % len(CRAFTED_SHAPES)]
            hashes = [i.to_bytes(4, "little") + b"a", i.to_bytes(4, "little") + b"b"]
            # A valid first chunk: the whole request is refused before anything is allocated.
            requests.append(p.encode(p.Store(meta=KeyMeta("crafted"), chunk_hashes=hashes,
                                             shapes=[[4, 4], shape], dtype="bfloat16",
                                             req_id=i + 1)))
        replies = pipelined(server.address, requests)
        assert all(r.code == p.BAD_REQUEST and "chunk 1: shape" in r.reason
                   and "allowed" in r.reason for r in replies)
        stats = client.stats().server
        assert stats.bad_requests == base.bad_requests + 4000
        assert stats.arena_used_bytes <= base.arena_used_bytes  # nothing taken
        assert stats.staged_chunks == 0
        # Nothing is stuck in the arena: a chunk as large as all of it still fits.
        whole = torch.full((64 << 20,), 3, dtype=torch.uint8)
        assert client.store(prompt_keys(6_000, chunks=1), [whole]) == 1


def nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\x00"  # [[[...0...]]]


def map_with(field: bytes, value: bytes) -> bytes:
    return b"\x83\xa2op\xa5store\xa6req_id\x05" + field + value


DECODE_BOMBS = [
    map_with(b"\xa5extra", nested(200_000)),  # an unknown field, skipped: RecursionError
    map_with(b"\xa6shapes", nested(200_000)),
    map_with(b"\xa4keys", b"\xdd\xff\xff\xff\xff"),  # 4 billion keys announced
    b"\xdf\xff\xff\xff\xff",  # a map of 4 billion entries
    nested(200_000),
    map_with(b"\xa6shapes", b"\x91\x91\xcf" + (1 << 64 - 1).to_bytes(8, "big")),
    b"\x82\xa2op\xa4ping\xa8abandoned" + b"\xdc\x08\x00" + b"\x01" * 2048,  # too many ids
    b"\x82\xa2op\xa4ping\xa8released" + b"\xdc\x08\x00" + b"\x92\x01\x01" * 2048,  # too many
]


def test_decode_failures_of_any_kind_are_counted_bad_requests_logged_at_a_bounded_rate(
        server) -> None:
    log_before = server.log()
    with server.client() as client:
        base = client.stats().server
        replies = pipelined(server.address, DECODE_BOMBS * 200)
        assert all(r.code == p.BAD_REQUEST for r in replies), {r.reason for r in replies}
        assert {r.reason for r in replies} >= {"undecodable request: nested too deeply"}
        stats = client.stats().server
        assert stats.bad_requests == base.bad_requests + len(replies)
        assert client.ping() is not None
    new_log = server.log()[len(log_before):]
    assert "Traceback" not in new_log and "internal" not in new_log
    assert new_log.count("refused a request") <= 3, new_log


def fake_server(answer) -> tuple[str, threading.Event, threading.Thread]:
    """A ROUTER that answers every request with ``answer(request)`` frames, until the
    event is set (its thread owns the socket: ZMQ sockets are not thread-safe)."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        try:
            while not stop.is_set():
                if sock.poll(50):
                    ident, header, *_ = sock.recv_multipart()
                    sock.send_multipart([ident, *answer(p.decode_request(header))])
        finally:
            sock.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"tcp://127.0.0.1:{port}", stop, thread


def test_hostile_replies_are_misses_on_the_client() -> None:
    ping = p.PingReply(protocol=1, pid=1, host_id="elsewhere", shm_name="", shm_size=0,
                       max_request_bytes=1 << 20, session_timeout_s=60, handle_ttl_s=30)
    chunk = p.ChunkInfo(-1, 131072, [-2, -32768], "bfloat16")  # nbytes matches the product

    def answer(req: p.Request) -> list[bytes]:
        if isinstance(req, p.Ping):
            return [p.encode(p.PingReply(**{**msgspec.structs.asdict(ping),
                                            "req_id": req.req_id}))]
        if isinstance(req, p.Retrieve):
            reply = p.RetrieveReply(handle=0, data_path="inline", shm_name="", chunks=[chunk],
                                    req_id=req.req_id)
            return [p.encode(reply), bytes(131072)]
        return [nested(200_000)]  # everything else: a decode bomb

    address, stop, thread = fake_server(answer)
    try:
        with ServerClient(address, timeout_ms=300) as client:
            assert client.ping() is not None
            assert client.retrieve(prompt_keys(70, chunks=1)) == []
            assert client.lookup(prompt_keys(70), [16, 32, 48, 64]) == 0
            assert client.counters.timeouts == 1  # the bomb was dropped, not raised
    finally:
        stop.set()
        thread.join(5)


def keyed(op: str, chunks: int = 2, **fields) -> bytes:
    """A raw keyed request of ``chunks`` chunks (16 tokens each) with ``fields``."""
    base: dict = {"op": op, "req_id": 17, "meta": {"model_name": "partials"},
                  "chunk_hashes": [bytes([i + 1]) * 32 for i in range(chunks)]}
    if op == "lookup":
        base.update(chunk_ends=[16 * (i + 1) for i in range(chunks)], prefetch=False)
    if op == "store":
        base.update(shapes=[[4, 4]] * chunks, dtype="bfloat16")
    return msgspec.msgpack.encode({**base, **fields})


BAD_PARTIALS = [
    (keyed("lookup", partial_hashes=[[b"x" * 65]], block_tokens=8), "length <= 64"),
    (keyed("lookup", partial_hashes=[[b""]], block_tokens=8), "length >= 1"),
    (keyed("store", partial_hashes=[[b"x"] * 1025]), "length <= 1024"),
    (keyed("retrieve", partial_hashes=[[]] * 65537, block_tokens=8), "length <= 65536"),
    (keyed("lookup", partial_hashes=[[b"x"]] * 3, block_tokens=8), "at most one list per chunk"),
    (keyed("store", partial_hashes=[[b"x"]] * 3), "at most one list per chunk"),
    (keyed("lookup", partial_hashes=[[b"x"]]), "block_tokens 0"),
    (keyed("retrieve", partial_hashes=[[b"x"]], block_tokens=1 << 21), "need 1 to"),
    (keyed("lookup", block_tokens=8), "block_tokens without partial_hashes"),
    (keyed("lookup", partial_hashes=[[b"x", b"y", b"z"]], block_tokens=8),
     "3 blocks of 8 tokens, but chunk 0 has 16 tokens"),
    (keyed("retrieve", keys_per_chunk=2, partial_hashes=[[b"x"]], block_tokens=8),
     "keys_per_chunk 1"),
    (keyed("lookup", partial_hashes="not a list", block_tokens=8), "got `str`"),
]


def test_bad_partial_hashes_get_one_line_and_leak_nothing(server) -> None:
    with server.client() as client:
        base = client.stats().server
        replies = pipelined(server.address, [raw for raw, _ in BAD_PARTIALS] * 50)
        for reply, (raw, reason) in zip(replies, BAD_PARTIALS * 50, strict=True):
            assert reply.code == p.BAD_REQUEST and reason in reply.reason, reply.reason
            assert "\n" not in reply.reason
            assert reply.req_id == (17 if len(raw) <= 1 << 16 else 0)  # salvaged when small
        stats = client.stats().server
        assert stats.bad_requests == base.bad_requests + len(replies)
        assert stats.staged_chunks == 0 and stats.held_lookups == 0
        assert stats.arena_used_bytes <= base.arena_used_bytes  # nothing taken
    still_serving(server)
