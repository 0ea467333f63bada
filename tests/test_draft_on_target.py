"""The DSpark drafter on the target's driver rank (`speculative.placement: target`, the default for DSpark
without online calibration): it drafts for the next step inside the step call, so nothing of the drafter
crosses a process boundary but the proposals' tokens and confidences; a sampled row's draft law stays on
the rank that verifies it. Outputs never change: greedy is token-identical to plain decoding in process
and through Ray (tensor 2, data 2, the run-time switch, a lost worker), sampling keeps the target's law
(tests/test_dspark.py, tests/test_idle_drafter.py run those with both placements), and a drafter failure
on the target degrades to plain decoding."""

import os
import signal

import pytest

from dspark_cluster import ConfigError, LLM, SamplingParams, load_config
from dspark_cluster.model import gemm

from conftest import (alive_actor_pids, dspark_proposer, outputs_overwritten_by_the_next_call, random_prompts,
                      wait_until_drafting)

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def target_config(draft, k=4, schedule="static", **parallel):
    return {"scheduler": {"block_size": 4, "num_kv_blocks": 256}, "parallel": parallel,
            "speculative": {"method": "dspark", "draft_model": str(draft), "num_tokens": k, "schedule": schedule,
                            "placement": "target"}}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([5, 17, 9, 3, 12], seed=51)


def test_placement_resolves_and_is_checked(drafter):
    spec = lambda **kw: {"speculative": {"method": "dspark", "draft_model": str(drafter), **kw}}  # noqa: E731
    assert load_config(spec()).speculative.on_target  # auto: DSpark without online calibration
    assert not load_config(spec(placement="group")).speculative.on_target
    assert not load_config(spec(calibration={"enabled": True})).speculative.on_target
    assert not load_config({"speculative": {"method": "ngram"}}).speculative.on_target
    with pytest.raises(ConfigError, match="speculative.*placement: got .target. with method .draft_model.*use method dspark"):
        load_config({"speculative": {"method": "draft_model", "draft_model": "tiny-draft", "placement": "target"}})
    with pytest.raises(ConfigError, match="speculative.*placement: got .target. with calibration.enabled"):
        load_config(spec(placement="target", calibration={"enabled": True}))


