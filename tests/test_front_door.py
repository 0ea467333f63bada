"""The one front door (dspark_cluster.client.EngineClient, in process and on Ray): what crosses each
boundary per step (one batch of pieces, not one object per request), a batch of requests as one
call, admin operations by name through one path, and LLM as a synchronous wrapper over it."""

from __future__ import annotations

import asyncio
import gc

import pytest

from dspark_cluster import LLM, RequestError, SamplingParams
from dspark_cluster.async_engine import UTILITIES, AsyncEngine
from dspark_cluster.client import EngineClient
from dspark_cluster.config import ASSETS_DIR, load_config
from dspark_cluster.outputs import StreamPiece, request_output

from conftest import random_prompts

TINY = ASSETS_DIR / "tiny-moe"
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


async def _stream_all(client, ids) -> dict:
    async def one(rid):
        return [p async for p in client.stream(rid)]

    return dict(zip(ids, await asyncio.gather(*(one(r) for r in ids))))


def test_one_hand_over_per_step_reaches_the_event_loop():
    """In process: the step thread hands each step's pieces to the readers' loop in one call,
    fanned out there to the requests' queues."""
    engine = AsyncEngine(load_config(None, {"model.path": str(TINY)}))
    batches = []
    fan_out = engine._fan_out
    engine._fan_out = lambda batch: (batches.append(len(batch)), fan_out(batch))
    prompts = random_prompts([5, 7, 9, 4, 6, 8, 3, 10], seed=61, vocab=200)
    try:
        client = EngineClient.local(engine)
        steps0 = engine.engine.num_steps

        async def run():
            ids = await client.submit_many(prompts, [PARAMS] * len(prompts))
            return await _stream_all(client, ids)

        pieces = asyncio.run(run())
        steps = engine.engine.num_steps - steps0
        assert all(sum(len(p.token_ids) for p in ps) == 6 for ps in pieces.values())
        assert len(batches) <= steps < sum(len(ps) for ps in pieces.values())
        assert max(batches) == len(prompts)  # every request's piece of a step, together
    finally:
        engine.shutdown()


def test_a_batch_is_validated_whole_and_queued_together():
    engine = AsyncEngine(load_config(None, {"model.path": str(TINY)}))
    try:
        async def run():
            with pytest.raises(RequestError, match="already in use"):
                engine.submit_many([[5, 6], [7, 8]], [PARAMS, PARAMS], ["a", "a"])
            with pytest.raises(RequestError, match="outside the vocabulary"):
                engine.submit_many([[5, 6], [10**6]], [PARAMS, PARAMS], ["b", "c"])
            assert engine._queues == {}  # nothing of a refused batch is queued
            return await engine.generate([[5, 6], [7, 8]], [PARAMS, PARAMS])

        outs = asyncio.run(run())
        assert [len(o.token_ids) for o in outs] == [6, 6]
    finally:
        engine.shutdown()


def test_a_request_output_is_its_pieces_folded():
    pieces = [StreamPiece("r", [1, 2], "ab", logprobs=[], prompt_logprobs=[None, "lp"]),
              StreamPiece("r", [3], "c", True, "length", logprobs=[], prompt_token_ids=[7, 8],
                          metrics={"ttft_s": 0.1})]
    out = request_output(pieces)
    assert (out.token_ids, out.text, out.finish_reason, out.prompt_token_ids) == ([1, 2, 3], "abc", "length", [7, 8])
    assert out.metrics == {"ttft_s": 0.1} and out.logprobs == [] and out.prompt_logprobs == [None, "lp"]
    assert request_output([StreamPiece("r", [4], "d", True, "stop")]).logprobs is None  # not asked for


def test_admin_operations_go_through_one_door_by_name():
    with LLM(TINY) as llm:
        assert llm.drafter_status() == llm.call_utility("drafter_status")  # the public wrapper is the door
        with pytest.raises(RequestError, match="there is no drafter to roll back"):
            llm.rollback_drafter(None)
        with pytest.raises(RequestError, match="no engine operation named 'shutdown'"):
            llm.call_utility("shutdown")
        llm.call_utility("set_speculation", False)  # runs between two steps on the step thread
        assert not llm.engine.scheduler.speculation_enabled
        assert set(UTILITIES) >= {"drafter_status", "rollback_drafter", "resume_drafter", "set_speculation",
                                  "rebalance_now"}


def test_an_llm_dropped_without_shutdown_stops_its_engine():
    import weakref

    llm = LLM(TINY)
    assert llm.generate([[5, 6, 7]], PARAMS)[0].token_ids
    engine, loop = weakref.ref(llm.client.engine), llm._loop.loop
    del llm
    gc.collect()
    assert loop.is_closed() and engine() is None  # shut down, and nothing of it is left


def test_through_ray_one_object_per_step_and_one_call_per_batch(ray_cluster, checkpoint):
    """The Router sends each client one object per step holding every request's piece, and a batch
    of requests (the server's n choices) is one call."""
    path = checkpoint("qwen3_moe")
    cfg = load_config({"model": {"path": str(path)}, "parallel": {"executor": "ray"}, "scheduler": {"block_size": 4}})
    prompts = random_prompts([5, 7, 9, 4, 6, 8], seed=62)
    with LLM(path, config={"scheduler": {"block_size": 4}}) as local:
        expected = [o.token_ids for o in local.generate(prompts, PARAMS)]
    client = EngineClient.start(cfg)
    try:
        assert client.kind == "ray" and client.engine is None
        calls = []

        class Counted:  # the Router's handle, counting the remote methods this client calls
            def __init__(self, handle):
                self.handle = handle

            def __getattr__(self, name):
                if name not in ("outputs", "close_outputs"):  # (the output stream is opened once, apart)
                    calls.append(name)
                return getattr(self.handle, name)

        client.router = Counted(client.router)

        async def run():
            ids = await client.submit_many(prompts, [PARAMS] * len(prompts))
            return ids, await _stream_all(client, ids)

        ids, pieces = asyncio.run(run())
        assert calls == ["add_requests"]  # six requests, one round trip
        assert [[t for p in pieces[r] for t in p.token_ids] for r in ids] == expected
        num_pieces = sum(len(ps) for ps in pieces.values())
        assert client.num_batches <= num_pieces / 3  # about one object per step, not one per piece
        assert asyncio.run(client.call_utility("drafter_status"))["serving_version"] is None
    finally:
        client.router = getattr(client.router, "handle", client.router)
        client.shutdown()
