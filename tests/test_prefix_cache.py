"""Prefix caching: hashed, reference-counted KV blocks shared by prompts that start alike."""

from __future__ import annotations

import asyncio
import random

import pytest

from dspark_cluster import LLM, SamplingParams
from dspark_cluster.async_engine import AsyncEngine
from dspark_cluster.config import ASSETS_DIR, load_config
from dspark_cluster.kv_cache import BlockManager, block_hashes

TINY = ASSETS_DIR / "tiny-moe"
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def shared_prompts(n: int, prefix_len: int = 100, suffix_len: int = 7, seed: int = 0) -> list[list[int]]:
    r = random.Random(seed)
    prefix = [r.randrange(3, 2000) for _ in range(prefix_len)]
    return [prefix + [r.randrange(3, 2000) for _ in range(suffix_len)] for _ in range(n)]


def test_block_manager_shares_counts_and_evicts_least_recently_freed():
    bm = BlockManager(6, 4, prefix_caching=True)
    a = list(range(100, 110))  # 2 full blocks + 2 tokens
    bm.allocate(1, len(a))
    bm.commit(1, a, len(a))
    assert len(bm.cached) == 2 and bm.block_hash[bm.block_tables[1][2]] is None  # the partial block is not cached
    # a prompt with the same first block only shares that one (the hash names the whole prefix)
    b = a[:4] + [7, 7, 7, 7, 7]
    assert bm.match_prefix(2, b, len(b) - 1) == 4 and bm.block_tables[2] == bm.block_tables[1][:1]
    assert bm.ref_counts[bm.block_tables[1][0]] == 2
    # never past max_tokens: the last prompt token is always computed
    assert bm.match_prefix(3, a[:8], 7) == 4
    for sid in (1, 2, 3):
        bm.free(sid)
    assert sum(bm.ref_counts) == 0 and bm.num_free == 6 and len(bm.cached) == 2  # freed, still cached
    # under pressure the least recently freed go first: the never-used blocks, then seq 1's tail, last its head
    head, second = bm.cached[block_hashes(a, 4, 1)[0]], bm.cached[block_hashes(a, 4, 2)[1]]
    bm.allocate(9, 4 * 4)  # 4 blocks: 3 never cached + seq 1's last (uncached) block
    assert set(bm.cached.values()) == {head, second} and bm.num_evicted == 0
    bm.allocate(10, 4)  # the next in line: the second block (freed before the head)
    assert set(bm.cached.values()) == {head} and bm.num_evicted == 1
    assert bm.match_prefix(11, a, 9) == 4  # the head is still there
    bm.free(9), bm.free(10), bm.free(11)
    assert sum(bm.ref_counts) == 0 and bm.num_free == 6


def test_outputs_identical_with_and_without_caching_and_blocks_come_back():
    prompts = shared_prompts(6)
    on = LLM(TINY, config={"scheduler": {"block_size": 16, "num_kv_blocks": 256}})
    off = LLM(TINY, config={"scheduler": {"block_size": 16, "num_kv_blocks": 256, "prefix_caching": False}})
    try:
        first = on.generate(prompts[:1], GREEDY)  # computes and caches the prefix
        rest = on.generate(prompts[1:], GREEDY)  # reuse it
        base = off.generate(prompts, GREEDY)
        assert [o.token_ids for o in first + rest] == [o.token_ids for o in base]
        assert first[0].metrics["num_cached_tokens"] == 0
        assert [o.metrics["num_cached_tokens"] for o in rest] == [96] * 5  # 6 full blocks of the 100-token prefix
        assert all(o.metrics["num_cached_tokens"] == 0 for o in base)
        bm = on.engine.block_manager
        assert sum(bm.ref_counts) == 0 and bm.num_used == 0 and not bm.block_tables  # every request ended
        load = on.engine.load()
        assert load["prefix_cache_hits"] == 5 * 96 and load["prefix_cache_queries"] == 6 * 106
        # an aborted request (a stream left early) gives its blocks back too
        for piece in on.stream(prompts[2], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)):
            assert piece.num_cached_tokens == 96
            break
        assert sum(bm.ref_counts) == 0 and not bm.block_tables
    finally:
        on.shutdown()
        off.shutdown()


def test_eviction_and_preemption_under_pressure_keep_outputs():
    """A pool too small for every prefix at once: blocks are evicted and sequences preempted, and
    the outputs are still those without caching."""
    prompts = [p for seed in range(4) for p in shared_prompts(3, prefix_len=40, seed=seed)]
    sched = {"block_size": 4, "num_kv_blocks": 40, "max_num_seqs": 6}
    on = LLM(TINY, config={"scheduler": sched})
    off = LLM(TINY, config={"scheduler": {**sched, "prefix_caching": False}})
    try:
        got = [o.token_ids for o in on.generate(prompts, GREEDY)]
        assert got == [o.token_ids for o in off.generate(prompts, GREEDY)]
        load = on.engine.load()
        assert load["prefix_cache_evictions"] > 0 and load["prefix_cache_hits"] > 0
        bm = on.engine.block_manager
        assert sum(bm.ref_counts) == 0 and not bm.block_tables
    finally:
        on.shutdown()
        off.shutdown()


