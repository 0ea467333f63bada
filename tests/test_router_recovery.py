"""Router recovery: a request resumed after the tokens its reader has (in process), and kill -9
of the Router actor under streams (Ray): a new Router, every stream continues, outputs as without
the fault, bounded by parallel.max_restarts."""

import asyncio
import os
import signal
import time

import pytest

from dspark_cluster import LLM, RequestError, SamplingParams, load_config
from dspark_cluster.errors import EngineError
from dspark_cluster.async_engine import AsyncEngine

from conftest import alive_actor_pids, random_prompts

TINY = "tiny-moe"  # the bundled model: a real tokenizer, so text and stop strings are in play


def _whole(engine, prompts, params, resume=None):
    async def go():
        ids = engine.submit_many(prompts, params, resume=resume)
        out = []
        for rid in ids:
            pieces = [p async for p in engine.stream(rid)]
            out.append((sum((p.token_ids for p in pieces), []), "".join(p.text for p in pieces),
                        pieces[-1].finish_reason, pieces[0].prompt_logprobs))
        return out

    return asyncio.run(go())


def test_a_resumed_request_continues_after_the_tokens_it_has():
    """In process: the pieces of a request resumed after its first k output tokens are exactly the
    rest of an uninterrupted run's pieces (tokens, text with a stop string in play, finish reason),
    and the prompt's log-probabilities are not sent again."""
    cfg = load_config({"model": {"path": TINY}, "scheduler": {"block_size": 4}})
    engine = AsyncEngine(cfg)
    try:
        prompts = ["def fib(n):", "class Stack:", "import os\n"]
        base_params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=1),
                       SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True),
                       SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)]
        base = _whole(engine, prompts, base_params)
        # a stop string that first occurs late in the first request's text: it ends that one early
        text0 = base[0][1]
        stop_at = next(text0[i:i + 4] for i in range(len(text0) * 2 // 3, len(text0) - 4)
                       if text0.find(text0[i:i + 4]) == i)
        params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=1, stop=[stop_at])]
        params += base_params[1:]
        base = _whole(engine, prompts, params)
        cut = [max(1, len(base[0][0]) - 3), 7, 4]
        assert all(0 < k < len(b[0]) for b, k in zip(base, cut)) and base[0][2] == "stop"
        resumed = _whole(engine, prompts, params, resume=[b[0][:k] for b, k in zip(base, cut)])
        for (toks, text, reason, _), (rtoks, rtext, rreason, rplp), k in zip(base, resumed, cut):
            assert rtoks == toks[k:] and rreason == reason
            assert text.endswith(rtext) and len(rtext) < len(text)
        assert base[0][3] is not None and resumed[0][3] is None
        with pytest.raises(RequestError, match="resume"):  # nothing left to produce
            _whole(engine, prompts[2:], params[2:], resume=[base[2][0]])
    finally:
        engine.shutdown()


def shard_worker_pids() -> list[int]:
    return alive_actor_pids("ShardWorker")  # this session's Ray only (conftest.alive_actor_pids says why)


def _placement_groups_of(actor_id: str) -> list:
    from ray.util.placement_group import placement_group_table

    return [i for i in placement_group_table().values()
            if (i.get("name") or "").startswith(f"dspark-{actor_id}") and i["state"] != "REMOVED"]


def _router_pid(client) -> int:
    import ray

    return ray.get(client.router.pid.remote())


