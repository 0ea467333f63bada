"""Sharded execution through Ray: TP attention + EP MoE over gloo match transformers."""

import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_cluster import CheckpointError, ConfigError, LLM, SamplingParams
from dspark_cluster.step import StepInput

from conftest import alive_actors, hf_model, random_prompts

LENGTHS = [6, 13, 3]
DECODE_STEPS = 4


def ray_llm(path, tensor, **sched):
    sched = {"block_size": 4, "num_kv_blocks": 64, **sched}
    return LLM(path, config={"parallel": {"executor": "ray", "tensor": tensor}, "scheduler": sched})


def step_input(tokens, context_lens, tables, block_size=4):
    """A StepInput that scores every sequence's last token greedily."""
    q = torch.tensor([len(t) for t in tokens])
    n = len(tokens)
    return StepInput(
        input_ids=torch.tensor(sum(tokens, [])), query_lens=q, context_lens=torch.tensor(context_lens),
        block_tables=tables, sample_rows=torch.arange(n), temperature=torch.zeros(n), top_k=torch.zeros(n, dtype=torch.long),
        top_p=torch.ones(n), seeds=torch.full((n,), -1), positions_out=torch.zeros(n, dtype=torch.long), block_size=block_size,
    )


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen2_moe", "mixtral"])
@pytest.mark.parametrize("tensor", [1, 2, 4])
def test_sharded_logits_and_greedy_match_transformers(arch, tensor, checkpoint, ray_cluster):
    path = checkpoint(arch)
    hf = hf_model(path)
    prompts = random_prompts(LENGTHS, seed=21)
    feed = random_prompts([DECODE_STEPS] * len(LENGTHS), seed=22)
    llm = ray_llm(path, tensor)
    try:
        import ray

        class cluster:  # the Cluster lives in the Router actor
            debug_logits = staticmethod(lambda step: ray.get(llm.router.debug_logits.remote(step)))
        tables = torch.arange(len(LENGTHS) * 8).view(len(LENGTHS), 8)  # 8 blocks of 4 per sequence
        errs = []
        with torch.no_grad():
            refs = [hf(torch.tensor([p + f])).logits[0] for p, f in zip(prompts, feed)]
            logits = cluster.debug_logits(step_input(prompts, LENGTHS, tables))
            errs += [float((logits[b] - refs[b][n - 1]).abs().max() / refs[b][n - 1].abs().max())
                     for b, n in enumerate(LENGTHS)]
            for s in range(DECODE_STEPS):
                logits = cluster.debug_logits(step_input([[f[s]] for f in feed], [n + s + 1 for n in LENGTHS], tables))
                errs += [float((logits[b] - refs[b][n + s]).abs().max() / refs[b][n + s].abs().max())
                         for b, n in enumerate(LENGTHS)]
        assert max(errs) <= 1e-4
        # a fresh request stream through the scheduler (the debug steps above used blocks 0..23 only
        # as scratch; the block manager hands out the same pool again)
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
        for p, o in zip(prompts, outs):
            ref = hf.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            assert o.token_ids == ref
    finally:
        llm.shutdown()


@pytest.mark.parametrize("tensor", [2, 4])
def test_each_worker_holds_only_its_shard(tensor, checkpoint, ray_cluster):
    path = checkpoint("deepseek_v3")
    full = load_file(str(path / "model.safetensors"))
    split_names = ("q_b_proj", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head")
    replicated = split = experts = 0
    for name, t in full.items():
        nbytes = t.numel() * t.element_size()
        if ".experts." in name:
            experts += nbytes
        elif any(s in name for s in split_names):
            split += nbytes
        else:
            replicated += nbytes
    llm = ray_llm(path, tensor)
    try:
        reports = __import__("ray").get(llm.router.worker_reports.remote())
        assert len(reports) == tensor
        held = [e for r in reports for e in r["experts"][0]]
        assert sorted(held) == list(range(8))  # every expert on exactly one rank
        for r in reports:
            own_experts = experts * len(r["experts"][0]) // 8
            assert r["param_bytes"] == replicated + split // tensor + own_experts
            assert r["expert_param_bytes"] == own_experts
    finally:
        llm.shutdown()


def test_impossible_topologies_are_refused_before_any_actor_starts(checkpoint, ray_cluster, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    for heads in (8, 16):
        LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=heads, num_key_value_heads=heads)).save_pretrained(
            str(tmp_path / f"h{heads}"))
    path = checkpoint("qwen2_moe")  # 4 heads, 8 experts
    before = alive_actors("ShardWorker")
    with pytest.raises(ConfigError, match="parallel.tensor"):
        ray_llm(path, 3)
    with pytest.raises(ConfigError, match="expert slots"):
        LLM(path, config={"parallel": {"executor": "ray", "tensor": 2}, "eplb": {"num_redundant_experts": 1}})
    with pytest.raises(ConfigError, match="expert slots"):
        LLM(path, config={"parallel": {"executor": "ray", "tensor": 1, "data": 3}})
    with pytest.raises(ConfigError, match="no node has 8 CPU"):
        LLM(tmp_path / "h8", config={"parallel": {"executor": "ray", "tensor": 8}})
    with pytest.raises(ConfigError, match="16 workers.*8 CPU devices"):
        LLM(tmp_path / "h16", config={"parallel": {"executor": "ray", "tensor": 16}})
    assert alive_actors("ShardWorker") <= before  # none started (an earlier test's may still be exiting)


