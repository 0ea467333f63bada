"""Speculative decoding is lossless: greedy outputs are identical, sampled outputs keep the
target's law, and a failing drafter only costs speed."""

import time

import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from dspark_cluster import LLM, SamplingParams

from conftest import random_prompts

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def spec_config(method, draft=None, k=4, **parallel):
    cfg = {"scheduler": {"block_size": 4, "num_kv_blocks": 256}, "parallel": parallel,
           "speculative": {"method": method, "num_tokens": k}}
    if draft is not None:
        cfg["speculative"]["draft_model"] = str(draft)
    return cfg


@pytest.fixture(scope="module")
def prompts():
    p = random_prompts([5, 17, 9, 28], seed=41)
    p.append([7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9])  # repetitive: n-gram lookup finds drafts
    return p


@pytest.mark.parametrize("method", ["ngram", "draft_model", "draft_model_poor"])
def test_greedy_output_is_identical_with_speculation(method, checkpoint, prompts):
    target = checkpoint("qwen3_moe")
    base = [o.token_ids for o in LLM(target, config={"scheduler": {"block_size": 4}}).generate(prompts, GREEDY)]
    draft = {"ngram": None, "draft_model": target, "draft_model_poor": checkpoint("llama")}[method]
    llm = LLM(target, config=spec_config(method.removesuffix("_poor"), draft))
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == base
    stats = llm.engine.drafter.stats.summary()
    assert stats["verify_rounds"] > 0 and stats["num_draft_tokens"] > 0
    if method == "draft_model":  # the target drafting for itself: everything is accepted
        assert stats["num_accepted_tokens"] == stats["num_draft_tokens"]
    assert sum(o.metrics["num_draft_tokens"] for o in outs) == stats["num_draft_tokens"]
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) == stats["num_accepted_tokens"]


def test_k_zero_is_plain_decoding(checkpoint, prompts):
    target = checkpoint("mixtral")
    base = LLM(target, config={"scheduler": {"block_size": 4}}).generate(prompts, GREEDY)
    llm = LLM(target, config=spec_config("ngram", k=0))
    assert llm.engine.drafter is None and llm.engine.scheduler.lookahead == 0
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [o.token_ids for o in base]


def test_speculation_switches_off_per_request_and_globally(checkpoint, prompts):
    target = checkpoint("deepseek_v3")
    llm = LLM(target, config=spec_config("draft_model", target))
    off = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, speculative=False)
    outs = llm.generate(prompts, off)
    assert all(o.metrics["num_draft_tokens"] == 0 for o in outs)
    k1 = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, num_speculative_tokens=1))
    assert [o.token_ids for o in k1] == [o.token_ids for o in outs]
    assert all(o.metrics["num_draft_tokens"] <= 11 for o in k1) and sum(o.metrics["num_draft_tokens"] for o in k1) > 0
    llm.engine.set_speculation(False)
    outs2 = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert all(o.metrics["num_draft_tokens"] == 0 for o in outs2)
    assert [o.token_ids for o in outs2] == [o.token_ids for o in outs]
    llm.engine.set_speculation(True)
    outs3 = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert sum(o.metrics["num_draft_tokens"] for o in outs3) > 0
    assert [o.token_ids for o in outs3] == [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A peaky 8-token target and drafters over the same vocabulary, so 3-token sequences have
    few enough outcomes for a chi-square test on 3000 samples."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(seed, scale, name):
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=2, initializer_range=scale,
                          max_position_embeddings=64, eos_token_id=None, bos_token_id=None)
        path = tmp_path_factory.mktemp(name)
        LlamaForCausalLM(cfg).save_pretrained(str(path))
        return path

    return {"target": make(0, 0.35, "t8"), "poor": make(7, 0.5, "p8"), "mild": make(3, 0.2, "m8")}


def joint_counts(outs):
    counts = {}
    for o in outs:
        key = tuple(o.token_ids[:3])
        counts[key] = counts.get(key, 0) + 1
    return counts


