"""What vLLM's block hash keys on besides token ids, as an lmkv ``Identity``.

vLLM's prefix cache keys each block on its LoRA adapter (name and path), the
request's ``cache_salt`` (first block), the multimodal inputs whose
placeholders the block overlaps (their identifier and offset in the block) and
the digest of the block's prompt embeddings (``kv_cache_utils``'s block-hash
extra keys). lmkv keys its chunks on the same things, at its own chunk
granularity, so a request never loads KV computed for another adapter, tenant,
image or embedding. No vLLM import here: it reads ``Request`` attributes.

Also the start-up check that lmkv can serve the model's KV cache layout.
"""

from __future__ import annotations

from typing import Any

from lmkv.base.errors import ConfigError
from lmkv.keys.chunking import Identity, MMInput


def request_identity(request: Any, chunk_size: int) -> Identity | None:
    """The identity of a vLLM ``Request`` (None when it has none: plain keys)."""
    lora = getattr(request, "lora_request", None)
    adapter = None
    if lora is not None:
        adapter = f"{lora.lora_name}\x00{getattr(lora, 'lora_path', '') or ''}"
    mm = tuple(MMInput(str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length))
               for f in getattr(request, "mm_features", None) or ())
    identity = Identity(salt=getattr(request, "cache_salt", None) or None, adapter=adapter,
                        mm=mm)
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is not None:
        identity = identity.with_embeddings(embeds, chunk_size)
    return identity or None


def check_kv_cache_groups(kv_cache_config: Any, model: str,
                          served: type | tuple[type, ...]) -> None:
    """ConfigError unless the model's KV cache is one group of a ``served`` kind
    (exactly: vLLM's ``FullAttentionSpec`` or ``MLAAttentionSpec``): the only
    layouts whose every block lmkv can store and load (sliding-window, Mamba and
    mixed models keep other state)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        return  # vLLM gave no KV cache config to this role: nothing to check
    kinds = [type(group.kv_cache_spec).__name__ for group in groups]
    served = served if isinstance(served, tuple) else (served,)
    if len(groups) != 1 or type(groups[0].kv_cache_spec) not in served:
        names = " or ".join(kind.__name__ for kind in served)
        raise ConfigError(f"lmkv cannot serve model {model!r}: its KV cache has "
                          f"{len(kinds)} group(s) ({', '.join(kinds)}); lmkv stores one "
                          f"group of full attention ({names}) only")
    spec = groups[0].kv_cache_spec
    # A page of packed or compressed states (DeepSeek's sparse MLA) is not one
    # vector per token and head: lmkv's copies would misplace it.
    if (getattr(spec, "tokens_per_state", 1) != 1
            or getattr(spec, "state_content_bytes", None) is not None):
        raise ConfigError(f"lmkv cannot serve model {model!r}: its KV cache packs or "
                          "compresses tokens (tokens_per_state "
                          f"{getattr(spec, 'tokens_per_state', 1)}, state_content_bytes "
                          f"{getattr(spec, 'state_content_bytes', None)}); lmkv stores one "
                          "vector per token and head")