def test_a_worker_that_cannot_load_its_shard_fails_cleanly(checkpoint, ray_cluster, tmp_path):
    src = checkpoint("mixtral")  # 4 experts: with tensor 2, rank 1 holds experts 2 and 3
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors["model.layers.0.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    before = alive_actors("ShardWorker")
    with pytest.raises(CheckpointError, match=r"experts\.3\.w2\.weight.*missing"):
        ray_llm(dst, 2)
    deadline = time.time() + 30
    while alive_actors("ShardWorker") > before and time.time() < deadline:
        time.sleep(0.5)
    assert alive_actors("ShardWorker") == before


def test_tp_groups_stay_on_one_node(checkpoint, ray_cluster):
    path = checkpoint("qwen3_moe")
    a = ray_llm(path, 4)
    try:
        b = ray_llm(path, 4)  # the first group fills one 4-CPU node, so this one must take the other
    except BaseException:
        a.shutdown()
        raise
    try:
        import ray

        nodes_a = {r["node_id"] for r in ray.get(a.router.worker_reports.remote())}
        nodes_b = {r["node_id"] for r in ray.get(b.router.worker_reports.remote())}
        assert len(nodes_a) == 1 and len(nodes_b) == 1 and nodes_a != nodes_b
        # a group on the Router's node steps through a compiled graph; one on another node through
        # plain actor calls (a cross-node compiled-graph channel can abort a raylet, ray#63229)
        for nodes, x in ((nodes_a, a), (nodes_b, b)):
            want = "compiled_graph" if nodes == {ray.get(x.router.node_id.remote())} else "actor_calls"
            assert ray.get(x.router.stats.remote())["step_transport"] == want
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        prompt = random_prompts([5], seed=23)
        assert a.generate(prompt, params)[0].token_ids == b.generate(prompt, params)[0].token_ids
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.parametrize("tensor, data", [(1, 2), (2, 2)])
def test_data_parallel_groups_share_the_experts(tensor, data, checkpoint, ray_cluster):
    """Each data-parallel group runs its own batch with its own KV pool; all groups meet in the
    expert all-to-all, and a group with nothing to do still joins it."""
    import ray

    path = checkpoint("deepseek_v3")
    prompts = random_prompts([6, 11, 4, 9, 14, 7, 5], seed=24)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    base = [o.token_ids for o in LLM(path, config={"scheduler": {"block_size": 4}}).generate(prompts, params)]
    llm = LLM(path, config={"parallel": {"executor": "ray", "tensor": tensor, "data": data}, "scheduler": {"block_size": 4}})
    try:
        assert [o.token_ids for o in llm.generate(prompts, params)] == base
        again = llm.generate(prompts[:1], params)[0]  # the other group idles
        # group 0 ran this prompt before: its first full block comes from that group's prefix cache
        assert again.token_ids == base[0] and again.metrics["num_cached_tokens"] == 4
        reports = ray.get(llm.router.worker_reports.remote())
        held = sorted(e for r in reports for e in r["experts"][0])
        assert len(reports) == tensor * data and held == list(range(8))
        assert ray.get(llm.router.stats.remote())["kv_blocks_used"] == 0
    finally:
        llm.shutdown()


def test_a_step_past_its_timeout_fails_its_requests_loudly(checkpoint, ray_cluster):
    """parallel.step_timeout_s bounds one round to the workers: a round that does not come back in
    time counts as a lost worker (restart); once parallel.max_restarts are spent every request
    fails with an error (never a hang, never a silent loss), and so does the engine's next request."""
    import ray

    from dspark_cluster import DSparkError

    path = checkpoint("qwen3_moe")
    llm = LLM(path, config={"parallel": {"executor": "ray", "tensor": 1, "step_timeout_s": 0.001, "max_restarts": 1},
                            "scheduler": {"block_size": 4, "num_kv_blocks": 64}})
    try:
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        t0 = time.time()
        with pytest.raises(DSparkError, match="max_restarts"):
            llm.generate(random_prompts([60, 60], seed=31), params)
        assert time.time() - t0 < 60
        stats = ray.get(llm.router.stats.remote())
        assert stats["state"] == "failed" and stats["restarts"] == 1
        with pytest.raises(DSparkError, match="stopped after an error"):
            llm.generate(random_prompts([5], seed=32), params)
    finally:
        llm.shutdown()
