"""The ``fs`` tier on S3, against a real S3-compatible HTTP endpoint (moto server mode)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from botocore.exceptions import ClientError

from lmkv.keys.chunking import CacheKey
from lmkv.memory import MemoryAllocator
from lmkv.testing import StorageBackendConformance
from lmkv_backends.tiers.fs import FSBackend
from lmkv_backends.tiers.fs_index import entry_name
from tests.backends.test_fs import (
    CORRUPTIONS,
    FRAME_BYTES,
    check_sharing,
    chunk,
    key,
    make_fs,
    put,
    read,
)
from tests.services import S3Endpoint

pytestmark = pytest.mark.slow  # an S3 service (moto) in a process

BUCKET = "lmkv-tests"
# Short timeouts: a stopped endpoint costs each test at most a few seconds.
FAST = {"connect_timeout_s": 1.0, "read_timeout_s": 2.0, "retries": 0}


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Endpoint]:
    endpoint = S3Endpoint()
    endpoint.start()
    endpoint.client().create_bucket(Bucket=BUCKET)
    yield endpoint
    endpoint.stop()


@pytest.fixture
def own_s3() -> Iterator[S3Endpoint]:
    """An endpoint of this test's own, to stop and start (moto keeps the objects)."""
    endpoint = S3Endpoint()
    endpoint.start()
    endpoint.client().create_bucket(Bucket=f"{BUCKET}-own")
    yield endpoint
    endpoint.stop()


@pytest.fixture
def arena() -> Iterator[MemoryAllocator]:
    arena = MemoryAllocator(16 << 20)
    yield arena
    assert arena.live_objects == 0, "a chunk buffer was leaked"


def s3_url(bucket: str = BUCKET) -> str:
    return f"s3://{bucket}/{uuid.uuid4().hex[:12]}"


@pytest.fixture
def make(s3: S3Endpoint, arena: MemoryAllocator) -> Iterator[Callable[..., FSBackend]]:
    """``make(url=None, endpoint=None, **options)``: an fs tier on S3, closed after the test."""
    made: list[FSBackend] = []

    def factory(url: str | None = None, endpoint: S3Endpoint | None = None,
                **options: object) -> FSBackend:
        backend = make_fs(url or s3_url(), arena, endpoint_url=(endpoint or s3).url,
                          key="testing", secret="testing", **options)
        made.append(backend)
        return backend

    yield factory
    for backend in made:
        backend.close()


def wait_for(condition: Callable[[], bool], deadline_s: float = 30.0) -> bool:
    """Poll ``condition`` until it holds (a liveness bound, not a timing assertion)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def object_exists(endpoint: S3Endpoint, url: str, name: str) -> bool:
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    try:
        endpoint.client().head_object(Bucket=bucket, Key=f"{prefix}/{name}")
        return True
    except ClientError:
        return False


def rewrite_object(endpoint: S3Endpoint, url: str, key: CacheKey,
                   change: Callable[[bytes], bytes]) -> None:
    """Change a stored object behind the tier's back."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    name = f"{prefix}/{entry_name(key)}"
    client = endpoint.client()
    body = client.get_object(Bucket=bucket, Key=name)["Body"].read()
    client.put_object(Bucket=bucket, Key=name, Body=change(body))


class TestS3Conformance(StorageBackendConformance):
    backend_class = FSBackend

    @pytest.fixture(autouse=True)
    def _setup(self, s3: S3Endpoint, arena: MemoryAllocator) -> None:
        self.s3 = s3
        self.arena = arena
        self.url = s3_url()

    def backend_options(self) -> dict[str, object]:
        return {"url": self.url, "endpoint_url": self.s3.url, "key": "testing",
                "secret": "testing", **FAST}

    def make_backend(self) -> FSBackend:
        return make_fs(self.url, self.arena, endpoint_url=self.s3.url, key="testing",
                       secret="testing", **FAST)

    def make_bounded_backend(self, max_bytes: int) -> FSBackend:
        return make_fs(self.url, self.arena, endpoint_url=self.s3.url, key="testing",
                       secret="testing", max_bytes=max_bytes, **FAST)

    def corrupt_entry(self, backend: FSBackend, key: CacheKey) -> bool:
        rewrite_object(self.s3, self.url, key, CORRUPTIONS["payload bit flip"])
        return True

    def copy_entry(self, backend: FSBackend, source: CacheKey, target: CacheKey) -> bool:
        bucket, _, prefix = self.url.removeprefix("s3://").partition("/")
        client = self.s3.client()
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/{entry_name(source)}")["Body"]
        client.put_object(Bucket=bucket, Key=f"{prefix}/{entry_name(target)}", Body=body.read())
        return True

    @contextmanager
    def make_unreachable(self, backend: FSBackend) -> Iterator[None]:
        """The endpoint stopped (connections refused), then started again on the
        same port with its objects."""
        self.s3.stop()
        try:
            yield
        finally:
            self.s3.start()


def test_entries_survive_a_restart(make: Callable[..., FSBackend]) -> None:
    url = s3_url()
    first = make(url)
    assert put(first, [0, 1, 2]) == 3
    first.close()
    second = make(url)
    assert wait_for(lambda: second.usage_bytes == 3 * FRAME_BYTES)  # the start-up listing
    assert second.batched_async_contains("l", [key(i) for i in range(4)]) == 3
    assert torch.equal(read(second, 2), chunk(2))


