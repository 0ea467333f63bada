"""The speculative wire carries what is used: greedy rows ship no draft law, a sampled row's law goes
to the driver rank only (in the drafter's dtype), and a draft request carries the tokens the drafter
has not been sent, not the whole sequence."""

import dataclasses

import pytest
import torch

from dspark_cluster import LLM, SamplingParams, load_config
from dspark_cluster.engine import LLMEngine
from dspark_cluster.speculative.proposers import DraftHistoryError, DraftRequest, SequenceHistory
from dspark_cluster.speculative.spec_decode import verify
from dspark_cluster.step import from_wire, to_wire

from conftest import random_prompts

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def mixed(n: int, max_tokens: int = 14) -> list[SamplingParams]:
    """Odd rows greedy, even rows seeded at temperature 1."""
    return [SamplingParams(max_tokens=max_tokens, temperature=0.0 if i % 2 else 1.0, seed=100 + i, ignore_eos=True)
            for i in range(n)]


def spec_cfg(target, draft, **parallel) -> dict:
    return {"model": {"path": str(target)}, "scheduler": {"block_size": 4, "num_kv_blocks": 256},
            "parallel": parallel,
            "speculative": {"method": "draft_model", "draft_model": str(draft), "num_tokens": 3, "schedule": "static"}}


def record_steps(engine) -> list:
    """Every StepInput the engine submits (and, on Ray, the bytes each rank got), kept in order."""
    seen, submit = [], engine.executor.submit

    def spy(step):
        handle = submit(step)
        seen.append((step, list(getattr(engine.executor, "last_input_bytes", []))))
        return handle

    engine.executor.submit = spy
    return seen


def run(engine, prompts, params) -> list[list[int]]:
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
    return [engine.seqs[r].output_token_ids for r in ids]


def check_laws(steps) -> int:
    """Every law a step carries belongs to a sampled row that drafted; returns the steps with one."""
    with_law = 0
    for step, _ in steps:
        if step.draft_probs is None:
            continue
        with_law += 1
        rows = step.draft_law_rows
        assert step.draft_probs.shape[0] == rows.numel() and step.draft_probs.dtype == torch.float32  # fp32 drafter
        assert bool((step.temperature[rows] > 0).all()), "a greedy row shipped a draft law"
        assert bool((step.num_draft[rows] > 0).all())
        for j, r in enumerate(rows.tolist()):  # a law per drafted position, zero past them
            n = int(step.num_draft[r])
            torch.testing.assert_close(step.draft_probs[j, :n].sum(-1), torch.ones(n))
            assert not step.draft_probs[j, n:].any()
    return with_law


# ------------------------------------------------------------------------------------- in process

def test_greedy_rows_ship_no_draft_law(checkpoint):
    target, draft = checkpoint("qwen3_moe"), checkpoint("llama")
    prompts = random_prompts([5, 12, 9, 7], seed=3)
    with LLM(target, config={"scheduler": {"block_size": 4}}) as plain:
        base = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    eng = LLMEngine(load_config(spec_cfg(target, draft)))
    try:
        steps = record_steps(eng)
        assert run(eng, prompts, [GREEDY] * len(prompts)) == base
        drafted = [s for s, _ in steps if s.draft_tokens is not None]
        assert drafted and all(s.draft_probs is None and s.draft_law_rows is None for s in drafted)
        steps.clear()
        outs = run(eng, prompts, mixed(len(prompts)))  # mixed batches: laws for the sampled rows only
        assert check_laws(steps) > 0
        assert [outs[i] for i in (1, 3)] == [base[i][:14] for i in (1, 3)]  # greedy rows as plain decoding
    finally:
        eng.shutdown()


def test_a_non_driver_rank_gets_no_draft_law():
    """actors/cluster.py: a round's inputs per rank: non-driver ranks none; each driver its group's."""
    from actors.cluster import input_slots, rank_inputs
    from dspark_cluster.step_builder import profile_input

    def step(law: bool):
        s = profile_input(3, 3, 4, 16)
        s.temperature = torch.tensor([0.0, 1.0, 1.0])
        if law:
            s.draft_probs, s.draft_law_rows = torch.rand(2, 2, 50).half(), torch.tensor([1, 2])
        return s

    assert input_slots(4, 2) == [1, 0, 2, 0] and input_slots(2, 1) == [0, 1] and input_slots(1, 1) == [0]
    a = step(True)
    bare, driver = [from_wire(to_wire(x)) for x in rank_inputs(a, 2, 1)]
    assert bare.draft_probs is None and bare.draft_law_rows is None
    assert driver.draft_probs.dtype == torch.float16  # the drafter's dtype, as shipped
    torch.testing.assert_close(driver.draft_probs, a.draft_probs)
    assert len(to_wire(bare)) + a.draft_probs.numel() * 2 <= len(to_wire(driver))
    torch.testing.assert_close(bare.draft_tokens, a.draft_tokens)
    # data parallel: each driver rank gets its own group's law, no other's
    b = step(False)
    slots = rank_inputs([a, b], 2, 2)
    assert [s.draft_probs is None for s in slots[0]] == [True, True]
    assert slots[1][0] is a and slots[1][1].draft_probs is None
    assert slots[2][0].draft_probs is None and slots[2][1] is b
    # a round without a law: one input for every rank
    c = step(False)
    assert all(x is c for x in rank_inputs(c, 2, 1))


