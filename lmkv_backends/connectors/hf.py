"""Transformers-style KV: per-layer ``(K, V)`` tensors, copied to and from
lmkv's chunk buffers ``[layers, 2, tokens, kv_heads, head_dim]`` on any torch
device by the ``lmkv_kernels`` dense copies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import lmkv_kernels
from lmkv.contracts.connector import ChunkSpan, GPUConnector
from lmkv.memory.transfer_stream import stream_for
from lmkv_backends.connectors.common import check

KVPairs = Sequence[tuple[torch.Tensor, torch.Tensor]]


class HFConnector(GPUConnector):
    """Per-layer ``(K, V)`` tensors of shape ``[batch, kv_heads, seq, head_dim]``.

    Keyword arguments: ``kv`` (one ``(K, V)`` pair per layer) and
    ``batch_index`` (default 0). ``from_chunks`` without ``kv`` builds new
    tensors of shape ``[1, kv_heads, end, head_dim]`` for the spans'
    tokens and returns them; with ``kv`` it writes into those tensors.
    """

    name = "hf"
    api_version = "2.0"
    kv_kind = "hf"

    def _validate(self, kv: KVPairs, end: int, batch_index: int) -> None:
        spec = self.spec
        check(len(kv) == spec.num_layers,
               f"KV has {len(kv)} layers; this engine stores {spec.num_layers}")
        for k, v in kv:
            for t in (k, v):
                check(t.dim() == 4 and t.shape[1] == spec.num_kv_heads
                       and t.shape[3] == spec.head_dim,
                       f"KV tensor of shape {tuple(t.shape)}; expected [batch, "
                       f"{spec.num_kv_heads}, seq, {spec.head_dim}]")
                check(t.dtype == spec.dtype, f"KV dtype {t.dtype}; expected {spec.dtype}")
                check(t.shape[2] >= end, f"KV holds {t.shape[2]} tokens; {end} needed")
                check(0 <= batch_index < t.shape[0], f"batch_index {batch_index} out of range")

    def to_chunks(self, spans: Sequence[ChunkSpan], *, kv: KVPairs,
                  batch_index: int = 0, after: Any = None, **_: Any) -> None:
        self._validate(kv, max((s.end for s in spans), default=0), batch_index)
        chunks = [(s.start, s.buffer) for s in spans]
        if kv:  # on the transfer stream; the buffers are published after its event
            stream_for(kv[0][0].device).store(
                lambda: lmkv_kernels.gather_dense(kv, chunks, batch_index), after=after).wait()

    def from_chunks(self, spans: Sequence[ChunkSpan], *, kv: KVPairs | None = None,
                    batch_index: int = 0, device: torch.device | str | None = None,
                    after: Any = None, **_: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        spec = self.spec
        if kv is None:
            total = max((s.end for s in spans), default=0)
            shape = (1, spec.num_kv_heads, total, spec.head_dim)
            kv = [(torch.empty(shape, dtype=spec.dtype, device=device),
                   torch.empty(shape, dtype=spec.dtype, device=device))
                  for _ in range(spec.num_layers)]
            batch_index = 0
        self._validate(kv, max((s.end for s in spans), default=0), batch_index)
        chunks = [(s.start, s.buffer) for s in spans]
        if kv:  # the compute stream waits for the copy; the buffers are released after it
            stream_for(kv[0][0].device).load(
                lambda: lmkv_kernels.scatter_dense(kv, chunks, batch_index),
                after=after).wait()
        return list(kv)
