"""bench_serve.py's workload: multi-round conversations and Mooncake trace
replay, streamed through the OpenAI client at a concurrency or a rate."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
from dataclasses import dataclass
from typing import Any

from lmkv.base.errors import LMKVError
from lmkv.replay.defaults import MOONCAKE_BLOCK_SIZE
from lmkv.testing.serve import VllmServe


class BenchError(LMKVError):
    """A bad flag or trace line; one line."""


@dataclass
class Request:
    """One request of the workload: a user's round (or a trace line)."""

    user: int
    round: int
    ttft_s: float = math.nan
    latency_s: float = math.nan
    prompt_chars: int = 0
    output_tokens: int = 0


class Conversations:
    """Text prompts of ``users`` multi-round conversations sharing one system prompt."""

    def __init__(self, tokenizer: Any, args: Any) -> None:
        from lmkv.integrations.hf_model import synthetic_text
        self.tokenizer = tokenizer

        def text(tokens: int, seed: int) -> str:
            words = max(8, tokens)
            ids = tokenizer.encode(synthetic_text(words, seed=seed), add_special_tokens=False)
            return tokenizer.decode(ids[:tokens])

        scale = args.scale
        self.system = "System: " + text(int(args.system_tokens * scale), 1) + "\n"
        self.contexts = [f"User {u} document: " + text(int(args.context_tokens * scale), 100 + u)
                         for u in range(args.users)]
        self.questions = [[f"\nQuestion {r}: " + text(args.question_tokens, 10_000 + 97 * u + r)
                           + "\nAnswer:" for r in range(args.rounds)] for u in range(args.users)]

    def tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))


def trace_prompts(path: str, shrink: int, limit: int, max_len: int) -> list[tuple[list[int], int]]:
    """A Mooncake trace's first ``limit`` lines as (token ids, output tokens):
    each hash id becomes a block of ``512 // shrink`` token ids seeded by the id."""
    block = max(1, MOONCAKE_BLOCK_SIZE // shrink)
    out: list[tuple[list[int], int]] = []
    try:
        with open(path) as f:
            lines = list(itertools.islice(f, limit))
    except OSError as exc:
        raise BenchError(f"--trace {path}: {exc.strerror}") from None
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            hash_ids = [int(h) for h in record["hash_ids"]]
            length = int(record["input_length"]) // shrink
            output = max(1, int(record["output_length"]))
        except (ValueError, KeyError, TypeError):
            raise BenchError(f"--trace {path}:{number}: not a Mooncake line (needs "
                             "hash_ids, input_length, output_length)") from None
        ids: list[int] = []
        for h in hash_ids:
            ids += random.Random(h).choices(range(10, 8000), k=block)
        ids = ids[:max(1, min(length, max_len - output - 1))]
        out.append((ids, min(output, 64)))
    if not out:
        raise BenchError(f"--trace {path}: no requests")
    return out


async def _stream(client: Any, model: str, prompt: Any, max_tokens: int,
                  request: Request) -> str:
    start = time.perf_counter()
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    parts: list[str] = []
    async for chunk in stream:
        if chunk.choices and math.isnan(request.ttft_s):
            request.ttft_s = time.perf_counter() - start
        if chunk.choices:
            parts.append(chunk.choices[0].text)
        if chunk.usage is not None:
            request.output_tokens = chunk.usage.completion_tokens
    request.latency_s = time.perf_counter() - start
    return "".join(parts)


class Gate:
    """Starts requests at a fixed concurrency, or at a Poisson rate."""

    def __init__(self, concurrency: int, rate: float | None, seed: int) -> None:
        self.semaphore = asyncio.Semaphore(concurrency if rate is None else 1 << 30)
        self.rate = rate
        self.rng = random.Random(seed)
        self.next_start = time.perf_counter()
        self.lock = asyncio.Lock()

    async def __aenter__(self) -> None:
        await self.semaphore.acquire()
        if self.rate is not None:
            async with self.lock:
                self.next_start = max(self.next_start, time.perf_counter()) + \
                    self.rng.expovariate(self.rate)
                delay = self.next_start - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)

    async def __aexit__(self, *exc: object) -> None:
        self.semaphore.release()


async def run_conversations(serve: VllmServe, conv: Conversations, args: Any) -> list[Request]:
    import openai
    client = openai.AsyncOpenAI(base_url=serve.api_base, api_key="unused", timeout=600)
    gate = Gate(args.concurrency, args.rate, args.seed)
    done: list[Request] = []

    async def user(u: int) -> None:
        history = conv.system + conv.contexts[u]
        for r in range(args.rounds):
            prompt = history + conv.questions[u][r]
            request = Request(u, r, prompt_chars=len(prompt))
            async with gate:
                answer = await _stream(client, serve.model, prompt, args.answer_tokens, request)
            done.append(request)
            history = prompt + answer

    await asyncio.gather(*(user(u) for u in range(args.users)))
    await client.close()
    return done


def trace_arrivals(path: str, limit: int) -> list[float]:
    """The first ``limit`` lines' arrival times in seconds after the first line's
    (Mooncake's ``timestamp`` is in milliseconds; a line without one arrives with
    the line before it)."""
    out: list[float] = []
    with open(path) as f:
        for number, line in enumerate(itertools.islice(f, limit), 1):
            try:
                stamp = float(json.loads(line).get("timestamp", out[-1] * 1e3 if out else 0))
            except (ValueError, TypeError, AttributeError):
                raise BenchError(f"--trace {path}:{number}: timestamp is not a number") from None
            out.append(stamp / 1e3)
    first = out[0] if out else 0.0
    return [max(0.0, t - first) for t in out]


async def run_trace(serve: VllmServe, prompts: list[tuple[list[int], int]],
                    args: Any, arrivals: list[float] | None = None) -> list[Request]:
    """Replay ``prompts``: at the trace's ``arrivals`` (seconds, divided by
    ``args.trace_speed``) when given, else as fast as the gate lets them in; the
    gate (``--concurrency`` / ``--rate``) caps the requests in flight either way."""
    import openai
    client = openai.AsyncOpenAI(base_url=serve.api_base, api_key="unused", timeout=600)
    gate = Gate(args.concurrency, args.rate, args.seed)
    done: list[Request] = []
    start_order = asyncio.Lock()  # the trace's order, whatever the gate lets through

    async def one(i: int, ids: list[int], output: int) -> None:
        request = Request(i, 0, prompt_chars=len(ids))
        async with gate:
            await _stream(client, serve.model, ids, output, request)
        done.append(request)

    tasks = []
    t0 = time.perf_counter()
    for i, (ids, output) in enumerate(prompts):
        if arrivals is not None:
            wait = t0 + arrivals[i] / args.trace_speed - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
        async with start_order:
            tasks.append(asyncio.create_task(one(i, ids, output)))
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    await client.close()
    return done
