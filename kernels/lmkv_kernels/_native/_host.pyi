from collections.abc import Sequence

def copy_blocks(into_caches: bool, caches: Sequence[int], cache_bytes: int,
                cache_strides: tuple[int, int, int], num_blocks: int, heads: int, row: int,
                block_size: int, block_ids: Sequence[int],
                chunks: Sequence[tuple[int, int, tuple[int, int, int], int, int, int]],
                threads: int, cpus: Sequence[int] | None) -> None:
    """Copy token rows between per-layer paged caches and chunk buffers (host.c)."""

def copy_checked(caches: Sequence[int], cache_bytes: int,
                 cache_strides: tuple[int, int, int], num_blocks: int, heads: int, row: int,
                 block_size: int, block_ids: Sequence[int],
                 chunks: Sequence[tuple[int, int, tuple[int, int, int], int, int, int, int,
                                        int]],
                 threads: int, cpus: Sequence[int] | None) -> list[bool]:
    """Copy whole chunk buffers into per-layer paged caches, each checked against its
    xxh3-64 as it is copied (host.c; only where built with libxxhash)."""

def use_openmp(on: bool, thread: int) -> bool:
    """Run the split copies called on ``thread`` on its OpenMP team (host.c)."""

def last_ran() -> str | None:
    """How the last copy ran: "alone", "helpers" or "team" (for tests)."""
