"""Identity against vLLM 0.32's own block hashes, with real ``Request`` objects.

Runs in the vLLM venv (``.venv-vllm/bin/python -m pytest tests/vllm``, a step of
.ci/run); skipped where vLLM is not installed. For pairs of requests with the same
token ids, lmkv's chunk keys must be equal exactly where vLLM's prefix-cache
block hashes are: same adapter, salt, images and embeddings share KV, anything
else never does.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from lmkv.base.errors import ConfigError
from lmkv.integrations.vllm.identity import check_kv_cache_groups, request_identity
from lmkv.keys.chunking import prefix_hashes

pytestmark = pytest.mark.vllm

BLOCK = 16  # vLLM's block size here
CHUNK = 32  # lmkv's chunk: two blocks
TOKENS = list(range(500, 628))  # 4 chunks, 8 blocks
EMBEDS = torch.randn(len(TOKENS), 8, generator=torch.Generator().manual_seed(0))

init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK, sha256)


def image(identifier: str, offset: int, length: int = 20) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


VARIANTS = {
    "plain": {},
    "salt a": {"cache_salt": "tenant-a"},
    "salt b": {"cache_salt": "tenant-b"},
    "lora 1": {"lora_request": LoRARequest("sql", 1, "/adapters/sql")},
    "lora 1 elsewhere": {"lora_request": LoRARequest("sql", 1, "/adapters/sql-v2")},
    "lora 2": {"lora_request": LoRARequest("chat", 2, "/adapters/chat")},
    "image x at 40": {"mm_features": [image("x", 40)]},
    "image y at 40": {"mm_features": [image("y", 40)]},
    "image x at 44": {"mm_features": [image("x", 44)]},
    "images x, y": {"mm_features": [image("x", 40), image("y", 70, 30)]},
    "embeds": {"prompt_embeds": EMBEDS},
    "other embeds": {"prompt_embeds": EMBEDS + 1},
    "salt a + lora 1": {"cache_salt": "tenant-a",
                        "lora_request": LoRARequest("sql", 1, "/adapters/sql")},
}


def request(name: str) -> Request:
    return Request(f"req-{name}", list(TOKENS), SamplingParams(max_tokens=1), None,
                   block_hasher=HASHER, **VARIANTS[name])


def lmkv_hashes(req: Request) -> list[bytes]:
    return prefix_hashes(TOKENS, CHUNK, identity=request_identity(req, CHUNK))


@pytest.mark.parametrize(("a", "b"), list(itertools.combinations(VARIANTS, 2)))
def test_chunks_are_shared_exactly_where_vllms_blocks_are(a: str, b: str) -> None:
    ra, rb = request(a), request(b)
    assert len(ra.block_hashes) == len(TOKENS) // BLOCK
    la, lb = lmkv_hashes(ra), lmkv_hashes(rb)
    per_chunk = CHUNK // BLOCK
    for i in range(len(la)):
        vllm_same = ra.block_hashes[(i + 1) * per_chunk - 1] == rb.block_hashes[
            (i + 1) * per_chunk - 1]
        assert (la[i] == lb[i]) == vllm_same, f"chunk {i}: {a} vs {b}"


def test_a_request_without_extras_has_plain_keys() -> None:
    assert request_identity(request("plain"), CHUNK) is None
    assert lmkv_hashes(request("plain")) == prefix_hashes(TOKENS, CHUNK)


def test_identity_survives_the_trip_to_the_workers() -> None:
    """Load and store plans are pickled to the workers: the identity must come back equal."""
    import pickle

    from lmkv.integrations.vllm.specs import LoadSpec
    for name in VARIANTS:
        identity = request_identity(request(name), CHUNK)
        spec = pickle.loads(pickle.dumps(LoadSpec("r", TOKENS, [1], identity=identity)))
        assert spec.identity == identity


def _config(*kinds: type) -> SimpleNamespace:
    """A KV cache config with one group per kind (vLLM's own spec classes)."""
    groups = [SimpleNamespace(kv_cache_spec=kind.__new__(kind)) for kind in kinds]
    return SimpleNamespace(kv_cache_groups=groups)


def test_hybrid_models_are_refused_at_start_with_one_line() -> None:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )
    served = (FullAttentionSpec, MLAAttentionSpec)
    check_kv_cache_groups(_config(FullAttentionSpec), "llama", served)
    check_kv_cache_groups(_config(MLAAttentionSpec), "deepseek", served)  # one latent a token
    for kinds in ((FullAttentionSpec, SlidingWindowSpec), (MambaSpec,),
                  (FullAttentionSpec, MambaSpec), (SlidingWindowSpec,),
                  (MLAAttentionSpec, MLAAttentionSpec)):
        with pytest.raises(ConfigError) as err:
            check_kv_cache_groups(_config(*kinds), "org/hybrid-7b", served)
        message = str(err.value)
        assert "\n" not in message and "org/hybrid-7b" in message
        assert all(kind.__name__ in message for kind in kinds)



def test_mla_pages_of_packed_or_compressed_states_are_refused() -> None:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    for field, value in (("tokens_per_state", 4), ("state_content_bytes", 656)):
        config = _config(MLAAttentionSpec)
        object.__setattr__(config.kv_cache_groups[0].kv_cache_spec, field, value)
        with pytest.raises(ConfigError, match=f"packs or compresses tokens.*{value}") as err:
            check_kv_cache_groups(config, "deepseek-v4", (MLAAttentionSpec,))
        assert "\n" not in str(err.value)