def test_nothing_of_the_drafter_crosses_but_tokens_and_confidences(target, drafter, prompts, plain):
    """Sampled rows verify against the law the driver rank kept (no draft law in any StepInput), no
    context rows leave the worker, and the proposals come back with the step that drafted them."""
    llm = LLM(target, config=target_config(drafter))
    ex = llm.engine.executor
    inputs, outputs, submit = [], [], ex.submit

    def spy(step):
        inputs.append(step)
        out = submit(step)
        outputs.append(out)
        return out

    ex.submit = spy
    sampled = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.9, seed=3, ignore_eos=True))
    drafting = [s for s in inputs if s.num_draft is not None and bool((s.num_draft > 0).any())]
    assert drafting and all(s.draft_probs is None for s in inputs)
    assert any(o.draft_lengths is not None and bool((o.draft_lengths > 0).any()) for o in outputs)
    assert all(o.context is None and o.export_bytes == 0 for o in outputs)
    assert sum(o.metrics["num_draft_tokens"] for o in sampled) > 0
    assert llm.engine.speculation.drafter.stats.failures == 0
    # greedy as plain decoding; the drafter's memory is counted on the target's device
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == plain
    by_kind = llm.engine.cost_ledger()["memory"]["by_kind"]
    assert by_kind["drafter_weights"] > 0 and by_kind.get("context_stash", 0) >= 0
    # a finished sequence's drafter state goes with the next step (StepInput.free_context): only the last
    # call's sequences are held once another call has run
    before = set(dspark_proposer(llm).ctx)
    llm.generate(prompts[:1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert before and not before & set(dspark_proposer(llm).ctx) and len(dspark_proposer(llm).ctx) <= 1


def test_the_drafter_on_the_target_reads_the_targets_own_tables(target, drafter, prompts, plain):
    """Unsharded, the driver rank's embedding and LM head are the whole vocabulary: the drafter beside them
    reads them in place (no second copy; the ledger counts its own weights only); a drafter group holds its own
    copy and counts it."""
    llm = LLM(target, config=target_config(drafter))
    m, model = dspark_proposer(llm).model, llm.engine.executor.worker.model
    assert m.embed.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert m.lm_head.data_ptr() == model.lm_head.weight.data_ptr()
    if gemm._ONEDNN:  # and the target's CPU oneDNN copy of its LM head, not a second one (gemm.detached)
        assert m.lm_head.__dict__["_onednn"][1] is model.lm_head.weight.__dict__["_onednn"][1]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == plain
    own = sum(p.numel() * p.element_size() for p in m.parameters())
    ledger = llm.engine.cost_ledger()["memory"]["by_kind"]
    assert ledger["drafter_weights"] == own
    # the CPU's oneDNN copies of the target's linear weights (model/gemm.py) are counted, as made at load
    assert ledger["weights_reordered"] == model.reordered_bytes and (model.reordered_bytes > 0) == gemm._ONEDNN
    # and the drafter's own (made at its load, before the KV plan): its serving weights, not the target's LM head
    def reordered(weights):
        return sum(w.numel() * w.element_size() for w in weights) if gemm._ONEDNN else 0
    assert ledger["drafter_weights_reordered"] == reordered(m.serving_weights(tables=False)) > 0 or not gemm._ONEDNN
    assert all("_onednn" in w.__dict__ for w in m.serving_weights()) == gemm._ONEDNN
    group = LLM(target, config={**target_config(drafter), "speculative": {
        **target_config(drafter)["speculative"], "placement": "group"}})
    g = dspark_proposer(group).model
    assert g.embed.data_ptr() != group.engine.executor.worker.model.model.embed_tokens.weight.data_ptr()
    tables = sum(b.numel() * b.element_size() for b in (g.embed, g.lm_head))
    assert group.engine.cost_ledger()["memory"]["by_kind"]["drafter_weights"] == own + tables
    assert group.engine.cost_ledger()["memory"]["by_kind"]["drafter_weights_reordered"] == reordered(g.serving_weights())


@pytest.mark.parametrize("fails_in", ["draft", "ingest"])
def test_a_drafter_failure_on_the_target_degrades_to_plain_decoding(fails_in, target, drafter, prompts, plain):
    cfg = target_config(drafter, schedule="confidence")
    # learn at any load: the planner drafts from the first steps whatever the start-up profile reads (with
    # the prior's gate, a machine busy when the profile ran can close it, and the 3rd call never comes)
    cfg["speculative"]["prior_acceptance"] = None
    llm = LLM(target, config=cfg)
    assert llm.engine.planner.prior_acceptance is None
    proposer = dspark_proposer(llm)
    inner, calls = getattr(proposer, fails_in), [0]

    def flaky(*args):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected drafter fault")
        return inner(*args)

    setattr(proposer, fails_in, flaky)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == plain  # nothing lost, nothing changed
    eng = llm.engine
    assert eng.drafter.stats.failures == 1 and not eng.drafter.alive
    assert not any(g.speculation_enabled for g in eng.schedulers)
    assert eng.executor.worker.drafter.proposer is None  # the worker dropped it
    assert [o.token_ids for o in llm.generate(prompts[:2], GREEDY)] == plain[:2]  # and goes on plainly


def test_through_ray_one_round_a_step_and_no_drafter_process(target, drafter, prompts, plain, ray_cluster):
    """Tensor 2, the confidence schedule: outputs as plain decoding's, also across stretches with the
    run-time switch off (the workers keep the rows meanwhile); no drafter actor exists, the drafter's
    memory is on the driver rank's device, no hidden states are exported, and each step is one round to
    the workers (the step's execute time is all of the engine's wait)."""
    import ray

    llm = LLM(target, config=target_config(drafter, k=4, schedule="static", executor="ray", tensor=2))
    try:
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == plain
        assert sum(o.metrics["num_draft_tokens"] for o in outs) > 0
        assert not ray.get(llm.router.drafter_names.remote())
        ray.get(llm.router.set_speculation.remote(False))
        half = llm.generate(prompts, GREEDY)
        ray.get(llm.router.set_speculation.remote(True))
        again = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in half] == [o.token_ids for o in again] == plain
        assert sum(o.metrics["num_draft_tokens"] for o in half) == 0 < sum(o.metrics["num_draft_tokens"] for o in again)
        stats = ray.get(llm.router.stats.remote())
        live = stats["cost"]
        assert {r: v["devices"] for r, v in live["roles"].items()} == {"target": 2, "router": 1}
        assert live["comm_bytes"]["hidden_state_export"] == 0
        drafter_bytes = [d["drafter_weights"] for d in live["memory"]["per_device"] if d["role"] == "target"]
        assert sorted(drafter_bytes)[0] == 0 < sorted(drafter_bytes)[1]  # on the driver rank only
        assert stats["speculative"]["drafter_failures"] == 0
    finally:
        llm.shutdown()


def test_data_parallel_groups_each_draft_on_their_driver_rank(target, drafter, prompts, plain, ray_cluster):
    llm = LLM(target, config=target_config(drafter, executor="ray", tensor=1, data=2))
    try:
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == plain
        assert all(o.metrics["num_draft_tokens"] > 0 for o in outs if len(o.token_ids) > 2)
    finally:
        llm.shutdown()


def test_kill_9_of_the_worker_that_hosts_the_drafter_loses_nothing(target, drafter, prompts, plain, ray_cluster):
    """The drafter's state dies with its worker: the Router restarts the workers, re-runs the requests
    in flight, and drafting resumes on the new driver rank; outputs are plain decoding's."""
    import ray

    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    base = [o.token_ids for o in LLM(target, config={"scheduler": {"block_size": 4}}).generate(prompts, params)]
    llm = LLM(target, config=target_config(drafter, executor="ray"))
    try:
        pids = alive_actor_pids("ShardWorker")
        assert pids, "no ShardWorker alive in this session's Ray"  # (kill nothing, and restarts == 0 says why)
        ref = llm.router.generate.remote(prompts, [params] * len(prompts))
        wait_until_drafting(llm)  # drafting has begun
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        assert [o.token_ids for o in ray.get(ref, timeout=300)] == base
        stats = ray.get(llm.router.stats.remote())
        assert stats["restarts"] == 1 and stats["state"] == "ok"
        again = llm.generate(prompts[:2], params)
        assert [o.token_ids for o in again] == base[:2] and all(o.metrics["num_draft_tokens"] > 0 for o in again)
    finally:
        llm.shutdown()


def test_async_scheduling_submits_a_verifying_step_before_its_caller_handles_the_last(target, drafter, prompts,
                                                                                      plain):
    """With async scheduling (Ray's default) a step cannot be scheduled ahead while speculating (drafts
    need the last tokens), so it is submitted as soon as those tokens reach the scheduler, before the
    caller detokenizes and streams them: the caller's work runs beside it. Outputs stay plain
    decoding's, also for a request aborted and one stopped while such a step is in flight, whose
    proposals are not kept."""
    cfg = target_config(drafter)
    cfg["scheduler"]["async_scheduling"] = True
    llm = LLM(target, config=cfg)
    eng = llm.engine
    costs, observe = [], eng.speculation.observe_step_cost
    eng.speculation.observe_step_cost = lambda *a, **kw: (costs.append(a), observe(*a, **kw))
    try:
        ids = [eng.add_request(p, GREEDY) for p in prompts]
        early = steps = verifying = 0
        aborted = stopped = None
        while eng.has_unfinished():
            eng.step()
            steps += 1
            inflight = eng._inflight
            if inflight is not None and inflight.early_host_s is not None:
                early += 1
                assert inflight.early_host_s >= 0
                verifying += any(s.proposal for sc in inflight.scheds for s in sc.scheduled)
                live = [r for r in ids if not eng.seqs[r].finished and eng.seqs[r].num_output_tokens > 8]
                if aborted is None and live:  # a client's abort, and a stop string, with its next step running
                    aborted = live[0]
                    eng.abort_request(aborted)
                elif stopped is None and len(live) > 1:
                    stopped = live[1]
                    eng.abort_request(stopped, "stop")
        assert early > steps // 2 and verifying > steps // 4 and aborted and stopped
        for r, want in zip(ids, plain):
            got = eng.seqs[r].output_token_ids
            assert got == want if r not in (aborted, stopped) else got == want[: len(got)]
        assert not eng.speculation.ready and eng.block_manager.num_used == 0
        # the step cost model still learns from every step: an early one's time runs from its submission,
        # and the host's part is what ran between the last output and that submission
        assert len(costs) >= steps - 1 and all(sec > 0 and host is not None and host >= 0 for _, sec, host in costs)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("placement", ["target", "group"])
def test_the_drafter_cost_is_measured_at_start_up(placement, target, drafter, prompts, plain):
    """A fresh engine's verify planner knows the drafter's cost before any live call (the drafter on the
    target measures itself in its worker; a group is measured through the engine's drafter calls), so its
    prior gate decides from the first step: where a drafter of the prior's acceptance would not pay,
    nothing is drafted at all, not even to learn. The profile's sequences leave nothing behind."""
    cfg = target_config(drafter, schedule="confidence")
    cfg["speculative"]["placement"] = placement
    llm = LLM(target, config=cfg)
    sp = llm.engine.speculation
    assert set(sp.drafter_profile) == {1, 4, 16} and all(s > 0 for s in sp.drafter_profile.values())
    assert sum(len(q) for q in sp.planner.draft_cost.samples.values()) == 3  # one call's weight each
    proposer = dspark_proposer(llm)
    assert not proposer.ctx and proposer.misses == 0
    sp.planner.prior_acceptance = 0.05  # (a drafter that would pay nowhere)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert sp.num_drafted == 0 and all(o.metrics["num_draft_tokens"] == 0 for o in outs)
    sp.planner.prior_acceptance = 0.95  # one that pays at batch 1: the planner learns, and drafts
    sp.planner._prior_memo.clear()
    assert sp.planner._prior_k(1) > 0
    assert [o.token_ids for o in llm.generate(prompts[:1], GREEDY)] == plain[:1] and sp.num_drafted > 0


def test_a_preempted_sequence_drafts_again_after_its_recompute(target, drafter, prompts, plain):
    """A KV pool too small for every sequence at once preempts some (their blocks freed, recomputed later under the
    same id): the drafter on the target forgets a preempted sequence's context with the step that frees it, and
    takes the rows its recompute sends, so it drafts again after it resumes (it used to drop them as a finished
    sequence's late rows: no drafting for the rest of that request). Outputs stay plain decoding's."""
    cfg = target_config(drafter, k=4)
    cfg["scheduler"]["num_kv_blocks"] = 28
    llm = LLM(target, config=cfg)
    try:
        proposer, events = dspark_proposer(llm), []
        free, draft = proposer.free, proposer.draft
        proposer.free = lambda ids, *a, **kw: events.append(("free", set(ids))) or free(ids, *a, **kw)

        def drafting(reqs):
            active, out = draft(reqs)
            events.append(("draft", {reqs[i].seq_id for i in active}))
            return active, out

        proposer.draft = drafting
        outs = llm.generate(prompts, GREEDY)
        preemptions = llm.engine.load()["preemptions"]
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == plain and preemptions > 0
    freed_then_drafted = {sid for i, (kind, ids) in enumerate(events) if kind == "free" for sid in ids
                          if any(k == "draft" and sid in later for k, later in events[i + 1:])}
    assert freed_then_drafted, events


def test_the_kv_pool_leaves_the_drafter_on_the_target_room(target, drafter, prompts, plain, monkeypatch):
    """Where the drafter runs beside the target's shard, the KV pool's share leaves its largest round room too: the
    profile run (CUDA's allocator statistics stood in: the steps and the round run here, for real) also drafts for
    max_num_seqs sequences at once, each with as much context as a sequence's store keeps (its window and
    KEEP_BEHIND rows), num_tokens each at temperature 1 with their laws, and holds those stores and laws while the
    target's largest steps run (in serving both are alive at once: the peak is of the two together); the profile's
    sequences are gone after, the drafter alive, and serving is plain decoding's."""
    from dspark_cluster import kv_cache, worker
    from dspark_cluster.speculative.dspark_proposer import KEEP_BEHIND, DSparkProposer

    rounds, steps, draft, execute_step = [], [], DSparkProposer.draft, worker.execute_step

    def recording(self, reqs):
        active, out = draft(self, reqs)
        rounds.append((len(active), {r.k for r in reqs}, {r.temperature for r in reqs},
                       {self.ctx[r.seq_id].length for r in reqs}, tuple(out[0].shape), out[2] is not None))
        return active, out

    def measured(run, device):  # the round, then the steps with its stores alive
        monkeypatch.setattr(DSparkProposer, "draft", recording)
        monkeypatch.setattr(worker, "execute_step", lambda model, step, *a, **kw: steps.append(
            len(proposer_of[0].ctx)) or execute_step(model, step, *a, **kw))
        run()
        monkeypatch.setattr(DSparkProposer, "draft", draft)
        monkeypatch.setattr(worker, "execute_step", execute_step)
        return 2**20

    proposer_of, init = [], DSparkProposer.__init__
    monkeypatch.setattr(DSparkProposer, "__init__", lambda self, *a, **kw: proposer_of.append(self) or init(
        self, *a, **kw))
    monkeypatch.setattr(worker, "peak_bytes_during", measured)
    monkeypatch.setattr(kv_cache, "free_device_memory", lambda device: 64 * 2**20)
    cfg = target_config(drafter, k=3)
    cfg["scheduler"] = {"block_size": 4, "kv_cache_memory": 0.5, "max_num_seqs": 5}
    llm = LLM(target, config=cfg)
    try:
        proposer, ex = dspark_proposer(llm), llm.engine.executor
        n = proposer.window + KEEP_BEHIND
        # 5 rows of n context rows, 3 drafts and a law each; both profile steps ran with the 5 stores held
        assert rounds == [(5, {3}, {1.0}, {n}, (5, 3), True)] and steps == [5, 5], (rounds, steps)
        assert not proposer.ctx and ex.worker.drafter.alive and ex.worker.drafter.num_proposed == 0
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == plain
    finally:
        llm.shutdown()


def test_the_kv_plan_takes_the_drafter_off_its_driver_ranks(target, drafter, prompts):
    """`dspark kv-plan` with a DSpark drafter on the target: each group's driver rank (TP rank 0) holds the drafter's
    weights (as the engine loads them), the target's tables again where tensor parallelism splits the target's, its
    Markov factors, every sequence's context store (a sequence's store never holds more rows than the plan's bound,
    checked on a live engine with a window of 8) and the sampled rows' laws; its KV share is of what is left."""
    import torch

    from dspark_cluster.kv_plan import drafter_context_rows, format_kv_plan, kv_plan
    from dspark_cluster.model.spec import load_spec

    spec = load_spec(target, "float32")
    cfg = target_config(drafter, k=3)
    cfg["speculative"]["context_window"] = 8
    cfg["scheduler"] = {"block_size": 4, "num_kv_blocks": 64, "max_num_seqs": 5}
    llm = LLM(target, config=cfg)
    try:
        proposer = dspark_proposer(llm)
        stores = []
        generate, draft = llm.generate, proposer.draft

        def drafting(reqs):  # each store's rows as the proposals run
            out = draft(reqs)
            stores.extend(st.k[0].shape[0] for st in proposer.ctx.values() if st.k)
            return out

        proposer.draft = drafting
        generate(prompts, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
        weights = sum(p.numel() * p.element_size() for p in proposer.model.parameters())
        c, report = proposer.c, proposer.memory_report()
    finally:
        llm.shutdown()
    bound = drafter_context_rows(8, c.block_size)
    assert stores and max(stores) <= bound, (max(stores), bound)
    plans = {}
    for tensor in (1, 2):
        for speculative in (True, False):
            conf = load_config({**cfg, "model": {"path": str(target), "dtype": "float32"},
                                "parallel": {"tensor": tensor, "executor": "ray"},
                                "scheduler": {"block_size": 4, "kv_cache_memory": 0.5, "max_num_seqs": 5},
                                **({} if speculative else {"speculative": {}})})
            plans[tensor, speculative] = kv_plan(conf, spec, device_memory=2**30)
    (one,), (none,) = plans[1, True], plans[1, False]
    elem, V, r = 4, c.vocab_size, c.markov_rank
    rope = 2 * min(1 << 16, 2 * (spec.max_position_embeddings + c.block_size)) * c.head_dim * 4
    assert report["rope_table_bytes"] <= rope  # (the table the live drafter grew, within the plan's)
    held = weights + V * r * (elem + 4) + 5 * bound * c.num_layers * 2 * c.hidden_size * elem + 5 * 3 * V * elem + rope
    assert one["drafter_bytes"] == held and none["drafter_bytes"] == 0
    left = 2**30 - one["weight_bytes"] - one["reordered_weight_bytes"]  # (a GPU's: no oneDNN copies)
    assert one["num_blocks"] == int(0.5 * (left - held)) // one["kv_bytes_per_block"] < none["num_blocks"]
    two = plans[2, True]  # tensor 2: the driver rank holds the tables again; the other rank no drafter
    assert two[0]["drafter_bytes"] == held + 2 * V * c.target_hidden_size * elem and two[1]["drafter_bytes"] == 0
    assert "the DSpark drafter" in format_kv_plan(two)
    # planned on this CPU: the oneDNN copies of its serving weights too, as the live drafter made them
    from dspark_cluster.kv_plan import drafter_bytes
    from dspark_cluster.model import gemm

    conf = load_config({**cfg, "model": {"path": str(target), "dtype": "float32"}})
    assert drafter_bytes(conf, spec, "cpu")["reordered"] == report["reordered_bytes"] and (
        report["reordered_bytes"] > 0) == gemm.runs_dtype(torch.float32)


def test_compiled_steps_with_the_drafter_on_the_target_verify_in_the_same_graphs(target, drafter, prompts, plain):
    """model.compile on with a DSpark drafter beside the target: its steps capture the exported layers (a guard of the
    compiled forward), so the warm-up compiles for both captures (none, the exported layers; a graph for one token
    and one for the larger buckets each); the buckets reach a full batch's verify step, and drafting steps (rows of
    1 + drafts tokens, cut to different lengths by the verify budget) replay the same graphs as decode steps:
    serving compiles nothing more, and greedy tokens equal plain decoding's. The drafter's greedy rounds run
    compiled too (`compiled_draft`: batch buckets up to max_num_seqs), with no recompile while serving; the run's
    compile summary and report say so; and nothing reads a step's or a round's outputs past the next compiled call
    (which CUDA graphs overwrite: simulated here). A drafter group's proposer (placement group) compiles its rounds
    as well."""
    from dspark_cluster.model.compiled import step_buckets
    from dspark_cluster.report import format_summary

    cfg = target_config(drafter)
    cfg["model"] = {"compile": "on"}
    cfg["scheduler"]["max_num_seqs"] = 2
    llm = LLM(target, config=cfg)
    try:
        steps, rounds = llm.engine.executor.worker.compiled, dspark_proposer(llm).compiled
        before = {"steps": steps.steps, "draft": rounds.rounds}  # (the start-up profile's)
        calls = outputs_overwritten_by_the_next_call(steps, rounds)
        loads, observe = [], llm.engine.balancer.observe

        def observing(load):  # each step's expert loads
            loads.extend([] if load is None else [load])
            observe(load)

        llm.engine.balancer.observe = observing
        outs = [o.token_ids for o in llm.generate(prompts[:2], GREEDY)]
        stats = llm.engine.executor.worker.memory_report()["compile"]
        k = llm.engine.cfg.speculative.num_tokens
        llm.engine.device_reports()  # (what the summary reads)
        summary = llm.engine.compile_summary()
    finally:
        llm.shutdown()
    assert outs == plain[:2] and all(calls.values())
    assert calls == {"steps": stats["compile_steps"] - before["steps"],
                     "draft": stats["draft_compile_rounds"] - before["draft"]}
    # a step's loads: no count below 0 and every MoE layer routing the step's tokens (read past the drafter's round
    # they would be garbage)
    assert loads and all(bool((load >= 0).all()) and len(set(load.sum(1).tolist())) == 1 for load in loads), loads
    assert stats["compile_buckets"] == step_buckets(2 * (1 + k)) and stats["compile_warm_up_graphs"] == 4
    assert stats["compile_recompiles_after_warm_up"] == 0 and stats["compile_verify_steps"] > 0, stats
    assert stats["compile_direct_steps"] > 0  # graphs called without dynamo's guards (one token and more, captures)
    assert stats["draft_compile_buckets"] == [1, 2] and stats["draft_compile_rounds"] > 0
    assert stats["draft_compile_warm_up_graphs"] == 4 and stats["draft_compile_recompiles_after_warm_up"] == 0, stats
    assert stats["draft_compile_direct_rounds"] > 0  # rounds called without dynamo's guards
    assert summary["draft_rounds"] == stats["draft_compile_rounds"] and summary["draft_recompiles_after_warm_up"] == 0
    assert "model.compile, the drafter" in format_summary({"compile": summary})
    cfg["speculative"]["placement"] = "group"  # a drafter group's proposer (here in process) compiles its rounds too
    llm = LLM(target, config=cfg)
    try:
        outs = [o.token_ids for o in llm.generate(prompts[:2], GREEDY)]
        runner = dspark_proposer(llm).compiled
    finally:
        llm.shutdown()
    assert outs == plain[:2] and runner.rounds > 0 and runner.stats()["draft_compile_recompiles_after_warm_up"] == 0


def test_a_compiled_drafting_round_drafts_what_the_eager_one_does(target, tmp_path, monkeypatch):
    """The drafter's round through `compiled_draft` (two block passes, a gated Markov head, a confidence head):
    drafts equal the eager round's and confidences to the compiler's rounding, at one row (the context read as views
    of the sequence's store) and three (a padded context with its mask, padded to the 4-row bucket), each row keeping
    its own k, as the contexts grow across block boundaries and after a drafter version switch (the Markov factors
    made again in place): four graphs (one row and the rest, greedy and sampled), nothing compiled after the warm-up.
    The CUDA-graph recording pass (forced here; on CUDA each drafting thread's first round) runs on each thread that
    drafts. Each round calls its graph's code without dynamo's guards (the guarded call where its key changed).
    Sampled rows at a temperature alone draft compiled: their laws as eager's
    where no draw is read yet, their draws following the law, the law outliving the next replay; a seeded row, or
    more rows than the largest bucket, drafts eager."""
    import threading
    from dataclasses import replace

    import torch
    from scipy.stats import chi2

    from dspark_cluster.model.spec import load_spec
    from dspark_cluster.speculative.dspark_proposer import DSparkProposer
    from dspark_cluster.speculative.proposers import DraftRequest
    from dspark_cluster.speculative.records import ContextRows

    from conftest import build_dspark

    path = build_dspark(target, tmp_path / "d2", layers=(0, 1), block_size=5, markov_gate=True, draft_passes=2)
    spec = load_spec(target, "float32")
    # (calibrate: each sequence's rows kept, which a version switch recomputes the context from)
    make = lambda buckets: DSparkProposer(path, target, spec, "cpu", num_tokens=4, draft_passes=2,  # noqa: E731
                                          calibrate=True, compile_buckets=buckets)
    from torch._dynamo.utils import counters

    breaks = dict(counters["graph_break"])
    compiled, eager = make([1, 2, 4]), make(None)
    runner = compiled.compiled
    # one row and the larger buckets, all greedy or with sampled rows
    assert runner is not None and runner.stats()["draft_compile_warm_up_graphs"] == 4
    assert dict(counters["graph_break"]) == breaks  # each a whole round
    # from here a recompile raises (dynamo past its limit would run the round eager without one: it would show here)
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    runner.records_cuda_graphs = True  # (CUDA's pass, forced: on the CPU it records nothing, and runs every bucket)
    g = torch.Generator().manual_seed(5)
    width = eager.model.fc.in_features
    tokens = {}

    def grow(sid, n):  # n more committed rows (and tokens) for sequence sid, to both proposers
        start = len(tokens.get(sid, []))
        rows = torch.randn(n, width, generator=g)
        tokens[sid] = tokens.get(sid, []) + torch.randint(2, spec.vocab_size, (n,), generator=g).tolist()
        for p in (compiled, eager):
            p.ingest(ContextRows(torch.tensor([sid]), torch.tensor([start]), torch.tensor([n]), rows))

    def requests(sids, temperature=0.0):
        return [DraftRequest(s, tokens[s] + [3], 4 - s % 2, temperature) for s in sids]

    def same(reqs):
        (_, (t_c, c_c, law)), (_, (t_e, c_e, _)) = compiled.draft(reqs), eager.draft(reqs)
        assert law is None and t_c.shape == t_e.shape == (len(reqs), max(r.k for r in reqs))
        assert torch.equal(t_c, t_e) and torch.allclose(c_c, c_e, atol=1e-5), (t_c, t_e, c_c, c_e)

    for sid, n in ((0, 9), (1, 14), (2, 3)):
        grow(sid, n)
    rounds = []
    for step in range(6):
        same(requests([0]))
        same(requests([0, 1, 2]))
        rounds.append(runner.rounds)
        for sid in (0, 1, 2):
            grow(sid, 1 + step % 3)
    assert rounds[-1] == 12
    # each round called its graph's code without dynamo's guards: every module value they read is fixed at load
    assert runner.direct.on and not runner.direct.unknown() and runner.direct.calls == 12
    factors = compiled.model.markov_factors()
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in eager.model.state_dict().items()}
    for p in (compiled, eager):
        p.stage(1, new, keep=[])
        p.use(1)
    same(requests([1, 2]))
    m = compiled.model
    assert all(a is b for a, b in zip(factors, m.markov_factors()))  # made again in place, of the new weights
    assert torch.allclose(factors[0], m.markov_in(m.embed)) and \
        torch.allclose(factors[1], (m.markov_out.weight.T @ m.lm_head.T).float())
    errors = []

    def other_thread():
        try:
            same(requests([2]))
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert not errors, errors
    assert runner.direct.calls == runner.rounds == 14  # after the version switch too, and on another thread
    runner._static = ("new factors",)  # the key (CUDA's static Markov factors) changed: the guarded call, then direct
    same(requests([0]))
    assert runner.direct.calls == 14
    same(requests([0]))
    assert runner.direct.calls == 15
    before = runner.rounds
    grow(3, 5)
    grow(4, 5)
    same(requests([0, 1, 2, 3, 4]))  # 5 rows: past the largest bucket
    _, (_, _, law) = compiled.draft([replace(r, seed=7) for r in requests([0], temperature=0.8)])
    assert law is not None and runner.rounds == before  # the 5-row and the seeded rounds ran eager
    same(requests([0, 1]))
    assert runner.rounds == before + 1

    # sampled rows at a temperature alone: compiled, with their draft laws. Beside a greedy row: the greedy row as
    # eager, the sampled row's slot-0 law and confidence as eager (they read no draw)
    mixed = requests([0], temperature=0.8) + requests([1])
    (_, (t_c, c_c, law_c)), (_, (t_e, c_e, law_e)) = compiled.draft(mixed), eager.draft(mixed)
    assert runner.sampled_rounds == 1 and law_c.shape == law_e.shape and law_c.dtype == law_e.dtype
    assert torch.allclose(law_c[:, 0], law_e[:, 0], atol=1e-6) and torch.allclose(c_c[:, 0], c_e[:, 0], atol=1e-5)
    assert torch.equal(t_c[1], t_e[1]) and torch.allclose(c_c[1], c_e[1], atol=1e-5)
    # the draws follow the law (slot 0, four rows of one context a round; a peaked law: cells of 5 expected or more)
    reqs = requests([2], temperature=0.3) * 4
    torch.manual_seed(3)  # (the compiled rounds' draws come from the global generator: the same draws every run)
    law0 = compiled.draft(reqs)[1][2][0, 0].double()
    draws = torch.cat([compiled.draft(reqs)[1][0][:, 0] for _ in range(250)])
    counts = torch.bincount(draws, minlength=law0.numel()).double()
    big = law0 * draws.numel() >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([law0[big], law0[~big].sum()[None]]) * draws.numel()
    keep = exp > 0
    p = chi2.sf(float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1)
    print(f"compiled draws against their law: p {p:.3g}, {int(big.sum())} cells")
    assert int(big.sum()) >= 3 and p > 1e-3, (p, int(big.sum()))
    # a law is held until the next step verifies it: it outlives the next replay (the compiled function replaced by
    # one that writes its outputs into the same memory at every call of a shape, as a CUDA graph's replay does)
    compiled_fn, held = runner.padded_round, {}

    def graph_like(*args):
        out = compiled_fn(*args)
        bufs = held.setdefault((args[0].shape[0], args[-1] is None),
                               tuple(None if o is None else torch.empty_like(o) for o in out))
        for b, o in zip(bufs, out):
            if o is not None:
                b.copy_(o)
        return bufs

    runner.padded_round = graph_like
    first = compiled.draft(requests([0], temperature=0.8))[1][2]
    kept = first.clone()
    second = compiled.draft(requests([0], temperature=1.5))[1][2]
    assert torch.equal(first, kept) and not torch.equal(first, second)
    stats = runner.stats()
    assert stats["draft_compile_recompiles_after_warm_up"] == 0 and stats["draft_compile_warm_up_graphs"] == 4, stats
    assert len(runner.cuda_graph_managers) == 2  # the recording pass ran on both drafting threads
