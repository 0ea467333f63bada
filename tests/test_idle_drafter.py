"""An idle DSpark drafter costs nothing (issue 28): a step that drafts nothing makes no drafter call
and exports no rows (the target's driver worker keeps each sequence's latest context_window rows,
speculative/context.py ContextStash); when drafting resumes for a sequence its kept rows go out
once, with its first step, and it drafts from the next. Outputs never change: greedy is
token-identical to plain decoding (in process and through Ray) and sampling keeps the target's law
across the catch-up."""

import numpy as np
import pytest
import torch

from dspark_cluster import LLM, SamplingParams
from dspark_cluster.speculative.context import ContextStash
from dspark_cluster.speculative.records import ContextRows
from dspark_cluster.speculative.verify_budget import VerifyPlanner

from conftest import build_dspark, dspark_proposer, hf_context_states, random_prompts, rows_by_position
from test_speculative import small_vocab  # noqa: F401 -- fixture
from test_speculative import LAW_P, LAW_PROMPT, LAW_SCHED, law_pvalue, seeded

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


class PatternPlanner(VerifyPlanner):
    """The confidence schedule's planner with its choice replaced: the i-th step drafts pattern[i %
    len(pattern)] positions (0: a plain step), and every drafted position is verified."""

    def __init__(self, base: VerifyPlanner, pattern):
        self.__dict__.update(base.__dict__)
        self.pattern, self.calls = list(pattern), 0

    def draft_len(self, num_rows: int) -> int:
        self.exploring = self._learning = False
        k = self.pattern[self.calls % len(self.pattern)]
        self.calls += 1
        return k

    def verify_lengths(self, raw, base_tokens, base_expected, draft_s, offsets=None):
        return (~np.isnan(raw)).sum(1)


def idle_config(draft, k=4, window=4, placement="group", **parallel):
    return {"scheduler": {"block_size": 4, "num_kv_blocks": 256}, "parallel": parallel,
            "speculative": {"method": "dspark", "draft_model": str(draft), "num_tokens": k, "schedule": "confidence",
                            "context_window": window, "placement": placement}}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([5, 17, 9, 3], seed=47)


def count_calls(llm) -> dict:
    """Counts of the in-process drafter group's calls, or with the drafter on the target of its proposer's
    (each still runs)."""
    if llm.engine.speculation.on_target:
        group, names = dspark_proposer(llm), ("draft", "ingest", "free")
    else:
        group, names = llm.engine.drafter.backend, ("propose", "ingest", "prefill_async", "free")
    counts = {}
    for name in names:
        inner = getattr(group, name)

        def spy(*args, _inner=inner, _name=name):
            counts[_name] = counts.get(_name, 0) + 1
            return _inner(*args)

        setattr(group, name, spy)
    return counts


@pytest.mark.parametrize("placement", ["group", "target"])
def test_a_step_that_drafts_nothing_calls_no_drafter_and_exports_nothing(placement, target, drafter, prompts):
    llm = LLM(target, config=idle_config(drafter, placement=placement))
    eng = llm.engine
    eng.speculation.planner = PatternPlanner(eng.planner, [0] * 8 + [4] * 4)
    counts = count_calls(llm)
    stash = eng.executor.worker.stash
    for p in prompts:
        eng.add_request(p, GREEDY)
    idle = active = 0
    while eng.has_unfinished():
        before = dict(counts)
        plan = eng.planner.pattern[eng.planner.calls % len(eng.planner.pattern)]
        eng.step()
        st = eng.step_stats[-1]
        if plan == 0 and eng.has_unfinished():  # (a last step frees the finished requests' drafter state)
            idle += 1
            assert counts == before, (counts, before)  # no drafter call at all
            assert st["export_bytes"] == 0 and st["num_drafted"] == 0
            assert stash.since and stash.rows_held <= len(prompts) * 2 * 4  # at most 2 windows each
            assert stash.nbytes <= (sum(map(len, prompts)) + eng.num_steps * len(prompts)) * stash.row_bytes
        elif plan:
            active += 1
    assert idle >= 8 and active >= 4
    stats = eng.drafter.stats.summary()
    assert stats["num_draft_tokens"] > 0  # drafting resumed after every idle stretch
    assert eng.speculation.num_catch_ups > 0 and stash.flushes > 0 and stash.rows_flushed > 0
    assert dspark_proposer(llm).resyncs > 0  # idle stretches longer than the window: rows skipped
    assert dspark_proposer(llm).misses == 0  # a proposal never waited for rows


