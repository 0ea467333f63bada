"""Async scheduling: step n+1 is scheduled and submitted before step n's tokens are known; the
workers take those tokens from their own output. It must never change what a request gets."""

import asyncio
import time

import pytest

from dspark_cluster import LLM, SamplingParams
from dspark_cluster.async_engine import AsyncEngine
from dspark_cluster.config import load_config
from dspark_cluster.engine import LLMEngine

from conftest import random_prompts


def mixed_params(n, stop_token_ids=None):
    """Greedy and seeded-random rows, different lengths, some with stop tokens."""
    out = []
    for i in range(n):
        out.append(SamplingParams(max_tokens=3 + 5 * (i % 4), temperature=0.0 if i % 2 else 0.9, seed=i,
                                  ignore_eos=True, stop_token_ids=tuple((stop_token_ids or {}).get(i, ()))))
    return out


def run(path, async_on, params, prompts, **sched):
    llm = LLM(path, config={"scheduler": {"block_size": 4, "async_scheduling": async_on, **sched}})
    try:
        outs = llm.generate(prompts, params)
        eng = llm.engine
        overlapped = sum(s["overlapped"] for s in eng.step_stats)
        assert eng.block_manager.num_used == 0 and not eng.has_unfinished()
        return [(o.token_ids, o.finish_reason) for o in outs], overlapped, eng.load()["preemptions"]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("sched", [{}, {"num_kv_blocks": 14}, {"max_num_batched_tokens": 8}],
                         ids=["roomy", "preempting", "chunked"])
