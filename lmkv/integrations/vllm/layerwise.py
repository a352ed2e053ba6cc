"""Layer-by-layer pipelining for the vLLM connector (``lmkv.layerwise``).

Why: a synchronous load makes a step's forward wait until every layer's KV is
in vLLM's paged caches. vLLM calls the connector's ``wait_for_layer_load(layer)``
right before each attention layer and ``save_kv_layer`` right after it, so the
first layers can compute while a loader thread copies the later ones in, and a
store can copy each layer out as soon as the forward has written it.

lmkv's storage unit is the whole-model chunk: one frame ``[layers, ...]`` (the
spec's chunk shape, layers first) under one key (the per-layer keys of ``lmkv.keys.chunking`` and
the storage's ``keys_per_chunk`` exist, but no engine writes them). Layerwise
mode keeps that unit: a load fetches each chunk once and scatters it into
vLLM's caches layer by layer; a store gathers each layer into the chunk's
buffer as the forward finishes it and publishes the chunk (puts it into the
tiers) once every layer is in, before ``wait_for_save`` returns. Keys and
frames are the same as without layerwise, so KV stored in either mode loads in
either mode, by the other engines too, and a tier never holds a half-written
chunk: a chunk is stored whole or not at all.

Three small pieces, each testable without vLLM:

- ``LayerGate``: how many leading layers are ready, with waits that time out
  (one per step and direction: the forward waits on the loads' gate; the store
  thread waits on the forward's gate);
- ``CopyGuard``: a cancel flag and a lock held while one layer is copied, so
  that once ``cancel`` returns no copy of the step is running or will start
  (a load given up on never writes into blocks vLLM recomputes, a store never
  reads blocks vLLM reuses);
- ``LayeredConnector``: wraps the engine's GPU connector; given a ``pace``
  keyword it copies layer by layer (a connector built for one layer does each
  copy), else it is the connector it wraps.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from lmkv.contracts.connector import ChunkSpan, ConnectorContext, GPUConnector

# The longest one wait for a layer lasts before lmkv gives the step's copies up
# (a tier that hangs, a loader stuck). The load's blocks are then reported
# failed and vLLM recomputes them; a store is dropped.
LAYER_TIMEOUT_S = 30.0


class CopyCancelled(RuntimeError):
    """The step's layer copies were given up on (timeout, or the step ended)."""


class LayerGate:
    """How many leading layers of a step are ready; never goes back.

    An Event per layer would do the same; layers become ready in order, so one
    counter under a condition is all it takes, and a wait for layer ``i`` is a
    wait for the counter to pass ``i``.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._ready = 0
        self._cond = threading.Condition()

    @property
    def ready(self) -> int:
        return self._ready

    def advance(self, layers: int) -> None:
        """The first ``layers`` layers are ready."""
        with self._cond:
            if layers > self._ready:
                self._ready = min(layers, self.num_layers)
                self._cond.notify_all()

    def open_all(self) -> None:
        self.advance(self.num_layers)

    def wait(self, layer: int, timeout_s: float) -> bool:
        """True once layer ``layer`` is ready; False after ``timeout_s``."""
        with self._cond:
            return self._cond.wait_for(lambda: self._ready > layer, timeout_s)


class CopyGuard:
    """The cancel flag of one step's copies and the lock a copy of a layer holds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.cancelled = False

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        with self._lock:
            if self.cancelled:
                raise CopyCancelled("lmkv: the step's layer copies were given up on")
            yield

    def cancel(self) -> None:
        """No copy runs once this returns (one running now finishes first)."""
        with self._lock:
            self.cancelled = True


class Pace:
    """What ``LayeredConnector`` is handed for one call: before layer ``i`` it waits
    for ``source`` to have it (stores: the forward produced it; loads: none), copies
    under ``guard`` and then reports ``i + 1`` layers done to ``progress``.

    ``events`` (stores): layer ``i``'s CUDA event, recorded on the forward's stream
    when the forward produced it (``StoreStep.layer_produced``); layer ``i``'s copy
    waits for it on the GPU. Read only after ``source`` has layer ``i``."""

    def __init__(self, guard: CopyGuard, *, source: LayerGate | None = None,
                 progress: Callable[[int], None] | None = None,
                 timeout_s: float = LAYER_TIMEOUT_S,
                 events: dict[int, Any] | None = None) -> None:
        self.guard = guard
        self.events = events
        self.source = source
        self.progress = progress
        self.timeout_s = timeout_s
        self.used = False  # a load's pace serves one call: its progress covers every chunk

    @contextlib.contextmanager
    def layer(self, index: int) -> Iterator[None]:
        if self.source is not None and not self.source.wait(index, self.timeout_s):
            self.guard.cancel()
            raise CopyCancelled(f"lmkv: layer {index} was not produced within "
                                f"{self.timeout_s:g} s")
        with self.guard.copying():
            yield
        if self.progress is not None:
            self.progress(index + 1)


