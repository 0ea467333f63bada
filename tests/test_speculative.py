"""Speculative decoding is lossless: greedy outputs are identical, sampled outputs keep the
target's law, and a failing drafter only costs speed."""

import functools
import itertools
import time

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from dspark_cluster import LLM, SamplingParams, step_exec
from dspark_cluster.speculative.spec_decode import verify as exact_verify
from dspark_cluster.speculative.verify_budget import StepCost

from conftest import random_prompts, wait_until_drafting, wait_until_drafting_resumes

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def spec_config(method, draft=None, k=4, speculative=None, **parallel):
    cfg = {"scheduler": {"block_size": 4, "num_kv_blocks": 256}, "parallel": parallel,
           "speculative": {"method": method, "num_tokens": k, "schedule": "static", **(speculative or {})}}
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
    """A peaky 8-token target and drafters over the same vocabulary, so that the joint law of 4
    output tokens has few enough likely outcomes for a chi-square test on a few thousand samples."""
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


# ------------------------------------------------------------------------------------ law tests
# A law test samples n seeded requests (request i has seed `seed + i`, so every run draws the same
# samples and gets the same p-value) and tests the joint law of their first LAW_TOKENS output
# tokens against the target's exact law, computed from the transformers model by chained
# conditionals. max_tokens = k + 2: the scheduler lets a round verify at most
# max_tokens - outputs - 1 drafts, so each request's first round after its prefill verifies all k
# (the 1st token comes from the prefill; tokens 2 .. k + 1 are the round's drafts' positions).

LAW_PROMPT = [1, 5, 2, 3, 1, 5, 2]
NGRAM_PROMPT = [6, 4, 7, 3, 0, 7, 2, 7, 5, 5, 6, 2]  # n-gram lookup drafts 2 tokens after almost every 1st token, and
# the target accepts 1.1 of them on average (found by a search over random prompts)
LAW_TOKENS = 4
LAW_P = 0.001  # a law test passes above this p-value
LAW_SCHED = {"block_size": 4, "num_kv_blocks": 2048, "max_num_seqs": 512, "max_num_batched_tokens": 8192}


def seeded(n: int, seed: int, **kw) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, ignore_eos=True, seed=seed + i, **kw) for i in range(n)]


def _nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The sampling law at temperature 1 after top-p, in float64, written out apart from the
    library's filter: a token stays while the mass of the tokens above it is below top_p."""
    p = logits.double().softmax(-1)
    if top_p >= 1.0:
        return p
    sp, order = p.sort(-1, descending=True)
    sp = torch.where(sp.cumsum(-1) - sp < top_p, sp, torch.zeros_like(sp))
    law = torch.zeros_like(p).scatter_(-1, order, sp)
    return law / law.sum(-1, keepdim=True)


@functools.lru_cache(maxsize=None)
def target_joint_law(path: str, prompt: tuple, m: int = LAW_TOKENS, top_p: float = 1.0) -> np.ndarray:
    """P(t_1 .. t_m | prompt) for every t in V^m (index: t_1 .. t_m as a base-V number), from the
    reference transformers model: one forward over all V^(m-1) continuations gives every
    conditional law of t_j given t_<j."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    V = hf.config.vocab_size
    prefixes = torch.tensor(list(itertools.product(range(V), repeat=m - 1)), dtype=torch.long).view(-1, m - 1)
    ids = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], dim=1)
    with torch.no_grad():
        cond = _nucleus(hf(ids).logits[:, len(prompt) - 1 :], top_p)  # [V^(m-1), m, V]
    joint = cond[:, m - 1].clone()
    for j in range(m - 1):
        joint *= cond[torch.arange(len(prefixes)), j, prefixes[:, j]][:, None]
    assert abs(float(joint.sum()) - 1.0) < 1e-9
    return joint.flatten().numpy()


def law_pvalue(outs, target, prompt, top_p: float = 1.0, m: int = LAW_TOKENS, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit of the outputs' first m tokens (jointly) to the target's
    exact law. The cells are chosen from the law alone (those expected at least min_expected times,
    the others pooled into one), so the statistic is chi-square with cells - 1 degrees of freedom
    under the law. A sample the law cannot produce fails outright."""
    law = target_joint_law(str(target), tuple(prompt), m, top_p)
    V, n = round(len(law) ** (1 / m)), len(outs)
    assert all(len(o.token_ids) >= m for o in outs)
    idx = np.zeros(n, dtype=np.int64)
    for j in range(m):
        idx = idx * V + np.array([o.token_ids[j] for o in outs])
    counts = np.bincount(idx, minlength=len(law)).astype(float)
    if counts[law == 0].sum() > 0:
        print(f"law check: {int(counts[law == 0].sum())} of {n} samples have probability 0 under the target's law")
        return 0.0
    big = law * n >= min_expected
    obs, exp = np.append(counts[big], counts[~big].sum()), np.append(law[big], law[~big].sum()) * n
    if exp[-1] < min_expected:  # too little pooled mass for a cell of its own: fold it into the last one
        obs, exp = np.append(obs[:-2], obs[-2:].sum()), np.append(exp[:-2], exp[-2:].sum())
    stat, df = float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1
    p = float(chi2.sf(stat, df))
    print(f"law check: chi2 {stat:.1f} on {df} dof, p {p:.3g} ({n} samples, first {m} tokens)")
    return p