def test_async_scheduling_gives_the_same_tokens(sched, checkpoint):
    path = checkpoint("deepseek_v3")
    prompts = random_prompts([9, 14, 5, 11, 8, 13, 6, 10], seed=41)
    sync, _, _ = run(path, False, mixed_params(len(prompts)), prompts, **sched)
    # stop three requests early on a token they would otherwise produce mid-way: the step already
    # scheduled for them after the stop is dropped
    stops = {i: [sync[i][0][len(sync[i][0]) // 2]] for i in (1, 3, 6) if len(sync[i][0]) > 2}
    sync, _, _ = run(path, False, mixed_params(len(prompts), stops), prompts, **sched)
    ahead, overlapped, preempted = run(path, True, mixed_params(len(prompts), stops), prompts, **sched)
    assert ahead == sync
    assert any(reason == "stop" for _, reason in ahead)
    assert overlapped > 0
    if "num_kv_blocks" in sched:
        assert preempted > 0


def test_a_pool_too_small_ends_the_request_at_the_same_token(checkpoint):
    """Out of KV blocks for the token still in flight: the decision waits for that token (it may end
    the request anyway), so the output and the reason match the synchronous engine's."""
    path = checkpoint("qwen3_moe")
    prompts = random_prompts([9], seed=46)
    reasons = {}
    for max_tokens in (40, 12):  # cut off by the 20-token pool; ends by length with the pool just full
        params = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)]
        sync, _, _ = run(path, False, params, prompts, num_kv_blocks=5)
        ahead, overlapped, _ = run(path, True, params, prompts, num_kv_blocks=5)
        assert ahead == sync and overlapped > 0
        reasons[max_tokens] = sync[0][1]
    assert reasons == {40: "kv_cache_full", 12: "length"}


def test_a_failed_step_is_undone_and_the_engine_steps_on(checkpoint):
    """An interrupt out of a step leaves no half-advanced sequence: the caller can catch it and step
    on to the same outputs. (An ordinary exception fails that step's requests: tests/test_faults.py.)"""
    path = checkpoint("deepseek_v3")
    prompts = random_prompts([7, 12, 5], seed=47)
    params = mixed_params(len(prompts))
    sync, _, _ = run(path, False, params, prompts)
    eng = LLMEngine(load_config({"model": {"path": str(path)}, "scheduler": {"block_size": 4, "async_scheduling": True}}))
    wait, calls = eng.executor.wait, []

    def flaky_wait(handle):
        calls.append(1)
        if len(calls) in (3, 7):
            raise KeyboardInterrupt("injected")
        return wait(handle)

    eng.executor.wait = flaky_wait
    try:
        ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        failures = 0
        while eng.has_unfinished():
            try:
                eng.step()
            except KeyboardInterrupt:
                failures += 1
        assert failures == 2
        assert [(eng.seqs[r].output_token_ids, eng.seqs[r].finish_reason) for r in ids] == sync
        assert eng.block_manager.num_used == 0
    finally:
        eng.shutdown()


def test_abort_with_a_step_in_flight_frees_everything(checkpoint):
    cfg = load_config({"model": {"path": str(checkpoint("mixtral"))},
                       "scheduler": {"block_size": 4, "num_kv_blocks": 64, "async_scheduling": True}})
    other_prompt, other_params = random_prompts([7], seed=43)[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    alone, _, _ = run(checkpoint("mixtral"), False, [other_params], [other_prompt])
    engine = AsyncEngine(cfg)

    async def scenario():
        long_rid = engine.submit(random_prompts([12], seed=42)[0], SamplingParams(max_tokens=200, ignore_eos=True))
        other = engine.submit(other_prompt, other_params)
        n = 0
        async for piece in engine.stream(long_rid):
            n += len(piece.token_ids)
            if n == 3:
                engine.abort(long_rid)
            if piece.finished:
                break
        return piece, await engine.result(other)

    try:
        last, out = asyncio.run(scenario())
        assert last.finish_reason == "abort" and [(out.token_ids, out.finish_reason)] == alone
        deadline = time.time() + 5
        while engine.stats()["kv_blocks_used"] and time.time() < deadline:
            time.sleep(0.01)
        assert engine.stats()["kv_blocks_used"] == 0
        assert sum(s["overlapped"] for s in engine.engine.step_stats) > 0
    finally:
        engine.shutdown()


def test_speculation_switched_at_run_time_steps_in_and_out_of_async(checkpoint):
    """Speculating steps run one at a time (drafts need the last token); switched off, the engine
    schedules ahead again. Greedy output stays the plain engine's."""
    path = checkpoint("qwen3_moe")
    prompts = random_prompts([6, 10, 8], seed=44)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(path, config={"scheduler": {"block_size": 4}}) as llm:
        plain = [o.token_ids for o in llm.generate(prompts, params)]
    eng = LLMEngine(load_config({"model": {"path": str(path)}, "speculative": {"method": "ngram", "num_tokens": 3, "schedule": "static"},
                                 "scheduler": {"block_size": 4, "async_scheduling": True}}))
    try:
        ids = [eng.add_request(p, params) for p in prompts]
        n, drafts = 0, {}
        while eng.has_unfinished():
            n += 1
            if n in (5, 12):  # (the step in flight at the switch, submitted before it, still verifies drafts)
                drafts[n] = sum(eng.seqs[r].num_draft_tokens for r in ids)
            if n in (4, 12):  # off after step 3; back on (with a step in flight) at step 12
                eng.set_speculation(n == 12)
            eng.step()
        assert [eng.seqs[r].output_token_ids for r in ids] == plain
        overlapped = [s["overlapped"] for s in eng.step_stats]
        assert any(overlapped[4:11]) and not any(overlapped[:3])
        assert 0 < drafts[5] == drafts[12] < sum(eng.seqs[r].num_draft_tokens for r in ids)
        assert eng.block_manager.num_used == 0
    finally:
        eng.shutdown()


def test_async_scheduling_through_ray_at_tensor_2(checkpoint, ray_cluster):
    """Rank 0 samples; rank 1 gets the tokens by broadcast, so the next step's inputs match on both
    ranks (a wrong token on rank 1 would change the all-reduced activations and the output)."""
    import ray

    path = checkpoint("qwen2_moe")
    prompts = random_prompts([10, 4, 7, 9], seed=45)
    base, _, _ = run(path, False, mixed_params(len(prompts)), prompts)
    params = mixed_params(len(prompts), {i: [base[i][0][len(base[i][0]) // 2]] for i in (1, 3)})  # two stop early
    base, _, _ = run(path, False, params, prompts)
    assert any(reason == "stop" for _, reason in base)
    llm = LLM(path, config={"parallel": {"executor": "ray", "tensor": 2}, "scheduler": {"block_size": 4}})
    try:
        outs = llm.generate(prompts, params)
        assert [(o.token_ids, o.finish_reason) for o in outs] == base
        stats = ray.get(llm.router.stats.remote())
        assert stats["async_scheduling"] and stats["overlapped_steps"] > 0
    finally:
        llm.shutdown()