class LayeredConnector(GPUConnector):
    """The engine's connector, copying layer by layer when given ``pace=``.

    ``writes_in_place`` is False on purpose: the local engine then hands every
    chunk of a retrieve over in one call (instead of tier by tier), so each layer
    is copied once for all of them and is complete when its copy returns. A
    layer's copy is done by ``per_layer``, the same connector class built for a
    one-layer spec, on the chunk buffers' layer ``i`` (a view) and vLLM's cache
    of layer ``i``.

    CUDA: each layer's copy runs on the transfer stream (``lmkv.memory.transfer_stream``,
    inside the wrapped connector) and returns once its event completed, so
    ``Pace`` progress follows the copy. The copies are issued from lmkv's threads,
    not the forward's: the caller passes the forward's stream as ``after=`` (part
    of ``kv``), and a store's pace the event recorded on it when the forward
    produced each layer (``Pace.events``), which that layer's copy waits for.
    """

    name = "layered"

    def __init__(self, whole: GPUConnector, per_layer: GPUConnector) -> None:
        # Not a plugin of its own: it takes the wrapped connector's identity.
        self.whole = whole
        self.per_layer = per_layer
        self.options = whole.options
        self.context = whole.context
        self.spec = whole.spec
        self.chunk_layout = whole.chunk_layout
        self.kv_kind = whole.kv_kind

    @classmethod
    def around(cls, whole: GPUConnector, create: Callable[[ConnectorContext], GPUConnector]
               ) -> LayeredConnector:
        """Wrap ``whole``; ``create`` builds the connector class for another context."""
        one_layer = replace(whole.context, spec=replace(whole.spec, num_layers=1))
        return cls(whole, create(one_layer))

    def to_chunks(self, spans: Sequence[ChunkSpan], *, pace: Pace | None = None,
                  **kv: Any) -> None:
        if pace is None:
            self.whole.to_chunks(spans, **kv)
        else:
            self._by_layer(self.per_layer.to_chunks, spans, pace, kv, once=False)

    def from_chunks(self, spans: Sequence[ChunkSpan], *, pace: Pace | None = None,
                    **kv: Any) -> Any:
        if pace is None:
            return self.whole.from_chunks(spans, **kv)
        self._by_layer(self.per_layer.from_chunks, spans, pace, kv, once=True)
        return None

    def _by_layer(self, copy: Callable[..., Any], spans: Sequence[ChunkSpan], pace: Pace,
                  kv: dict[str, Any], *, once: bool) -> None:
        """Copy ``spans`` layer by layer. ``once``: a load, whose pace's progress
        opens layers to the forward, takes every chunk in one call. A store may
        come in several (the server's inline data path fills it batch by batch):
        each copies its chunks layer by layer, each layer after the forward
        produced it."""
        if once and pace.used:  # a load: layers already reported done would lack these
            # chunks; the caller fails the whole load (vLLM recomputes its blocks)
            raise RuntimeError("lmkv: a layerwise copy got its chunks in more than one call")
        pace.used = True
        caches = kv.pop("kv_caches")
        if len(caches) != self.spec.num_layers:
            raise ValueError(f"{len(caches)} KV caches; this engine stores "
                             f"{self.spec.num_layers} layers")
        for index, cache in enumerate(caches):
            layer = [ChunkSpan(s.start, s.end, s.buffer[index:index + 1]) for s in spans]
            with pace.layer(index):
                after = pace.events.get(index) if pace.events is not None else None
                copy(layer, kv_caches=[cache], **(kv if after is None else {**kv, "after": after}))


class LoadStep:
    """One step's synchronous loads, run layer by layer on the loader thread.

    ``gate`` opens a layer once every load of the step has it: the loads run one
    after the other, so only the last one's progress opens layers early (the
    earlier ones are whole before it starts). ``failed`` gathers the blocks that
    did not load; ``give_up`` adds every block of the loads not finished, so that
    what vLLM is told to recompute covers anything a cancelled copy left half
    written.
    """

    def __init__(self, num_layers: int, block_size: int, specs: Sequence[Any]) -> None:
        self.gate = LayerGate(num_layers)
        self.guard = CopyGuard()
        self.specs = list(specs)
        self.block_size = block_size
        self.failed: set[int] = set()
        self.finished = 0  # loads done (success or failure), in order
        self.done = threading.Event()
        self._lock = threading.Lock()

    def load_done(self, failed: set[int]) -> None:
        with self._lock:
            if not self.guard.cancelled:
                self.failed |= failed
                self.finished += 1

    def give_up(self) -> set[int]:
        """Cancel the copies; every block of an unfinished load is failed. Returns
        the step's failed blocks."""
        self.guard.cancel()
        with self._lock:
            for spec in self.specs[self.finished:]:
                want = -(-len(spec.token_ids) // self.block_size)
                self.failed |= set(spec.block_ids[spec.skip_tokens // self.block_size:want])
            self.finished = len(self.specs)
        self.gate.open_all()  # the forward's later waits return at once
        self.done.set()
        return self.failed

    def end(self) -> None:
        self.gate.open_all()
        self.done.set()


class StoreStep:
    """One step's eager stores, run layer by layer on the store thread as the
    forward produces each layer (``save_kv_layer``)."""

    def __init__(self, num_layers: int) -> None:
        self.produced = LayerGate(num_layers)
        self.guard = CopyGuard()
        self._seen: set[int] = set()
        self.events: dict[int, Any] = {}  # layer -> event on the forward's stream
        self.future: Any = None

    def open_all(self, event: Any = None) -> None:
        """Every layer is produced (the forward is done; ``event``, on its stream,
        stands for the layers that reported no event of their own)."""
        if event is not None:
            for index in range(self.produced.num_layers):
                self.events.setdefault(index, event)
        self.produced.open_all()

    def layer_produced(self, index: int, event: Any = None) -> None:
        """Layer ``index``'s KV is queued on the forward's stream (``event``, recorded
        there then: its copy waits for it; None without CUDA); layers open in order
        of index (a layer produced out of order waits for the ones before it)."""
        if event is not None:
            self.events[index] = event  # before the gate opens the layer
        self._seen.add(index)
        n = self.produced.ready
        while n in self._seen:
            n += 1
        self.produced.advance(n)
