"""Faults: a lost worker restarts the target and re-runs the requests in flight; a failing step fails
its own requests only; restarts are bounded; memory for statistics is bounded; bad checkpoints and
remote code are refused."""

import asyncio
import json
import os
import shutil
import signal
import time

import pytest
import torch

from dspark_cluster import LLM, SamplingParams, load_config
from dspark_cluster.async_engine import AsyncEngine
from dspark_cluster.engine import LLMEngine
from dspark_cluster.executor import LocalExecutor
from dspark_cluster.errors import CheckpointError, EngineError, RequestError, StepError, WorkerError

from conftest import alive_actor_pids, random_prompts

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def local_cfg(path, **overrides):
    cfg = {"model": {"path": str(path)}, "scheduler": {"block_size": 4, "num_kv_blocks": 128}}
    for key, value in overrides.items():
        cfg.setdefault(key, {}).update(value)
    return load_config(cfg)


def fail_at(monkeypatch, steps: set, error_of):
    """Make LocalExecutor.submit raise error_of(step_input) at these submission counts (1-based)."""
    calls = {"n": 0}
    real = LocalExecutor.submit

    def submit(self, step):
        calls["n"] += 1
        if calls["n"] in steps:
            raise error_of(step)
        return real(self, step)

    monkeypatch.setattr(LocalExecutor, "submit", submit)
    return calls


def run_all(engine: AsyncEngine, prompts, params):
    """Every request's tokens, or the exception its stream raised."""

    async def one(p):
        rid = engine.submit(p, params)
        try:
            return (await engine.result(rid)).token_ids
        except Exception as e:  # noqa: BLE001
            return e

    async def go():
        return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(go())


def test_a_lost_worker_restarts_the_executor_and_outputs_do_not_change(checkpoint, monkeypatch):
    """The restart path (new executor, every running request recomputed from prompt + tokens so
    far) on the in-process executor: greedy tokens identical to a run without the fault."""
    path = checkpoint("qwen3_moe")
    prompts = random_prompts([7, 12, 5, 9, 15, 4], seed=3)
    base = [o.token_ids for o in LLM(path, config={"scheduler": {"block_size": 4}}).generate(prompts, GREEDY)]
    calls = fail_at(monkeypatch, {9, 17}, lambda step: WorkerError("test: worker lost"))
    import dspark_cluster.recovery as recovery_mod  # where the engine restarts its workers

    seen, make = [], recovery_mod.make_executor

    def make_executor(cfg, spec):  # what /health would say while the new workers start
        seen.append(engine.state())
        return make(cfg, spec)

    engine = AsyncEngine(local_cfg(path, scheduler={"max_num_seqs": 4}))
    monkeypatch.setattr(recovery_mod, "make_executor", make_executor)
    try:
        outs = run_all(engine, prompts, GREEDY)
        assert outs == base
        stats = engine.stats()
        assert [state for state, _ in seen] == ["restarting", "restarting"]
        assert calls["n"] > 17 and stats["restarts"] == 2 and stats["state"] == "ok"
        assert stats["kv_blocks_used"] == 0 and stats["preemptions"] == 0
    finally:
        engine.shutdown()


def test_restarts_are_bounded_then_requests_fail_and_the_engine_reports_failed(checkpoint, monkeypatch):
    path = checkpoint("qwen3_moe")
    fail_at(monkeypatch, set(range(3, 1000)), lambda step: WorkerError("test: worker lost"))
    engine = AsyncEngine(local_cfg(path, parallel={"max_restarts": 2}))
    try:
        outs = run_all(engine, random_prompts([5, 6], seed=4), GREEDY)
        assert all(isinstance(o, EngineError) and "max_restarts" in str(o) for o in outs)
        stats = engine.stats()
        assert stats["state"] == "failed" and stats["restarts"] == 2 and "max_restarts" in stats["error"]
        with pytest.raises(EngineError, match="stopped"):
            asyncio.run(engine.generate(random_prompts([5], seed=5), [GREEDY]))
    finally:
        engine.shutdown()