def test_verify_reads_a_sparse_law_as_the_dense_one():
    """The law of some rows (the rest one-hot) verifies as the dense [S, K, V] law with one-hot rows."""
    torch.manual_seed(0)
    S, K, V = 6, 3, 11
    logits = torch.randn(S, K + 1, V)
    drafts = torch.randint(0, V, (S, K))
    nd = torch.tensor([3, 2, 0, 3, 1, 3])
    temp = torch.tensor([1.0, 0.0, 1.0, 0.7, 1.0, 1.0])
    law_rows = torch.tensor([0, 3, 4])
    sparse = torch.rand(3, K, V).softmax(-1)
    for j, r in enumerate(law_rows.tolist()):
        sparse[j, nd[r]:] = 0
    dense = torch.zeros(S, K, V)
    for s in range(S):
        dense[s, : nd[s]] = torch.nn.functional.one_hot(drafts[s, : nd[s]], V).float()
    dense[law_rows] = sparse
    params = (temp, torch.zeros(S, dtype=torch.long), torch.ones(S), torch.arange(S) + 5, torch.arange(S))
    for trial in range(20):
        d = drafts.clone()
        d[:, 0] = logits[:, 0].argmax(-1) if trial % 2 else d[:, 0]  # greedy rows accept at times
        dense_t = dense.clone()
        for s in range(S):
            if s not in law_rows.tolist():
                dense_t[s, : nd[s]] = torch.nn.functional.one_hot(d[s, : nd[s]], V).float()
        ref = verify(logits, d, nd, dense_t, *params)
        got = verify(logits, d, nd, sparse, *params, law_rows)
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    # a 16-bit law is read as its renormalised fp32 values
    half = sparse.half()
    full = half.float() / half.float().sum(-1, keepdim=True).clamp(min=1e-30)
    a = verify(logits, drafts, nd, half, *params, law_rows)
    b = verify(logits, drafts, nd, full, *params, law_rows)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_draft_requests_after_the_first_carry_only_new_tokens(checkpoint):
    target, draft = checkpoint("qwen3_moe"), checkpoint("llama")
    prompts = random_prompts([9, 14, 6], seed=5)
    eng = LLMEngine(load_config(spec_cfg(target, draft)))
    try:
        group = eng.speculation.drafter.backend
        sent, resolved = [], []  # what the group is sent (prompt prefills and proposals), in order
        propose, prefill, inner = group.propose, group.prefill_async, group.proposer.propose

        def spy(requests, version=0):
            sent.extend(dataclasses.replace(r, token_ids=list(r.token_ids)) for r in requests)  # as sent now
            return propose(requests, version)

        def spy_prefill(requests):
            sent.extend(dataclasses.replace(r, token_ids=list(r.token_ids)) for r in requests)
            return prefill(requests)

        def spy_inner(requests):
            resolved.extend((r.seq_id, list(r.token_ids)) for r in requests)
            return inner(requests)

        group.propose, group.prefill_async, group.proposer.propose = spy, spy_prefill, spy_inner
        outs = run(eng, prompts, mixed(len(prompts), 16))
        by_seq = {}
        for r in sent:
            by_seq.setdefault(r.seq_id, []).append(r)
        assert len(by_seq) == len(prompts)
        full = {sid: prompts[i] + outs[i] for i, sid in enumerate(sorted(by_seq))}
        for sid, reqs in by_seq.items():
            assert len(reqs) >= 3
            assert reqs[0].start == 0 and reqs[0].token_ids == full[sid][: len(reqs[0].token_ids)]
            for prev, r in zip(reqs, reqs[1:]):
                assert r.start == prev.start + len(prev.token_ids)  # continues where the last one ended
                assert 1 <= len(r.token_ids) <= 4  # the tokens committed since: at most k + 1
                assert r.token_ids == full[sid][r.start : r.start + len(r.token_ids)]
        for sid, tokens in resolved:  # the proposer still sees whole sequences
            assert tokens == full[sid][: len(tokens)]
        assert not group.history.tokens and not eng.speculation.drafter.sent  # freed with their sequences
    finally:
        eng.shutdown()