@pytest.mark.parametrize("placement", ["group", "target"])
def test_greedy_identical_after_long_idle_stretches_in_process(placement, target, drafter, prompts, plain):
    """The rows that reach the drafter are the target's states at their positions (flushes put the
    kept rows at the right place), and outputs are plain decoding's."""
    from conftest import hf_model

    llm = LLM(target, config=idle_config(drafter, window=3, placement=placement))
    llm.engine.speculation.planner = PatternPlanner(llm.engine.planner, [0] * 10 + [3] * 3 + [0] * 2 + [4] * 2)
    proposer = dspark_proposer(llm)
    seen, ingest = [], proposer.ingest
    proposer.ingest = lambda rows: (seen.append(rows), ingest(rows))
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.metrics["num_draft_tokens"] for o in outs) > 0
    assert proposer.resyncs > 0 and proposer.misses == 0
    by_seq = rows_by_position(seen)
    hf = hf_model(target)
    for o in outs:
        seq = o.prompt_token_ids + o.token_ids
        want = hf_context_states(hf, seq)
        rows = next(r for r in by_seq.values()
                    if max(r) < len(seq) - 1 and torch.allclose(r[min(r)], want[min(r)], atol=1e-4))
        assert len(rows) < len(seq) - 1  # rows before a gap never went out
        for pos, h in rows.items():
            torch.testing.assert_close(h, want[pos], atol=1e-4, rtol=1e-4)


class GraphLike:
    """A compiled decode step as a CUDA graph runs it, without a compiler: each (batch, capture) writes its outputs
    into the same memory every time, so a step's outputs are overwritten by the next step of its shape."""

    def __init__(self, forward):
        self.forward, self.model, self.out = forward, forward.__self__, {}

    def __call__(self, ids, positions, meta, capture, real):
        hidden = self.forward(ids, positions, meta, capture, real)
        fresh = (hidden, self.model.captured)
        held = self.out.setdefault((ids.numel(), capture),
                                   tuple(None if t is None else torch.empty_like(t) for t in fresh))
        for t, h in zip(fresh, held):
            if t is not None:
                h.copy_(t)
        self.model.captured = held[1]
        return held[0]


def test_rows_kept_from_compiled_steps_outlive_the_next_replay(target, drafter, prompts, plain, monkeypatch):
    """model.compile on (on CUDA: CUDA graphs, whose outputs the next replay of the same bucket overwrites): the
    idle steps run compiled and the stash holds their exported layers' states until drafting resumes; the rows
    that then reach the drafter are still the target's states at their positions (the runner copies them out of
    the graph's memory), and outputs are plain decoding's."""
    from conftest import hf_model

    # (the drafter's round, compiled too, runs as the function itself: its own graphs are not what this checks)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: GraphLike(fn) if fn.__name__ == "forward" else fn)
    cfg = idle_config(drafter, window=3, placement="target")
    cfg["model"] = {"compile": "on"}
    cfg["scheduler"]["max_num_seqs"] = len(prompts)
    llm = LLM(target, config=cfg)
    llm.engine.speculation.planner = PatternPlanner(llm.engine.planner, [0] * 10 + [3] * 3 + [0] * 2 + [4] * 2)
    proposer, compiled = dspark_proposer(llm), llm.engine.executor.worker.compiled
    assert isinstance(compiled.fn, GraphLike)
    seen, ingest = [], proposer.ingest
    proposer.ingest = lambda rows: (seen.append(rows), ingest(rows))
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert compiled.steps >= 12 and llm.engine.executor.worker.stash.flushes > 0
    assert sum(o.metrics["num_draft_tokens"] for o in outs) > 0
    by_seq, hf = rows_by_position(seen), hf_model(target)
    for o in outs:
        seq = o.prompt_token_ids + o.token_ids
        want = hf_context_states(hf, seq)
        rows = next(r for r in by_seq.values()
                    if max(r) < len(seq) - 1 and torch.allclose(r[min(r)], want[min(r)], atol=1e-4))
        for pos, h in rows.items():
            torch.testing.assert_close(h, want[pos], atol=1e-4, rtol=1e-4)


