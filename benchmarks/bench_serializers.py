"""Serializers on real KV: frame size, speed, and the lossy one's error.

Builds the demo model (random-weight Llama, built locally), computes the KV
of a real prompt, and for each serializer reports the frame size against the
raw bytes, encode/decode throughput against a plain copy of the same bytes,
and for ``int8`` the max abs error, relative L2 error and whether greedy
generation changes when the prompt's prefix KV goes through it.

    python benchmarks/bench_serializers.py [--preset tiny|default] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse

import torch
from _timing import best_of

from lmkv.contracts.connector import ChunkSpan, ConnectorContext
from lmkv.integrations import hf_model
from lmkv.integrations.transformers import kv_spec_of
from lmkv.keys.chunking import CacheKey, KeyMeta
from lmkv.memory import MemoryAllocator, tensor_obj
from lmkv_backends.connectors.hf import HFConnector
from lmkv_backends.serde.int8 import Int8Serializer
from lmkv_backends.serde.naive import NaiveSerializer
from lmkv_backends.serde.zstd import ZstdSerializer

CHUNK = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="default", choices=["tiny", "default"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prefix", type=int, default=1792)
    parser.add_argument("--suffix", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    tokenizer = hf_model.build_tokenizer()
    model = hf_model.build_preset(args.preset, dtype=dtype)
    prompt = hf_model.synthetic_prompts(tokenizer, 1, args.prefix, args.suffix)[0]
    full_logits, full_cache = hf_model.prefill(model, prompt)
    ref_tokens = hf_model.greedy_generate(model, full_logits, full_cache, args.new_tokens)

    _, cache = hf_model.prefill(model, prompt[:args.prefix])
    kv = hf_model.cache_to_kv(cache)
    spec = kv_spec_of(model)
    connector = HFConnector(None, ConnectorContext(spec))
    n_chunks = args.prefix // CHUNK
    spans = [ChunkSpan(i * CHUNK, (i + 1) * CHUNK, torch.empty(spec.chunk_shape(CHUNK),
                                                               dtype=dtype))
             for i in range(n_chunks)]
    connector.to_chunks(spans, kv=kv)
    objs = [tensor_obj(s.buffer) for s in spans]
    keys = [CacheKey(KeyMeta("bench"), i.to_bytes(32, "little")) for i in range(len(objs))]
    raw_bytes = sum(o.nbytes for o in objs)
    arena = MemoryAllocator(raw_bytes * 2 + (1 << 20))
    dst = [torch.empty_like(s.buffer) for s in spans]
    copy_t = best_of(lambda: [d.copy_(o.tensor) for d, o in zip(dst, objs, strict=True)], 3)

    print(f"{args.preset} model, {args.dtype}, {n_chunks} chunks of {CHUNK} tokens "
          f"({raw_bytes / 2**20:.1f} MiB of KV); plain copy {raw_bytes / copy_t / 1e9:.2f} GB/s")
    for ser in (NaiveSerializer(), ZstdSerializer(), ZstdSerializer({"shuffle": False}),
                Int8Serializer(), Int8Serializer({"granularity": "channel"})):
        opts = ",".join(f"{k}={v}" for k, v in ser.options.model_dump().items())
        label = f"{ser.name}({opts})" if opts else ser.name
        frames = [ser.frame_bytes(o, k) for o, k in zip(objs, keys, strict=True)]
        size = sum(len(f) for f in frames)
        enc = best_of(lambda s=ser: [s.serialize(o, k) for o, k in zip(objs, keys, strict=True)],
                      3)

        def decode(s=ser, fr=frames) -> list:
            out = [s.deserialize(f, arena.allocate, k) for f, k in zip(fr, keys, strict=True)]
            for o in out:
                o.ref_down()
            return out

        dec = best_of(decode, 3)
        decoded = [ser.deserialize(f, arena.allocate, k) for f, k in zip(frames, keys,
                                                                          strict=True)]
        x = torch.stack([o.tensor.float() for o in objs])
        y = torch.stack([o.tensor.float() for o in decoded])
        max_abs = float((x - y).abs().max())
        rel_l2 = float((x - y).norm() / x.norm())
        # greedy generation with the prefix KV taken from the decoded frames
        rebuilt = connector.from_chunks([ChunkSpan(s.start, s.end, o.tensor)
                                         for s, o in zip(spans, decoded, strict=True)])
        for o in decoded:
            o.ref_down()
        logits, c = hf_model.prefill(model, prompt[n_chunks * CHUNK:],
                                     hf_model.kv_to_cache(rebuilt, model.config))
        tokens = hf_model.greedy_generate(model, logits, c, args.new_tokens)
        same = sum(a == b for a, b in zip(tokens, ref_tokens, strict=True))
        print(f"  {label:34s} size {size / raw_bytes:5.3f}  encode {raw_bytes / enc / 1e9:5.2f} "
              f"GB/s ({copy_t / enc:4.2f}x copy)  decode {raw_bytes / dec / 1e9:5.2f} GB/s  "
              f"max|err| {max_abs:.3g}  rel L2 {rel_l2:.2e}  logits max|diff| "
              f"{float((logits - full_logits).abs().max()):.3g}  greedy {same}/{len(tokens)} "
              "same")


if __name__ == "__main__":
    main()
