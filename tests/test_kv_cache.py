"""Paged KV: block reuse, many sequences sharing one pool, one sequence over many blocks, preemption."""

import torch

from dspark_cluster import LLM, SamplingParams
from dspark_cluster.kv_cache import BlockManager

from conftest import hf_model, random_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_block_manager_reuses_freed_blocks():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.allocate(1, 9) == [0, 1, 2]  # 9 tokens -> 3 blocks
    assert not bm.can_allocate(2, 8)
    bm.free(1)
    assert bm.num_free == 4
    table = list(bm.allocate(2, 8))
    assert set(table) <= {0, 1, 2}  # freed blocks are handed out again
    assert len(table) == 2 and bm.num_free == 2
    grown = bm.allocate(2, 9)
    assert grown[:2] == table and len(grown) == 3  # grows by one block, keeps the old ones
    assert bm.blocks_needed(2, 12) == 0 and bm.blocks_needed(2, 13) == 1


def test_many_sequences_share_the_pool_and_blocks_come_back(checkpoint):
    llm = LLM(checkpoint("qwen3_moe"), config={"scheduler": {"block_size": 4, "num_kv_blocks": 64}})
    bm = llm.engine.block_manager
    prompts = random_prompts([3, 9, 14, 6, 11, 2, 8, 5], seed=5)
    outs = llm.generate(prompts, GREEDY)
    assert all(len(o.token_ids) == 12 for o in outs)
    peak = max(s["kv_blocks_used"] for s in llm.engine.step_stats)
    assert peak >= sum(-(-(len(p) + 1) // 4) for p in prompts)  # all ran at once, each in its own blocks
    assert bm.num_free == bm.num_blocks and not bm.block_tables
    # the freed blocks serve the next batch, with the same outputs as before
    again = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


def test_one_sequence_spans_many_blocks(checkpoint):
    path = checkpoint("deepseek_v3")
    llm = LLM(path, config={"scheduler": {"block_size": 2, "num_kv_blocks": 64}})
    prompt = random_prompts([21], seed=6)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    assert max(s["kv_blocks_used"] for s in llm.engine.step_stats) == (21 + 40 - 1 + 1) // 2  # 30 blocks
    ref = hf_model(path).generate(
        torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, 21:].tolist()
    assert out.token_ids == ref


def test_pool_too_small_preempts_and_outputs_stay_identical(checkpoint):
    path = checkpoint("mixtral")
    prompts = random_prompts([10, 13, 7, 12, 9, 11], seed=7)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    roomy = LLM(path, config={"scheduler": {"block_size": 4, "num_kv_blocks": 128}}).generate(prompts, params)
    tight = LLM(path, config={"scheduler": {"block_size": 4, "num_kv_blocks": 20}})
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert sum(o.metrics["num_preemptions"] for o in outs) == tight.engine.scheduler.num_preemptions


def test_chunked_prefill_matches_whole_prefill(checkpoint):
    path = checkpoint("qwen2_moe")
    prompts = random_prompts([40, 33, 5], seed=8)
    whole = LLM(path, config={"scheduler": {"block_size": 4, "num_kv_blocks": 96}}).generate(prompts, GREEDY)
    chunked = LLM(path, config={"scheduler": {"block_size": 4, "num_kv_blocks": 96, "max_num_batched_tokens": 16}})
    outs = chunked.generate(prompts, GREEDY)
    assert max(s["num_tokens"] for s in chunked.engine.step_stats) <= 16
    assert [o.token_ids for o in outs] == [o.token_ids for o in whole]