def test_a_failing_step_fails_its_requests_only(checkpoint, monkeypatch):
    """An error inside one step (not a lost worker) ends that step's requests with an error and
    frees their KV; requests that arrive later are served, with the same tokens as without it."""
    path = checkpoint("qwen3_moe")
    first = random_prompts([6, 8], seed=6)
    later = random_prompts([5, 9, 7], seed=7)
    base = [o.token_ids for o in LLM(path, config={"scheduler": {"block_size": 4}}).generate(later, GREEDY)]
    fail_at(monkeypatch, {3}, lambda step: ValueError("test: a bad step input"))
    engine = AsyncEngine(local_cfg(path))
    try:
        outs = run_all(engine, first, GREEDY)
        assert all(isinstance(o, StepError) for o in outs)
        assert "ValueError" in str(outs[0]) and "test: a bad step input" not in str(outs[0])  # the cause goes to the log
        assert engine.stats()["state"] == "ok" and engine.stats()["kv_blocks_used"] == 0
        assert run_all(engine, later, GREEDY) == base
        assert [r["finish_reason"] for r in list(engine.finished)[:2]] == ["error", "error"]
    finally:
        engine.shutdown()


def test_llm_in_process_raises_the_step_error_and_steps_on(checkpoint, monkeypatch):
    path = checkpoint("qwen3_moe")
    fail_at(monkeypatch, {2}, lambda step: ValueError("test"))
    llm = LLM(path, config={"scheduler": {"block_size": 4, "num_kv_blocks": 64}})
    with pytest.raises(StepError):
        llm.generate(random_prompts([5, 6], seed=8), GREEDY)
    assert llm.engine.block_manager.num_used == 0 and not llm.engine.has_unfinished()
    assert len(llm.generate(random_prompts([5], seed=9), GREEDY)[0].token_ids) == GREEDY.max_tokens


def test_top_k_above_the_vocabulary_is_refused_at_submission(checkpoint):
    engine = LLMEngine(local_cfg(checkpoint("qwen3_moe")))
    with pytest.raises(RequestError, match="top_k"):
        engine.add_request([3, 4], SamplingParams(top_k=10**6))
    with pytest.raises(RequestError, match="seed"):
        SamplingParams(seed=2**63)


def test_statistics_a_server_keeps_are_bounded_and_a_run_keeps_every_step(checkpoint, monkeypatch):
    import dspark_cluster.engine as engine_mod

    monkeypatch.setattr(engine_mod, "STEP_STATS_KEPT", 5)
    path = checkpoint("qwen3_moe")
    engine = AsyncEngine(local_cfg(path))
    try:
        asyncio.run(engine.generate(random_prompts([4, 5], seed=10), [GREEDY] * 2))
        eng = engine.engine
        assert eng.num_steps > 20 and len(eng.step_stats) == 5 and engine.stats()["steps"] == eng.num_steps

        from dspark_cluster.workload import WorkloadRequest as Request

        raw = asyncio.run(engine.run_workload([Request(0.0, [3, 4, 5], GREEDY)]))
        assert len(raw["steps"]) >= GREEDY.max_tokens and len(raw["requests"]) == 1
    finally:
        engine.shutdown()


def test_which_ray_to_use():
    """parallel.ray_address: auto joins RAY_ADDRESS, else a `ray start` instance still running here,
    else none (a private one); local never joins; an address is joined as given."""
    from actors.cluster import ray_address_to_join

    running = lambda: ["10.0.0.5:6379"]  # noqa: E731
    assert ray_address_to_join("auto", "ray://head:10001", lambda: "10.0.0.5:6379", running) == "ray://head:10001"
    assert ray_address_to_join("auto", None, lambda: "10.0.0.5:6379", running) == "10.0.0.5:6379"
    assert ray_address_to_join("auto", "", lambda: "10.0.0.9:6379", running) is None  # stale: not running
    assert ray_address_to_join("auto", None, lambda: None, running) is None
    assert ray_address_to_join("local", "ray://head:10001", lambda: "10.0.0.5:6379", running) is None
    assert ray_address_to_join("head:6379", None, lambda: None, running) == "head:6379"


def test_compiled_graph_only_within_one_node():
    """A cross-node compiled-graph channel closed under a writer aborts the raylet (ray#63229)."""
    from actors.cluster import compiled_graph_wanted

    assert compiled_graph_wanted("auto", {"n1"}, "n1")
    assert not compiled_graph_wanted("auto", {"n2"}, "n1")
    assert not compiled_graph_wanted("auto", {"n1", "n2"}, "n1")
    assert compiled_graph_wanted("on", {"n1", "n2"}, "n1")
    assert not compiled_graph_wanted("off", {"n1"}, "n1")


def test_a_ray_cluster_that_cannot_be_joined_is_a_config_error(monkeypatch, capsys):
    import ray

    from actors.cluster import ensure_ray
    from dspark_cluster.errors import ConfigError

    def refuse(**kw):
        raise ConnectionError("could not connect to the GCS")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    with pytest.raises(ConfigError, match=r"parallel.ray_address.*127\.0\.0\.1:1.*ray status"):
        ensure_ray(2, "127.0.0.1:1")
    assert "joining the Ray cluster at 127.0.0.1:1" in capsys.readouterr().err


