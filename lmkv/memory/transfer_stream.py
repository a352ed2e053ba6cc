"""Copies between GPU KV caches and host chunk buffers, on a stream of their own.

Why a stream of their own: a store or a load run on the compute stream would
queue the engine's next kernels behind PCIe copies, and the usual way of
waiting for them (``torch.cuda.synchronize()``, or a synchronize of the compute
stream) blocks the host until *every* kernel queued so far has run. Here each
transfer is ordered against the compute stream by CUDA events only:

- **store** (device → pinned host arena): an event ``ready`` is recorded on the
  compute stream when the store is issued, that is after the forward that wrote
  the KV was queued; the transfer stream waits
  for ``ready`` (on the GPU, the host does not wait), then runs the copy and
  records ``done``. The chunk buffers may be published (handed to tiers and to
  other threads) only once ``done`` has completed: ``Transfer.wait()`` polls
  ``done.query()`` and, if the copy is still running, waits for that one event.
- **load** (pinned host arena → device): the same, and the compute stream waits
  for ``done`` (``wait_event``, on the GPU) so that kernels queued after the
  load, the layers that read this KV, run after the copy. The host buffers may
  be reused or released once ``done`` has completed (``Transfer.wait()``).

The compute stream is the stream the engine's forward runs on. torch's current
stream is per thread, and vLLM sets its own stream for the forward thread only:
a store or load issued from another thread (lmkv's loader and store threads)
must name it with ``after=``: the forward's stream (captured on the forward
thread: ``current()``) or an event recorded there (``mark()``: the vLLM worker
marks one per step for its loader and store threads, and one per layer for
layerwise stores). Without ``after=`` the calling thread's current stream
is the compute stream, right only on the forward thread itself.

Without CUDA (caches on the CPU, or a torch without CUDA) the same calls run the
copy at once, on the calling thread, and return a transfer that is already
done: the CPU path is the synchronous one it always was.

There is one transfer stream per device and process (``stream_for``). The CUDA
calls go through a small namespace (``torch.cuda`` by default) so tests can
stub them and check the order of events, waits and copies on any machine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class Transfer:
    """One issued copy; ``done`` is None when it ran synchronously (already done)."""

    __slots__ = ("_cuda", "_device", "done")

    def __init__(self, done: Any = None, cuda: Any = None,
                 device: torch.device | None = None) -> None:
        self.done = done
        self._cuda = cuda
        self._device = device

    def order_before_compute(self) -> None:
        """Make the kernels queued from now on the compute stream (the caller's
        current stream) run after this copy: a wait on the GPU, the host goes on.
        ``load`` does this at once; a loader that issues many loads ahead (layer
        by layer) calls it when the layer that reads this KV is about to be queued."""
        if self.done is not None:
            self._cuda.current_stream(self._device).wait_event(self.done)

    def ready(self) -> bool:
        """Whether the copy has completed (never blocks)."""
        return self.done is None or bool(self.done.query())

    def wait(self) -> None:
        """Block until the copy has completed: this copy's event only, never the
        device or a whole stream."""
        if self.done is not None and not self.done.query():
            self.done.synchronize()


DONE = Transfer()


class TransferStream:
    """The transfer stream of one device, and stores and loads issued on it."""

    def __init__(self, device: torch.device | str, cuda: Any = None) -> None:
        """``cuda``: what provides ``Stream``, ``Event``, ``current_stream`` and
        ``stream`` (default ``torch.cuda`` for a CUDA device; tests pass a stub).
        A device that is not CUDA, without a ``cuda`` given, copies synchronously."""
        self.device = torch.device(device)
        if cuda is None and self.device.type == "cuda":
            cuda = torch.cuda
        self._cuda = cuda
        self._stream = cuda.Stream(device=self.device) if cuda is not None else None

    @property
    def synchronous(self) -> bool:
        """True when copies run at once on the calling thread (no CUDA)."""
        return self._stream is None

    def current(self) -> Any:
        """The calling thread's current stream (None without CUDA): called on the
        forward thread, the compute stream to hand other threads as ``after=``."""
        return None if self._stream is None else self._cuda.current_stream(self.device)

    def mark(self) -> Any:
        """An event recorded now on the calling thread's current stream (None
        without CUDA): on the forward thread, "what the forward queued so far"."""
        if self._stream is None:
            return None
        event = self._cuda.Event()
        event.record(self._cuda.current_stream(self.device))
        return event

    def store(self, copy: Callable[[], None], *, after: Any = None) -> Transfer:
        """Run ``copy`` (device → host) after what the compute stream has queued so
        far (``after``: that stream, or an event recorded on it; default the calling
        thread's current stream); publish its buffers only after ``wait()`` (or
        once ``ready()``)."""
        return self._issue(copy, compute_waits=False, after=after)

    def load(self, copy: Callable[[], None], *, compute_waits: bool = True,
             after: Any = None) -> Transfer:
        """Run ``copy`` (host → device) after what the compute stream has queued so
        far (``after`` as for ``store``), and make the compute stream's later
        kernels wait for it (with ``compute_waits=False``: once the caller says so,
        ``order_before_compute``; with ``after`` an event there is no stream to make
        wait: the caller lets the compute read the KV only once ``wait()`` returned,
        as lmkv's loader threads do); release or reuse the host buffers only after
        ``wait()``."""
        return self._issue(copy, compute_waits=compute_waits, after=after)

    def _issue(self, copy: Callable[[], None], *, compute_waits: bool,
               after: Any = None) -> Transfer:
        if self._stream is None:
            copy()
            return DONE
        cuda = self._cuda
        if after is not None and not hasattr(after, "wait_event"):  # an event
            ready, compute = after, None  # the caller orders the reads itself
        else:  # a stream (or the calling thread's): what it queued so far
            compute = after if after is not None else cuda.current_stream(self.device)
            ready = cuda.Event()
            ready.record(compute)
        self._stream.wait_event(ready)
        with cuda.stream(self._stream):  # tensors made inside belong to this stream
            copy()
        done = cuda.Event()
        done.record(self._stream)
        transfer = Transfer(done, cuda, self.device)
        if compute_waits and compute is not None:
            compute.wait_event(done)
        return transfer


_streams: dict[torch.device, TransferStream] = {}
_streams_lock = threading.Lock()


def stream_for(device: torch.device | str) -> TransferStream:
    """This process's transfer stream for ``device`` (made on first use; a
    synchronous one for a device that is not CUDA)."""
    if isinstance(device, torch.device):  # one already seen, named as it was then
        stream = _streams.get(device)
        if stream is not None:
            return stream
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _streams_lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = TransferStream(device)
        return stream