def full_rounds(llm, k: int) -> int:
    """Verify rounds that verified k drafts or more."""
    return llm.engine.drafter.stats.proposed[k - 1]


def first_position_law_verify(target_logits, draft_tokens, num_draft, draft_probs, *args):
    """A wrong verifier (the law tests must fail on it): position 0's draft law stands in for the
    draft law at every position, in the acceptance ratio and in the residual."""
    if draft_probs is not None:
        draft_probs = draft_probs[:, :1].expand_as(draft_probs)
    return exact_verify(target_logits, draft_tokens, num_draft, draft_probs, *args)


def sampling_law_pvalue(small_vocab, drafter: str, k: int, top_p: float, n: int = 3000, seed: int = 0) -> float:
    """Speculation with `drafter` ("ngram" or a small_vocab drafter), k drafts a round: the p-value
    of the output law against the target's, after checking that rounds verifying all k ran."""
    prompt = NGRAM_PROMPT if drafter == "ngram" else LAW_PROMPT
    method = "ngram" if drafter == "ngram" else "draft_model"
    cfg = {"scheduler": LAW_SCHED, "speculative": {"method": method, "num_tokens": k, "schedule": "static"}}
    if method == "draft_model":
        cfg["speculative"]["draft_model"] = str(small_vocab[drafter])
    llm = LLM(small_vocab["target"], config=cfg)
    spec = llm.generate([prompt] * n, seeded(n, seed, max_tokens=k + 2, top_p=top_p))
    assert full_rounds(llm, k) >= n / 2, llm.engine.drafter.stats.proposed  # most first rounds verify all k
    assert sum(o.metrics["num_draft_tokens"] for o in spec) == llm.engine.drafter.stats.summary()["num_draft_tokens"]
    p = law_pvalue(spec, small_vocab["target"], prompt, top_p)
    print(f"law p-value {p:.3g} ({drafter}, k={k}, top_p={top_p}, drafts by position "
          f"{llm.engine.drafter.stats.proposed}, accepted {llm.engine.drafter.stats.accepted})")
    return p


@pytest.mark.parametrize("drafter, k, top_p", [("ngram", 2, 1.0), ("target", 2, 1.0), ("poor", 3, 1.0),
                                                ("mild", 2, 1.0), ("poor", 2, 0.8)])
def test_sampling_is_lossless(drafter, k, top_p, small_vocab):
    p = sampling_law_pvalue(small_vocab, drafter, k, top_p)
    assert p > LAW_P, p


def test_the_law_test_fails_on_a_verifier_that_reuses_the_first_draft_law(small_vocab, monkeypatch):
    """The law check above has the power to see a wrong verifier at positions past the first."""
    monkeypatch.setattr(step_exec, "verify", first_position_law_verify)
    p = sampling_law_pvalue(small_vocab, "poor", 3, 1.0)
    assert p < LAW_P, p


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


