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


# ---- extreme values are computed as their limits (issue 29) ---------------------------------------------


def _rows(logits, temperature, top_p=1.0):
    B = logits.shape[0]
    return dict(temperature=torch.full((B,), temperature), top_k=torch.zeros(B, dtype=torch.long),
                top_p=torch.full((B,), top_p), seeds=torch.full((B,), -1), positions=torch.zeros(B, dtype=torch.long))


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-8, 9e-6])
def test_a_tiny_temperature_is_greedy(temperature):
    """logits / T overflows fp32 below ~1e-37 (softmax of inf - inf is NaN); the limit T -> 0 is the argmax."""
    torch.manual_seed(3)
    logits = torch.randn(64, 50) * 8
    r = _rows(logits, temperature)
    assert torch.equal(sample(logits, r["temperature"], r["top_k"], r["top_p"], r["seeds"], r["positions"]),
                       logits.argmax(-1))
    assert torch.isfinite(filter_logits(logits, r["temperature"], r["top_k"], r["top_p"])).all()
    p = SamplingParams(temperature=temperature)
    assert p.temperature == 0.0 and p.greedy  # stored as greedy: the drafters and the step read 0
    assert SamplingParams(temperature=1e-3).temperature == 1e-3 and not SamplingParams(temperature=1e-3).greedy


def test_a_top_p_that_rounds_to_zero_keeps_the_top_token():
    """top_p = 1e-300 is 0 in fp32: the nucleus still holds the most likely token, so sampling is the argmax."""
    torch.manual_seed(4)
    logits = torch.randn(64, 50) * 3
    r = _rows(logits, 1.0, top_p=1e-300)
    assert float(r["top_p"][0]) == 0.0
    kept = torch.isfinite(filter_logits(logits, r["temperature"], r["top_k"], r["top_p"]))
    assert kept.sum(-1).tolist() == [1] * 64 and torch.equal(kept.float().argmax(-1), logits.argmax(-1))
    out = sample(logits, r["temperature"], r["top_k"], r["top_p"], r["seeds"], r["positions"])
    assert torch.equal(out, logits.argmax(-1))
    assert SamplingParams(top_p=1e-300).top_p == 1e-300  # valid (> 0): its limit is computed, not refused


def test_verification_treats_a_tiny_temperature_as_greedy():
    """spec_decode.verify with T = 1e-40 rows: no NaN in the rejection sampler; it is greedy verification."""
    from dspark_cluster.speculative.spec_decode import verify

    torch.manual_seed(5)
    S, K, V = 6, 3, 40
    logits = torch.randn(S, K + 1, V) * 6
    drafts = logits[:, :K].argmax(-1)
    drafts[::2, 1] = (drafts[::2, 1] + 1) % V  # some rows' second draft is wrong
    q = torch.full((S, K, V), 1.0 / V)
    args = lambda t: (torch.full((S,), t), torch.zeros(S, dtype=torch.long), torch.ones(S),  # noqa: E731
                      torch.full((S,), -1), torch.zeros(S, dtype=torch.long))
    tiny = verify(logits, drafts, torch.full((S,), K), q, *args(1e-40))
    greedy = verify(logits, drafts, torch.full((S,), K), q, *args(0.0))
    assert torch.equal(tiny[0], greedy[0]) and torch.equal(tiny[1], greedy[1])
    assert tiny[1].tolist() == [2 if s % 2 == 0 else K + 1 for s in range(S)]


def test_a_tiny_temperature_with_speculation_is_greedy_and_finite(checkpoint):
    """The whole path at T = 1e-40 (drafter, verification, log-probabilities): greedy output, finite numbers."""
    import math

    path = checkpoint("qwen3_moe")
    llm = LLM(path, config={"parallel": {"executor": "local"}, "scheduler": {"block_size": 4, "num_kv_blocks": 256},
                            "speculative": {"method": "draft_model", "draft_model": str(path), "num_tokens": 3,
                                            "schedule": "static"}})
    try:
        prompts = random_prompts([5, 9, 12], seed=7)
        greedy = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
        tiny = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=1e-40, ignore_eos=True, logprobs=2))
        assert [o.token_ids for o in tiny] == [o.token_ids for o in greedy]
        assert llm.engine.drafter.stats.summary()["num_draft_tokens"] > 0
        lps = [x for o in tiny for e in o.logprobs for x in (e.logprob, *(lp for _, lp in e.top))]
        assert len(lps) == 3 * 10 * 3 and all(math.isfinite(x) for x in lps)
    finally:
        llm.shutdown()
