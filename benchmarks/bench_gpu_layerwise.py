"""Layerwise overlap on CUDA: a real small model's forward with and without
concurrent layer-by-layer KV loads (docs/benchmarks.md, "Layerwise loads").

Run: ``python benchmarks/bench_gpu_layerwise.py`` (or ``bench_gpu.py``, which
calls ``layerwise_overlap`` as its ``layerwise overlap`` section). Without CUDA
it prints that it needs a GPU and exits 0.

What it does, per load size N (``--load-tokens``, default 2048, 8192, 32768):

* a random-weight Llama (TinyLlama-1.1B's shape by default: 22 layers, hidden
  2048, 32 heads, 4 KV heads of 64, bf16) runs a prefill of ``--new-tokens``
  (default 512) tokens: the forward of a warm request whose prefix was loaded;
* the load: N tokens of that model's KV (every layer) from pinned host memory
  (the pinned arena's chunk buffers, ``[layers, 2, N, kv_heads, head_dim]``)
  into vLLM-layout paged caches (``[2, blocks, 16, kv_heads, head_dim]``, a
  shuffled block table): per layer, a non-blocking host-to-device copy into a
  staging buffer, then a device-side scatter by slot index (what
  ``lmkv_kernels.scatter_blocks`` does for this layout, written inline so that
  no host synchronisation can hide in it; the kernels have their own section
  in bench_gpu.py);
* a model of a layerwise pipeline, written inline here: it does NOT run lmkv's
  code path (lmkv's vLLM worker copies through the paged connector on its
  loader thread, one layer at a time, and opens a layer to the forward once
  that layer's copy event completed; see docs/gpu.md). This model issues every
  layer's copy on a dedicated transfer stream, in layer order, each followed
  by an event;
  a forward pre-hook on decoder layer ``i`` makes the compute stream wait for
  event ``i`` (``wait_event``: no host synchronisation), so layer ``i``
  computes while later layers still copy. Every event is recorded before the
  forward starts (a ``wait_event`` on an event not yet recorded waits for
  nothing).

Figures (medians of ``--repeats``, each a ratio to a baseline of the same run):
``forward`` alone, ``load`` alone, ``sequential`` (the whole load, then the
forward: lmkv's whole-model loads), ``layerwise``; ``slowdown`` =
layerwise / forward (what the concurrent copies cost the forward) and
``hidden`` = (sequential - layerwise) / load (the share of the load time the
forward hid; the target is >= 0.8). The KV the loads write is not what the
forward reads (the HF model computes its own): the figure is the overlap, the
correctness of layerwise loads is tested on CPU (tests/vllm).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

BLOCK = 16  # vLLM's GPU block size


def needs_gpu() -> bool:
    """True (after saying so) when there is no CUDA device."""
    try:
        import torch
    except ImportError:
        print("bench_gpu_layerwise: needs a GPU (torch is not installed); skipped")
        return True
    if not torch.cuda.is_available():
        print("bench_gpu_layerwise: needs a GPU (no CUDA device); skipped")
        return True
    return False


class LayerLoads:
    """N tokens of KV per layer, pinned on the host, and paged caches to load into."""

    def __init__(self, model: Any, tokens: int, dtype: Any, seed: int = 0) -> None:
        import torch

        config = model.config
        self.layers = config.num_hidden_layers
        heads = config.num_key_value_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        blocks = -(-tokens // BLOCK)
        gen = torch.Generator().manual_seed(seed)
        self.host = torch.randn(self.layers, 2, tokens, heads, dim, generator=gen).to(dtype)
        self.host = self.host.pin_memory()
        self.staging = torch.empty(self.host.shape, dtype=dtype, device="cuda")
        spare = blocks + blocks // 4  # caches with more blocks than the load uses
        self.caches = [torch.zeros(2, spare, BLOCK, heads, dim, dtype=dtype, device="cuda")
                       for _ in range(self.layers)]
        table = torch.randperm(spare, generator=gen)[:blocks]
        slots = (table[:, None] * BLOCK + torch.arange(BLOCK)[None, :]).reshape(-1)[:tokens]
        self.slots = slots.to("cuda")
        self.nbytes = self.host.numel() * self.host.element_size()
        self.stream = torch.cuda.Stream()
        self.events = [torch.cuda.Event() for _ in range(self.layers)]

    def copy_layer(self, i: int) -> None:
        """Layer ``i``: host to staging, staging to the paged cache (current stream)."""
        self.staging[i].copy_(self.host[i], non_blocking=True)
        cache = self.caches[i]
        flat = cache.view(2, cache.shape[1] * BLOCK, *cache.shape[3:])
        flat.index_copy_(1, self.slots, self.staging[i])

    def issue(self) -> None:
        """Every layer's copy on the transfer stream, an event after each; returns
        at once. The transfer stream first waits for the compute stream (what ran
        before: the buffers are free)."""
        import torch

        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for i in range(self.layers):
                self.copy_layer(i)
                self.events[i].record(self.stream)

    def load_all(self) -> None:
        for i in range(self.layers):
            self.copy_layer(i)

    def check(self) -> None:
        """The pipeline's copies landed: every layer's cache holds its chunk."""
        import torch

        for i in (0, self.layers - 1):
            flat = self.caches[i].view(2, -1, *self.caches[i].shape[3:])
            got = flat.index_select(1, self.slots).cpu()
            if not torch.equal(got, self.host[i]):
                raise AssertionError(f"layer {i}'s paged cache does not hold its chunk")


def _timed(fn: Callable[[], object], repeats: int) -> list[float]:
    """ms of ``fn`` to a device synchronize, ``repeats`` times after one warm-up."""
    import torch

    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def layerwise_overlap(*, load_tokens: tuple[int, ...] = (2048, 8192, 32768),
                      new_tokens: int = 512, repeats: int = 10, num_layers: int = 22,
                      hidden_size: int = 2048, num_heads: int = 32, num_kv_heads: int = 4,
                      head_dim: int = 64, intermediate_size: int = 5632,
                      dtype_name: str = "bfloat16", report: Callable[[str], None] = print
                      ) -> list[dict[str, float]]:
    """The ``layerwise overlap`` figures, one dict per load size (needs CUDA)."""
    import torch

    from lmkv.integrations.hf_model import build_model

    dtype = getattr(torch, dtype_name)
    model = build_model(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                        num_kv_heads=num_kv_heads, head_dim=head_dim,
                        intermediate_size=intermediate_size, vocab_size=32000,
                        max_position_embeddings=max(4096, new_tokens), dtype=dtype).to("cuda")
    ids = torch.randint(10, 32000, (1, new_tokens), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    decoder_layers = model.model.layers
    waits: list[Any] = []  # the events the hooks wait for; empty: no waits

    def hook(index: int) -> Callable[..., None]:
        def wait(module: Any, args: Any) -> None:
            if waits:
                torch.cuda.current_stream().wait_event(waits[index])
        return wait

    handles = [layer.register_forward_pre_hook(hook(i)) for i, layer in enumerate(decoder_layers)]

    @torch.inference_mode()
    def forward() -> None:
        model(input_ids=ids, use_cache=False)

    rows = []
    try:
        report(f"layerwise overlap: {num_layers}-layer Llama ({hidden_size} hidden, "
               f"{num_kv_heads}x{head_dim} KV heads, {dtype_name}), forward of {new_tokens} "
               f"tokens; loads host (pinned) -> paged caches; median of {repeats} (ms)")
        report(f"{'load tok':>9}{'MiB':>8}{'forward':>9}{'load':>8}{'seq':>8}{'layerw':>8}"
               f"{'slowdn':>8}{'hidden':>8}")
        for n in load_tokens:
            loads = LayerLoads(model, n, dtype)

            def layerwise(loads: LayerLoads = loads) -> None:
                loads.issue()
                waits[:] = loads.events
                try:
                    forward()
                finally:
                    waits.clear()

            def sequential(loads: LayerLoads = loads) -> None:
                loads.load_all()
                forward()

            med = statistics.median
            t_fwd = med(_timed(forward, repeats))
            t_load = med(_timed(loads.load_all, repeats))
            t_seq = med(_timed(sequential, repeats))
            for cache in loads.caches:
                cache.zero_()
            t_lw = med(_timed(layerwise, repeats))
            loads.check()
            row = {"load_tokens": n, "mib": loads.nbytes / 2**20, "forward_ms": t_fwd,
                   "load_ms": t_load, "sequential_ms": t_seq, "layerwise_ms": t_lw,
                   "slowdown": t_lw / t_fwd, "hidden": (t_seq - t_lw) / t_load,
                   "load_gbps": loads.nbytes / t_load / 1e6}
            rows.append(row)
            report(f"{n:>9}{row['mib']:>8.0f}{t_fwd:>9.2f}{t_load:>8.2f}{t_seq:>8.2f}"
                   f"{t_lw:>8.2f}{row['slowdown']:>8.2f}{row['hidden']:>8.0%}"
                   f"   (load {row['load_gbps']:.1f} GB/s)")
            del loads
            torch.cuda.empty_cache()
        missed = [r["load_tokens"] for r in rows if r["hidden"] < 0.8]
        report("target (>= 80% of the load hidden): "
               + ("met" if not missed else f"missed at {missed} tokens"))
    finally:
        for handle in handles:
            handle.remove()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--load-tokens", default="2048,8192,32768")
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        default="bfloat16")
    args = parser.parse_args(argv)
    if needs_gpu():
        return 0
    layerwise_overlap(load_tokens=tuple(int(x) for x in args.load_tokens.split(",")),
                      new_tokens=args.new_tokens, repeats=args.repeats, dtype_name=args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