def drafter_names() -> list[str]:
    """Live drafter actors, by name (from the GCS: no dashboard needed)."""
    import ray

    return sorted(n for n in ray.util.list_named_actors() if n.startswith("dspark-drafter-"))


@pytest.mark.parametrize("draft_tensor", [1, 2])
def test_killing_the_drafter_mid_run_loses_nothing(draft_tensor, checkpoint, ray_cluster):
    """draft_tensor 1: every drafter dies. draft_tensor 2: one rank of the TP group dies while its
    partner may be waiting for it in a collective; the group is dropped at once, not at the timeout."""
    import ray

    target = checkpoint("qwen2_moe")
    prompts = random_prompts([6, 11, 4, 9, 14, 7, 5, 12], seed=42)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    base = [o.token_ids for o in LLM(target, config={"scheduler": {"block_size": 4}}).generate(prompts, params)]
    llm = LLM(target, config=spec_config("draft_model", checkpoint("llama"), executor="ray",
                                         speculative={"draft_tensor": draft_tensor, "draft_workers": draft_tensor}))
    try:
        ref = llm.router.generate.remote(prompts, [params] * len(prompts))
        wait_until_drafting(llm)  # drafting has begun
        drafters = ray.get(llm.router.drafter_names.remote())
        assert len(drafters) == draft_tensor
        victims = drafters if draft_tensor == 1 else [a for a in drafters if a.endswith("-1")]  # TP rank 1
        assert victims
        t0 = time.monotonic()
        for name in victims:
            ray.kill(ray.get_actor(name), no_restart=True)
        outs = ray.get(ref, timeout=300)
        assert [o.token_ids for o in outs] == base
        assert time.monotonic() - t0 < 30  # the drafter's timeout: the failure was seen, not waited out
        stats = ray.get(llm.router.stats.remote())
        assert stats["speculative"]["drafter_failures"] == 1 and stats["drafter_restarts"] == 1
        # a new drafter group starts in the background and takes over at a step boundary
        wait_until_drafting_resumes(llm, prompts[0], params, base[0], "drafter group")
        new = ray.get(llm.router.drafter_names.remote())
        assert len(new) == draft_tensor and not set(new) & set(drafters)
    finally:
        llm.shutdown()


# ---- a tensor-parallel drafter group (speculative.draft_tensor) ------------------------------------

BAD_DRAFT_TP = [
    ({"draft_tensor": 2, "draft_workers": 3}, "speculative.draft_workers: got 3"),
    ({"draft_tensor": 3, "draft_workers": 3},
     "speculative.draft_tensor: got 3; it must divide the draft model's 4 attention heads"),
    ({"draft_tensor": 0}, "speculative.draft_tensor: got 0"),
    ({"draft_tensor": 2, "draft_workers": 2, "method": "ngram"}, "speculative.draft_tensor: got 2; only method 'draft_model' has a tensor-parallel drafter (got method 'ngram')"),
    ({"draft_tensor": 2, "draft_workers": 2, "executor": "local"}, "set parallel.executor: ray"),
]


@pytest.mark.parametrize("override, message", BAD_DRAFT_TP,
                         ids=["workers_not_a_multiple", "heads_not_divisible", "zero", "ngram", "local_executor"])
def test_bad_draft_tensor_is_refused_naming_the_key(override, message, checkpoint):
    from dspark_cluster import ConfigError, load_config

    override = dict(override)
    executor = override.pop("executor", "ray")
    cfg = spec_config(override.pop("method", "draft_model"), checkpoint("llama"), speculative=override,
                      executor=executor)
    cfg["model"] = {"path": str(checkpoint("qwen3_moe"))}
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    assert message in str(e.value)


class FakeRay:
    """What check_drafter_resources asks of Ray: the cluster's totals and its nodes."""

    def __init__(self, nodes):
        self._nodes = nodes

    def cluster_resources(self):
        keys = {k for n in self._nodes for k in n}
        return {k: float(sum(n.get(k, 0) for n in self._nodes)) for k in keys}

    def nodes(self):
        return [{"Alive": True, "Resources": n} for n in self._nodes]


