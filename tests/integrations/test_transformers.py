"""The transformers integration on a real (tiny, random-weight) Llama."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from lmkv.config.model import load_config
from lmkv.integrations import hf_model
from lmkv.integrations.transformers import HFCacheEngine

pytestmark = pytest.mark.slow  # runs a model


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
    assert torch.allclose(first.logits[0, -1], full_logits, atol=1e-5, rtol=1e-5)

    again = engine.prefill(prompts[0])
    # every whole 16-token block but the last token's (the tail chunk is stored too)
    assert again.hit_tokens == (len(prompts[0]) - 1) // 16 * 16
    assert torch.allclose(again.logits[0, -1], full_logits, atol=1e-5, rtol=1e-5)
    assert hf_model.greedy_generate(model, again.logits[0, -1], again.cache, 6) == full_tokens


def test_prefill_logits_have_hugging_faces_shape(model, prompts, engine) -> None:
    """``prefill().logits`` is what the model's own forward gives for the last position
    (``logits_to_keep=1``): ``[batch, 1, vocab]`` in the model's dtype, cold and warm."""
    ids = torch.tensor([prompts[2]])
    with torch.inference_mode():
        theirs = model(ids).logits[:, -1:]
    for hit in (False, True):
        out = engine.prefill(ids)
        assert (out.hit_tokens > 0) is hit
        assert out.logits.shape == theirs.shape == (1, 1, model.config.vocab_size)
        assert out.logits.dtype == theirs.dtype
        assert torch.allclose(out.logits, theirs, atol=1e-4, rtol=1e-4)
        assert int(out.logits[:, -1, :].argmax(-1)) == int(theirs[:, -1, :].argmax(-1))


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
    # 300 shared tokens -> 4 whole 64-token chunks and 2 whole 16-token blocks of the 5th
    assert out.hit_tokens == 288
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
    from lmkv.base.errors import ConfigError

    config = load_config(env={}, overrides={"lmkv.gpu_connector": "paged"})
    with pytest.raises(ConfigError, match="gpu_connector = 'paged': cannot serve a transformers"):
        HFCacheEngine(model, config)


def test_a_namespace_never_shares_kv_with_another(model, prompts, engine) -> None:
    engine.namespace = "tenant-a"
    engine.prefill(prompts[0])
    engine.namespace = "tenant-b"
    assert engine.retrieve(prompts[0])[0] == 0
    engine.namespace = None
    assert engine.retrieve(prompts[0])[0] == 0
    engine.namespace = "tenant-a"
    assert engine.retrieve(prompts[0])[0] > 0


def _lora(model, adapters: dict[str, int]):  # type: ignore[no-untyped-def]
    """A copy of ``model`` with LoRA adapters of random (non-zero) weights, by seed."""
    import copy

    peft = pytest.importorskip("peft")
    peft_model = None
    for name, seed in adapters.items():
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "k_proj",
                                                                      "v_proj"],
                                 init_lora_weights=False)
        if peft_model is None:
            peft_model = peft.get_peft_model(copy.deepcopy(model), config, adapter_name=name)
        else:
            peft_model.add_adapter(name, config)
    peft_model.eval()
    return peft_model


def test_lora_adapters_share_kv_with_neither_the_base_nor_each_other(model, prompts,
                                                                      tmp_path) -> None:
    """Two models whose adapter is named "sql" but has other weights, and a second
    adapter and the base model, over one disk tier: each gets its own KV or a miss,
    and an adapter's output with reused KV equals its recompute."""
    config = load_config(env={}, overrides={
        "lmkv.chunk_size": 64,
        "lmkv.tiers": [{"type": "cpu", "options": {"max_bytes": "64MiB"}},
                       {"type": "fs", "options": {"url": str(tmp_path)}}]})
    first = _lora(model, {"sql": 1, "chat": 2})
    other_sql = _lora(model, {"sql": 3})
    prompt = prompts[0]
    hit = (len(prompt) - 1) // 16 * 16  # whole 16-token blocks
    engine = HFCacheEngine(first, config, model_name="tiny-test")
    try:
        first.set_adapter("sql")
        engine.prefill(prompt)
        assert engine.engine.storage.flush(60)
        first.set_adapter("chat")
        assert engine.retrieve(prompt)[0] == 0
        with first.disable_adapter():
            assert engine.retrieve(prompt)[0] == 0
            engine.prefill(prompt)  # the base model's own KV
        first.set_adapter("sql")
        expected_logits, expected_cache = hf_model.prefill(first, prompt)
        again = engine.prefill(prompt)
        assert again.hit_tokens == hit
        assert torch.allclose(again.logits[0, -1], expected_logits, atol=1e-5, rtol=1e-5)
        assert hf_model.greedy_generate(first, again.logits[0, -1], again.cache, 6) == \
            hf_model.greedy_generate(first, expected_logits, expected_cache, 6)
        assert engine.engine.storage.flush(60)
    finally:
        engine.close()
    other = HFCacheEngine(other_sql, config, model_name="tiny-test")
    try:
        assert other.retrieve(prompt)[0] == 0  # same name "sql", other weights
    finally:
        other.close()
    plain = HFCacheEngine(model, config, model_name="tiny-test")
    try:
        assert plain.retrieve(prompt)[0] == hit  # the base model's, stored above
    finally:
        plain.close()


def test_an_adapter_reloaded_or_changed_under_its_name_is_another_adapter(model, prompts
                                                                         ) -> None:
    import peft

    peft_model = _lora(model, {"sql": 1})
    config = load_config(env={}, overrides={"lmkv.chunk_size": 64,
                                            "lmkv.tiers.0.options.max_bytes": "64MiB"})
    prompt = prompts[0]
    engine = HFCacheEngine(peft_model, config, model_name="tiny-test")
    try:
        engine.prefill(prompt)
        assert engine.retrieve(prompt)[0] > 0
        peft_model.delete_adapter("sql")  # same name, other weights
        torch.manual_seed(99)
        peft_model.add_adapter("sql", peft.LoraConfig(
            r=4, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj"],
            init_lora_weights=False))
        peft_model.set_adapter("sql")
        assert engine.retrieve(prompt)[0] == 0
        engine.prefill(prompt)
        assert engine.retrieve(prompt)[0] > 0
        state = peft.get_peft_model_state_dict(peft_model, adapter_name="sql")
        state = {k: v + 1 for k, v in state.items()}
        peft.set_peft_model_state_dict(peft_model, state, adapter_name="sql")  # changed in place
        assert engine.retrieve(prompt)[0] == 0
    finally:
        engine.close()


def test_a_prompt_leaving_a_stored_one_mid_chunk_reproduces_a_full_recompute(
        model, prompts, engine) -> None:
    """The chunk it leaves inside serves its leading whole blocks, and the result is
    the model's own: the logits and greedy tokens of a full recompute."""
    engine.prefill(prompts[0])
    diverging = [*prompts[0][:150], *prompts[1][200:300]]  # leaves chunk 2 at token 150
    full_logits, full_cache = hf_model.prefill(model, diverging)
    out = engine.prefill(diverging, store=False)
    assert out.hit_tokens == 144  # 2 chunks of 64 and one 16-token block
    assert torch.allclose(out.logits[0, -1], full_logits, atol=1e-4, rtol=1e-4)
    assert hf_model.greedy_generate(model, out.logits[0, -1], out.cache, 6) == \
        hf_model.greedy_generate(model, full_logits, full_cache, 6)
