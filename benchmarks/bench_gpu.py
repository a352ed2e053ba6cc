"""lmkv's GPU path on a CUDA device, every figure a ratio to a baseline measured in the same run.

Sections (``--sections``, default all):

- ``transfer``: store (``PagedConnector.to_chunks``: paged caches to chunk
  buffers in one pinned host arena) and load (``from_chunks``: back) of 2048 /
  8192 / 32768 tokens of Llama-3-8B-shaped KV (32 layers, 8 KV heads, head size
  128, bf16: 128 KiB a token) in the flash layout and in vLLM 0.32's GPU page
  (``PAGES``), 16-token blocks, a shuffled block table, 256-token chunks;
  against ``torch`` ``copy_`` of the same bytes between one contiguous device
  tensor and pinned host memory (the PCIe/NVLink limit). Ratio = pinned copy
  time / lmkv time (target >= 0.9 at 8192 tokens and more), for the Triton
  kernels and for the torch reference.
- ``kernels``: the Triton kernels (``lmkv_kernels.triton_impl``) against the
  torch reference (``lmkv_kernels.torch_ref``), both device to device (chunk
  buffers on the GPU: only the copies count), every layout and vLLM 0.32's GPU
  page, bf16 and fp8, a shuffled block table; checked bit for bit before they
  are timed. Ratio = reference time / Triton time (target >= 1.5).
- ``layerwise``: forward time of a small model with and without concurrent
  layer-by-layer loads (``bench_gpu_layerwise.py``).

Timing: CUDA events around each call on the current stream, after warm-up
calls, median of ``--iters``; every call ends synchronized (the connector
synchronizes its stream; the copies here are followed by an event wait).

Without CUDA it says it needs a GPU and exits 0. ``--dry-run`` runs every
section on CPU tensors at toy sizes (the Triton kernels under
``TRITON_INTERPRET=1``) with wall-clock timing, to check the script itself
where no GPU is; its figures mean nothing.

    python benchmarks/bench_gpu.py                       # on a GPU machine
    python benchmarks/bench_gpu.py --sections kernels --iters 50
    python benchmarks/bench_gpu.py --dry-run             # anywhere: the script runs
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lmkv.contracts.connector import KVSpec

# Llama-3-8B: 32 layers, 8 KV heads (GQA), head size 128.
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
BLOCK = 16  # vLLM's default block size
CHUNK = 256  # lmkv's default chunk size
TRANSFER_TOKENS = (2048, 8192, 32768)
#: The paged caches measured: lmkv_kernels' layouts, and ``vllm``: vLLM 0.32's
#: GPU page, the cpu layout's ``[B, H, N, 2D]`` as a view of ``[B, N, H, 2D]``
#: memory (what its FlashAttention backend allocates).
PAGES = ("flash", "vllm")


@dataclass(frozen=True)
class Run:
    """Where and how long to measure."""

    device: torch.device
    iters: int
    warmup: int
    dry: bool

    def time_ms(self, fn: Callable[[], object]) -> float:
        """Median milliseconds of ``fn`` (CUDA events on a GPU; wall clock in a dry run)."""
        for _ in range(self.warmup):
            fn()
        times = []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            for _ in range(self.iters):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
        else:
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def host(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of host memory, pinned where there is a GPU."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def shuffled_table(blocks: int, num_blocks: int, seed: int = 0) -> list[int]:
    return random.Random(seed).sample(range(num_blocks), blocks)


# -- transfer: store and load against the pinned-copy limit -------------------------------------

def transfer_section(run: Run, token_counts: tuple[int, ...], layers: int, heads: int,
                     head_dim: int) -> None:
    from lmkv.contracts.connector import KVSpec

    spec = KVSpec(layers, heads, head_dim, torch.bfloat16)
    print(f"\n== transfer: {layers} layers x {heads} KV heads x {head_dim}, {spec.dtype}, "
          f"{spec.chunk_nbytes(1)} bytes a token; {BLOCK}-token blocks (shuffled), "
          f"{CHUNK}-token chunks in one pinned arena ==")
    print("   ratio = torch copy_ time (contiguous device <-> pinned host) / lmkv time; "
          "target >= 0.9 at 8192 tokens and more")
    for page in PAGES:
        for tokens in token_counts:
            transfer_one(run, spec, tokens, page)
            if run.device.type == "cuda":
                torch.cuda.empty_cache()


def paged_caches(page: str, layers: int, num_blocks: int, heads: int, dim: int,
                 dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Random bits in ``page`` form (``PAGES``), one tensor per layer."""
    from lmkv_kernels.layouts import shape_of

    layout = "cpu" if page == "vllm" else page
    shape = shape_of(layout, num_blocks, BLOCK, heads, dim)
    if page == "vllm":  # [B, N, H, 2D] in memory, seen as [B, H, N, 2D]
        shape = (shape[0], shape[2], shape[1], shape[3])
    caches = [torch.randint(0, 256, (*shape, dtype.itemsize), dtype=torch.uint8,
                            device=device).view(dtype).view(shape) for _ in range(layers)]
    return [c.transpose(1, 2) for c in caches] if page == "vllm" else caches