# ---- loading --------------------------------------------------------------------------------


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_a_checkpoint_that_ships_its_own_code_never_runs_it(checkpoint, tmp_path, caplog):
    """auto_map (as DeepSeek-V3's official config.json has) is ignored for an architecture we
    implement, with one log line; a tokenizer that only the checkpoint's code can build is refused."""
    import logging

    from dspark_cluster.engine import load_tokenizer
    from dspark_cluster.model.spec import load_spec

    bundled = os.path.join(os.path.dirname(__import__("dspark_cluster").__file__), "assets", "tiny-moe")
    ckpt = copy_checkpoint(bundled, tmp_path / "remote")
    for name in ("tokenization_evil.py", "configuration_evil.py"):
        (ckpt / name).write_text("raise SystemExit('remote code ran')\n")
    tok_cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    tok_cfg["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (ckpt / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig"}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.INFO):
        assert load_spec(ckpt).family == "deepseek_v3"
        assert load_tokenizer(ckpt).encode("hello") == load_tokenizer(bundled).encode("hello")
    ignored = [r.getMessage() for r in caplog.records if "auto_map" in r.getMessage()]
    assert len(ignored) == 2 and all("ignored" in m for m in ignored)
    assert LLM(ckpt).generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))[0].token_ids

    # only the checkpoint's own code could build this tokenizer: refused, never run
    (ckpt / "tokenizer.json").unlink()
    tok_cfg["tokenizer_class"] = "EvilTokenizer"
    (ckpt / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    with pytest.raises(CheckpointError, match="auto_map.*never runs remote code"):
        load_tokenizer(ckpt)


def test_a_transposed_expert_tensor_is_refused_by_name(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt = copy_checkpoint(checkpoint("qwen3_moe"), tmp_path / "transposed")
    weights = load_file(str(ckpt / "model.safetensors"))
    name = next(k for k in weights if ".experts.3.down_proj" in k)
    weights[name] = weights[name].t().contiguous()  # same number of elements, wrong shape
    save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        LLM(ckpt, config={"scheduler": {"num_kv_blocks": 8}})


def test_a_transposed_split_tensor_is_refused_by_name(checkpoint, tmp_path):
    """With tensor parallelism each rank reads a slice; the dimensions it does not split must
    still match the architecture."""
    from safetensors.torch import load_file, save_file

    from dspark_cluster.model.loader import CheckpointReader

    ckpt = copy_checkpoint(checkpoint("llama"), tmp_path / "square")
    weights = load_file(str(ckpt / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"  # [64, 128]
    weights[name] = weights[name].t().contiguous()
    save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        CheckpointReader(ckpt).read(name, 1, 0, 64, expect=torch.Size([64, 64]))


# ---- Ray: kill -9 of a shard worker ----------------------------------------------------------


def shard_worker_pids() -> list[int]:
    return alive_actor_pids("ShardWorker")  # this session's Ray only (conftest.alive_actor_pids says why)


def test_kill_9_of_a_shard_worker_mid_stream_loses_nothing(checkpoint, ray_cluster):
    """Tensor 2: one rank is killed with SIGKILL while requests stream. The Router restarts the
    workers and re-runs the requests in flight; every request completes with the tokens of a run
    without the fault, the KV pool is empty afterwards and the restart is counted."""
    import ray

    path = checkpoint("qwen2_moe")
    prompts = random_prompts([6, 11, 4, 9, 14, 7], seed=12)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    base = [o.token_ids for o in LLM(path, config={"scheduler": {"block_size": 4}}).generate(prompts, params)]
    llm = LLM(path, config={"parallel": {"executor": "ray", "tensor": 2}, "scheduler": {"block_size": 4}})
    try:
        before = set(shard_worker_pids())
        ref = llm.router.generate.remote(prompts, [params] * len(prompts))
        deadline = time.monotonic() + 60
        while ray.get(llm.router.stats.remote())["steps"] < 10:  # mid-stream
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(sorted(before)[-1], signal.SIGKILL)
        outs = ray.get(ref, timeout=300)
        assert [o.token_ids for o in outs] == base
        stats = ray.get(llm.router.stats.remote())
        assert stats["restarts"] == 1 and stats["state"] == "ok" and stats["kv_blocks_used"] == 0
        assert not before & set(shard_worker_pids())  # a whole new set of workers
        again = llm.generate(prompts[:2], params)  # the new workers serve new requests too
        assert [o.token_ids for o in again] == base[:2]
    finally:
        llm.shutdown()
