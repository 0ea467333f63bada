"""The DSpark drafter: its serving path is its training path, the workers export exactly the
target's states of the committed tokens, and speculation with it is lossless in both executors."""

import pytest
import torch

from dspark_cluster import LLM, SamplingParams, step_exec
from dspark_cluster.errors import ConfigError
from dspark_cluster.model import gemm

from conftest import (build_dspark, dspark_proposer, hf_context_states, random_prompts, rows_by_position,
                      wait_until_drafting, wait_until_drafting_resumes)
from test_speculative import small_vocab  # noqa: F401 -- fixture
from test_speculative import (LAW_P, LAW_PROMPT, LAW_SCHED, exact_verify, first_position_law_verify, full_rounds,
                              law_pvalue, seeded)

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def dspark_config(draft, k=4, placement="group", passes="auto", **parallel):
    return {"scheduler": {"block_size": 4, "num_kv_blocks": 256}, "parallel": parallel,
            "speculative": {"method": "dspark", "draft_model": str(draft), "num_tokens": k, "schedule": "static",
                            "placement": placement, "draft_passes": passes}}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([5, 17, 9, 28, 3], seed=43)


@pytest.fixture(scope="module")
def drafters(checkpoint, tmp_path_factory):
    """arch -> a random DSpark drafter built for that test checkpoint (context: layers 0 and 1)."""
    cache = {}

    def get(arch, **kw):
        key = (arch, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = build_dspark(checkpoint(arch), tmp_path_factory.mktemp(f"dspark-{arch}"), layers=(0, 1), **kw)
        return cache[key]

    return get


@pytest.mark.parametrize("onednn", [False, True])
def test_packed_serving_weights_follow_a_version_switch_and_a_move(checkpoint, drafters, onednn, monkeypatch):
    """Serving packs each layer's q/k/v and gate/up weights into one tensor each (the modules' weights views
    of them): a drafter version switch (load_trained) and a move (.to) leave the packed forward equal to the
    modules' own, and nothing is held twice. With oneDNN's matmul on every product (`gemm`: its reordered copy of
    a weight is kept per storage and version), the switch's new values reach the packed weights' copies too."""
    from dspark_cluster.model.spec import load_spec
    from dspark_cluster.speculative.proposers import DraftRequest
    from dspark_cluster.speculative.records import ContextRows
    from dspark_cluster.speculative.dspark_proposer import DSparkProposer

    if onednn:
        if not gemm.runs_dtype(torch.float32):
            pytest.skip("no oneDNN matmul on this CPU")
        monkeypatch.setattr(gemm, "ONEDNN_MIN_WORK", 1)
    target = checkpoint("qwen3_moe")
    prop = DSparkProposer(drafters("qwen3_moe", markov_gate=True, draft_passes=2), str(target),
                          load_spec(str(target), "float32"), num_tokens=4, draft_passes=2)
    m, layer = prop.model, prop.model.layers[0]  # (made outside inference mode, as serving makes it)
    assert layer.q_proj.weight.data_ptr() == layer.packed[0].data_ptr()  # a view, not a copy
    assert not onednn or "_onednn" in layer.packed[0].__dict__  # its oneDNN copy made at load
    torch.manual_seed(0)
    prop.ingest(ContextRows(torch.tensor([7]), torch.tensor([0]), torch.tensor([10]), torch.randn(10, 2 * 64)))
    req = DraftRequest(7, torch.randint(2, 160, (11,)).tolist(), 4)

    def both():
        packed = prop.block_forward([req])
        saved = [lay.packed for lay in m.layers]
        for lay in m.layers:
            lay.packed = None
        unpacked = prop.block_forward([req])
        for lay, p in zip(m.layers, saved):
            lay.packed = p
        return packed, unpacked

    state = {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v for k, v in m.state_dict().items()}
    before = both()[0]
    m.load_trained(state)  # a version switch: copied into the packed weights
    (hn, base), (hn_ref, base_ref) = both()
    # (oneDNN's blocked products of a packed weight and of its parts may round apart in the last bits)
    same = (lambda a, b: torch.allclose(a, b, atol=1e-5)) if onednn else torch.equal  # noqa: E731
    assert not torch.equal(base, before[1])
    assert same(hn, hn_ref) and same(base, base_ref)
    m.to(torch.float64).to(torch.float32)  # a move: packed again
    assert layer.q_proj.weight.data_ptr() == layer.packed[0].data_ptr()
    (hn, base), (hn_ref, base_ref) = both()
    assert same(hn, hn_ref) and same(base, base_ref)


@pytest.mark.parametrize("markov_gate,passes", [(False, 1), (True, 1), (True, 2)])
@torch.inference_mode()  # what serving runs in (the drafter's store is an inference tensor)
def test_serving_forward_is_the_training_forward(markov_gate, passes, checkpoint, drafters):
    """Context ingested row by row, then one block, gives the logits and confidences of the dense
    masked training forward at the same anchor (RoPE positions, masks and Markov bias, gated by the
    slot's row or not, included); with two passes, slots 1.. those of a second-pass block, and online
    calibration's forward over a recorded round those the draft was made with."""
    from dspark_cluster.model.spec import load_spec
    from dspark_cluster.speculative.proposers import DraftRequest
    from dspark_cluster.speculative.records import ContextRows
    from dspark_cluster.speculative.dspark_proposer import DSparkProposer

    target = checkpoint("qwen3_moe")
    prop = DSparkProposer(drafters("qwen3_moe", markov_gate=markov_gate, draft_passes=passes), str(target),
                          load_spec(str(target), "float32"), num_tokens=4, draft_passes=passes)
    T, F = 16, 2 * 64
    torch.manual_seed(0)
    tokens = torch.randint(2, 160, (1, T))
    hidden = torch.randn(1, T, F)
    for a, b in ((0, 5), (5, 6), (6, 10)):  # chunks, as prefill and verify rounds deliver them
        prop.ingest(ContextRows(torch.tensor([7]), torch.tensor([a]), torch.tensor([b - a]), hidden[0, a:b]))
    anchor = 10
    req = DraftRequest(7, tokens[0, : anchor + 1].tolist(), 4)
    hn, base = prop.block_forward([req])
    m = prop.model
    # training: the same anchor, teacher-forced previous tokens = the tokens after the anchor
    z, conf = m.forward_train(tokens, hidden, torch.tensor([[anchor]]))
    w1, w2 = m.markov_factors()
    prev = tokens[0, anchor : anchor + 4]
    e, bias = m.markov_bias(prev, w1, w2, m.markov_gates(hn[0]))
    assert m.c.markov_gate == markov_gate
    torch.testing.assert_close(base[0] + bias, z[0, 0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(m.confidence_logit(hn[0], e), conf[0, 0], atol=1e-4, rtol=1e-4)
    if passes == 2:  # the second pass, teacher-forced: slot 1 holds the true token after the anchor
        hn2, base2 = prop.block_forward([req], tokens[0, anchor + 1:anchor + 2])
        z2, conf2 = m.forward_train(tokens, hidden, torch.tensor([[anchor]]), torch.tensor([[True]]))
        e2, bias2 = m.markov_bias(prev, w1, w2, m.markov_gates(hn2[0]))
        torch.testing.assert_close((base2[0] + bias2)[1:], z2[0, 0, 1:], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(m.confidence_logit(hn2[0], e2)[1:], conf2[0, 0, 1:], atol=1e-4, rtol=1e-4)
    # drafting: slot i's bias reads the token drafted at slot i - 1 (and, gated, slot i's own row); with two
    # passes slots 1.. come from a block holding slot 0's draft
    _, (drafted, confs, _) = prop.draft([req])
    prev = torch.cat([tokens[0, anchor:anchor + 1], drafted[0, :3]])
    if passes == 2:
        hn2, base2 = prop.block_forward([req], drafted[0, :1])
        hn, base = torch.cat([hn[:, :1], hn2[:, 1:]], 1), torch.cat([base[:, :1], base2[:, 1:]], 1)
    e, bias = m.markov_bias(prev, w1, w2, m.markov_gates(hn[0]))
    assert drafted[0].tolist() == (base[0] + bias).argmax(-1).tolist()
    torch.testing.assert_close(confs[0], torch.sigmoid(m.confidence_logit(hn[0], e)))
    # online calibration's forward of this round (the rows before the anchor; prev: anchor, then the drafts)
    zr, cr = m.forward_rounds(hidden[:, :anchor], torch.arange(anchor)[None], torch.ones(1, anchor, dtype=torch.bool),
                              tokens[:, anchor:anchor + 1], torch.tensor([[anchor]]), prev[None, None])
    torch.testing.assert_close(zr[0, 0, :4], base[0, :4] + bias, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.sigmoid(cr[0, 0, :4]), confs[0], atol=1e-4, rtol=1e-4)
    # a sequence's first rows start its context (past a cached prefix, after 0); earlier ones arriving after
    # them (a drafter actor takes rows on two threads) start it instead, the others waiting behind, in any order;
    # a recompute rewrites history
    prop.ingest(ContextRows(torch.tensor([8]), torch.tensor([4]), torch.tensor([2]), hidden[0, 4:6]))
    assert (prop.ctx[8].first_row, prop.ctx[8].length) == (4, 6)
    prop.ingest(ContextRows(torch.tensor([8]), torch.tensor([2]), torch.tensor([2]), hidden[0, 2:4]))
    assert (prop.ctx[8].first_row, prop.ctx[8].length) == (2, 6) and not prop.ctx[8].pending
    prop.ingest(ContextRows(torch.tensor([8]), torch.tensor([6]), torch.tensor([2]), hidden[0, 6:8]))
    prop.ingest(ContextRows(torch.tensor([8]), torch.tensor([0]), torch.tensor([1]), hidden[0, :1]))
    assert (prop.ctx[8].first_row, prop.ctx[8].length) == (0, 1) and sorted(prop.ctx[8].pending) == [2, 4, 6]
    prop.ingest(ContextRows(torch.tensor([8]), torch.tensor([1]), torch.tensor([1]), hidden[0, 1:2]))
    assert prop.ctx[8].length == 8 and not prop.ctx[8].pending
    prop._materialize([8])
    torch.testing.assert_close(prop.ctx[8].k[0][:8], prop.model.layers[0].context_kv(
        prop.model.fuse(hidden[0, :8]), prop.model.rope(torch.arange(8)))[0])
    prop.ingest(ContextRows(torch.tensor([8]), torch.tensor([0]), torch.tensor([3]), hidden[0, :3]))
    assert prop.ctx[8].length == 3
    # rows that arrive after their sequence was freed are dropped (no memory held for ever)
    prop.free([8])
    prop.ingest(ContextRows(torch.tensor([8]), torch.tensor([3]), torch.tensor([1]), hidden[0, 3:4]))
    assert 8 not in prop.ctx


@pytest.mark.parametrize("passes", [1, 2])
def test_a_context_that_starts_past_a_cached_prefix_reads_no_row_before_it(passes, checkpoint, drafters):
    """A request that took cached blocks computes only its prompt's latest rows: its drafter's context starts
    there. Its blocks, alone or batched with others, draft as a drafter holding every row would with a window
    that ends at that row (the rows before it unread: here garbage), at the window of 512 the config gives."""
    from dspark_cluster.model.spec import load_spec
    from dspark_cluster.speculative.proposers import DraftRequest
    from dspark_cluster.speculative.records import ContextRows
    from dspark_cluster.speculative.dspark_proposer import DSparkProposer

    target = checkpoint("qwen3_moe")
    spec, path = load_spec(str(target), "float32"), drafters("qwen3_moe", draft_passes=passes)
    cached = DSparkProposer(path, str(target), spec, num_tokens=4, context_window=512, draft_passes=passes)
    torch.manual_seed(2)
    p, L = 24, 37  # cached prefix, context length (the anchor's position)
    rows, tokens = torch.randn(L, 2 * 64), torch.randint(2, 160, (L + 1,)).tolist()
    cached.ingest(ContextRows(torch.tensor([1, 2]), torch.tensor([p, 0]), torch.tensor([L - p, 9]),
                              torch.cat([rows[p:], torch.randn(9, 2 * 64)])))
    assert cached.ctx[1].first_row == p and cached.resyncs == 0  # (a start, not a gap)
    _, (alone, conf, _) = cached.draft([DraftRequest(1, tokens, 4)])
    _, (batched, conf_b, _) = cached.draft([DraftRequest(2, tokens[:10], 4), DraftRequest(1, tokens, 4)])
    for window in (L - p, 512):  # every row held: the rows before p garbage, a window that stops at p reads none
        full = DSparkProposer(path, str(target), spec, num_tokens=4, context_window=window, draft_passes=passes)
        full.ingest(ContextRows(torch.tensor([1]), torch.tensor([0]), torch.tensor([L]),
                                torch.cat([100 * torch.randn(p, 2 * 64), rows[p:]])))
        _, (want, want_conf, _) = full.draft([DraftRequest(1, tokens, 4)])
        if window == L - p:
            assert alone[0].tolist() == want[0].tolist() == batched[1].tolist()
            torch.testing.assert_close(conf[0], want_conf[0])
            torch.testing.assert_close(conf_b[1], want_conf[0], atol=1e-5, rtol=1e-5)
        else:  # reading the garbage changes the block (so the test above can tell)
            assert not torch.allclose(conf[0], want_conf[0])


@pytest.mark.parametrize("passes", [1, 2])
def test_a_batch_of_blocks_drafts_as_each_block_alone(passes, checkpoint, drafters):
    """Blocks of sequences with contexts of different lengths, some past the window, drafted together (the
    context keys/values padded into one batch, made once for both passes) give each sequence's drafts and
    confidences as drafted alone (views of its own rows)."""
    from dspark_cluster.model.spec import load_spec
    from dspark_cluster.speculative.proposers import DraftRequest
    from dspark_cluster.speculative.records import ContextRows
    from dspark_cluster.speculative.dspark_proposer import DSparkProposer

    target = checkpoint("qwen3_moe")
    prop = DSparkProposer(drafters("qwen3_moe", draft_passes=passes), str(target), load_spec(str(target), "float32"),
                          num_tokens=4, context_window=8, draft_passes=passes)
    torch.manual_seed(1)
    reqs = []
    for sid, n in ((1, 5), (2, 11), (3, 16), (4, 8), (5, 40)):
        prop.ingest(ContextRows(torch.tensor([sid]), torch.tensor([0]), torch.tensor([n]), torch.randn(n, 2 * 64)))
        reqs.append(DraftRequest(sid, torch.randint(2, 160, (n + 1,)).tolist(), 4))
    prop.draft([reqs[-1]])  # sequence 5's store is made (40 rows' keys/values), then 200 rows come in one chunk
    prop.ingest(ContextRows(torch.tensor([5]), torch.tensor([40]), torch.tensor([200]), torch.randn(200, 2 * 64)))
    reqs[-1] = DraftRequest(5, torch.randint(2, 160, (241,)).tolist(), 4)
    _, (tokens, confs, _) = prop.draft(reqs)
    for b, r in enumerate(reqs):
        _, (alone, conf, _) = prop.draft([r])
        assert tokens[b].tolist() == alone[0].tolist()
        torch.testing.assert_close(confs[b], conf[0], atol=1e-5, rtol=1e-5)
    # a block anchored before rows the drafter holds (an older request) leaves those rows as they were
    st = prop.ctx[3]
    held = [t[:st.kv_length].clone() for t in st.k + st.v]
    prop.draft([DraftRequest(3, reqs[2].token_ids[:10], 4)])
    assert all(torch.equal(a, t[:st.kv_length]) for a, t in zip(held, st.k + st.v))
    assert prop.draft([reqs[2]])[1][0][0].tolist() == tokens[2].tolist()


@pytest.mark.parametrize("passes", [1, 2])
def test_a_sequences_drafter_context_holds_its_window_not_its_length(passes, checkpoint, drafters):
    """A drafter keeps a sequence's keys/values for the rows its blocks read (the latest window and a few more), not
    its whole context: over 600 rows taken a few at a time and drafted from at every length (window 8, and 40 where
    two sequences draft together), the store stays within a bound of the window whatever the length, and each
    proposal drafts what a drafter that took the same rows in one chunk drafts. A proposal behind the rows taken
    reads what is kept (a narrower window, counted) and one anchored below them is a miss; history rewritten below
    the kept rows (a recompute) starts the store again there."""
    from dspark_cluster.model.spec import load_spec
    from dspark_cluster.speculative.dspark_proposer import KEEP_BEHIND, DSparkProposer
    from dspark_cluster.speculative.proposers import DraftRequest
    from dspark_cluster.speculative.records import ContextRows

    target = checkpoint("qwen3_moe")
    spec, path = load_spec(str(target), "float32"), drafters("qwen3_moe", draft_passes=passes)
    g = torch.Generator().manual_seed(4)
    rows, tokens = torch.randn(600, 2 * 64, generator=g), torch.randint(2, 160, (601,), generator=g).tolist()
    for window, sids in ((8, [1]), (40, [1, 2])):
        make = lambda: DSparkProposer(path, str(target), spec, num_tokens=4, context_window=window,  # noqa: E731
                                      draft_passes=passes)
        prop = make()
        bound = max(64, 2 * (window + KEEP_BEHIND + 2 * prop.c.block_size))
        n, step = 0, 0
        while n < 600:
            m = min(600 - n, 1 + step % 5)
            for sid in sids:
                prop.ingest(ContextRows(torch.tensor([sid]), torch.tensor([n]), torch.tensor([m]), rows[n:n + m]))
            n, step = n + m, step + 1
            if n < 20 and step % 3:
                continue
            reqs = [DraftRequest(sid, tokens[:n + 1], 4) for sid in sids]
            _, (got, conf, _) = prop.draft(reqs)
            ref = make()
            ref.ingest(ContextRows(torch.tensor([9]), torch.tensor([0]), torch.tensor([n]), rows[:n]))
            _, (want, want_conf, _) = ref.draft([DraftRequest(9, tokens[:n + 1], 4)])
            for b in range(len(sids)):
                assert got[b].tolist() == want[0].tolist(), (window, n, b)
                torch.testing.assert_close(conf[b], want_conf[0], atol=1e-5, rtol=1e-5)
            assert all(t.shape[0] <= bound for sid in sids for t in prop.ctx[sid].k + prop.ctx[sid].v), (n, bound)
        st = prop.ctx[1]
        assert st.base > 600 - window - KEEP_BEHIND - bound  # the oldest rows were dropped
    # a proposal behind the rows taken (within KEEP_BEHIND) reads its whole window
    _, (got, _, _) = prop.draft([DraftRequest(1, tokens[:590 + 1], 4)])
    ref = make()
    ref.ingest(ContextRows(torch.tensor([9]), torch.tensor([0]), torch.tensor([590]), rows[:590]))
    assert got[0].tolist() == ref.draft([DraftRequest(9, tokens[:591], 4)])[1][0][0].tolist()
    # a proposal anchored below the kept rows is a miss (no block reads rows the store dropped); one behind them by
    # more than KEEP_BEHIND reads what is kept (a narrower window, counted)
    misses, narrowed = prop.misses, prop.narrowed
    assert prop.draft([DraftRequest(1, tokens[:101], 4)]) == ([], ()) and prop.misses == misses + 1
    assert prop.draft([DraftRequest(1, tokens[:prop.ctx[1].base + 3], 4)])[0] == [0] and prop.narrowed == narrowed + 1
    # history rewritten from row 100 (below the kept rows): the store starts again at the rows sent
    fresh = torch.randn(60, 2 * 64, generator=g)
    prop.ingest(ContextRows(torch.tensor([1]), torch.tensor([100]), torch.tensor([60]), fresh))
    assert prop.ctx[1].length == 160
    _, (got, _, _) = prop.draft([DraftRequest(1, tokens[:161], 4)])
    ref = make()
    ref.ingest(ContextRows(torch.tensor([9]), torch.tensor([0]), torch.tensor([160]), torch.cat([rows[:100], fresh])))
    assert got[0].tolist() == ref.draft([DraftRequest(9, tokens[:161], 4)])[1][0][0].tolist()
    # and rewritten below them with no rows: nothing to draft from until rows come
    prop.ingest(ContextRows(torch.tensor([1]), torch.tensor([30]), torch.tensor([0]), fresh[:0]))
    assert prop.draft([DraftRequest(1, tokens[:31], 4)]) == ([], ())


def test_online_calibration_keeps_a_long_sequences_latest_rows(checkpoint, drafters):
    """With online calibration a proposer keeps each sequence's rows (16-bit) for its training sample and a version
    switch's recompute: of a sequence of 3,000 rows, the latest CALIBRATION_KEPT_ROWS (and at most MAX_CONTEXT more),
    not all; its sample starts there (row_offset), its rows the rows sent, and holds every round whose context lies
    there; a version switch recomputes the window from them and drafts as a drafter of the new weights that took
    every row."""
    from dspark_cluster.model.spec import load_spec
    from dspark_cluster.speculative.calibration import MAX_CONTEXT
    from dspark_cluster.speculative.dspark_proposer import CALIBRATION_KEPT_ROWS, DSparkProposer
    from dspark_cluster.speculative.proposers import DraftRequest
    from dspark_cluster.speculative.records import ContextRows

    from test_calibration import rounds

    target = checkpoint("qwen3_moe")
    spec, path = load_spec(str(target), "float32"), drafters("qwen3_moe")
    make = lambda calibrate: DSparkProposer(path, str(target), spec, num_tokens=4, calibrate=calibrate)  # noqa: E731
    prop = make(True)
    g = torch.Generator().manual_seed(6)
    n = 3000
    rows, tokens = torch.randn(n, 2 * 64, generator=g), torch.randint(2, 160, (n + 1,), generator=g).tolist()
    for start in range(0, n, 100):  # a step's rows and a round anchored at each of its 25 positions
        r = rounds(25, seq=1, start=start)
        r.anchor_pos = torch.arange(start, start + 100, 4)
        prop.ingest(ContextRows(torch.tensor([1]), torch.tensor([start]), torch.tensor([100]), rows[start:start + 100],
                                rounds=r))
        kept = sum(h.shape[0] for _, h in prop.ctx[1].kept)
        assert kept <= CALIBRATION_KEPT_ROWS + MAX_CONTEXT + 100, (start, kept)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in prop.model.state_dict().items()}
    prop.stage(1, new, keep=[])
    prop.use(1)
    ref = make(False)
    ref.model.load_trained(new)
    # (the switch recomputes from the 16-bit rows kept)
    ref.ingest(ContextRows(torch.tensor([1]), torch.tensor([0]), torch.tensor([n]), rows.to(torch.float16).float()))
    req = DraftRequest(1, tokens, 4)
    (_, (got, conf, _)), (_, (want, want_conf, _)) = prop.draft([req]), ref.draft([req])
    assert torch.equal(got, want) and torch.allclose(conf, want_conf, atol=1e-5)
    prop.free([1], {1: "stop"})
    (sample,) = prop.take_samples()
    lo = sample.row_offset
    assert n - CALIBRATION_KEPT_ROWS - MAX_CONTEXT <= lo <= n - CALIBRATION_KEPT_ROWS
    assert torch.equal(sample.rows, rows[lo:].to(torch.float16))
    anchors = sample.rounds.anchor_pos
    assert int(anchors.min()) - MAX_CONTEXT >= lo and anchors.tolist() == list(range(lo + MAX_CONTEXT + (-(lo + MAX_CONTEXT) % 4), n, 4))


@torch.inference_mode()  # what serving runs in (the drafter's store is an inference tensor)
def test_a_second_pass_block_reads_its_first_draft(checkpoint, drafters):
    """`forward_train(..., second_pass)`: a second-pass block holds the token after the anchor at slot 1
    (train_dspark.py --second-pass-share): its later slots read that token through the backbone, where a
    first pass's slot 2 does not depend on it at all (slot 1 holds a mask, and the Markov head reads it at
    slot 1 only)."""
    from dspark_cluster.model.spec import load_spec
    from dspark_cluster.speculative.dspark_proposer import DSparkProposer

    target = checkpoint("qwen3_moe")
    m = DSparkProposer(drafters("qwen3_moe", markov_gate=True), str(target), load_spec(str(target), "float32"),
                       num_tokens=4).model
    torch.manual_seed(0)
    tokens = torch.randint(2, 160, (1, 16))
    hidden = torch.randn(1, 16, 2 * 64)
    anchors = torch.tensor([[6, 9]])
    with torch.no_grad():
        z1, c1 = m.forward_train(tokens, hidden, anchors)
        z0, c0 = m.forward_train(tokens, hidden, anchors, torch.zeros_like(anchors, dtype=torch.bool))
        assert torch.equal(z0, z1) and torch.equal(c0, c1)
        second = torch.tensor([[True, False]])
        z2, _ = m.forward_train(tokens, hidden, anchors, second)
        other = tokens.clone()
        other[0, 7] = (tokens[0, 7] + 1) % 160  # the token after the first block's anchor
        z1b, _ = m.forward_train(other, hidden, anchors)
        z2b, _ = m.forward_train(other, hidden, anchors, second)
    assert torch.equal(z1[0, 0, 2], z1b[0, 0, 2])  # first pass: slot 2 never sees it
    assert not torch.allclose(z2[0, 0, 2], z2b[0, 0, 2])  # second pass: it does
    assert torch.equal(z2[0, 1], z1[0, 1])  # the other block is a first pass
    ids = torch.tensor([tokens[0, 6], tokens[0, 7], 1, 1])
    torch.testing.assert_close(m.block_input(tokens[0, 6:7], 4, tokens[0, 7:8])[0], m.in_proj(m.embed[ids]))


def spy_on_ingest(llm) -> list:
    """The ContextRows the in-process drafter ingests, as they arrive (it still ingests them)."""
    backend = dspark_proposer(llm)
    seen, ingest = [], backend.ingest

    def spy(rows):
        seen.append(rows)
        ingest(rows)

    backend.ingest = spy
    return seen


@pytest.mark.parametrize("placement", ["group", "target"])
def test_exported_context_is_the_target_states_of_committed_tokens(placement, checkpoint, drafters, prompts):
    """What reaches the drafter, position by position, equals transformers' hidden states of the
    final sequence (so rejected drafts never leak in), and the step's byte count is those rows'
    (none with the drafter on the target: the rows never leave its device)."""
    from conftest import hf_model

    target = checkpoint("deepseek_v3")
    llm = LLM(target, config=dspark_config(drafters("deepseek_v3"), placement=placement))
    seen = spy_on_ingest(llm)
    outs = llm.generate(prompts, GREEDY)
    stats = llm.engine.drafter.stats.summary()
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] < stats["num_draft_tokens"]  # rejections happened
    by_seq = rows_by_position(seen)
    hf = hf_model(target)
    for o in outs:
        seq = o.prompt_token_ids + o.token_ids
        want = hf_context_states(hf, seq)[: len(seq) - 1]
        # this request's rows: every token but the last (which the target has not run yet)
        rows = next(r for r in by_seq.values() if torch.allclose(r[0], want[0], atol=1e-4) and len(r) == len(seq) - 1)
        assert sorted(rows) == list(range(len(seq) - 1))
        torch.testing.assert_close(torch.stack([rows[p] for p in range(len(seq) - 1)]), want, atol=1e-4, rtol=1e-4)
    exported = sum(s["export_bytes"] for s in llm.engine.step_stats)
    assert exported == (0 if placement == "target" else sum(r.nbytes for r in seen)) and seen


@pytest.mark.parametrize("arch, placement, passes", [("qwen3_moe", "group", 1), ("deepseek_v3", "group", 1),
                                                     ("qwen3_moe", "target", 1), ("deepseek_v3", "target", 1),
                                                     ("qwen3_moe", "group", 2), ("deepseek_v3", "target", 2)])
def test_greedy_output_is_identical_with_dspark(arch, placement, passes, checkpoint, drafters, prompts):
    target = checkpoint(arch)
    base = [o.token_ids for o in LLM(target, config={"scheduler": {"block_size": 4}}).generate(prompts, GREEDY)]
    drafter = drafters(arch, draft_passes=passes) if passes > 1 else drafters(arch)
    llm = LLM(target, config=dspark_config(drafter, k=3, placement=placement, passes=passes))
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == base
    stats = llm.engine.drafter.stats.summary()
    assert stats["verify_rounds"] > 0 and stats["num_draft_tokens"] > 0
    assert dspark_proposer(llm).misses == 0  # in process the context is always there in time
    conf = stats["mean_confidence_by_position"]
    assert len(conf) == 3 and all(0 < c < 1 for c in conf)


def dspark_law_pvalue(small_vocab, tmp_path, k: int, top_p: float, n: int = 3000, seed: int = 0,  # noqa: F811
                      placement: str = "group", passes: int = 1, dtype: str = "float32", compile: str = "off") -> float:
    """Speculation with a random DSpark drafter over small_vocab's target, k drafts a round: the
    p-value of the output law against the target's (see test_speculative's law tests), after
    checking that rounds verifying all k drafts ran and that drafts were both accepted and rejected.
    dtype: model.dtype (the drafter serves in it too; the reference law stays the fp32 target's, which a
    bf16 target of this peaky 8-token vocabulary matches far within the test's resolution). compile on: model.compile
    (the drafter's rounds compiled too), 16 rows a step (few buckets to compile), unseeded requests (a seeded
    row drafts eager)."""
    draft = build_dspark(small_vocab["target"], tmp_path / "d", seed=5, layers=(0,), block_size=3, hidden=16, scale=2.0,
                         draft_passes=passes)
    sched = LAW_SCHED if compile == "off" else {**LAW_SCHED, "max_num_seqs": 16}
    llm = LLM(small_vocab["target"], config={"model": {"dtype": dtype, "compile": compile}, "scheduler": sched,
                                             "speculative": {
        "method": "dspark", "draft_model": str(draft), "num_tokens": k, "schedule": "static", "placement": placement,
        "draft_passes": passes}})
    assert dspark_proposer(llm).model.fc.weight.dtype == getattr(torch, dtype)
    params = seeded(n, seed, max_tokens=k + 2, top_p=top_p) if compile == "off" else \
        SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=k + 2, top_p=top_p)
    torch.manual_seed(seed)  # (unseeded rows draw from the global generator, the compiled rounds' too: the same run)
    spec = llm.generate([LAW_PROMPT] * n, params)
    if compile != "off":  # the drafts came from compiled rounds with sampled rows
        assert dspark_proposer(llm).compiled.sampled_rounds > 0
    stats = llm.engine.drafter.stats
    assert full_rounds(llm, k) >= n / 2, stats.proposed  # every first round verifies all k
    assert 0 < stats.accepted[k - 1] and sum(stats.accepted) < sum(stats.proposed)
    p = law_pvalue(spec, small_vocab["target"], LAW_PROMPT, top_p)
    print(f"law p-value {p:.3g} (dspark, k={k}, top_p={top_p}, drafts by position {stats.proposed}, "
          f"accepted {stats.accepted})")
    return p


@pytest.mark.parametrize("k, top_p, placement, passes, dtype, compile", [
    (2, 1.0, "group", 1, "float32", "off"), (3, 0.8, "group", 1, "float32", "off"),
    (3, 0.8, "target", 1, "float32", "off"), (3, 1.0, "group", 2, "float32", "off"),
    (3, 0.8, "group", 1, "bfloat16", "off"), (3, 1.0, "target", 2, "bfloat16", "off"),
    (3, 1.0, "target", 2, "float32", "on")])
def test_dspark_sampling_is_lossless(k, top_p, placement, passes, dtype, compile, small_vocab, tmp_path):  # noqa: F811
    """With the drafter on the target the draft law of a sampled row never crosses: the driver rank
    verifies against the law it kept. A two-pass drafter's later slots are drawn from the second forward's
    law, which the verifier must then use. A bf16 drafter draws from its law rounded to bf16, which is what
    it ships and what the verifier renormalises. A compiled round draws inside its graph and ships the law it drew
    from."""
    p = dspark_law_pvalue(small_vocab, tmp_path, k, top_p, placement=placement, passes=passes, dtype=dtype,
                          compile=compile)
    assert p > LAW_P, p


@pytest.mark.parametrize("placement", ["group", "target"])
def test_the_drafter_serves_in_the_targets_dtype(placement, checkpoint, drafters, prompts, monkeypatch):
    """model.dtype bfloat16: the drafter's weights, the target's tables it holds, its context keys/values and the
    sampled rows' draft laws are bf16 (an fp32 drafter beside a bf16 target reads and holds twice the bytes);
    greedy output is the bf16 target's own."""
    target, bf16 = checkpoint("qwen3_moe"), {"dtype": "bfloat16"}
    base = [o.token_ids for o in LLM(target, config={"model": bf16, "scheduler": {"block_size": 4}}).generate(
        prompts, GREEDY)]
    laws, kv = [], set()

    def spy(target_logits, draft_tokens, num_draft, draft_probs, *args):
        laws.append(None if draft_probs is None else draft_probs.dtype)
        kv.update(t.dtype for st in dspark_proposer(llm).ctx.values() for t in st.k + st.v)
        return exact_verify(target_logits, draft_tokens, num_draft, draft_probs, *args)

    monkeypatch.setattr(step_exec, "verify", spy)
    llm = LLM(target, config={"model": bf16, **dspark_config(drafters("qwen3_moe"), k=3, placement=placement)})
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == base
    m = dspark_proposer(llm).model
    assert {p.dtype for p in m.parameters()} == {m.embed.dtype, m.lm_head.dtype} == {torch.bfloat16}
    assert kv == {torch.bfloat16}
    assert set(laws) == {None}  # greedy rows carry no law
    laws.clear()
    llm.generate(prompts[:2], [SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)] * 2)
    assert torch.bfloat16 in laws and torch.float32 not in laws
    assert llm.engine.drafter.stats.summary()["num_draft_tokens"] > 0


