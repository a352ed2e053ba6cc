"""Reuse a Hugging Face causal LM's prompt KV through lmkv.

    from lmkv.integrations.transformers import HFCacheEngine

    cache = HFCacheEngine(model)              # config: LMKV_* env / lmkv.yaml / defaults
    out = cache.prefill(input_ids)            # loads the stored prefix, computes the rest,
    out.logits, out.cache, out.hit_tokens     # stores the new chunks

``out.logits`` is ``[1, 1, vocab]``, as transformers' ``model(input_ids,
logits_to_keep=1).logits``: ``out.logits[:, -1, :]`` is the next token's, as with
transformers.

``retrieve`` and ``store`` are there for loops that run the model themselves.
Hits are matched in blocks of ``BLOCK_TOKENS`` inside lmkv's chunks, so a prompt
that leaves a stored one mid-chunk still loads the chunk's leading blocks.

KV is shared only between calls with the same identity: the engine's
``namespace`` (a tenant, say: it seeds every chunk's hash) and the model's
active PEFT adapter (its name and a digest of its weights, so two adapters that
share a name never share KV). The base model and each adapter have their own
chunks.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmkv.config.model import LMKVConfig, load_config
from lmkv.contracts.connector import KVSpec
from lmkv.engines import Engine, open_engine
from lmkv.integrations.hf_model import cache_to_kv, forward_last, kv_to_cache
from lmkv.keys.chunking import Identity


@dataclass
class PrefillOutput:
    logits: torch.Tensor
    """The last prompt position's logits, ``[1, 1, vocab]`` in the model's dtype: what
    transformers' ``model(input_ids, logits_to_keep=1).logits`` gives (the positions
    before it are loaded or computed without logits)."""
    cache: Any
    """The model's cache after the prompt, ready for decoding."""
    hit_tokens: int
    """Prompt tokens loaded from lmkv instead of computed."""


def kv_spec_of(model: Any) -> KVSpec:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return KVSpec(cfg.num_hidden_layers, kv_heads, head_dim, model.dtype)


#: Hits inside chunks are matched in blocks of this many tokens (``block_size`` in the
#: config overrides it): a prompt that leaves a stored one inside a chunk reuses the
#: chunk's leading blocks. transformers' caches have no blocks; 16 is vLLM's GPU block.
BLOCK_TOKENS = 16


class HFCacheEngine:
    """lmkv's cache engine bound to one transformers model (batch size 1)."""

    def __init__(self, model: Any, config: LMKVConfig | None = None, *,
                 model_name: str | None = None, namespace: str | None = None) -> None:
        self.model = model
        self.namespace = namespace
        self._adapter_digests: dict[str, tuple[list[tuple[Any, int]], str]] = {}
        name = model_name or getattr(model.config, "_name_or_path", "") or model.config.model_type
        self.engine: Engine = open_engine(config or load_config(), kv_spec_of(model),
                                          model_name=name, kv_kind="hf",
                                          block_size=BLOCK_TOKENS)

    def store(self, input_ids: Sequence[int] | torch.Tensor, cache: Any) -> int:
        """Store the KV of ``input_ids``' whole chunks found in ``cache``; returns tokens stored."""
        return self.engine.store(_flat(input_ids), identity=self.identity(),
                                 kv=cache_to_kv(cache))

    def retrieve(self, input_ids: Sequence[int] | torch.Tensor) -> tuple[int, Any]:
        """(hit tokens, a model cache holding them) for the stored prefix of the prompt.

        At least the last prompt token is left to compute, since its logits are needed.
        """
        ids = _flat(input_ids)
        result = self.engine.retrieve(ids[:-1], identity=self.identity(),
                                      device=self.model.device)
        if result.num_tokens == 0:
            return 0, None
        return result.num_tokens, kv_to_cache(result.kv, self.model.config)

    def prefill(self, input_ids: Sequence[int] | torch.Tensor, *,
                store: bool = True) -> PrefillOutput:
        ids = _flat(input_ids)
        hit, cache = self.retrieve(ids)
        logits, cache = forward_last(self.model, ids[hit:], cache)
        if store:
            self.store(ids, cache)
        return PrefillOutput(logits, cache, hit)

    def identity(self) -> Identity | None:
        """What names this engine's chunks besides the tokens, now: the namespace and
        the model's active adapter(s)."""
        adapters = [f"{name}\x00{self._adapter_digest(name)}"
                    for name in _active_adapters(self.model)]
        identity = Identity(salt=self.namespace, adapter="\x01".join(adapters) or None)
        return identity or None

    def _adapter_digest(self, name: str) -> str:
        """sha256 of an adapter's weights. Computed again whenever they may have changed:
        a parameter replaced (the adapter deleted and added again under the same name,
        say) or changed in place (its version counter moved)."""
        params = _adapter_params(self.model, name)
        cached = self._adapter_digests.get(name)
        if cached is not None:
            seen, digest = cached
            if len(seen) == len(params) and all(
                    ref() is param and version == param._version
                    for (ref, version), (_, param) in zip(seen, params, strict=True)):
                return digest
        h = hashlib.sha256()
        for key, param in params:
            h.update(key.encode())
            h.update(param.detach().cpu().contiguous().view(torch.uint8).numpy())
        digest = h.hexdigest()
        self._adapter_digests[name] = ([(weakref.ref(p), p._version) for _, p in params],
                                       digest)
        return digest

    def close(self) -> None:
        self.engine.close()


def _active_adapters(model: Any) -> list[str]:
    """Names of the PEFT adapters that compute ``model``'s KV now (a ``PeftModel``, or a
    transformers model with adapters loaded): what its adapter layers say, so a
    ``disable_adapter()`` block counts as the base model. [] without adapters."""
    if not getattr(model, "peft_config", None):
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer  # present whenever peft_config is
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            if module.disable_adapters:
                return []
            names = module.active_adapters
            return sorted([names] if isinstance(names, str) else names)
    return []


def _adapter_params(model: Any, name: str) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters of adapter ``name`` (PEFT names them ``...lora_A.<name>.weight``)."""
    marker = f".{name}."
    return [(key, param) for key, param in model.named_parameters() if marker in key]


def _flat(input_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"expected one prompt (batch size 1), got shape {tuple(ids.shape)}")
    return ids.cpu()