def test_context_stash_keeps_a_window_and_frees():
    F, W = 3, 4
    stash = ContextStash(window=W)

    def rows(sid, start, n):
        h = torch.arange(start, start + n, dtype=torch.float32)[:, None].expand(n, F).contiguous()
        return ContextRows(torch.tensor([sid]), torch.tensor([start]), torch.tensor([n]), h)

    stash.keep(rows(1, 0, 6))  # a prompt longer than the window: its last 4 rows are kept (copied out)
    assert stash.rows_held == 4 and stash.nbytes == 4 * F * 4
    for pos in range(6, 20):  # decode steps of both: the latest `window` steps stay
        a, b = rows(1, pos, 1), rows(2, pos - 6, 1)
        stash.keep(ContextRows(torch.tensor([1, 2]), torch.tensor([pos, pos - 6]), torch.tensor([1, 1]),
                               torch.cat([a.hidden, b.hidden])))
        assert len(stash.log) <= W and stash.nbytes <= (2 * W + W) * F * 4  # (the prompt step until it ages out)
    assert stash.rows_held == 2 * W and stash.nbytes == 2 * W * F * 4 and stash.peak_bytes >= 4 * F * 4
    out = stash.take(rows(1, 20, 1))  # drafting resumes: the kept window, then the step's own row
    assert out.starts.tolist() == [16] and out.counts.tolist() == [5]
    assert out.hidden[:, 0].tolist() == [16, 17, 18, 19, 20]
    assert 1 not in stash.since
    stash.keep(rows(2, 3, 2))  # a recompute (after a preemption) rewinds: rows from 3 on are new
    stash.keep(rows(2, 5, 1))
    out = stash.take(rows(2, 6, 1))
    assert out.starts.tolist() == [3] and out.hidden[:, 0].tolist() == [3, 4, 5, 6]
    assert not stash.since and stash.rows_held == 0 and stash.nbytes == 0  # nobody needs the steps any more
    stash.keep(rows(2, 7, 1))
    stash.free([2])
    assert not stash.since and stash.rows_held == 0 and stash.nbytes == 0
    # a sequence that never idles is never kept
    out = stash.route(rows(3, 0, 2), torch.tensor([True]), torch.tensor([3]))
    assert out.counts.tolist() == [2] and not stash.since
    assert stash.route(rows(3, 2, 1), torch.tensor([False]), torch.tensor([3])) is None
    assert stash.rows_held == 1
    # a long prompt in chunks: each chunk is a whole window, so the chunk before it goes at once
    stash.free([3])
    stash.keep(rows(5, 0, 7))
    stash.keep(rows(5, 7, 7))
    assert len(stash.log) == 1 and stash.nbytes == W * F * 4
    out = stash.take(rows(5, 14, 1))
    assert out.starts.tolist() == [10] and out.hidden[:, 0].tolist() == [10, 11, 12, 13, 14]
    # a sequence missing from a step in between (not scheduled): its run is cut at the gap
    stash.keep(rows(4, 0, 2))
    stash.keep(rows(4, 5, 1))
    out = stash.take(rows(4, 6, 1))
    assert out.starts.tolist() == [5] and out.hidden[:, 0].tolist() == [5, 6]


