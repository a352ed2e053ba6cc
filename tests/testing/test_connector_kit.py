"""The GPU-connector kit (``lmkv.testing.GPUConnectorConformance``) passes for the
built-in connectors: ``paged`` over cpu caches (chunks held heads outer),
flash caches (canonical chunks) and ``hf`` (per-layer K and V)."""

from __future__ import annotations

import random
from typing import Any

import torch

from lmkv.contracts.connector import KVSpec
from lmkv.testing import GPUConnectorConformance
from lmkv_backends.connectors.hf import HFConnector
from lmkv_backends.connectors.paged import PagedConnector

BLOCK = 16


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int | None) -> torch.Tensor:
    if seed is None:
        return torch.zeros(shape, dtype=dtype)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


class PagedKit(GPUConnectorConformance):
    connector_class = PagedConnector
    layout = "cpu"

    def engine_state(self, spec: KVSpec, tokens: int, seed: int | None) -> dict[str, Any]:
        blocks = -(-tokens // BLOCK)
        ids = random.Random(seed).sample(range(blocks + 3), blocks)
        h, d = spec.num_kv_heads, spec.head_dim
        shape = ((blocks + 3, h, BLOCK, 2 * d) if self.layout == "cpu"
                 else (2, blocks + 3, BLOCK, h, d))
        return {"kv_caches": [_random(shape, spec.dtype, None if seed is None else seed + i)
                              for i in range(spec.num_layers)],
                "block_ids": ids}

    def token_kv(self, state: dict[str, Any], layer: int, token: int) -> torch.Tensor:
        cache = state["kv_caches"][layer]
        b, o = state["block_ids"][token // BLOCK], token % BLOCK
        if self.layout == "cpu":
            return cache[b, :, o].view(cache.shape[1], 2, -1).transpose(0, 1)
        return cache[:, b, o]


class TestPagedCPUKit(PagedKit):
    def test_cpu_caches_give_a_heads_outer_spec(self) -> None:
        assert self.kit_spec().heads_outer


class TestPagedFlashKit(PagedKit):
    layout = "flash"
    spec = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)


class TestHFKit(GPUConnectorConformance):
    connector_class = HFConnector

    def engine_state(self, spec: KVSpec, tokens: int, seed: int | None) -> dict[str, Any]:
        shape = (1, spec.num_kv_heads, tokens, spec.head_dim)
        return {"kv": [(_random(shape, spec.dtype, None if seed is None else seed + 2 * i),
                        _random(shape, spec.dtype, None if seed is None else seed + 2 * i + 1))
                       for i in range(spec.num_layers)]}

    def token_kv(self, state: dict[str, Any], layer: int, token: int) -> torch.Tensor:
        k, v = state["kv"][layer]
        return torch.stack([k[0, :, token], v[0, :, token]])
