"""Write ``benchmarks/traces/sample_trace.jsonl``: a small synthetic request trace in
the Mooncake FAST'25 JSONL format, for trying ``lmkv replay`` without downloading
anything.

    python benchmarks/make_sample_trace.py [OUT]    # default: the committed file

What it models, so that replay has prefixes to reuse: a few shared system prompts
(every request starts with one), multi-turn conversations (each turn's prompt is
the previous prompt, its answer and a new question), and one-off requests.
Arrivals are Poisson; conversations interleave. Like Mooncake's traces, each
512-token block is named by an integer that stands for its whole prefix: two
requests share a block id at a position exactly when they share every token up
to the end of that block. Deterministic: the same seed writes the same bytes
(``tests/replay/test_sample_trace.py`` checks the committed file against it).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

BLOCK_TOKENS = 512
REQUESTS = 300
SEED = 2025
OUT = Path(__file__).resolve().parent / "traces" / "sample_trace.jsonl"


class PrefixIds:
    """An integer per distinct prefix of content blocks, in order of first use."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, ...], int] = {}

    def of(self, blocks: list[int]) -> list[int]:
        return [self._ids.setdefault(tuple(blocks[:n + 1]), len(self._ids))
                for n in range(len(blocks))]


def requests(seed: int = SEED, count: int = REQUESTS) -> list[dict[str, object]]:
    rng = random.Random(seed)
    content = iter(range(1, 1 << 30))  # a fresh block of text each time
    systems = [[next(content) for _ in range(rng.randint(2, 6))] for _ in range(4)]
    ids = PrefixIds()
    open_chats: list[list[int]] = []
    out: list[dict[str, object]] = []
    now = 0.0
    while len(out) < count:
        now += rng.expovariate(1 / 400)  # a request every 0.4 s on average
        kind = rng.random()
        if open_chats and kind < 0.55:  # the next turn of a conversation
            i = rng.randrange(len(open_chats))
            prompt = open_chats[i] + [next(content) for _ in range(rng.randint(1, 3))]
            if len(prompt) > 40 or rng.random() < 0.2:
                open_chats.pop(i)  # the conversation ends with this turn
            else:
                open_chats[i] = prompt
        elif kind < 0.85:  # a new conversation under a system prompt
            prompt = rng.choice(systems) + [next(content) for _ in range(rng.randint(1, 4))]
            open_chats.append(prompt)
        else:  # a one-off request, sharing only its system prompt
            prompt = rng.choice(systems) + [next(content) for _ in range(rng.randint(1, 8))]
        tokens = len(prompt) * BLOCK_TOKENS - rng.randrange(BLOCK_TOKENS)
        out.append({"timestamp": int(now), "input_length": tokens,
                    "output_length": rng.randint(8, 400), "hash_ids": ids.of(prompt)})
    return out


def write(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in requests()), encoding="utf-8")


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