def test_a_step_logged_as_it_is_gives_the_rows_committed_rows_selects():
    """keep_step (an idle step: its captured states as they are, no selection) and keep(committed_rows(..))
    hand out the same rows when the sequences export again: verify rows with rejected drafts, a request
    that does not speculate, a prompt chunk longer than the window, and a recompute."""
    from dspark_cluster.speculative.context import committed_rows

    F, W = 2, 5
    g = torch.Generator().manual_seed(0)
    # step 1: seq 7 a 8-token prompt chunk, seq 9 a non-speculating request (-1), seq 8 a 3-token chunk
    # step 2: seq 7 verifies 3 drafts (1 accepted), seq 8 decodes; step 3: seq 8 recomputed from 1
    steps = [dict(seq_ids=[7, -1, 8], q=[8, 2, 3], ctx=[8, 2, 3], rows=[0, 1, 2], nd=None, nt=[1, 1, 1]),
             dict(seq_ids=[7, 8], q=[4, 1], ctx=[12, 4], rows=[0, 1], nd=[3, 0], nt=[2, 1]),
             dict(seq_ids=[8], q=[3], ctx=[4], rows=[0], nd=None, nt=[1])]
    a, b = ContextStash(W), ContextStash(W)
    for st in steps:
        T = sum(st["q"])
        captured = torch.randn(T, F, generator=g)
        args = (torch.tensor(st["seq_ids"]), torch.tensor(st["q"]), torch.tensor(st["ctx"]), torch.tensor(st["rows"]),
                None if st["nd"] is None else torch.tensor(st["nd"]), torch.tensor(st["nt"]))
        a.keep_step(captured, *args)
        b.keep(committed_rows(captured, *args))
    assert a.rows_held == b.rows_held and set(a.since) == set(b.since) == {7, 8}
    for sid, start in ((7, 10), (8, 4)):
        own = ContextRows(torch.tensor([sid]), torch.tensor([start]), torch.tensor([1]), torch.zeros(1, F))
        x, y = a.take(own), b.take(own)
        assert x.starts.tolist() == y.starts.tolist() and x.counts.tolist() == y.counts.tolist()
        assert torch.equal(x.hidden, y.hidden) and x.counts.item() == min(W, start) + 1
    assert a.rows_held == b.rows_held == 0 and a.nbytes == 0


