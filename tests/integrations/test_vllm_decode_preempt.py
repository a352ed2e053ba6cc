"""The vLLM scheduler side with ``lmkv.store_decode`` (generated tokens' whole blocks
are stored like a prompt's) and across a preemption (a resumed request is looked up
afresh). vLLM-free: requests and scheduler outputs are plain objects, the worker is
a real engine over the lookup channel; tests/vllm/test_decode_preempt_vllm.py runs
the same through a real vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.integrations.test_vllm_connector import _ask, _no_steps, _scheduler_and_worker

PROMPT = list(range(500, 540))  # 2 whole chunks (and blocks) of 16 + 8 tokens
ANSWER = list(range(7000, 7030))


def _request(req_id: str, salt: str | None = None) -> SimpleNamespace:
    """A vLLM ``Request``'s parts the scheduler side reads; ``all_token_ids`` grows
    as tokens are sampled."""
    return SimpleNamespace(request_id=req_id, prompt_token_ids=list(PROMPT),
                           all_token_ids=list(PROMPT), block_hashes=[], cache_salt=salt,
                           lora_request=None, mm_features=None, prompt_embeds=None,
                           num_preemptions=0)


def _new_step(req_id: str, blocks: list[int], computed: int, scheduled: int):  # type: ignore[no-untyped-def]
    new = SimpleNamespace(req_id=req_id, prompt_token_ids=list(PROMPT), block_ids=(blocks,),
                          num_computed_tokens=computed)
    out = _no_steps([new])
    out.num_scheduled_tokens = {req_id: scheduled}
    return out


def _cached_step(req_id: str, computed: int, scheduled: int, new_blocks: list[int] | None = None,
                 resumed: bool = False):  # type: ignore[no-untyped-def]
    out = _no_steps()
    out.scheduled_cached_reqs = SimpleNamespace(
        req_ids=[req_id], new_block_ids=[(new_blocks,) if new_blocks is not None else None],
        resumed_req_ids={req_id} if resumed else set(), num_computed_tokens=[computed])
    out.num_scheduled_tokens = {req_id: scheduled}
    return out


def _prefill_and_decode(sched, engine, caches, request, blocks: list[int], steps: int):  # type: ignore[no-untyped-def]
    """Prefill the prompt, then ``steps`` decode steps, storing every planned store
    with the engine (what the workers do in ``wait_for_save``). The stores."""
    stores = []

    def run(out) -> None:  # type: ignore[no-untyped-def]
        for spec in sched.build_meta(out).stores:
            engine.store(spec.token_ids, identity=spec.identity, kv_caches=caches,
                         block_ids=spec.block_ids)
            stores.append(spec)

    assert _ask(sched, request, 0) == 0
    sched.after_alloc(request, blocks, 0)
    run(_new_step(request.request_id, blocks, 0, len(PROMPT)))
    request.all_token_ids.append(ANSWER[0])  # the prefill's sampled token: no KV yet
    for i in range(steps):
        # This step computes the KV of the token sampled by the one before.
        run(_cached_step(request.request_id, len(PROMPT) + i, 1))
        request.all_token_ids.append(ANSWER[i + 1])
    return stores


@pytest.mark.parametrize("store_decode", [False, True])
def test_decode_blocks_are_stored_once_whole_and_computed(tmp_path, store_decode: bool) -> None:
    sched, engine, server, caches = _scheduler_and_worker(
        tmp_path, **{"lmkv.store_decode": store_decode})
    try:
        request = _request("d", salt="t")
        # 40 prompt tokens; 8 decode steps compute the KV of tokens 40..47: block 2
        # (tokens 32..47) is whole once the 8th step ran; token 48 was only sampled.
        stores = _prefill_and_decode(sched, engine, caches, request, [0, 1, 2, 3], 8)
        ends = [len(s.token_ids) for s in stores]
        assert ends == ([32, 48] if store_decode else [32])
        assert stores[-1].token_ids == request.all_token_ids[:ends[-1]]
        assert not any(s.release for s in stores)
        assert sched.counters.decode_stored_tokens == (8 if store_decode else 0)
        # One more decode step: its block is not whole: nothing more.
        assert sched.build_meta(_cached_step("d", 48, 1)).stores == []
        request.num_computed_tokens = 49
        assert sched.finished(request, [0, 1, 2, 3]) is False  # nothing left to store
        # Round 2 (prompt + answer + a question), same identity: loads the answer's
        # whole block too; another tenant nothing.
        follow = [*request.all_token_ids[:49], *range(9000, 9020)]
        again = SimpleNamespace(**{**vars(_request("r2", salt="t")),
                                   "prompt_token_ids": follow, "all_token_ids": follow})
        assert _ask(sched, again, 0) == (48 if store_decode else 32)
        other = SimpleNamespace(**{**vars(again), "request_id": "r3", "cache_salt": "u"})
        assert _ask(sched, other, 0) == 0
    finally:
        sched.close()
        server.close()
        engine.close()


@pytest.mark.parametrize("steps,during,tail", [(8, [32], 48), (24, [32, 64], None)])
def test_eager_decode_stores_whole_chunks_and_the_block_tail_at_finish(
        tmp_path, steps: int, during: list[int], tail: int | None) -> None:
    """Chunks of 32, blocks of 16: decode steps store whole chunks only (not the
    growing partial chunk at every block); the finished request's whole blocks past
    them are stored once, by the next step, and vLLM keeps its blocks until then."""
    sched, engine, server, caches = _scheduler_and_worker(
        tmp_path, **{"lmkv.store_decode": True, "lmkv.chunk_size": 32,
                     "lmkv.block_size": 16})
    try:
        request = _request("e")
        stores = _prefill_and_decode(sched, engine, caches, request, [0, 1, 2, 3, 4], steps)
        assert [len(s.token_ids) for s in stores] == during
        request.num_computed_tokens = len(PROMPT) + steps  # the last sampled: no KV
        assert sched.finished(request, [0, 1, 2, 3, 4]) is (tail is not None)
        # The next round, asked before the tail's store went out, waits a step for it.
        follow = [*request.all_token_ids, *range(9000, 9020)]
        again = SimpleNamespace(**{**vars(_request("r2")), "prompt_token_ids": follow,
                                   "all_token_ids": follow})
        if tail:
            assert sched.num_new_matched_tokens(again, 0) is None
        finish = sched.build_meta(_no_steps()).stores  # the next step: no tokens needed
        assert [(len(s.token_ids), s.release) for s in finish] == \
            ([(tail, True)] if tail else [])
        if tail:
            assert finish[0].token_ids == request.all_token_ids[:tail]
            assert finish[0].block_ids == [0, 1, 2, 3, 4]
            engine.store(finish[0].token_ids, kv_caches=caches, block_ids=finish[0].block_ids)
        assert _ask(sched, again, 0) == (tail or during[-1])
        assert sched.counters.decode_stored_tokens == (tail or during[-1]) - len(PROMPT)
        assert sched.build_meta(_no_steps()).stores == []  # planned once
    finally:
        sched.close()
        server.close()
        engine.close()


def test_a_preempted_request_has_no_tail_to_store(tmp_path) -> None:
    """Aborted while preempted: its blocks are gone, nothing to store or keep."""
    sched, engine, server, caches = _scheduler_and_worker(
        tmp_path, **{"lmkv.store_decode": True, "lmkv.chunk_size": 32, "lmkv.block_size": 16})
    try:
        request = _request("g")
        _prefill_and_decode(sched, engine, caches, request, [0, 1, 2, 3], 8)
        request.num_computed_tokens = 0
        assert sched.finished(request, []) is False
        assert sched.build_meta(_no_steps()).stores == []
    finally:
        sched.close()
        server.close()
        engine.close()


@pytest.mark.parametrize("store_decode", [False, True])
def test_a_resumed_request_is_looked_up_again_and_loads(tmp_path, store_decode: bool) -> None:
    """Preempted after its prefill and 8 decode steps, the request is asked about again
    with nothing computed: it must load what it stored (not answer the stale 0 of its
    first lookup), over its generated tokens too with ``store_decode``."""
    sched, engine, server, caches = _scheduler_and_worker(
        tmp_path, **{"lmkv.store_decode": store_decode})
    try:
        request = _request("p")
        _prefill_and_decode(sched, engine, caches, request, [0, 1, 2, 3], 8)
        lookups, stored = sched.counters.lookups, sched.counters.decode_stored_tokens
        request.num_preemptions = 1  # vLLM freed its blocks, zeroed its computed tokens
        hit = 48 if store_decode else 32
        assert _ask(sched, request, 0) == hit
        assert sched.counters.lookups == lookups + 1
        sched.after_alloc(request, [6, 5, 4, 7], hit)
        assert sched.counters.preempted_resumes == 1
        # The resume is a cached request with a fresh block table.
        out = _cached_step("p", hit, len(request.all_token_ids) - hit, [6, 5, 4, 7], resumed=True)
        meta = sched.build_meta(out)
        (load,) = meta.loads
        assert (load.token_ids, load.block_ids, load.skip_tokens) == \
            (request.all_token_ids[:hit], [6, 5, 4, 7], 0)
        assert meta.stores == []  # what it loaded is stored already
        assert sched.counters.decode_stored_tokens == stored  # nothing counted twice
        assert sched.client.counters.cancels == 0  # the load took the prefetch
        # Asked again later (say, its allocation failed): same answer, counted once.
        assert sched.num_new_matched_tokens(request, 0) == hit
        assert sched.counters.preempted_resumes == 1
    finally:
        sched.close()
        server.close()
        engine.close()


def test_a_resume_that_loads_nothing_is_not_counted(tmp_path) -> None:
    sched, engine, server, _caches = _scheduler_and_worker(tmp_path)
    try:
        request = _request("q")
        assert _ask(sched, request, 0) == 0
        sched.after_alloc(request, [0, 1, 2], 0)
        sched.build_meta(_new_step("q", [0, 1, 2], 0, 8))  # a chunked prefill's first 8
        request.num_preemptions = 1
        assert _ask(sched, request, 0) == 0
        sched.after_alloc(request, [3], 0)
        assert sched.counters.preempted_resumes == 0
    finally:
        sched.close()
        server.close()
        engine.close()