@pytest.mark.parametrize("placement", ["group", "target"])
def test_the_dspark_law_test_fails_on_a_verifier_that_reuses_the_first_draft_law(placement, small_vocab,  # noqa: F811
                                                                                tmp_path, monkeypatch):
    monkeypatch.setattr(step_exec, "verify", first_position_law_verify)
    p = dspark_law_pvalue(small_vocab, tmp_path, 3, 0.8, placement=placement)
    assert p < LAW_P, p


def test_dspark_config_is_checked_against_the_target(checkpoint, drafters):
    draft = drafters("qwen3_moe")
    with pytest.raises(ConfigError, match="speculative.num_tokens"):
        LLM(checkpoint("qwen3_moe"), config=dspark_config(draft, k=5))  # the block holds 4
    with pytest.raises(ConfigError, match="was not trained for model.path's target"):
        LLM(checkpoint("deepseek_v3"), config=dspark_config(draft))  # another target's tables
    with pytest.raises(ConfigError, match="draft_tensor"):
        LLM(checkpoint("qwen3_moe"), config={**dspark_config(draft), "speculative": {
            "method": "dspark", "draft_model": str(draft), "draft_tensor": 2, "draft_workers": 2}})


@pytest.mark.parametrize("draft_workers, schedule, passes", [(1, "static", 2), (2, "confidence", "auto")])
def test_greedy_identical_through_ray_with_dspark(draft_workers, schedule, passes, checkpoint, drafters, prompts,
                                                  ray_cluster):
    """The workers send the context rows straight to the drafter actors that own the sequences; the
    confidence schedule (profiled through the Ray workers) keeps the output too, and so does a drafter
    that takes two passes (speculative.draft_passes resolved in the Router's process, carried to the actors;
    auto resolved for the cluster's devices: CPUs here, one pass)."""
    import ray

    target = checkpoint("deepseek_v3")
    base = [o.token_ids for o in LLM(target, config={"scheduler": {"block_size": 4}}).generate(prompts, GREEDY)]
    drafter = drafters("deepseek_v3", draft_passes=2) if passes == 2 else drafters("deepseek_v3")
    cfg = dspark_config(drafter, executor="ray", tensor=2, passes=passes)
    cfg["speculative"]["draft_workers"] = draft_workers
    cfg["speculative"]["schedule"] = schedule
    # the confidence schedule learns at any load (the prior gate could stay shut on a loaded machine, and
    # this test asserts that the drafters ran)
    cfg["speculative"]["prior_acceptance"] = None
    llm = LLM(target, config=cfg)
    try:
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == base
        drafted = sum(o.metrics["num_draft_tokens"] for o in outs)
        assert drafted > 0
        names = sorted(ray.get(llm.router.drafter_names.remote()))
        ctx = [ray.get(ray.get_actor(n).context_stats.remote()) for n in names]
        assert all(c["draft_passes"] == (1 if passes == "auto" else passes) for c in ctx)
        assert sum(c["ingested_rows"] for c in ctx) >= sum(len(p) for p in prompts)
        stats = ray.get(llm.router.stats.remote())
        assert stats["speculative"]["num_draft_tokens"] == drafted
        assert stats["speculative"]["schedule"] == schedule
        if schedule == "confidence":
            table = stats["speculative"]["calibration"]["step_cost"]
            assert table["tokens"][0] == 1 and all(t > 0 for t in table["profiled_s"])
            assert 0 < stats["speculative"]["verified_share"] <= 1
        # the live cost ledger sees every device: two target workers, the drafters, the Router's core
        live = stats["cost"]
        assert {r: v["devices"] for r, v in live["roles"].items()} == {"target": 2, "drafter": draft_workers, "router": 1}
        assert live["tokens"]["output"] == sum(len(o.token_ids) for o in outs)
        assert live["tokens"]["drafted"] >= drafted and live["comm_bytes"]["hidden_state_export"] > 0
        for d in live["memory"]["per_device"]:
            assert (d["weights"] > 0 and d["kv_pool"] > 0) if d["role"] == "target" else d["weights"] == 0
            assert (d["drafter_weights"] > 0) == (d["role"] == "drafter")
            # each drafter actor's CPU oneDNN copies (model/gemm.py), made at its load
            assert (d["drafter_weights_reordered"] > 0) == (d["role"] == "drafter" and gemm._ONEDNN)
        # a run's ledger (run_workload) also counts the bytes each collective sent
        from dspark_cluster.workload import WorkloadRequest

        run = ray.get(llm.router.run_workload.remote([WorkloadRequest(0.0, prompts[0], GREEDY)]))
        comm = run["cost"]["comm_bytes"]
        # (one request: the confidence schedule may judge drafting not worth it at batch 1, and export nothing)
        drafted_run = sum(s["num_drafted"] for s in run["steps"])
        assert comm["all_reduce"] > 0 and (comm["hidden_state_export"] > 0 or drafted_run == 0)
        assert drafted_run > 0 or schedule == "confidence"
        assert run["cost"]["tokens"]["output"] == sum(r["num_output_tokens"] for r in run["requests"])
    finally:
        llm.shutdown()