def test_drafter_resources_are_checked_beside_the_target(checkpoint):
    from dspark_cluster import ConfigError, load_config
    from actors.drafter_group import check_drafter_resources

    def cfg(draft_workers, draft_tensor, **parallel):
        c = spec_config("draft_model", checkpoint("llama"), executor="ray", **parallel,
                        speculative={"draft_workers": draft_workers, "draft_tensor": draft_tensor})
        return load_config({**c, "model": {"path": str(checkpoint("qwen3_moe"))}})

    two_by_four = FakeRay([{"CPU": 4}, {"CPU": 4}])
    assert check_drafter_resources(cfg(4, 2, tensor=2, data=2), two_by_four) == "cpu"  # 4 + 4 CPUs
    with pytest.raises(ConfigError, match="speculative.draft_workers: got 6; .* beside the target's 4, .* has 8"):
        check_drafter_resources(cfg(6, 2, tensor=2, data=2), two_by_four)
    with pytest.raises(ConfigError, match="speculative.draft_tensor: got 4; no node has 4 CPU"):
        check_drafter_resources(cfg(4, 4), FakeRay([{"CPU": 3}] * 3))
    gpus = FakeRay([{"CPU": 8, "GPU": 4}])
    assert check_drafter_resources(cfg(2, 2, tensor=2), gpus) == "cuda"
    assert check_drafter_resources(cfg(4, 2, tensor=2), gpus) == "cpu"  # GPUs only for the target: CPU drafters
    with pytest.raises(ConfigError, match="beside the target's 2, .* has 5"):  # GPU workers take a CPU each too
        check_drafter_resources(cfg(4, 2, tensor=2), FakeRay([{"CPU": 5, "GPU": 4}]))


def test_draft_passes_auto_resolves_for_the_devices_that_draft_on_the_cluster():
    """A Router on a head node without a GPU resolves speculative.draft_passes auto for the devices the
    drafting runs on (the bundled drafter was trained for two passes, auto takes them on CUDA), not for its
    own process; the planner, workers and drafter actors all read the resolved value."""
    from actors.cluster import resolve_on_cluster
    from dspark_cluster import load_config
    from dspark_cluster.speculative.dspark_model import draft_passes_of
    from dspark_cluster.worker import WorkerConfig

    def cfg(**sp):
        return load_config({"parallel": {"executor": "ray"},
                            "speculative": {"method": "dspark", "draft_model": "tiny-dspark", **sp}})

    gpu_workers = FakeRay([{"CPU": 4}, {"CPU": 8, "GPU": 2}])  # the head: no GPU
    if not torch.cuda.is_available():  # what this process alone would resolve
        assert draft_passes_of(cfg()) == 1
    on_target = resolve_on_cluster(cfg(), gpu_workers)
    assert on_target.speculative.draft_passes == 2 and WorkerConfig.of(on_target).draft_passes == 2
    assert draft_passes_of(resolve_on_cluster(cfg(placement="group"), gpu_workers)) == 2  # a GPU for the drafter
    # two drafters and the target need three GPUs: the drafters run on CPUs, one pass
    assert draft_passes_of(resolve_on_cluster(cfg(placement="group", draft_workers=2), gpu_workers)) == 1
    assert draft_passes_of(resolve_on_cluster(cfg(), FakeRay([{"CPU": 8}]))) == 1
    assert resolve_on_cluster(cfg(draft_passes=1), gpu_workers).speculative.draft_passes == 1  # as asked
    plain = load_config({"parallel": {"executor": "ray"}})
    assert resolve_on_cluster(plain, gpu_workers) is plain