def test_a_group_that_takes_over_gets_every_sequence_whole(checkpoint):
    """The rule for a restarted drafter group: it holds nothing, so the next request is whole."""
    from dspark_cluster.speculative.drafting import LocalDrafterGroup

    target, draft = checkpoint("qwen3_moe"), checkpoint("llama")
    eng = LLMEngine(load_config(spec_cfg(target, draft)))
    try:
        d = eng.speculation.drafter
        tokens = random_prompts([10], seed=9)[0]
        d.propose([DraftRequest(1, tokens, 2)])
        assert d.sent == {1: 10}
        got = []
        d.backend.propose = lambda reqs, version=0: got.extend(reqs) or [None] * len(reqs)
        d.propose([DraftRequest(1, tokens + [3, 4], 2)])
        assert (got[-1].start, got[-1].token_ids) == (10, [3, 4])
        d._restarted = LocalDrafterGroup(eng.cfg, eng.spec)  # a restarted group takes over
        assert d.poll() and d.sent == {}
        fresh = d.backend
        props = d.propose([DraftRequest(1, tokens + [3, 4, 5], 2)])
        assert fresh.history.tokens[1] == tokens + [3, 4, 5] and len(props[0].tokens) == 2
    finally:
        eng.shutdown()


def test_sequence_history_rule():
    h = SequenceHistory()
    assert [r.token_ids for r in h.resolve([DraftRequest(1, [5, 6, 7], 2)])] == [[5, 6, 7]]
    assert h.resolve([DraftRequest(1, [8], 2, start=3)])[0].token_ids == [5, 6, 7, 8]
    assert h.resolve([DraftRequest(1, [9, 9], 2, start=2)])[0].token_ids == [5, 6, 9, 9]  # rewrites from start
    assert h.resolve([DraftRequest(1, [1, 2], 2)])[0].token_ids == [1, 2]  # start 0: whole again
    with pytest.raises(DraftHistoryError, match="holds 2 of its tokens"):
        h.resolve([DraftRequest(1, [3], 2, start=4)])
    with pytest.raises(DraftHistoryError, match="holds 0"):
        h.resolve([DraftRequest(2, [3], 2, start=1)])
    h.free([1])
    assert h.tokens == {}


# ------------------------------------------------------------------------------------------ Ray

@pytest.mark.parametrize("compiled", ["on", "off"])
def test_ray_tensor_2_with_a_drafter_actor(compiled, checkpoint, ray_cluster):
    """Through Ray at tensor 2 with a drafter actor: greedy rows as plain decoding, seeded sampled rows
    as in process; the driver rank alone receives the sampled rows' law; requests are incremental."""
    target, draft = checkpoint("deepseek_v3"), checkpoint("llama")
    prompts = random_prompts([5, 17, 9, 12], seed=41)
    params = mixed(len(prompts))
    local = LLMEngine(load_config(spec_cfg(target, draft)))
    try:
        want = run(local, prompts, params)
    finally:
        local.shutdown()
    with LLM(target, config={"scheduler": {"block_size": 4}}) as plain:
        base = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    eng = LLMEngine(load_config(spec_cfg(target, draft, executor="ray", tensor=2, compiled_graph=compiled)))
    try:
        assert eng.executor.transport == ("compiled_graph" if compiled == "on" else "actor_calls")
        steps = record_steps(eng)
        group = eng.speculation.drafter.backend
        sent, propose = [], group.propose
        group.propose = lambda reqs, version=0: sent.extend(reqs) or propose(reqs, version)  # pickled at the call
        outs = run(eng, prompts, params)
        assert outs == want
        assert [outs[i] for i in (1, 3)] == [base[i][:14] for i in (1, 3)]
        assert check_laws(steps) > 0
        for step, per_rank in steps:
            if step.draft_probs is None:
                assert per_rank[0] == per_rank[1]
            else:  # rank 1 (not the driver) got the step without the law
                assert per_rank[0] - per_rank[1] >= step.draft_probs.numel() * step.draft_probs.element_size()
        assert sum(r.start > 0 for r in sent) > len(prompts)
        assert all(len(r.token_ids) <= 4 for r in sent if r.start > 0)
    finally:
        eng.shutdown()