def test_finished_sequences_leave_the_stash(target, drafter, prompts):
    """Kept rows go with the sequence: the next step after it finishes (or is preempted) frees them, and
    the cost ledger counts the stash's peak."""
    llm = LLM(target, config=idle_config(drafter))
    llm.engine.speculation.planner = PatternPlanner(llm.engine.planner, [0])  # never drafts
    stash = llm.engine.executor.worker.stash
    first = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert stash.peak_bytes > 0 and stash.rows_flushed == 0
    assert sum(o.metrics["num_draft_tokens"] for o in first) == 0
    llm.generate(prompts[:1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(stash.since) <= 1  # the first batch's rows went with its sequences
    ledger = llm.engine.cost_ledger()
    assert ledger["memory"]["by_kind"]["context_stash"] == stash.peak_bytes


def catch_up_law_pvalue(small_vocab, tmp_path, k: int = 2, n: int = 3000, chunk: int = 500, top_p: float = 0.8,
                        m: int = 4, idle: int = 1, placement: str = "group") -> float:  # noqa: F811
    """Seeded sampling where each request's drafter is idle for its first `idle` steps (its prefill: the
    rows kept, the latest 2 of them, the window), catches up in its next step (the kept rows and the
    step's own go out once: past a gap, a resync) and drafts k from the next: with idle 1 its tokens
    3 .. 2 + k are drafted positions. Returns the p-value of the first m tokens' joint law against the
    target's."""
    draft = build_dspark(small_vocab["target"], tmp_path / "d", seed=5, layers=(0,), block_size=3, hidden=16, scale=2.0)
    cfg = {"scheduler": LAW_SCHED, "speculative": {"method": "dspark", "draft_model": str(draft), "num_tokens": k,
                                                   "schedule": "confidence", "context_window": 2,
                                                   "placement": placement}}
    llm = LLM(small_vocab["target"], config=cfg)
    planner = llm.engine.speculation.planner = PatternPlanner(llm.engine.planner, [0] * idle + [k] * 8)
    outs = []
    for i in range(0, n, chunk):  # one batch per call: every request is in the same phase of the pattern
        planner.calls = 0
        outs += llm.generate([LAW_PROMPT] * chunk, seeded(chunk, i, max_tokens=k + 2 + idle, top_p=top_p))
    stats, proposer = llm.engine.drafter.stats, dspark_proposer(llm)
    assert proposer.resyncs == n and llm.engine.executor.worker.stash.flushes == n  # every request caught up once
    assert stats.proposed[k - 1] >= n / 2  # and then verified all k drafts
    assert 0 < stats.accepted[k - 1] and sum(stats.accepted) < sum(stats.proposed)
    p = law_pvalue(outs, small_vocab["target"], LAW_PROMPT, top_p, m=m)
    print(f"law p-value {p:.3g} across the catch-up (drafts by position {stats.proposed}, accepted {stats.accepted})")
    return p


@pytest.mark.parametrize("placement", ["group", "target"])
def test_sampling_keeps_the_law_across_the_catch_up(placement, small_vocab, tmp_path):  # noqa: F811
    p = catch_up_law_pvalue(small_vocab, tmp_path, placement=placement)
    assert p > LAW_P, p


def test_the_catch_up_law_test_fails_on_a_verifier_that_reuses_the_first_draft_law(small_vocab, tmp_path,  # noqa: F811
                                                                                  monkeypatch):
    from dspark_cluster import step_exec
    from test_speculative import first_position_law_verify

    monkeypatch.setattr(step_exec, "verify", first_position_law_verify)
    p = catch_up_law_pvalue(small_vocab, tmp_path, placement="target")
    assert p < LAW_P, p


def test_greedy_identical_through_ray_after_idle_stretches(target, drafter, prompts, plain, ray_cluster):
    """executor ray, a drafter actor: speculation switched off at run time (every step drafts nothing:
    the workers keep the rows, no actor is called) for stretches longer than the window, then on
    again; the drafter catches up from the kept rows and outputs are plain decoding's."""
    import threading
    import time

    import ray

    llm = LLM(target, config=idle_config(drafter, window=3, executor="ray"))
    try:
        params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
        base = [o.token_ids for o in LLM(target, config={"scheduler": {"block_size": 4}}).generate(prompts[:2], params)]
        stop, toggles = threading.Event(), []
        start = ray.get(llm.router.stats.remote())["steps"]

        def toggle():  # the run-time switch, as an operator flips it (the Router applies it between steps),
            # at step counts rather than times (a fast machine would finish first): off for 20 steps, longer
            # than the window; 120 tokens take at least 40 steps at k = 4 with these switches
            for at, on in ((5, False), (25, True), (35, False), (55, True)):
                while not stop.is_set() and ray.get(llm.router.stats.remote())["steps"] - start < at:
                    time.sleep(0.005)
                if stop.is_set():
                    return
                ray.get(llm.router.set_speculation.remote(on))
                toggles.append(on)

        t = threading.Thread(target=toggle, daemon=True)
        t.start()
        try:
            outs = llm.generate(prompts[:2], params)
        finally:
            stop.set()
            t.join()
        ray.get(llm.router.set_speculation.remote(True))
        assert [o.token_ids for o in outs] == base and len(toggles) >= 2
        names = sorted(ray.get(llm.router.drafter_names.remote()))
        ctx = [ray.get(ray.get_actor(n).context_stats.remote()) for n in names]
        print(f"drafted {[o.metrics['num_draft_tokens'] for o in outs]}, drafter context {ctx}")
        assert sum(o.metrics["num_draft_tokens"] for o in outs) > 0
        assert sum(c["resyncs"] for c in ctx) > 0  # an idle stretch longer than the window was caught up
        # and after more plain stretches the outputs are still the same
        again = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in again] == plain
    finally:
        llm.shutdown()
