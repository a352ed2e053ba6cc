"""A small, fully local Hugging Face Llama stack for tests, demos and benchmarks.

Nothing here downloads anything: the tokenizer is a BPE trained in code on a
deterministic synthetic corpus of English-like words, and the model is a
random-weight :class:`~transformers.LlamaForCausalLM` (GQA, RoPE). The KV
helpers convert between a transformers cache object and plain per-layer
``(K, V)`` tensors of shape ``[batch, kv_heads, seq, head_dim]``.

Works with transformers 5.x, where the forward kwarg and output field are
named ``cache`` (``past_key_values`` is a deprecated alias) and there is no
``cache_position``, and with 4.x, where they are ``past_key_values`` and
``cache_position``.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<unk>", "<pad>", "<s>", "</s>")
_COMMON_TEXT = (
    "the of and to a in is it that was for on are as with his they at be this from have or "
    "by one had not but what all were when we there can an your which their said if do will "
    "each about how up out them then she many some so these would other into has more her two "
    "like him see time could no make than first been its who now people my made over did down"
)
_ONSETS = ("b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "w",
           "br", "ch", "cl", "dr", "fr", "gr", "pl", "pr", "sh", "st", "str", "th", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "ou", "oo")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rt")
_PUNCT = (".", ".", ",", ",", ",", "?", ";")


@dataclass(frozen=True)
class ModelSize:
    """Shape of a random Llama. ``num_kv_heads < num_heads`` (GQA)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int = 8192
    max_position_embeddings: int = 4096


#: ``tiny``: unit tests (600-token prefill ~10 ms on 2 cores).
#: ``default``: demos (75M params; 2048-token prefill ~1.5 s on 2 cores, fp32).
PRESETS: dict[str, ModelSize] = {
    "tiny": ModelSize(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=32, intermediate_size=256),
    "default": ModelSize(hidden_size=768, num_layers=10, num_heads=12, num_kv_heads=4,
                         head_dim=64, intermediate_size=2048),
}
_DEFAULT = PRESETS["default"]


def _lexicon(size: int, seed: int) -> list[str]:
    """``size`` distinct pseudo-English words, common function words first."""
    rng = random.Random(seed)
    words = _COMMON_TEXT.split()
    seen = set(words)
    while len(words) < size:
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS)
                       for _ in range(rng.choice((1, 1, 2, 2, 2, 3))))
        word += rng.choice(_CODAS)
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def synthetic_text(num_words: int, seed: int = 0, lexicon_size: int = 6000) -> str:
    """Deterministic English-like text: Zipf-distributed words in sentences."""
    rng = random.Random(seed)
    lexicon = _lexicon(lexicon_size, 1234)  # fixed lexicon: shared by every seed
    weights = [1.0 / (rank + 2) for rank in range(len(lexicon))]
    chosen = rng.choices(lexicon, weights=weights, k=num_words)
    out: list[str] = []
    start = True
    for word in chosen:
        out.append(word.capitalize() if start else word)
        start = False
        if rng.random() < 0.12:
            punct = rng.choice(_PUNCT)
            out[-1] += punct
            start = punct in ".?"
    return " ".join(out)


@lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int) -> str:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = synthetic_text(200_000, seed=0)
    lines = [corpus[i : i + 2000] for i in range(0, len(corpus), 2000)]
    tok.train_from_iterator(lines, trainer=trainer)
    return tok.to_str()