def transfer_one(run: Run, spec: KVSpec, tokens: int, page: str) -> None:
    from lmkv.contracts.connector import ChunkSpan, ConnectorContext
    from lmkv_backends.connectors.paged import PagedConnector

    dtype = spec.dtype
    blocks = -(-tokens // BLOCK)
    num_blocks = blocks + blocks // 2 + 1  # room for the table to spread out
    caches = paged_caches(page, spec.num_layers, num_blocks, spec.num_kv_heads,
                          spec.head_dim, dtype, run.device)
    table = shuffled_table(blocks, num_blocks)
    nbytes = spec.chunk_nbytes(tokens)
    arena = run.host(nbytes)
    spans, offset = [], 0
    for start in range(0, tokens, CHUNK):
        n = min(CHUNK, tokens - start)
        size = spec.chunk_nbytes(n)
        spans.append(ChunkSpan(start, start + n, arena[offset:offset + size].view(dtype)
                               .view(spec.chunk_shape(n))))
        offset += size
    device_flat = torch.empty(nbytes, dtype=torch.uint8, device=run.device)
    d2h_ms = run.time_ms(lambda: arena.copy_(device_flat, non_blocking=True))
    h2d_ms = run.time_ms(lambda: device_flat.copy_(arena, non_blocking=True))
    print(f"  {page} page, {tokens} tokens, {nbytes / (1 << 20):.0f} MiB: pinned copy "
          f"D2H {gbps(nbytes, d2h_ms):.1f} GB/s, H2D {gbps(nbytes, h2d_ms):.1f} GB/s")
    for kernels in ("triton", "torch"):
        conn = PagedConnector({"kernels": kernels, "layout": "cpu" if page == "vllm"
                               else page}, ConnectorContext(spec))
        store_ms = run.time_ms(lambda c=conn: c.to_chunks(spans, kv_caches=caches,
                                                          block_ids=table))
        load_ms = run.time_ms(lambda c=conn: c.from_chunks(spans, kv_caches=caches,
                                                           block_ids=table))
        print(f"    {kernels:6s}: store {gbps(nbytes, store_ms):6.1f} GB/s "
              f"({d2h_ms / store_ms:.2f})  load {gbps(nbytes, load_ms):6.1f} GB/s "
              f"({h2d_ms / load_ms:.2f})")


# -- kernels: Triton against the torch reference, device to device ------------------------------

def kernels_section(run: Run, tokens: int, layers: int, heads: int, head_dim: int,
                    latent: int) -> bool:
    """True when every Triton copy matched the reference bit for bit."""
    from lmkv_kernels.layouts import LAYOUTS

    print(f"\n== kernels: Triton against the torch reference, {tokens} tokens, "
          f"{layers} layers, {BLOCK}-token blocks (shuffled), {CHUNK}-token chunks on "
          "the device ==")
    print("   ratio = reference time / Triton time; target >= 1.5")
    ok = True
    for page in (*LAYOUTS, "vllm"):
        h, d = (1, latent) if page == "mla" else (heads, head_dim)
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            ok = kernels_one(run, page, dtype, tokens, layers, h, d) and ok
    return ok


def kernels_one(run: Run, page: str, dtype: torch.dtype, tokens: int, layers: int,
                heads: int, dim: int) -> bool:
    from lmkv_kernels import torch_ref, triton_impl
    from lmkv_kernels.layouts import planes_of

    blocks = -(-tokens // BLOCK)
    num_blocks = 2 * blocks
    table = shuffled_table(blocks, num_blocks, seed=1)
    caches = paged_caches(page, layers, num_blocks, heads, dim, dtype, run.device)
    layout = "cpu" if page == "vllm" else page
    planes = planes_of(layout)

    def buffers() -> list[tuple[int, torch.Tensor]]:
        return [(s, torch.zeros(layers, planes, min(CHUNK, tokens - s), heads, dim,
                                dtype=dtype, device=run.device))
                for s in range(0, tokens, CHUNK)]

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                   for x, y in zip(a, b, strict=True))

    ref, tri = buffers(), buffers()
    torch_ref.gather_blocks(caches, table, ref, layout)
    triton_impl.gather_blocks(caches, table, tri, layout)
    back_ref = [torch.zeros_like(c) for c in caches]
    back_tri = [torch.zeros_like(c) for c in caches]
    torch_ref.scatter_blocks(back_ref, table, ref, 0, layout)
    triton_impl.scatter_blocks(back_tri, table, ref, 0, layout)
    if not (same([b for _, b in ref], [b for _, b in tri]) and same(back_ref, back_tri)):
        print(f"  {page:10s} {dtype!s:22s}: MISMATCH between Triton and the reference "
              "(not timed)")
        return False
    nbytes = sum(buf.numel() * buf.element_size() for _, buf in ref)
    g_ref, g_tri = (run.time_ms(lambda f=f: f(caches, table, tri, layout))
                    for f in (torch_ref.gather_blocks, triton_impl.gather_blocks))
    s_ref, s_tri = (run.time_ms(lambda f=f: f(back_tri, table, ref, 0, layout))
                    for f in (torch_ref.scatter_blocks, triton_impl.scatter_blocks))
    print(f"  {page:10s} {dtype!s:22s}: gather ref {g_ref:7.3f} ms, triton "
          f"{g_tri:7.3f} ms ({gbps(nbytes, g_tri):6.0f} GB/s) {g_ref / g_tri:5.2f}x | "
          f"scatter ref {s_ref:7.3f} ms, triton {s_tri:7.3f} ms "
          f"({gbps(nbytes, s_tri):6.0f} GB/s) {s_ref / s_tri:5.2f}x")
    return True


# -- layerwise: forward time with and without concurrent loads ---------------------------------

def layerwise_section(run: Run) -> None:
    """The forward time of a real small model with and without concurrent
    layer-by-layer loads on a transfer stream (target: the loads hide >= 80% of
    their time behind the forward): ``bench_gpu_layerwise.layerwise_overlap``,
    every figure against the forward alone and the load alone of the same run."""
    if run.dry:
        print("\n== layerwise: needs CUDA streams (not run in a dry run) ==")
        return
    from bench_gpu_layerwise import layerwise_overlap

    print("\n== layerwise ==")
    layerwise_overlap()


SECTIONS = ("transfer", "kernels", "layerwise")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--iters", type=int, default=20, help="timed calls per figure")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first")
    parser.add_argument("--kernel-tokens", type=int, default=8192,
                        help="tokens of the kernels section")
    parser.add_argument("--dry-run", action="store_true",
                        help="toy sizes on CPU tensors, Triton interpreted: checks the "
                             "script, measures nothing")
    args = parser.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before lmkv_kernels.triton_impl is imported
        run = Run(torch.device("cpu"), iters=1, warmup=0, dry=True)
        shapes = dict(layers=2, heads=2, head_dim=8)
        transfer_tokens, kernel_tokens, latent = (40, 300), 300, 24
        print("dry run: CPU tensors, toy sizes, Triton interpreted; the figures mean nothing")
    else:
        if not torch.cuda.is_available():
            print("bench_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False): "
                  "nothing measured. (--dry-run checks the script on the CPU.)")
            return 0
        run = Run(torch.device("cuda"), iters=args.iters, warmup=args.warmup, dry=False)
        shapes = dict(layers=LAYERS, heads=KV_HEADS, head_dim=HEAD_DIM)
        transfer_tokens, kernel_tokens, latent = TRANSFER_TOKENS, args.kernel_tokens, 576
        print(f"device: {torch.cuda.get_device_name(run.device)}, torch {torch.__version__}")
    ok = True
    if "transfer" in args.sections:
        transfer_section(run, transfer_tokens, **shapes)
    if "kernels" in args.sections:
        ok = kernels_section(run, kernel_tokens, latent=latent, **shapes)
    if "layerwise" in args.sections:
        layerwise_section(run)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