def test_kill_9_of_the_router_under_streams_resumes_every_stream(ray_cluster):
    """Tensor 2: the Router is killed with SIGKILL while 8 streams run. The client starts a new
    Router; each stream goes on after a pause with the tokens and text of a run without the fault;
    a request submitted during the restart waits and completes; stats say restarting meanwhile and
    count the restart after."""
    from actors.client import RouterClient

    prompts = random_prompts([6, 11, 4, 9, 14, 7, 5, 12], seed=41)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    local = LLM(TINY, config={"scheduler": {"block_size": 4}})
    base = local.generate(prompts, params)
    local.shutdown()
    cfg = load_config({"model": {"path": TINY}, "scheduler": {"block_size": 4},
                       "parallel": {"executor": "ray", "tensor": 2, "max_restarts": 1}})
    client = RouterClient.start(cfg)
    lost = []

    async def scenario():
        ids = await client.submit_many(prompts, [params] * len(prompts))
        got = {rid: [] for rid in ids}
        states = []

        async def read(rid):
            async for piece in client.stream(rid):
                got[rid].append(piece)

        readers = [asyncio.ensure_future(read(rid)) for rid in ids]
        while sum(len(v) for v in got.values()) < 3 * len(ids):  # mid-stream
            await asyncio.sleep(0.01)
        lost.append(client.router._actor_id.hex())
        os.kill(_router_pid(client), signal.SIGKILL)
        t0 = time.monotonic()
        late = asyncio.ensure_future(client.submit_many([prompts[0]], [params]))  # waits for the new Router
        while client.num_router_restarts == 0 or client._recovery is None or not client._recovery.done():
            states.append((await client.stats())["state"])
            await asyncio.sleep(0.05)
            assert time.monotonic() - t0 < 240
        (late_id,) = await late
        late_pieces = [p async for p in client.stream(late_id)]
        await asyncio.gather(*readers)
        return ids, got, states, late_pieces

    try:
        ids, got, states, late_pieces = asyncio.run(scenario())
        for rid, b in zip(ids, base):
            pieces = got[rid]
            assert [t for p in pieces for t in p.token_ids] == b.token_ids
            assert "".join(p.text for p in pieces) == b.text and pieces[-1].finish_reason == b.finish_reason
        assert [t for p in late_pieces for t in p.token_ids] == base[0].token_ids
        assert "restarting" in states
        stats = asyncio.run(client.stats())
        assert stats["state"] == "ok" and stats["router_restarts"] == 1
        assert stats["last_router_restart"]["resubmitted"] >= 1
        assert not _placement_groups_of(lost[0])  # removed (Ray keeps them: they would hold its devices)
        deadline = time.monotonic() + 30  # the lost Router's workers went with it: only the new pair is left
        while len(shard_worker_pids()) != 2:
            assert time.monotonic() < deadline, shard_worker_pids()
            time.sleep(0.2)
    finally:
        client.shutdown()


def test_router_restarts_are_bounded(ray_cluster):
    """max_restarts 0: a lost Router fails the requests in flight with an EngineError naming the
    limit; stats say failed; new requests are refused with the same error."""
    from actors.client import RouterClient

    cfg = load_config({"model": {"path": TINY}, "scheduler": {"block_size": 4},
                       "parallel": {"executor": "ray", "max_restarts": 0}})
    client = RouterClient.start(cfg)
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    lost = client.router._actor_id.hex()

    async def scenario():
        (rid,) = await client.submit_many(["def fib(n):"], [params])
        n = 0
        with pytest.raises(EngineError, match="max_restarts"):
            async for _ in client.stream(rid):
                n += 1
                if n == 2:
                    os.kill(_router_pid(client), signal.SIGKILL)
        assert (await client.stats())["state"] == "failed"
        assert not _placement_groups_of(lost)  # not restarted, but its devices are freed
        with pytest.raises(EngineError, match="max_restarts"):
            await client.submit_many(["x"], [params])

    try:
        asyncio.run(scenario())
    finally:
        client.shutdown()


def test_a_router_killed_while_it_shuts_down_leaves_no_placement_group(ray_cluster):
    """A Router that does not finish its shutdown in time is killed; Ray ends the workers it made but
    keeps its placement groups, which would hold their devices for the rest of the job: stop_router
    removes them."""
    from actors.cluster import start_router, stop_router

    cfg = load_config({"model": {"path": TINY}, "parallel": {"executor": "ray", "tensor": 2}})
    router = start_router(cfg)
    rid = router._actor_id.hex()
    assert len(_placement_groups_of(rid)) == 1
    stop_router(router, timeout_s=0)  # killed at once, mid-shutdown at best
    assert not _placement_groups_of(rid)
