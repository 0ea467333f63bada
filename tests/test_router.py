"""Continuous batching through the AsyncEngine / Router: joins, leaves, preemption, cancellation,
streaming, and the `dspark run` job."""

import asyncio
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark_cluster import LLM, RequestError, SamplingParams, load_config
from dspark_cluster.async_engine import AsyncEngine

from conftest import random_prompts

REPO = Path(__file__).resolve().parents[1]


def local_cfg(path, **sched):
    return load_config({"model": {"path": str(path)}, "scheduler": {"block_size": 4, **sched}})


def test_many_concurrent_requests_match_running_alone(checkpoint):
    path = checkpoint("qwen3_moe")
    rng = random.Random(0)
    n = 104
    prompts = random_prompts([rng.randint(2, 40) for _ in range(n)], seed=31)
    params = [SamplingParams(max_tokens=rng.randint(1, 24), temperature=0, ignore_eos=True) for _ in range(n)]
    alone_llm = LLM(path, config={"scheduler": {"block_size": 4, "num_kv_blocks": 64}})
    alone = [alone_llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    engine = AsyncEngine(local_cfg(path, num_kv_blocks=400, max_num_seqs=48, max_num_batched_tokens=96))

    async def arrive_over_time():
        async def one(i):
            await asyncio.sleep(0.002 * i)  # staggered arrivals join the running batch
            rid = engine.submit(prompts[i], params[i])
            return (await engine.result(rid)).token_ids

        return await asyncio.gather(*(one(i) for i in range(n)))

    try:
        outs = asyncio.run(arrive_over_time())
        steps = engine.engine.step_stats
        assert max(s["num_seqs"] for s in steps) > 1 and max(s["num_tokens"] for s in steps) <= 96
        assert outs == alone
        assert engine.stats()["kv_blocks_used"] == 0
    finally:
        engine.shutdown()


def test_tight_kv_pool_preempts_without_changing_outputs(checkpoint):
    path = checkpoint("deepseek_v3")
    prompts = random_prompts([9, 14, 5, 11, 8, 13, 6, 10], seed=32)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    roomy = LLM(path, config={"scheduler": {"block_size": 4, "num_kv_blocks": 256}}).generate(prompts, params)
    engine = AsyncEngine(local_cfg(path, num_kv_blocks=24))
    try:
        outs = asyncio.run(engine.generate(prompts, [params] * len(prompts)))
        assert engine.stats()["preemptions"] > 0
        assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    finally:
        engine.shutdown()


def test_cancellation_frees_blocks_and_others_continue(checkpoint):
    engine = AsyncEngine(local_cfg(checkpoint("mixtral"), num_kv_blocks=64))

    async def scenario():
        long_rid = engine.submit(random_prompts([12], seed=33)[0], SamplingParams(max_tokens=200, ignore_eos=True))
        other = engine.submit(random_prompts([7], seed=34)[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        pieces = []
        async for piece in engine.stream(long_rid):
            pieces.append(piece)
            if len(pieces) == 3:
                engine.abort(long_rid)
            if piece.finished:
                break
        out = await engine.result(other)
        return pieces, out

    try:
        pieces, out = asyncio.run(scenario())
        assert pieces[-1].finished and pieces[-1].finish_reason == "abort"
        assert sum(len(p.token_ids) for p in pieces) < 200
        assert len(out.token_ids) == 30
        deadline = time.time() + 5
        while engine.stats()["kv_blocks_used"] and time.time() < deadline:
            time.sleep(0.01)
        assert engine.stats()["kv_blocks_used"] == 0
    finally:
        engine.shutdown()


def test_overlong_prompt_is_refused_while_others_complete(checkpoint):
    engine = AsyncEngine(local_cfg(checkpoint("llama"), num_kv_blocks=64, max_model_len=32))

    async def scenario():
        good = [engine.submit(p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
                for p in random_prompts([5, 9], seed=35)]
        with pytest.raises(RequestError, match="max_model_len is 32"):
            engine.submit(list(range(2, 50)), SamplingParams(max_tokens=8))
        return [await engine.result(r) for r in good]

    try:
        outs = asyncio.run(scenario())
        assert [len(o.token_ids) for o in outs] == [8, 8]
    finally:
        engine.shutdown()


def test_streaming_delivers_each_token_once_in_order_then_ends(checkpoint, ray_cluster):
    path = checkpoint("qwen2_moe")
    prompt = random_prompts([10], seed=36)[0]
    params = SamplingParams(max_tokens=17, temperature=0, ignore_eos=True)
    expected = LLM(path, config={"scheduler": {"block_size": 4}}).generate([prompt], params)[0].token_ids
    llm = LLM(path, config={"parallel": {"executor": "ray", "tensor": 2}, "scheduler": {"block_size": 4}})
    try:
        pieces = list(llm.stream(prompt, params))
        assert [t for p in pieces for t in p.token_ids] == expected
        assert all(len(p.token_ids) == 1 for p in pieces)  # one token per step, none repeated
        assert pieces[-1].finished and pieces[-1].finish_reason == "length"
        assert not any(p.finished for p in pieces[:-1])
        # an abandoned stream is cancelled and frees its KV in the router
        gen = llm.stream(prompt, SamplingParams(max_tokens=500, ignore_eos=True))
        next(gen)
        gen.close()
        import ray

        deadline = time.time() + 10
        while ray.get(llm.router.stats.remote())["kv_blocks_used"] and time.time() < deadline:
            time.sleep(0.05)
        assert ray.get(llm.router.stats.remote())["kv_blocks_used"] == 0
    finally:
        llm.shutdown()


def test_dspark_run_writes_a_report(checkpoint, tmp_path):
    path = checkpoint("deepseek_v3")
    cmd = [sys.executable, "-m", "dspark_cluster.cli", "run", "--no-progress", "--set", f"model.path={path}",
           "--set", "workload.kind=synthetic", "--set", "workload.num_requests=12", "--set", "workload.prompt_len=[4,40]",
           "--set", "workload.output_len=[2,12]", "--set", "workload.request_rate=50", "--set", f"report.out_dir={tmp_path}",
           "--set", "report.name=t"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "output tokens/s" in res.stdout and "TTFT p50 / p99" in res.stdout
    for f in ("report.json", "requests.csv", "latency.png", "kv_usage.png", "step_time.png"):
        assert (tmp_path / "t" / f).stat().st_size > 0
    bad = subprocess.run([sys.executable, "-m", "dspark_cluster.cli", "run", "--set", "scheduler.block_size=-4"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "scheduler.block_size" in bad.stderr