def test_killing_the_dspark_drafter_mid_run_loses_nothing(checkpoint, drafters, ray_cluster):
    """Running sequences go on without drafts (the new drafter has none of their context); requests
    that start after the restart speculate again, their context sent to the new actors."""
    import ray

    target = checkpoint("deepseek_v3")
    prompts = random_prompts([6, 11, 4, 9, 14, 7], seed=44)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    base = [o.token_ids for o in LLM(target, config={"scheduler": {"block_size": 4}}).generate(prompts, params)]
    llm = LLM(target, config=dspark_config(drafters("deepseek_v3"), executor="ray"))
    try:
        ref = llm.router.generate.remote(prompts, [params] * len(prompts))
        wait_until_drafting(llm)  # drafting has begun
        old = sorted(ray.get(llm.router.drafter_names.remote()))
        for name in old:
            ray.kill(ray.get_actor(name), no_restart=True)
        assert [o.token_ids for o in ray.get(ref, timeout=300)] == base
        wait_until_drafting_resumes(llm, prompts[0], params, base[0], "DSpark drafter")
        new = sorted(ray.get(llm.router.drafter_names.remote()))
        assert new and not set(new) & set(old)
    finally:
        llm.shutdown()


def test_context_rows_split_by_owner():
    """Each drafter group gets its sequences' rows, in order (seq_id % groups)."""
    from dspark_cluster.speculative.records import ContextRows

    rows = ContextRows(torch.tensor([3, 4, 5, 6]), torch.tensor([0, 2, 4, 1]), torch.tensor([2, 1, 3, 2]),
                       torch.arange(8.0)[:, None].repeat(1, 2))
    even, odd = rows.split(2)
    assert even.seq_ids.tolist() == [4, 6] and even.starts.tolist() == [2, 1] and even.counts.tolist() == [1, 2]
    assert even.hidden[:, 0].tolist() == [2.0, 6.0, 7.0]
    assert odd.seq_ids.tolist() == [3, 5] and odd.hidden[:, 0].tolist() == [0.0, 1.0, 3.0, 4.0, 5.0]
    assert [(sid, s, h.shape[0]) for sid, s, h in odd] == [(3, 0, 2), (5, 4, 3)]


