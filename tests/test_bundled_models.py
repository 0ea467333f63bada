"""The shipped model family loads through transformers and through this engine with identical
greedy output, and the default config runs on it."""

import json

import pytest
import torch

from dspark_cluster import LLM, SamplingParams
from dspark_cluster.config import ASSETS_DIR
from dspark_cluster.workload import DEFAULT_PROMPTS, read_prompts


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-draft"])
def test_engine_matches_transformers_on_bundled_checkpoint(name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ASSETS_DIR / name
    tok = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = read_prompts(DEFAULT_PROMPTS)[:4]
    llm = LLM(path, config={"model": {"dtype": "float32"}})
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        ref = hf.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=tok.pad_token_id or 0)[0, ids.shape[1]:].tolist()
        assert out.prompt_token_ids == ids[0].tolist()
        assert out.token_ids == ref
        assert out.text == tok.decode(ref, skip_special_tokens=True)


def test_bundled_target_is_deepseek_v3_moe_and_drafter_shares_vocab():
    target = json.loads((ASSETS_DIR / "tiny-moe" / "config.json").read_text())
    draft = json.loads((ASSETS_DIR / "tiny-draft" / "config.json").read_text())
    assert target["model_type"] == "deepseek_v3" and target["n_routed_experts"] >= 8
    assert target["n_shared_experts"] == 1 and target["first_k_dense_replace"] == 1
    assert draft["vocab_size"] == target["vocab_size"] and draft["num_hidden_layers"] <= 2


def test_bundled_dspark_drafter_is_lossless_and_drafts_well():
    """tiny-dspark on tiny-moe: greedy output identical to plain decoding on held-out prompts, and
    the drafter earns its keep (more than one token per verify round on average)."""
    prompts = read_prompts(DEFAULT_PROMPTS)[:4]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    base = [o.token_ids for o in LLM("tiny-moe").generate(prompts, params)]
    llm = LLM("tiny-moe", config={"speculative": {"method": "dspark", "draft_model": "tiny-dspark", "num_tokens": 4,
                                                   "schedule": "static"}})
    assert [o.token_ids for o in llm.generate(prompts, params)] == base
    stats = llm.engine.drafter.stats.summary()
    assert stats["mean_accepted_length"] > 1.5
