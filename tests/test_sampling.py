"""Per-request sampling: greedy, temperature, top-k, top-p, seeds, and parameter validation."""

import pytest
import torch
from scipy.stats import chisquare

from dspark_cluster import LLM, RequestError, SamplingParams
from dspark_cluster.sampling import ACCEPT, DRAFT, RESIDUAL, SAMPLE, filter_logits, race_sample, sample, seeded_generator

from conftest import random_prompts


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(checkpoint):
    llm = LLM(checkpoint("llama"), config={"scheduler": {"block_size": 4, "num_kv_blocks": 64}})
    p = random_prompts([6], seed=9)[0]
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate([p], params)[0].token_ids
    others = random_prompts([4, 9, 3], seed=10)
    batched = llm.generate([others[0], p, others[1], others[2]], [SamplingParams(max_tokens=8), params,
                                                                   SamplingParams(max_tokens=30), SamplingParams()])
    assert batched[1].token_ids == alone
    other_seed = llm.generate([p], SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True))[0]
    assert other_seed.token_ids != alone


def test_sampled_law_matches_softmax_with_temperature():
    torch.manual_seed(0)
    logits = torch.randn(1, 6) * 2
    n = 20000
    rows = logits.expand(n, 6).contiguous()
    temp = torch.full((n,), 0.7)
    out = sample(rows, temp, torch.zeros(n, dtype=torch.long), torch.ones(n), torch.full((n,), -1), torch.zeros(n, dtype=torch.long))
    observed = torch.bincount(out, minlength=6).numpy()
    expected = (logits[0] / 0.7).double().softmax(-1).numpy()
    expected = expected / expected.sum() * n
    assert chisquare(observed, expected).pvalue > 1e-3


def _stream(seed, position, purpose):
    return torch.rand(8, generator=seeded_generator(seed, position, purpose, "cpu"))


def test_seeded_streams_are_keyed_by_seed_position_and_purpose():
    """One stream per (seed, position, purpose): reproducible, and no two keys share one. The
    formulas this replaced collided: seed * 1000003 + position (target sampling) was the stream of
    seed * 1000003 + 0 * 7919 + salt (verification / drafting) for positions 1..3, and torch's CPU
    generator keeps only a seed's low 32 bits, so seeds 2**32 apart were one stream."""
    assert torch.equal(_stream(5, 7, SAMPLE), _stream(5, 7, SAMPLE))
    keys = [(s, p, u) for s in (0, 1, 5, 5 + 2**32, 2**63 - 1) for p in range(6) for u in (SAMPLE, ACCEPT, RESIDUAL, DRAFT)]
    streams = {tuple(_stream(*key).tolist()) for key in keys}
    assert len(streams) == len(keys)


def test_race_sample_draws_from_the_law_seeded_or_not():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    n = 8000
    rows = probs.expand(n, 4).contiguous()
    expected = probs[0].double().numpy()
    expected = expected / expected.sum() * n
    torch.manual_seed(3)
    unseeded = torch.bincount(race_sample(rows), minlength=4).numpy()
    assert chisquare(unseeded, expected).pvalue > 1e-3
    seeds, positions = list(range(n)), [4] * n  # one draw per seed: independent across seeds
    seeded = race_sample(rows, seeds, positions, DRAFT)
    assert chisquare(torch.bincount(seeded, minlength=4).numpy(), expected).pvalue > 1e-3
    # a seeded row's draw is its own: the same whatever rides with it, and unseeded rows (-1) do not disturb it
    mixed = race_sample(rows[:3], [-1, seeds[7], -1], [0, 4, 0], DRAFT)
    assert mixed[1] == seeded[7]
    # per position: one seed's draws across positions follow the law too
    along = race_sample(rows, [11] * n, list(range(n)), SAMPLE)
    assert chisquare(torch.bincount(along, minlength=4).numpy(), expected).pvalue > 1e-3


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3))
    out = filter_logits(logits, torch.ones(3), torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.7, 0.85]))
    kept = torch.isfinite(out)
    assert kept[0].tolist() == [True, True, False, False, False]  # top-k 2
    assert kept[1].tolist() == [True, True, False, False, False]  # 0.5 + 0.2 reaches 0.7
    assert kept[2].tolist() == [True, True, True, False, False]  # 0.85 needs the third
    n = 4000
    seeds = torch.arange(n)
    draws = sample(logits[1:2].expand(n, 5).contiguous(), torch.ones(n), torch.zeros(n, dtype=torch.long),
                   torch.full((n,), 0.7), seeds, torch.zeros(n, dtype=torch.long))
    assert set(draws.tolist()) == {0, 1}


def test_greedy_rows_ignore_filters_and_take_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [2.0, 0.0, 1.0]])
    out = sample(logits, torch.tensor([0.0, 0.0]), torch.tensor([1, 0]), torch.tensor([0.1, 1.0]),
                 torch.tensor([-1, 5]), torch.tensor([0, 0]))
    assert out.tolist() == [1, 0]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -1}, "top_k"),
        ({"seed": -3}, "seed"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"temprature": 1.0}, "temprature"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(RequestError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_stop_tokens_and_eos(checkpoint):
    llm = LLM(checkpoint("qwen3"), config={"scheduler": {"block_size": 4, "num_kv_blocks": 64}})
    p = random_prompts([5], seed=11)[0]
    free = llm.generate([p], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    stop_at = free[4]
    first = free.index(stop_at)
    out = llm.generate([p], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop_at,), ignore_eos=True))[0]
    assert out.token_ids == free[: first + 1] and out.finish_reason == "stop"
    llm.engine.spec = llm.engine.spec  # eos of this checkpoint is 1
    eos_prompt_out = llm.generate([p], SamplingParams(max_tokens=12, temperature=0))[0]
    if 1 in free:
        assert eos_prompt_out.token_ids == free[: free.index(1) + 1]
    else:
        assert eos_prompt_out.token_ids == free


def test_bad_prompts_are_refused_and_others_keep_running(checkpoint):
    llm = LLM(checkpoint("llama"), config={"scheduler": {"block_size": 4, "num_kv_blocks": 32, "max_model_len": 64}})
    with pytest.raises(RequestError, match="max_model_len"):
        llm.generate([list(range(2, 80))], SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.generate([[5, 100000]], SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="no tokenizer"):
        llm.generate(["hello"], SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=4))
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    assert llm.engine.block_manager.num_free == llm.engine.num_blocks
    # max_model_len caps generation
    long = llm.generate([list(range(2, 60))], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0]
    assert len(long.token_ids) == 64 - 58 and long.finish_reason == "length"