def test_tensor_parallel_drafter_group(checkpoint, ray_cluster):
    """Two TP groups of two ranks in one drafter world: process-group facts, half of every split
    weight per rank, proposals equal to the whole model's, and identical tokens on both ranks of a
    group even when their global RNGs differ."""
    import ray

    from dspark_cluster import ConfigError, load_config
    from actors.drafter_group import RayDrafterGroup
    from dspark_cluster.model.spec import load_spec
    from dspark_cluster.speculative.proposers import DraftModelProposer, DraftRequest

    target, draft = checkpoint("qwen3_moe"), checkpoint("llama")

    def cfg(workers, tensor):
        c = spec_config("draft_model", draft, executor="ray",
                        speculative={"draft_workers": workers, "draft_tensor": tensor})
        return load_config({**c, "model": {"path": str(target)}})

    before = drafter_names()
    with pytest.raises(ConfigError, match="speculative.draft_workers: got 12"):  # 12 + 1 > 8 CPUs
        RayDrafterGroup(cfg(12, 4), load_spec(target))
    assert drafter_names() == before  # refused before any drafter started
    whole = DraftModelProposer(draft, load_spec(target), block_size=4)  # the draft_tensor = 1 drafter
    full = whole.memory_report()
    group = RayDrafterGroup(cfg(4, 2), load_spec(target))
    try:
        reports = group.reports
        assert [r["rank"] for r in reports] == [0, 1, 2, 3]
        for r in reports:
            assert (r["world_size"], r["tp_size"], r["tp_rank"], r["backend"]) == (4, 2, r["rank"] % 2, "gloo")
            assert r["tp_ranks"] == [r["rank"] // 2 * 2, r["rank"] // 2 * 2 + 1]
            # really split: the replicated part whole, half of each split tensor, and read no more
            assert r["replicated_param_bytes"] == full["replicated_param_bytes"] > 0
            assert r["split_param_bytes"] * 2 == full["split_param_bytes"]
            assert r["param_bytes"] == r["bytes_read"] < 0.6 * full["param_bytes"]
        assert reports[0]["node_id"] == reports[1]["node_id"] and reports[2]["node_id"] == reports[3]["node_id"]

        prompts = random_prompts([5, 17, 9, 12], seed=43)
        reqs = [DraftRequest(i, p, 4) for i, p in enumerate(prompts)]  # greedy; ids 0..3 cover both groups
        reqs += [DraftRequest(10 + i, p, 3, temperature=1.0, seed=7 + i) for i, p in enumerate(prompts)]
        got, want = group.propose(reqs), whole.propose(reqs)
        for g, w in zip(got, want):
            assert g.tokens == w.tokens and len(g.tokens) in (3, 4)
            torch.testing.assert_close(g.probs, w.probs, atol=1e-5, rtol=0)

        # unseeded sampling draws from each process's global RNG (fresh processes start from the
        # same default seed): give every rank its own, then check that both ranks of each group fed
        # the same tokens, rank 0's, into their KV
        ray.get([a.__ray_call__.remote(lambda self, s: torch.manual_seed(s), 1000 + i)
                 for i, a in enumerate(group.actors)])
        hot = [DraftRequest(20 + i, p, 4, temperature=1.5) for i, p in enumerate(prompts)]
        proposals = group.propose(hot)
        fed = ray.get([a.__ray_call__.remote(lambda self: {s: st.fed for s, st in self.proposer.state.items()})
                       for a in group.actors])
        for r, prop in zip(hot, proposals):
            lead = 2 * (r.seq_id % 2)  # rank 0 of the sequence's group
            assert fed[lead][r.seq_id] == r.token_ids + prop.tokens[:-1]  # the last draft is not fed yet
            assert fed[lead + 1][r.seq_id] == fed[lead][r.seq_id]
        stats = group.comm_stats()
        assert stats[0]["calls"]["broadcast"] == stats[1]["calls"]["broadcast"] > 0
        assert stats[0]["bytes"]["broadcast"] > 0 == stats[1]["bytes"]["broadcast"]
    finally:
        pgs = list(group.placement_groups)
        group.shutdown()
    deadline = time.monotonic() + 30
    while drafter_names() != before and time.monotonic() < deadline:
        time.sleep(0.2)  # actors die asynchronously
    assert drafter_names() == before
    assert all(ray.util.placement_group_table(pg)["state"] == "REMOVED" for pg in pgs)


def test_greedy_identical_with_a_tensor_parallel_drafter(checkpoint, prompts, ray_cluster):
    """draft_tensor 2 (target tensor 1), the target drafting for itself (MLA + MoE, split over the
    drafter's 2 ranks): the same outputs as without speculation, every draft accepted, and the same
    per-request counts as the whole draft model in process (draft_tensor 1)."""
    import ray

    target = checkpoint("deepseek_v3")
    base = [o.token_ids for o in LLM(target, config={"scheduler": {"block_size": 4}}).generate(prompts, GREEDY)]
    whole = LLM(target, config=spec_config("draft_model", target)).generate(prompts, GREEDY)
    llm = LLM(target, config=spec_config("draft_model", target, executor="ray",
                                         speculative={"draft_tensor": 2, "draft_workers": 2}))
    try:
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == base
        for key in ("num_draft_tokens", "num_accepted_tokens"):
            assert [o.metrics[key] for o in outs] == [o.metrics[key] for o in whole]
        assert all(o.metrics["num_accepted_tokens"] == o.metrics["num_draft_tokens"] > 0 for o in outs)
        assert ray.get(llm.router.stats.remote())["speculative"]["drafter_failures"] == 0
    finally:
        llm.shutdown()


class _FixedCost(StepCost):
    """A step cost that live steps do not correct: T(B) = 1 + B / 512 s (a slot is then verified
    when its survival is above about N / (512 + N), one half in a full batch)."""

    def observe(self, num_tokens, seconds):
        pass


def _set_confidences(llm, reads: str) -> None:
    """Replace the drafter's confidences with deliberately wrong ones: 0.95 after (or, for "own",
    at) an even token, 0.05 after an odd one, whatever the drafter's law says."""
    inner = llm.engine.drafter.propose

    def propose(reqs):
        props = inner(reqs)
        for r, p in zip(reqs, props):
            toks = [r.token_ids[-1]] + list(p.tokens)
            src = toks[:-1] if reads == "previous" else toks[1:]
            p.confidences = torch.tensor([0.95 if t % 2 == 0 else 0.05 for t in src])
        return props

    llm.engine.drafter.propose = propose


@pytest.mark.parametrize("reads, lossless", [("previous", True), ("own", False)])
def test_confidence_schedule_is_lossless_with_wrong_confidences(reads, lossless, small_vocab):
    """The verify budget with the confidence schedule on, fed confidences that are badly wrong but
    read only the tokens before their own (what a DSpark confidence head reads): the law is the
    target's. The same test catches the mistake of letting a token's own confidence decide whether
    it is verified (DSpark, Appendix A): that law differs."""
    n = 6000  # the mistake's bias is a few percent of some tokens' mass: enough rounds to see it
    params = seeded(n, 1000, max_tokens=4)  # 2 drafts fit after the 1st token
    # the flattest target: the law test sees most
    cfg = {"scheduler": LAW_SCHED, "speculative": {"method": "draft_model", "num_tokens": 2, "schedule": "confidence",
                                                   "draft_model": str(small_vocab["poor"])}}
    llm = LLM(small_vocab["mild"], config=cfg)
    planner = llm.engine.planner
    planner.step_cost = _FixedCost([1, 512, 4096], [1 + 1 / 512, 2.0, 9.0])
    planner.refit_every = planner.min_rounds = 10**9  # keep the wrong confidences as they are (no STS fit)
    planner.explore_rows = n  # and draft on every row (without outcomes the schedule would learn on a few only)
    planner.prior_acceptance = None  # and go on learning whatever the drafter's cost
    _set_confidences(llm, reads)
    spec = llm.generate([LAW_PROMPT] * n, params)
    steps = list(llm.engine.step_stats)
    drafted, verified = sum(s["num_drafted"] for s in steps), sum(s["num_verified"] for s in steps)
    assert 0 < verified < drafted / 1.5  # the budget cut many drafts and kept others
    assert full_rounds(llm, 2) > 0
    p = law_pvalue(spec, small_vocab["mild"], LAW_PROMPT)
    print(f"law p-value {p:.3g} (confidences reading {reads})")
    assert (p > LAW_P) if lossless else (p < 1e-6), p
