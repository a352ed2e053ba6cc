"""``GPUConnectorConformance``: contract tests every GPU connector passes.

Subclass it in a ``Test*`` class, set ``connector_class`` (and
``connector_options()``), and say what your engine's KV is: ``engine_state``
builds the keyword arguments your connector's ``to_chunks``/``from_chunks``
take (KV for ``tokens`` tokens, random or zeros), ``token_kv`` reads one
token's KV back the obvious way. The kit builds the connector the way lmkv
does, for the spec it reads from that state (``spec_from``; the kit's
``spec`` where the connector cannot say), and checks that:

* the class passes lmkv's load check;
* each chunk holds each token's KV where the spec says, in the spec's order
  (``KVSpec.chunk_shape``; ``KVSpec.planes_first`` views it canonically), bit
  for bit: a connector that fills ``heads_outer`` buffers in the canonical
  order fails here, not in a user's engine;
* chunks load back into other engine state bit for bit;
* an engine takes the connector for that spec and never names its chunks by
  the other order's tag (a connector whose tag differs from its spec's where
  either names heads-outer chunks is refused);
* where lmkv calls its ``from_checked_chunks`` (API 2.2), checked loads of
  whole chunks copy what matched bit for bit, leave the tokens past a span
  alone, and say False for a chunk whose checksum is not its bytes' (skipped
  for a connector without one, or one that declines the kit's KV).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from lmkv.contracts.connector import (
    ChunkSpan,
    ConnectorContext,
    GPUConnector,
    KVSpec,
    checked_loads,
)
from lmkv.contracts.serde import payload_checksum
from lmkv.testing.building import build_plugin, config_of, load_problem


class GPUConnectorConformance:
    """Contract tests every GPU connector passes."""

    #: The connector class under test.
    connector_class: type[GPUConnector] | None = None
    #: The KV the kit's engine holds; a connector that reads its spec from the
    #: engine's state (``spec_from``) is checked with the spec it reads there.
    spec: KVSpec = KVSpec(num_layers=2, num_kv_heads=3, head_dim=16, dtype=torch.float32)
    #: Tokens of the kit's request (a partial last chunk) and of each chunk.
    tokens: int = 70
    chunk_tokens: int = 32

    def connector_options(self) -> dict[str, Any]:
        """The ``options`` a config would give the connector."""
        return {}

    def engine_state(self, spec: KVSpec, tokens: int, seed: int | None) -> dict[str, Any]:
        """The keyword arguments ``to_chunks``/``from_chunks`` take for an engine
        holding ``spec``'s KV of ``tokens`` tokens: random with ``seed``, else zeros."""
        raise NotImplementedError("the kit's subclass builds its engine's state")

    def token_kv(self, state: dict[str, Any], layer: int, token: int) -> torch.Tensor:
        """KV of ``token`` in ``layer`` of ``state``, ``[planes, kv_heads, head_dim]``."""
        raise NotImplementedError("the kit's subclass reads one token's KV")

    # -- helpers -----------------------------------------------------------------
    def kit_spec(self) -> KVSpec:
        cls = self._class()
        try:
            return cls.spec_from(**self.engine_state(self.spec, self.tokens, None))
        except NotImplementedError:
            return self.spec

    def make_connector(self, spec: KVSpec) -> GPUConnector:
        return build_plugin(self._class(), self.connector_options(), ConnectorContext(spec))

    def _class(self) -> type[GPUConnector]:
        if self.connector_class is None:
            pytest.fail("set connector_class (and connector_options) on the kit's subclass: "
                        "the kit builds and checks the connector the way lmkv does")
        return self.connector_class

    def spans(self, spec: KVSpec) -> list[ChunkSpan]:
        return [ChunkSpan(s, min(s + self.chunk_tokens, self.tokens),
                          torch.zeros(spec.chunk_shape(min(self.chunk_tokens, self.tokens - s)),
                                      dtype=spec.dtype))
                for s in range(0, self.tokens, self.chunk_tokens)]

    @staticmethod
    def _bits(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.uint8)

    def _stored(self) -> tuple[KVSpec, dict[str, Any], list[ChunkSpan]]:
        spec = self.kit_spec()
        state = self.engine_state(spec, self.tokens, 1)
        spans = self.spans(spec)
        self.make_connector(spec).to_chunks(spans, **state)
        return spec, state, spans

    # -- the tests ---------------------------------------------------------------
    def test_the_class_passes_lmkvs_load_check(self) -> None:
        problem = load_problem(self._class())
        assert problem == "", problem

    def test_chunks_hold_each_tokens_kv_in_the_specs_order(self) -> None:
        spec, state, spans = self._stored()
        for span in spans:
            assert tuple(span.buffer.shape) == spec.chunk_shape(span.end - span.start)
            canonical = spec.planes_first(span.buffer)
            for t in range(span.start, span.end):
                for layer in range(spec.num_layers):
                    want = self.token_kv(state, layer, t)
                    got = canonical[layer, :, t - span.start]
                    assert torch.equal(self._bits(got), self._bits(want)), (
                        f"token {t}, layer {layer}: the chunk does not hold its KV where "
                        f"the spec's {spec.chunk_layout} order puts it")

    def test_chunks_load_back_bit_for_bit(self) -> None:
        spec, state, spans = self._stored()
        other = self.engine_state(spec, self.tokens, None)
        self.make_connector(spec).from_chunks(spans, **other)
        for t in range(self.tokens):
            for layer in range(spec.num_layers):
                assert torch.equal(self._bits(self.token_kv(other, layer, t)),
                                   self._bits(self.token_kv(state, layer, t))), \
                    f"token {t}, layer {layer} loaded back other KV"

    def test_an_engine_names_the_connectors_chunks(self) -> None:
        from lmkv.engines.keys import engine_chunker

        spec = self.kit_spec()
        meta = engine_chunker(config_of([{"type": "cpu"}]), spec, "connector-kit",
                              self.make_connector(spec), 1, 0).meta
        # never the other order's tag: its engines would read these bytes as theirs
        other = replace(spec, heads_outer=not spec.heads_outer).chunk_layout
        assert meta.kv_layout != other, (
            f"an engine names {spec.chunk_layout} chunks {meta.kv_layout}")

    def test_checked_loads_copy_what_matched_and_fail_what_did_not(self) -> None:
        spec, state, spans = self._stored()
        connector = self.make_connector(spec)
        checker = checked_loads(connector)
        if checker is None:
            pytest.skip("lmkv calls no from_checked_chunks of this connector (API 2.2)")
        # (the checksum stored entries carry: lmkv.contracts.serde.payload_checksum)
        sums = [payload_checksum(self._bits(s.buffer).numpy().tobytes()) for s in spans]
        # the last span ends a token short of its chunk: that token is not copied
        short = [*spans[:-1], replace(spans[-1], end=spans[-1].end - 1)]
        other = self.engine_state(spec, self.tokens, None)
        verdicts = checker(short, sums, **other)
        if verdicts is None:
            pytest.skip("the connector declines checked loads of the kit's KV")
        assert list(verdicts) == [True] * len(spans), f"checksums that match: {verdicts}"
        empty = self.engine_state(spec, self.tokens, None)
        for t in range(self.tokens):
            want = state if t < short[-1].end else empty  # (the last token: left alone)
            for layer in range(spec.num_layers):
                assert torch.equal(self._bits(self.token_kv(other, layer, t)),
                                   self._bits(self.token_kv(want, layer, t))), \
                    f"token {t}, layer {layer}: a checked load copied other KV"
        wrong = [*sums]
        wrong[0] ^= 1 << 17
        verdicts = checker(spans, wrong, **self.engine_state(spec, self.tokens, None))
        assert verdicts is not None and list(verdicts) == [False] + [True] * (len(spans) - 1), \
            f"a chunk whose bytes do not have its checksum: {verdicts}"
