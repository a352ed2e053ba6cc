"""The transformers integration on a real (tiny, random-weight) Llama."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from lmkv.config import load_config
from lmkv.integrations import hf_model
from lmkv.integrations.transformers import HFCacheEngine


@pytest.fixture(scope="module")
def model():
    return hf_model.build_preset("tiny")


@pytest.fixture(scope="module")
def prompts():
    tokenizer = hf_model.build_tokenizer()
    return hf_model.synthetic_prompts(tokenizer, 3, prefix_tokens=300, suffix_tokens=250)


@pytest.fixture
def engine(model):
    config = load_config(env={}, overrides={"lmkv.chunk_size": 64,
                                            "lmkv.tiers.0.options.max_bytes": "64MiB"})
    engine = HFCacheEngine(model, config, model_name="tiny-test")
    yield engine
    engine.close()


def test_reused_kv_reproduces_a_full_recompute(model, prompts, engine) -> None:
    full_logits, full_cache = hf_model.prefill(model, prompts[0])
    full_tokens = hf_model.greedy_generate(model, full_logits, full_cache, 6)

    first = engine.prefill(prompts[0])
    assert first.hit_tokens == 0
    # two separate full prefills: equal up to the CPU kernels' run-to-run rounding
    assert torch.allclose(first.logits, full_logits, atol=1e-5, rtol=1e-5)

    again = engine.prefill(prompts[0])
    assert again.hit_tokens == (len(prompts[0]) - 1) // 64 * 64
    assert torch.allclose(again.logits, full_logits, atol=1e-5, rtol=1e-5)
    assert hf_model.greedy_generate(model, again.logits, again.cache, 6) == full_tokens


def test_reused_kv_is_the_stored_kv_bit_for_bit(model, prompts, engine) -> None:
    stored = engine.prefill(prompts[1])
    computed = [(k.clone(), v.clone()) for k, v in hf_model.cache_to_kv(stored.cache)]
    hit, cache = engine.retrieve(prompts[1])
    assert hit > 0
    for (k1, v1), (k2, v2) in zip(hf_model.cache_to_kv(cache), computed, strict=True):
        assert torch.equal(k1, k2[:, :, :hit]) and torch.equal(v1, v2[:, :, :hit])


def test_shared_prefix_hits_across_prompts(prompts, engine) -> None:
    engine.prefill(prompts[0])
    out = engine.prefill(prompts[2])
    assert out.hit_tokens == 256  # 300 shared tokens -> 4 whole 64-token chunks
    stats = engine.engine.stats()[0]
    assert stats["hits"] >= 4


def test_a_different_model_name_never_hits(model, prompts, engine) -> None:
    engine.prefill(prompts[0])
    other = HFCacheEngine(model, engine.engine.config, model_name="another-model")
    try:
        assert other.engine.lookup(prompts[0]) == 0
    finally:
        other.close()


def test_a_paged_connector_is_refused_for_transformers(model) -> None:
    from lmkv.errors import ConfigError

    config = load_config(env={}, overrides={"lmkv.gpu_connector": "paged"})
    with pytest.raises(ConfigError, match="gpu_connector = 'paged': cannot serve a transformers"):
        HFCacheEngine(model, config)