def two_sample_pvalue(a: dict, b: dict) -> float:
    keys = sorted(set(a) | set(b), key=lambda k: -(a.get(k, 0) + b.get(k, 0)))
    big = [k for k in keys if a.get(k, 0) + b.get(k, 0) >= 10]
    rest = [k for k in keys if k not in big]
    table = [[a.get(k, 0) for k in big] + [sum(a.get(k, 0) for k in rest)],
             [b.get(k, 0) for k in big] + [sum(b.get(k, 0) for k in rest)]]
    table = [row for row in zip(*table) if sum(row) > 0]
    return chi2_contingency(list(zip(*table)))[1]


@pytest.mark.parametrize("drafter, k, top_p", [("ngram", 2, 1.0), ("target", 2, 1.0), ("poor", 3, 1.0),
                                                ("mild", 2, 1.0), ("poor", 2, 0.8)])
def test_sampling_is_lossless(drafter, k, top_p, small_vocab):
    n = 3000
    prompt = [1, 5, 2, 3, 1, 5, 2]
    params = SamplingParams(max_tokens=3, temperature=1.0, top_p=top_p, ignore_eos=True)
    sched = {"block_size": 4, "num_kv_blocks": 2048, "max_num_seqs": 512, "max_num_batched_tokens": 8192}
    base = LLM(small_vocab["target"], config={"scheduler": sched}).generate([prompt] * n, params)
    method = "ngram" if drafter == "ngram" else "draft_model"
    cfg = {"scheduler": sched, "speculative": {"method": method, "num_tokens": k}}
    if method == "draft_model":
        cfg["speculative"]["draft_model"] = str(small_vocab[drafter])
    llm = LLM(small_vocab["target"], config=cfg)
    spec = llm.generate([prompt] * n, params)
    stats = llm.engine.drafter.stats.summary()
    assert stats["num_draft_tokens"] > n / 20  # speculation really ran (at most 1 draft fits before the 3rd token)
    assert two_sample_pvalue(joint_counts(base), joint_counts(spec)) > 0.001
    if top_p == 1.0:  # the first token's law is the target's softmax
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(small_vocab["target"]), dtype=torch.float32)
        with torch.no_grad():
            law = hf(torch.tensor([prompt])).logits[0, -1].double().softmax(-1).numpy()
        first = torch.bincount(torch.tensor([o.token_ids[0] for o in spec]), minlength=8).numpy()
        keep = law * n >= 5
        expected = law[keep] / law[keep].sum() * first[keep].sum()
        assert chisquare(first[keep], expected).pvalue > 0.001


@pytest.mark.parametrize("tensor", [1, 2])
def test_greedy_identical_through_ray_with_drafter_actors(tensor, checkpoint, prompts, ray_cluster):
    target = checkpoint("deepseek_v3")
    base = [o.token_ids for o in LLM(target, config={"scheduler": {"block_size": 4}}).generate(prompts, GREEDY)]
    for method in ("ngram", "draft_model"):
        llm = LLM(target, config=spec_config(method, checkpoint("llama") if method == "draft_model" else None,
                                             executor="ray", tensor=tensor))
        try:
            outs = llm.generate(prompts, GREEDY)
            assert [o.token_ids for o in outs] == base
            assert sum(o.metrics["num_draft_tokens"] for o in outs) > 0
        finally:
            llm.shutdown()


def test_killing_the_drafter_mid_run_loses_nothing(checkpoint, ray_cluster):
    import ray
    from ray.util.state import list_actors

    target = checkpoint("qwen2_moe")
    prompts = random_prompts([6, 11, 4, 9, 14, 7, 5, 12], seed=42)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    base = [o.token_ids for o in LLM(target, config={"scheduler": {"block_size": 4}}).generate(prompts, params)]
    llm = LLM(target, config=spec_config("draft_model", checkpoint("llama"), executor="ray"))
    try:
        ref = llm.router.generate.remote(prompts, [params] * len(prompts))
        time.sleep(1.0)
        drafters = [a for a in list_actors(filters=[("state", "=", "ALIVE")]) if a.class_name == "Drafter"]
        assert drafters
        for a in drafters:
            ray.kill(ray.get_actor(a.name), no_restart=True)
        outs = ray.get(ref, timeout=300)
        assert [o.token_ids for o in outs] == base
    finally:
        llm.shutdown()
