"""A request gets its own KV or a miss: identity (salt, adapter, multimodal inputs,
prompt embeddings) and KV geometry keep chunks with the same token ids apart."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
import torch

from lmkv import KVSpec, load_config
from lmkv.engines.local import LocalEngine
from lmkv.keys.chunking import Identity, MMInput, prefix_hashes
from lmkv.memory import tensor_obj
from lmkv.testing.engines import open_local_engine
from tests.keys.test_chunking import reference_hashes

CHUNK = 32
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16)
TOKENS = list(range(1000, 1100))  # 3 whole chunks and a partial one


def hf_kv(total: int, spec: KVSpec = SPEC, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (1, spec.num_kv_heads, total, spec.head_dim)
    return [(torch.randn(shape, generator=gen).to(spec.dtype),
             torch.randn(shape, generator=gen).to(spec.dtype)) for _ in range(spec.num_layers)]


def engine(spec: KVSpec = SPEC, **overrides) -> LocalEngine:
    config = load_config(env={}, overrides={"lmkv.chunk_size": CHUNK, **overrides})
    return open_local_engine(config, spec, model_name="identity-test")


IDENTITIES = {
    "salt": Identity(salt="tenant-a"),
    "other salt": Identity(salt="tenant-b"),
    "adapter": Identity(adapter="sql-lora@/adapters/sql"),
    "other adapter": Identity(adapter="chat-lora@/adapters/chat"),
    "image": Identity(mm=(MMInput("img-1", 40, 20),)),
    "other image": Identity(mm=(MMInput("img-2", 40, 20),)),
    "image elsewhere": Identity(mm=(MMInput("img-1", 44, 20),)),
    "embeds": Identity().with_embeddings(torch.ones(100, 8), CHUNK),
    "other embeds": Identity().with_embeddings(torch.zeros(100, 8), CHUNK),
}


def test_no_identity_keeps_todays_keys() -> None:
    assert prefix_hashes(TOKENS, CHUNK, identity=Identity()) == reference_hashes(TOKENS, CHUNK)
    assert prefix_hashes(TOKENS, CHUNK, identity=None) == reference_hashes(TOKENS, CHUNK)


def test_every_identity_names_other_chunks() -> None:
    plain = prefix_hashes(TOKENS, CHUNK)
    seen = {tuple(plain)}
    for name, identity in IDENTITIES.items():
        hashes = prefix_hashes(TOKENS, CHUNK, identity=identity)
        assert len(hashes) == len(plain)
        assert tuple(hashes) not in seen, name
        seen.add(tuple(hashes))
        assert hashes == prefix_hashes(TOKENS, CHUNK, identity=identity)  # deterministic


def test_salt_seeds_the_chain_and_adapter_enters_every_chunk() -> None:
    plain = prefix_hashes(TOKENS, CHUNK)
    salted = prefix_hashes(TOKENS, CHUNK, identity=IDENTITIES["salt"])
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    # A multimodal input changes the chunks it overlaps and, through the chain, the rest.
    image = prefix_hashes(TOKENS, CHUNK, identity=IDENTITIES["image"])
    assert image[0] == plain[0] and image[1] != plain[1] and image[2] != plain[2]


def test_hashes_are_stable_across_runs() -> None:
    """Golden values: a change here orphans every stored chunk with an identity."""
    digest = hashlib.sha256(b"".join(
        prefix_hashes(TOKENS, CHUNK, True, IDENTITIES[name])[-1] for name in
        ("salt", "adapter", "image", "embeds"))).hexdigest()
    assert digest == GOLDEN, digest


GOLDEN = "ef446099bdd8c4b253a1136be9debc567a5432f04f3bb5f961eaeb6841f8d580"


def test_partial_chunks_cannot_collide_with_a_crafted_prompt() -> None:
    """A prompt whose first chunk is another prompt's chain state plus its partial
    tail must not name that tail (the ambiguity of a plain sha256(prev || tokens))."""
    chunk0 = prefix_hashes(TOKENS[:CHUNK], CHUNK)[0]
    tail = TOKENS[CHUNK:CHUNK + 10]
    crafted = [int.from_bytes(chunk0[i:i + 4], "little") for i in range(0, 32, 4)] + tail
    victim = prefix_hashes(TOKENS[:CHUNK + 10], CHUNK, keep_partial=True)[-1]
    assert prefix_hashes(crafted, CHUNK, keep_partial=True)[0] != victim


@pytest.mark.parametrize("name", [n for n in IDENTITIES if not n.startswith("other")])
def test_equal_tokens_under_another_identity_never_hit(name: str) -> None:
    identity = IDENTITIES[name]
    with engine() as e:
        kv = hf_kv(100)
        assert e.store(TOKENS, kv=kv, identity=identity) == 96
        assert e.lookup(TOKENS, identity=identity) == 96
        mine = prefix_hashes(TOKENS, CHUNK, identity=identity)
        for other in [None, *IDENTITIES.values()]:
            if other == identity:
                continue
            theirs = prefix_hashes(TOKENS, CHUNK, identity=other)
            shared = next(i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b)
            # Only chunks whose KV is the same (before an image, say) may be shared.
            assert shared < 3 and e.lookup(TOKENS, identity=other) == shared * CHUNK
            assert e.retrieve(TOKENS, identity=other).num_tokens == shared * CHUNK
        result = e.retrieve(TOKENS, identity=identity)
        assert result.num_tokens == 96
        assert torch.equal(result.kv[0][0][0], kv[0][0][0, :, :96])


def test_engines_of_other_geometry_under_one_model_name_never_share(tmp_path: Path) -> None:
    """Two engines with one model_name and different KV heads over one disk tier."""
    tiers = [{"type": "fs", "options": {"url": str(tmp_path), "max_bytes": "64MiB"}}]
    wide = KVSpec(num_layers=2, num_kv_heads=4, head_dim=16, dtype=torch.float16)
    with engine(wide, **{"lmkv.tiers": tiers}) as a:
        assert a.store(TOKENS, kv=hf_kv(100, wide)) == 96
        assert settled(lambda: a.lookup(TOKENS) == 96)  # written in the background
    with engine(SPEC, **{"lmkv.tiers": tiers}) as b:
        assert b.lookup(TOKENS) == 0
        assert b.retrieve(TOKENS).num_tokens == 0
        assert b.store(TOKENS, kv=hf_kv(100)) == 96  # its own chunks, beside a's
        assert settled(lambda: b.lookup(TOKENS) == 96)
        assert b.retrieve(TOKENS).num_tokens == 96
    assert len(list(tmp_path.iterdir())) == 6


def settled(condition, deadline_s: float = 30.0) -> bool:
    deadline = time.monotonic() + deadline_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


@pytest.mark.parametrize("connector", ["hf", "paged"])
def test_a_chunk_of_the_wrong_shape_or_dtype_is_a_counted_miss(connector: str) -> None:
    """Whatever a tier hands back under the right key, the engine checks it first."""
    overrides = {} if connector == "hf" else {
        "lmkv.gpu_connector": "paged"}
    with engine(**overrides) as e:
        keys = e.chunker.chunk(TOKENS).keys
        good = tensor_obj(torch.zeros(SPEC.chunk_shape(CHUNK), dtype=SPEC.dtype))
        wrong = [tensor_obj(torch.zeros(2, 2, CHUNK, 4, 16, dtype=SPEC.dtype)),  # heads
                 tensor_obj(torch.zeros(SPEC.chunk_shape(CHUNK), dtype=torch.float32))]
        e.storage.put(keys[:3], [good, *wrong])
        if connector == "hf":
            result = e.retrieve(TOKENS)
        else:
            caches = [torch.zeros(8, 2, 16, 32).half() for _ in range(2)]
            result = e.retrieve(TOKENS, kv_caches=caches, block_ids=list(range(7)))
        assert result.num_tokens == CHUNK
        assert e.counters.spec_mismatches == 1
        # the misfit is removed and counted as corrupt; nothing leaked, nothing held
        assert e.storage.stats()[0]["entries"] == 2
        assert e.storage.stats()[0]["corrupt_frames"] == 1
        for obj in (good, *wrong):
            assert obj.ref_count == 1
