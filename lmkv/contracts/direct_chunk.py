"""Chunks a tier leaves where they are until the engine reads them into its KV.

A fresh engine process that loads a prefix another process stored on disk would
otherwise pay three passes over every byte before the forward can start: the
tier reads the entry into a chunk buffer (fresh memory: page faults), verifies
its checksum, and the connector copies the buffer into the engine's paged
cache. A ``DirectChunk`` is the entry's verified header and an open handle
instead. The engine reads it piece by piece (whole layers, a few MiB) into one
small staging buffer of its own that stays in the CPU's caches, folds each
piece into the checksum while it is there, and has the connector copy the piece
into the paged cache: one read from the page cache, one copy out.

The checksum can only be compared after the last piece, so the pieces are
already in the engine's KV when a corrupt entry is found. ``pieces`` then
raises ``CorruptFrameError`` (the tier has dropped the entry): the caller must
treat the whole chunk as not loaded, and vLLM recomputes its blocks, as for any
failed load. A caller that cannot give that guarantee reads chunks into buffers
instead (``StorageManager.lookup_and_prefetch`` without ``direct``).

Only a tier that reads raw payloads from a handle of its own makes them (the
``fs`` tier on local disk, ``direct_reads``); the storage manager hands them
only to a caller that asked (a local engine whose connector copies into KV in
host memory), and never promotes them into the tier above.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator

import torch
import xxhash

from lmkv.base.errors import CorruptFrameError
from lmkv.contracts.mapped_file import MappedFile
from lmkv.keys.chunking import CacheKey
from lmkv.memory import MemoryObj

#: Bytes per piece: whole layers, at least one; small enough to stay in the caches.
PIECE_BYTES = 4 << 20

ReadAt = Callable[[int, memoryview], None]


class ChunkReleased(Exception):
    """A direct chunk was read after its holder released it (a load given up on)."""


class DirectChunk:
    """One stored chunk, verified up to its payload, read on demand.

    ``read_at(offset, view)`` fills ``view`` with the payload's bytes from
    ``offset`` (raising ``CorruptFrameError`` when the entry is shorter, or an
    ``OSError``); ``failed(exc)`` is the tier's answer to a piece that could not
    be read or a checksum that did not match (count it, drop the entry);
    ``close()`` gives the handle back, once, on ``ref_down`` or when the object
    is collected; a ``ref_down`` while a piece is being read leaves the close to
    that read (the handle is never closed, or its number reused, under it), and
    a read after ``ref_down`` raises ``ChunkReleased`` without telling the tier.
    ``tensor`` is a meta tensor of the chunk's shape and dtype: it
    answers shape checks and holds no data.

    ``mapped``: the payload mapped (``MappedFile``, its offset 0 the payload's
    first byte). ``pieces`` then yields views of the mapping, not copies in the
    staging buffer: the checksum reads the page cache where it is and the
    connector copies from there. A read the mapping's guard caught (the file
    shrank under it, or the disk failed) fails the piece, or the chunk in
    ``finish`` when it happened while the piece was copied out. ``read_piece``
    always reads with ``read_at`` (a tier may have it copy out of the mapping).
    The tier closes the mapping in ``close``.
    """

    def __init__(self, key: CacheKey, shape: tuple[int, ...], dtype: torch.dtype,
                 checksum: int, read_at: ReadAt, failed: Callable[[BaseException], None],
                 close: Callable[[], None], mapped: MappedFile | None = None) -> None:
        if len(shape) != 5 or not all(n > 0 for n in shape):
            raise ValueError(f"a direct chunk is a chunk's shape ([layers, planes, tokens, "
                             f"heads, dim] or heads outer), not {shape}")
        self.key = key
        self.tensor = torch.empty(shape, dtype=dtype, device="meta")
        self.checksum = checksum
        self._read_at = read_at
        self._mapped = mapped
        self._failed = failed
        self._lock = threading.Lock()
        self._closer = weakref.finalize(self, close)
        self._reading = False
        self._released = False

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def ref_down(self) -> None:
        """Give the handle back (``lmkv.memory.release`` calls this)."""
        with self._lock:
            self._released = True
            if self._reading:  # that read closes it when it returns
                return
        self._closer()

    @property
    def mapped(self) -> bool:
        """Whether ``pieces`` yields views of a mapping (its ``staging`` unused)."""
        return self._mapped is not None

    @property
    def layer_bytes(self) -> int:
        return self.nbytes // self.shape[0]

    def groups(self, piece_bytes: int = PIECE_BYTES) -> list[tuple[int, int]]:
        """``(first layer, layers)`` of each piece, in payload order: whole layers,
        as many as fit in ``piece_bytes`` (at least one)."""
        layers = self.shape[0]
        per_piece = max(1, min(layers, piece_bytes // self.layer_bytes))
        return [(first, min(per_piece, layers - first)) for first in range(0, layers, per_piece)]

    def read_piece(self, first: int, layers: int, staging: torch.Tensor,
                   hasher: xxhash.xxh3_64) -> torch.Tensor:
        """Layers ``first`` to ``first + layers`` read into ``staging`` (flat uint8)
        and folded into ``hasher``, which must have seen every earlier piece: a
        view of ``staging`` shaped as the chunk's layers (``[layers, ...shape[1:]]``).
        ``CorruptFrameError`` (the tier told) when the bytes cannot be read."""
        nbytes = layers * self.layer_bytes
        if staging.dtype != torch.uint8 or staging.dim() != 1 or staging.numel() < nbytes:
            raise ValueError(f"staging must be a flat uint8 tensor of at least {nbytes} bytes")
        buf = staging[:nbytes]
        view = buf.numpy().data
        with self._lock:
            if self._released:
                raise ChunkReleased(self.key.to_string())
            self._reading = True
        failure: BaseException | None = None
        try:
            self._read_at(first * self.layer_bytes, view)
        except (CorruptFrameError, OSError) as exc:
            failure = exc
        finally:
            with self._lock:
                self._reading = False
                released = self._released
            if released:
                self._closer()
        if released:  # what it read is nobody's; a failure is not the entry's fault
            raise ChunkReleased(self.key.to_string())
        if failure is not None:
            raise self._failure(failure) from None
        hasher.update(view)
        return buf.view(self.dtype).view(layers, *self.shape[1:])

    def _view(self, first: int, layers: int) -> tuple[memoryview, torch.Tensor]:
        """Layers ``first`` to ``first + layers`` of a mapped payload, where they are:
        the bytes and a tensor shaped as the chunk's layers (``[layers, ...shape[1:]]``)."""
        mapped = self._mapped
        assert mapped is not None
        offset, nbytes = first * self.layer_bytes, layers * self.layer_bytes
        with self._lock:  # a release after the view is made unmaps once it is gone
            if self._released:
                raise ChunkReleased(self.key.to_string())
            view = mapped.view(offset, nbytes)
        flat = torch.frombuffer(view, dtype=torch.uint8)
        return view, flat.view(self.dtype).view(layers, *self.shape[1:])

    def _check_mapping(self) -> None:
        """``CorruptFrameError`` (the tier told) when a read of the mapping faulted:
        the file shrank under it, or its disk failed; what was read is zeros."""
        if self._mapped is not None and self._mapped.damaged:
            raise self._failure(CorruptFrameError("the entry shrank while it was read"))

    def mapping(self) -> torch.Tensor:
        """A mapped payload's bytes where they are, shaped as the chunk, for a
        connector that checks them as it copies them
        (``GPUConnector.from_checked_chunks``); then ``finish_checked``. The
        mapping stays while the tensor lives. ``ChunkReleased`` after ``ref_down``."""
        return self._view(0, self.shape[0])[1]

    def finish_checked(self, matched: bool) -> None:
        """After a copy that read the whole mapped payload and compared it with
        ``checksum`` (``matched``): ``CorruptFrameError`` (the tier told) unless it
        matched and no read of the mapping faulted."""
        self._check_mapping()
        if not matched:
            raise self._failure(CorruptFrameError("frame payload checksum mismatch"))

    def finish(self, hasher: xxhash.xxh3_64) -> None:
        """After the last piece: ``CorruptFrameError`` (the tier told) unless the
        payload read matches the header's checksum."""
        self._check_mapping()
        if hasher.intdigest() != self.checksum:
            raise self._failure(CorruptFrameError("frame payload checksum mismatch"))

    def _failure(self, exc: BaseException) -> CorruptFrameError:
        self._failed(exc)
        return CorruptFrameError(f"direct read of {self.key.to_string()}: {exc}")

    def pieces(self, staging: torch.Tensor, piece_bytes: int = PIECE_BYTES
               ) -> Iterator[tuple[int, torch.Tensor]]:
        """The pieces one after another: ``(first layer, layers shaped [layers,
        ...shape[1:]])``, each valid until the next; then ``finish``.
        What was yielded must be treated as never loaded when this raises.

        A mapped payload's pieces are views of the mapping (``staging`` unused),
        each folded into the checksum after the caller has copied it out, from
        the CPU's caches: a change to the file since the copy read it shows as a
        mismatch, never as KV that was not checked. Otherwise each piece is
        ``read_piece``'s, in ``staging``."""
        hasher = xxhash.xxh3_64()
        if self._mapped is not None:
            for first, layers in self.groups(piece_bytes):
                view, piece = self._view(first, layers)
                yield first, piece
                del piece
                hasher.update(view)
                self._check_mapping()
        else:
            for first, layers in self.groups(min(piece_bytes, staging.numel())):
                yield first, self.read_piece(first, layers, staging, hasher)
        self.finish(hasher)

    def __repr__(self) -> str:
        return f"DirectChunk(shape={tuple(self.shape)}, dtype={self.dtype})"


def memory_prefix(objs: list[MemoryObj | DirectChunk]) -> int:
    """How many of ``objs`` lead with data in memory (before the first direct one)."""
    for i, obj in enumerate(objs):
        if isinstance(obj, DirectChunk):
            return i
    return len(objs)