def build_tokenizer(vocab_size: int = 8192) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained locally; deterministic for a given ``vocab_size``."""
    tok = Tokenizer.from_str(_trained_tokenizer_json(vocab_size))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
        bos_token="<s>", eos_token="</s>",
    )


def build_model(
    *,
    hidden_size: int = _DEFAULT.hidden_size,
    num_layers: int = _DEFAULT.num_layers,
    num_heads: int = _DEFAULT.num_heads,
    num_kv_heads: int = _DEFAULT.num_kv_heads,
    head_dim: int = _DEFAULT.head_dim,
    intermediate_size: int = _DEFAULT.intermediate_size,
    vocab_size: int = _DEFAULT.vocab_size,
    max_position_embeddings: int = _DEFAULT.max_position_embeddings,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
) -> LlamaForCausalLM:
    """A random-weight Llama in eval mode. ``build_model(**asdict(PRESETS["tiny"]))`` for tests."""
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=max_position_embeddings, bos_token_id=2, eos_token_id=3,
        pad_token_id=1, tie_word_embeddings=False, use_cache=True,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    return model.eval()


def build_preset(name: str = "default", **overrides: Any) -> LlamaForCausalLM:
    """``build_model`` with the sizes of ``PRESETS[name]``; keyword overrides win."""
    return build_model(**{**asdict(PRESETS[name]), **overrides})


def synthetic_prompts(
    tokenizer: PreTrainedTokenizerFast,
    num_prompts: int,
    prefix_tokens: int,
    suffix_tokens: int,
    seed: int = 0,
) -> list[list[int]]:
    """Prompts sharing one ``prefix_tokens``-long prefix, each with its own suffix."""

    def exact(text_seed: int, n: int) -> list[int]:
        ids: list[int] = []
        words = max(16, n)
        while len(ids) < n:  # ~1-2 tokens per word, so this rarely loops
            ids = tokenizer.encode(synthetic_text(words, seed=text_seed), add_special_tokens=False)
            words *= 2
        return ids[:n]

    prefix = exact(seed * 1_000_003 + 1, prefix_tokens)
    return [prefix + exact(seed * 1_000_003 + 2 + i, suffix_tokens) for i in range(num_prompts)]


def cache_to_kv(past_key_values: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(K, V)``, each ``[batch, kv_heads, seq, head_dim]`` (views, not copies)."""
    if hasattr(past_key_values, "layers"):  # transformers >= 4.56 / 5.x
        return [(layer.keys, layer.values) for layer in past_key_values.layers]
    if hasattr(past_key_values, "key_cache"):  # older DynamicCache
        return list(zip(past_key_values.key_cache, past_key_values.value_cache, strict=True))
    return [(k, v) for k, v, *_ in past_key_values]  # legacy tuple-of-tuples


def kv_to_cache(kv: Sequence[tuple[torch.Tensor, torch.Tensor]], model_config: Any) -> Any:
    """A ``DynamicCache`` holding ``kv`` (copied in), usable as the model's cache."""
    try:
        cache = DynamicCache(config=model_config)
    except TypeError:  # older transformers: no config argument
        cache = DynamicCache()
    for layer_idx, (k, v) in enumerate(kv):
        cache.update(k, v, layer_idx)
    return cache


@lru_cache(maxsize=8)
def _forward_params(cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(cls.forward).parameters)


def prefill(
    model: LlamaForCausalLM,
    input_ids: Sequence[int] | torch.Tensor,
    past_kv: Any = None,
) -> tuple[torch.Tensor, Any]:
    """Run ``input_ids`` after the tokens already in ``past_kv`` (mutated in place, if given).

    Returns the last position's logits ``[vocab]`` (float32) and the cache.
    """
    logits, cache = forward_last(model, input_ids, past_kv)
    return logits[0, -1].float(), cache


def forward_last(
    model: Any,
    input_ids: Sequence[int] | torch.Tensor,
    past_kv: Any = None,
) -> tuple[torch.Tensor, Any]:
    """``prefill``, with the logits as the model returns them for its last position:
    ``[1, 1, vocab]`` in the model's dtype, as transformers' ``model(input_ids,
    logits_to_keep=1).logits``."""
    device = model.device
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device).reshape(1, -1)
    past_len = past_kv.get_seq_length() if past_kv is not None else 0
    positions = torch.arange(past_len, past_len + ids.shape[1], device=device)
    model_class: type = type(model)
    params = _forward_params(model_class)
    kwargs: dict[str, Any] = {"input_ids": ids, "position_ids": positions[None], "use_cache": True}
    cache_kw = "cache" if "cache" in params else "past_key_values"
    if past_kv is None:
        past_kv = DynamicCache() if cache_kw == "past_key_values" else None
    kwargs[cache_kw] = past_kv
    if "cache_position" in params:  # transformers 4.x
        kwargs["cache_position"] = positions
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1
    with torch.inference_mode():
        out = model(**kwargs)
    cache = getattr(out, "cache", None)
    # Without logits_to_keep (older transformers) every position's logits come back.
    return out.logits[:, -1:], cache if cache is not None else out.past_key_values


def greedy_generate(
    model: LlamaForCausalLM,
    logits_last: torch.Tensor,
    past_key_values: Any,
    num_new_tokens: int,
) -> list[int]:
    """Greedy continuation of a :func:`prefill`, one token per step (mutates the cache)."""
    tokens: list[int] = []
    logits, cache = logits_last, past_key_values
    for step in range(num_new_tokens):
        tokens.append(int(torch.argmax(logits)))
        if step + 1 < num_new_tokens:
            logits, cache = prefill(model, tokens[-1:], cache)
    return tokens