def test_writes_and_removals_of_others_are_seen(make: Callable[..., FSBackend]) -> None:
    url = s3_url()
    reader, writer = make(url), make(url)
    put(writer, [1, 2])
    assert reader.batched_async_contains("l", [key(1), key(2), key(3)], pin=True) == 2
    assert torch.equal(read(reader, 1), chunk(1))
    assert writer.remove(key(2))
    assert not reader.contains(key(2))  # the remote is asked, not only the index
    assert reader.usage_bytes == FRAME_BYTES
    assert reader.stats()["errors"] == 0


@pytest.mark.parametrize("corrupt", CORRUPTIONS)
def test_a_corrupted_object_is_a_removed_miss(corrupt: str, s3: S3Endpoint,
                                              make: Callable[..., FSBackend]) -> None:
    url = s3_url()
    backend = make(url)
    put(backend, [1, 2])
    rewrite_object(s3, url, key(1), CORRUPTIONS[corrupt])
    assert read(backend, 1) is None
    assert backend.stats()["corrupt_frames"] == 1
    assert not object_exists(s3, url, entry_name(key(1)))
    assert torch.equal(read(backend, 2), chunk(2))


def test_budget_evicts_objects(s3: S3Endpoint, make: Callable[..., FSBackend]) -> None:
    url = s3_url()
    backend = make(url, max_bytes=2 * FRAME_BYTES)
    assert put(backend, [0]) == 1
    backend.pin(key(0))
    assert put(backend, [1]) == 1
    assert put(backend, [2]) == 1  # 1 goes for 2: 0 is older, but pinned
    assert [object_exists(s3, url, entry_name(key(i))) for i in range(3)] == [True, False,
                                                                              True]
    assert backend.usage_bytes == 2 * FRAME_BYTES
    backend.unpin(key(0))


def test_a_stopped_endpoint_degrades_to_misses_and_recovers(
        own_s3: S3Endpoint, make: Callable[..., FSBackend]) -> None:
    url = s3_url(f"{BUCKET}-own")
    backend = make(url, endpoint=own_s3, **FAST)
    keys = [key(i) for i in range(4)]
    assert put(backend, [0, 1, 2, 3]) == 4
    own_s3.stop()
    assert put(backend, [4, 5]) == 0
    assert backend.batched_async_contains("l", keys, pin=True) == 0
    assert not backend.contains(key(0))
    assert read(backend, 0) is None
    assert backend.batched_get_non_blocking("l", keys).result(timeout=60) == []
    assert put(backend, [6]) == 0
    stats = backend.stats()
    # the first failure opens the breaker: what it refuses is not attempted, not an error
    assert stats["dropped_writes"] == 3 and stats["errors"] >= 1
    assert stats["hits"] == 0 and stats["misses"] >= 1
    assert backend.usage_bytes == 4 * FRAME_BYTES  # a failed check removes nothing
    own_s3.start()  # same port; the objects are still there
    assert wait_for(lambda: backend.batched_async_contains("l", keys) == 4)
    assert torch.equal(read(backend, 3), chunk(3))
    assert put(backend, [4]) == 1


def test_an_endpoint_stopped_under_load_never_raises_nor_returns_wrong_kv(
        own_s3: S3Endpoint, make: Callable[..., FSBackend]) -> None:
    backend = make(s3_url(f"{BUCKET}-own"), endpoint=own_s3, **FAST)
    stop = threading.Event()
    problems: list[str] = []
    hits_after: list[int] = []
    restarted = threading.Event()

    def workload() -> None:
        i = 0
        while not stop.is_set():
            try:
                put(backend, [i])
                if backend.batched_async_contains("l", [key(i)], pin=True):
                    got = read(backend, i)
                    backend.unpin(key(i))
                    if got is not None and not torch.equal(got, chunk(i)):
                        problems.append(f"wrong KV for {i}")
                    if got is not None and restarted.is_set():
                        hits_after.append(i)
            except Exception as exc:  # the point: nothing may raise
                problems.append(repr(exc))
            i += 1

    worker = threading.Thread(target=workload)
    worker.start()
    try:
        assert wait_for(lambda: backend.stats()["hits"] >= 3)
        own_s3.stop()
        assert wait_for(lambda: backend.stats()["dropped_writes"] >= 3)
        own_s3.start()
        restarted.set()
        assert wait_for(lambda: len(hits_after) >= 3)
    finally:
        stop.set()
        worker.join(timeout=60)
    assert not problems
    assert backend.stats()["errors"] >= 1


@pytest.mark.parametrize("fault", ["stopped", "hung"])
def test_close_returns_promptly_when_the_endpoint_is_down(
        fault: str, own_s3: S3Endpoint, make: Callable[..., FSBackend],
        arena: MemoryAllocator) -> None:
    backend = make(s3_url(f"{BUCKET}-own"), endpoint=own_s3, **FAST)
    assert put(backend, [0]) == 1
    own_s3.stop() if fault == "stopped" else own_s3.hang()
    objs = []
    for i in range(1, 9):
        obj = arena.allocate(chunk(i).shape, chunk(i).dtype)
        obj.tensor.copy_(chunk(i))
        objs.append(obj)
    future = backend.batched_submit_put([key(i) for i in range(1, 9)], objs)
    for obj in objs:
        obj.ref_down()
    closer = threading.Thread(target=backend.close)
    closer.start()
    closer.join(timeout=10)  # a hang bound: close must not wait for the remote
    assert not closer.is_alive()
    # what was in flight ends within the timeouts and gives its buffers back
    assert future.result(timeout=60) == 0
    assert backend.stats()["dropped_writes"] == 8


def test_two_processes_share_one_bucket(s3: S3Endpoint) -> None:
    check_sharing(s3_url(), s3.url)