def test_a_request_that_does_not_speculate_exports_nothing(checkpoint, drafters, prompts):
    """Only speculating requests' rows go to the drafter; the others' outputs are unchanged."""
    target = checkpoint("deepseek_v3")
    llm = LLM(target, config=dspark_config(drafters("deepseek_v3")))
    seen = spy_on_ingest(llm)
    off = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, speculative=False)
    outs = llm.generate(prompts[:2], [GREEDY, off])
    sids = {sid for rows in seen for sid, _, _ in rows}
    assert len(sids) == 1  # the first request's
    assert sum(h.shape[0] for rows in seen for _, _, h in rows) == len(prompts[0]) + len(outs[0].token_ids) - 1
    assert outs[1].metrics["num_draft_tokens"] == 0
    plain = LLM(target, config={"scheduler": {"block_size": 4}}).generate(prompts[:2], GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


@pytest.mark.parametrize("reads, lossless", [("previous", True), ("own", False)])
def test_the_confidence_schedule_on_the_target_is_lossless_with_wrong_confidences(reads, lossless,
                                                                                  small_vocab, tmp_path):  # noqa: F811
    """The confidence schedule with the drafter on the target: its proposals come back with the step before,
    the Router cuts them to the verify budget, and the driver rank verifies sampled rows against the draft
    laws it kept. Fed confidences that are badly wrong but read only the tokens before their own, the law
    stays the target's; a confidence that reads its own token (DSpark, Appendix A's mistake) changes it,
    and the test sees that."""
    from test_speculative import _FixedCost

    n, k = 6000, 2
    draft = build_dspark(small_vocab["mild"], tmp_path / "d", seed=5, layers=(0,), block_size=3, hidden=16, scale=2.0)
    llm = LLM(small_vocab["mild"], config={"scheduler": LAW_SCHED, "speculative": {
        "method": "dspark", "draft_model": str(draft), "num_tokens": k, "schedule": "confidence", "placement": "target"}})
    planner = llm.engine.planner
    planner.step_cost = _FixedCost([1, 512, 4096], [1 + 1 / 512, 2.0, 9.0])
    planner.refit_every = planner.min_rounds = 10**9  # keep the wrong confidences as they are
    planner.explore_rows, planner.prior_acceptance = n, None  # draft on every row, whatever the drafter's cost
    proposer = dspark_proposer(llm)
    inner = proposer.draft

    def draft_with_wrong_confidences(reqs):
        active, drafted = inner(reqs)
        if active:
            tokens, _, laws = drafted
            anchors = torch.tensor([reqs[i].token_ids[-1] for i in active])[:, None]
            src = torch.cat([anchors, tokens[:, :-1]], 1) if reads == "previous" else tokens
            drafted = (tokens, torch.where(src % 2 == 0, 0.95, 0.05), laws)
        return active, drafted

    proposer.draft = draft_with_wrong_confidences
    spec = llm.generate([LAW_PROMPT] * n, seeded(n, 1000, max_tokens=4))
    steps = list(llm.engine.step_stats)
    drafted, verified = sum(s["num_drafted"] for s in steps), sum(s["num_verified"] for s in steps)
    assert 0 < verified < drafted / 1.5  # the budget cut many drafts and kept others
    assert full_rounds(llm, k) > 0
    p = law_pvalue(spec, small_vocab["mild"], LAW_PROMPT)
    print(f"law p-value {p:.3g} (confidences reading {reads}, drafter on the target)")
    assert (p > LAW_P) if lossless else (p < 1e-6), p