@pytest.mark.parametrize("placement,window", [("target", 32), ("group", 32), ("target", "auto"), ("group", "auto")])
def test_a_dspark_request_caches_up_to_32_tokens_before_the_prompts_end(placement, window):
    """DSpark drafts from the target's states of its context tokens, which a cached prefix does not produce:
    a request that speculates takes cached blocks only up to 32 tokens before its prompt's end (the context
    window, if smaller: PREFIX_RECOMPUTE_ROWS) and computes the rest; its drafter's context starts there (its
    blocks read no row before: with the window of 512 of tiny-dspark's config, fewer rows than the window),
    it drafts, and its output is plain decoding's."""
    prompts = shared_prompts(3)  # 96 shared tokens, then each its own (106 in all)
    cfg = {"scheduler": {"block_size": 16, "num_kv_blocks": 256},
           "speculative": {"method": "dspark", "draft_model": "tiny-dspark", "schedule": "static",
                           "context_window": window, "placement": placement}}
    base = LLM(TINY, config={"scheduler": {"block_size": 16, "num_kv_blocks": 256, "prefix_caching": False}})
    want = [o.token_ids for o in base.generate(prompts, GREEDY)]
    base.shutdown()
    llm = LLM(TINY, config=cfg)
    try:
        first = llm.generate(prompts[:1], GREEDY)[0]
        assert first.metrics["num_cached_tokens"] == 0
        outs = llm.generate(prompts[1:], GREEDY)
        # 105 tokens before the last, less 32: 73, i.e. 4 whole blocks of the shared 96
        assert [o.metrics["num_cached_tokens"] for o in outs] == [64, 64]
        assert [first.token_ids] + [o.token_ids for o in outs] == want
        assert all(o.metrics["num_draft_tokens"] > 0 for o in outs)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("placement", ["target", "group"])
def test_a_dspark_request_admitted_while_nothing_drafts_takes_every_cached_block(placement):
    """At a load where the confidence schedule drafts nothing a speculating request takes every cached block,
    as plain decoding (recomputing its prompt's last 32 tokens there was a cost for no drafts: through Ray,
    prefix caching on, DSpark read 0.76x of plain at 8 rows and 0.83x at 64, drafting nothing); when drafting
    resumes its drafter's context starts at the prompt's end, and outputs are plain decoding's."""
    from test_idle_drafter import PatternPlanner

    prompts = shared_prompts(3)
    sched = {"block_size": 16, "num_kv_blocks": 256}
    base = LLM(TINY, config={"scheduler": {**sched, "prefix_caching": False}})
    want = [o.token_ids for o in base.generate(prompts, GREEDY)]
    base.shutdown()
    llm = LLM(TINY, config={"scheduler": sched, "speculative": {
        "method": "dspark", "draft_model": "tiny-dspark", "num_tokens": 4, "schedule": "confidence",
        "placement": placement}})
    try:
        planner = llm.engine.speculation.planner = PatternPlanner(llm.engine.planner, [0] * 3 + [4] * 200)
        first = llm.generate(prompts[:1], GREEDY)[0]
        planner.calls = 0
        outs = llm.generate(prompts[1:], GREEDY)
        assert [o.metrics["num_cached_tokens"] for o in outs] == [96, 96]  # every shared block
        assert [first.token_ids] + [o.token_ids for o in outs] == want
        assert all(o.metrics["num_draft_tokens"] > 0 for o in outs)
    finally:
        llm.shutdown()


def test_prompt_logprobs_skip_the_cache_and_speculative_requests_recompute_32_tokens():
    """Prompt log-probabilities need every position's law: such requests compute their whole prompt; a DSpark
    request its last 32 tokens (the test above); the others reuse every cached block."""
    prompts = shared_prompts(3)
    cfg = {"scheduler": {"block_size": 16, "num_kv_blocks": 256},
           "speculative": {"method": "dspark", "draft_model": "tiny-dspark", "schedule": "static"}}
    llm = LLM(TINY, config=cfg)
    try:
        llm.generate(prompts[:1], GREEDY)
        spec = llm.generate(prompts[1:2], GREEDY)[0]
        assert spec.metrics["num_cached_tokens"] == 64 and spec.metrics["num_draft_tokens"] > 0
        plain = llm.generate(prompts[2:], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, speculative=False))
        assert plain[0].metrics["num_cached_tokens"] == 96
        lp = llm.generate(prompts[1:2], SamplingParams(max_tokens=2, temperature=0, speculative=False, prompt_logprobs=0))[0]
        assert lp.metrics["num_cached_tokens"] == 0 and all(x is not None for x in lp.prompt_logprobs[1:])
    finally:
        llm.shutdown()


def test_hit_rate_in_the_run_report_and_stats():
    cfg = load_config(None, {"model.path": str(TINY), "scheduler.block_size": 16, "scheduler.num_kv_blocks": 256})
    engine = AsyncEngine(cfg)
    try:
        prompts = shared_prompts(4)
        asyncio.run(engine.generate(prompts[:1], [GREEDY]))
        asyncio.run(engine.generate(prompts[1:], [GREEDY] * 3))
        stats = engine.stats()
        assert stats["prefix_cache_hits"] == 3 * 96 and stats["prefix_cache_queries"] == 4 * 106
        from dspark_cluster.report import summarize

        s = summarize(list(engine.finished), [], 1.0, 256, 0)
        assert s["prefix_cached_tokens"] == 3 * 96
        assert abs(s["prefix_cache_hit_rate"] - 3 * 96 / (4 * 107)) < 1e-9
    finally:
        engine.shutdown()
