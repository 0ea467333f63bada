"""The engine computes the same function as the transformers reference, for every architecture."""

import pytest
import torch

from dspark_cluster import LLM, SamplingParams
from dspark_cluster.kv_cache import BlockManager, allocate_kv_cache
from dspark_cluster.model.attention import build_metadata
from dspark_cluster.model.loader import load_model
from dspark_cluster.model.spec import load_spec

from conftest import ARCHS, hf_model, random_prompts

LENGTHS = [7, 19, 3, 12]
DECODE_STEPS = 16


def rel_err(ours, ref):
    return float((ours - ref).abs().max() / ref.abs().max())


def paged_model(path, seq_lens, block_size, num_blocks=64):
    """The checkpoint's model with a paged KV pool, and block tables [len(seq_lens), max blocks]
    (zero-padded) holding seq_lens[i] tokens for sequence i."""
    model = load_model(path, load_spec(path, "float32"))
    allocate_kv_cache(model, num_blocks, block_size, "cpu")
    blocks = BlockManager(num_blocks, block_size)
    for i, n in enumerate(seq_lens):
        blocks.allocate(i, n)
    width = max(len(t) for t in blocks.block_tables.values())
    return model, torch.tensor([blocks.block_tables[i] + [0] * (width - len(blocks.block_tables[i]))
                                for i in range(len(seq_lens))])


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_transformers_prefill_and_cached_decode(arch, checkpoint):
    block_size = 4
    prompts = random_prompts(LENGTHS, seed=1)
    feed = random_prompts([DECODE_STEPS] * len(LENGTHS), seed=2)
    path = checkpoint(arch)
    model, tables = paged_model(path, [len(p) + DECODE_STEPS for p in prompts], block_size)
    hf = hf_model(path)
    with torch.no_grad():
        refs = [hf(torch.tensor([p + f])).logits[0] for p, f in zip(prompts, feed)]
        lens = torch.tensor(LENGTHS)
        positions, meta = build_metadata(lens, lens, tables, block_size)
        logits = model.compute_logits(model(torch.tensor(sum(prompts, [])), positions, meta))
        errs = []
        for ref, chunk in zip(refs, logits.split(LENGTHS)):
            errs.append(rel_err(chunk, ref[: len(chunk)]))
        assert max(errs) <= 1e-4, f"prefill rel err {max(errs)}"
        for step in range(DECODE_STEPS):
            ids = torch.tensor([f[step] for f in feed])
            positions, meta = build_metadata(torch.ones(len(feed), dtype=torch.long), lens + step + 1, tables, block_size)
            logits = model.compute_logits(model(ids, positions, meta))
            for b, ref in enumerate(refs):
                errs.append(rel_err(logits[b], ref[LENGTHS[b] + step]))
        assert max(errs) <= 1e-4, f"decode rel err {max(errs)}"


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_generation_matches_transformers(arch, checkpoint):
    path = checkpoint(arch)
    llm = LLM(path, config={"model": {"dtype": "float32"}, "scheduler": {"block_size": 4, "num_kv_blocks": 96}})
    prompts = random_prompts([5, 23, 2, 11, 16], seed=3)
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    hf = hf_model(path)
    for p, out in zip(prompts, outs):
        ref = hf.generate(
            torch.tensor([p]), max_new_tokens=20, min_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(p):].tolist()
        assert out.token_ids == ref
        assert out.finish_reason == "length"


def test_padded_batches_stay_within_their_slack():
    """pad_groups: every sequence in exactly one batch, in step order, each batch's padded query-key pairs
    within PAD_SLACK x its own + PAD_MIN_PAIRS; sequences of one size share a batch."""
    import numpy as np

    from dspark_cluster.model.attention import PAD_MIN_PAIRS, PAD_SLACK, pad_groups

    rng = np.random.default_rng(0)
    for _ in range(50):
        B = int(rng.integers(1, 40))
        q = rng.integers(2, 300, B)
        ctx = q + rng.integers(0, 200, B) * rng.integers(0, 2, B)
        groups = pad_groups(np.arange(B), q, ctx, 16)
        assert sorted(np.concatenate(groups).tolist()) == list(range(B))
        for g in groups:
            assert (np.diff(g) > 0).all()
            span = -(-ctx[g] // 16) * 16
            assert len(g) == 1 or len(g) * q[g].max() * span.max() <= PAD_SLACK * (q[g] * span).sum() + PAD_MIN_PAIRS
    same = pad_groups(np.arange(16), np.full(16, 200), np.full(16, 200), 16)
    assert len(same) == 1
    # decodes (one query each) by their own rule: within it, and a batch of very different contexts does split
    from dspark_cluster.model.attention import DECODE_PAD, decode_groups

    slack, min_pairs = DECODE_PAD
    for _ in range(50):
        B = int(rng.integers(1, 130))
        ctx = rng.integers(1, 600, B)
        groups = pad_groups(np.arange(B), np.ones(B, dtype=np.int64), ctx, 16, *DECODE_PAD)
        # the decodes' numpy form of the rule makes the same groups (any subset of a step's sequences)
        seqs = np.flatnonzero(rng.random(B) < 0.8)
        assert [g.tolist() for g in decode_groups(seqs, ctx, 16, *DECODE_PAD)] == \
            [g.tolist() for g in pad_groups(seqs, np.ones(B, dtype=np.int64), ctx, 16, *DECODE_PAD)]
        assert sorted(np.concatenate(groups).tolist()) == list(range(B))
        for g in groups:
            span = -(-ctx[g] // 16) * 16
            assert len(g) == 1 or len(g) * span.max() <= slack * span.sum() + min_pairs
    assert len(pad_groups(np.arange(64), np.ones(64, dtype=np.int64), np.linspace(16, 512, 64).astype(np.int64), 16,
                          *DECODE_PAD)) > 1


# one step of decodes and prompt chunks: (prompt lengths, tokens cached before the step, the attention batches
# expected as (sequences, most queries)); mixed: seqs 0 and 3 decode, seq 1 prefills its last 11, seq 2 all 9;
# groups: chunks of very different lengths (93, 41 over 30 cached, 7, 5) padded in two batches, not one
STEPS = {"mixed": ([14, 17, 9, 11], [13, 6, 0, 10], 4, [(2, 1), (2, 11)]),
         "groups": ([93, 7, 71, 5, 40], [0, 0, 30, 0, 39], 5, [(1, 1), (2, 93), (2, 7)])}


@pytest.mark.parametrize("arch, step", [("deepseek_v3", "mixed"), ("qwen3_moe", "mixed"), ("deepseek_v3", "groups"),
                                        ("llama", "groups")])
def test_one_step_mixing_decodes_and_prefill_chunks_matches_transformers(arch, step, checkpoint):
    """Decodes and prefill chunks in the same step are attended as separate batches, and chunks of very
    different lengths in several (a short chunk is not padded to the longest's queries and keys); every
    row's logits still match the reference on the whole sequence."""
    lengths, cached, seed, layout = STEPS[step]
    block_size = 4
    seqs = random_prompts(lengths, seed=seed)
    path = checkpoint(arch)
    model, tables = paged_model(path, [len(s) for s in seqs], block_size)
    hf = hf_model(path)
    with torch.no_grad():
        first = [i for i, c in enumerate(cached) if c]
        lens = torch.tensor([cached[i] for i in first])
        positions, meta = build_metadata(lens, lens, tables[first], block_size)
        model(torch.tensor([t for i in first for t in seqs[i][: cached[i]]]), positions, meta)
        q = torch.tensor([len(s) - c for s, c in zip(seqs, cached)])
        positions, meta = build_metadata(q, torch.tensor([len(s) for s in seqs]), tables, block_size)
        assert [(b.num_seqs, b.max_q) for b in meta.batches] == layout
        logits = model.compute_logits(model(torch.tensor([t for s, c in zip(seqs, cached) for t in s[c:]]), positions, meta))
        for (s, c), chunk in zip(zip(seqs, cached), logits.split(q.tolist())):
            ref = hf(torch.tensor([s])).logits[0, c:]
            assert rel_err(chunk, ref) <= 1e-4


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_decodes_of_different_contexts_attend_in_groups_and_match_transformers(arch, checkpoint, monkeypatch):
    """A decode step split into batches of similar context (here a rule that splits every distinct key span,
    so five sequences make five batches): every row's logits match the reference's and those of one padded
    batch (`group_decodes=False`); and the same decodes beside a prompt chunk (a mixed
    step: each decode batch's rows are its sequences' tokens among the chunk's)."""
    from dspark_cluster.model import attention

    block_size, lengths = 4, [30, 5, 61, 9, 33, 18]
    seqs = random_prompts(lengths, seed=7)
    path = checkpoint(arch)
    model, tables = paged_model(path, lengths, block_size)
    hf = hf_model(path)
    refs = [hf(torch.tensor([s])).logits[0] for s in seqs]
    monkeypatch.setattr(attention, "DECODE_PAD", (1.0, 0))
    dec = slice(0, 5)
    with torch.no_grad():
        prior = torch.tensor([n - 1 for n in lengths[dec]])
        positions, meta = build_metadata(prior, prior, tables[dec], block_size)
        model(torch.tensor([t for s in seqs[dec] for t in s[:-1]]), positions, meta)
        ones, ctx, ids = torch.ones(5, dtype=torch.long), torch.tensor(lengths[dec]), torch.tensor([s[-1] for s in seqs[dec]])
        positions, grouped = build_metadata(ones, ctx, tables[dec], block_size)
        assert [b.num_seqs for b in grouped.batches] == [1] * 5 and all(b.max_q == 1 for b in grouped.batches)
        logits = model.compute_logits(model(ids, positions, grouped))
        positions, one = build_metadata(ones, ctx, tables[dec], block_size, group_decodes=False)
        assert len(one.batches) == 1
        torch.testing.assert_close(logits, model.compute_logits(model(ids, positions, one)), rtol=1e-5, atol=1e-5)
        for row, ref in zip(logits, refs):
            assert rel_err(row, ref[-1]) <= 1e-4
        # mixed: decodes 0 and 2 before sequence 5's whole prompt, decode 3 after it (token order: 0, 2, 5 x 18, 3)
        order = [0, 2, 5, 3]
        q = torch.tensor([1, 1, 18, 1])
        positions, mixed = build_metadata(q, torch.tensor([lengths[i] for i in order]), tables[order], block_size)
        assert sorted((b.num_seqs, b.max_q) for b in mixed.batches) == [(1, 1), (1, 1), (1, 1), (1, 18)]
        ids = torch.tensor([seqs[0][-1], seqs[2][-1], *seqs[5], seqs[3][-1]])
        out = model.compute_logits(model(ids, positions, mixed)).split([1, 1, 18, 1])
        for i, rows in zip(order, out):
            assert rel_err(rows, refs[i][-rows.shape[0]:]) <= 1e-4


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe", "mixtral"])
def test_a_long_prompt_whose_experts_run_slot_by_slot_matches_transformers(arch, checkpoint, monkeypatch):
    """A prompt long enough that each MoE layer's experts run slot by slot on oneDNN (on the CPU, from
    gemm.ONEDNN_EXPERT_MIN_ROWS rows a slot) matches the reference at every position."""
    from dspark_cluster.model import gemm, layers

    calls = []
    by_slot = layers.experts_by_slot
    monkeypatch.setattr(layers, "experts_by_slot",
                        lambda *a, **kw: calls.append((a[0].shape[0], a[4] is gemm.plain_linear)) or by_slot(*a, **kw))
    path = checkpoint(arch)
    (prompt,) = random_prompts([300], seed=11)
    model, tables = paged_model(path, [300], 16, num_blocks=32)
    hf = hf_model(path)
    with torch.no_grad():
        lens = torch.tensor([300])
        positions, meta = build_metadata(lens, lens, tables, 16)
        logits = model.compute_logits(model(torch.tensor(prompt), positions, meta))
        assert rel_err(logits, hf(torch.tensor([prompt])).logits[0]) <= 1e-4
    assert bool(calls) == gemm._ONEDNN and all(n >= 300 and onednn for n, onednn in calls)


@pytest.mark.parametrize("arch", ["deepseek_v3", "llama"])
def test_long_queries_attend_in_chunks_and_match_transformers(arch, checkpoint, monkeypatch):
    """Prompt chunks long enough to be attended in chunks of the query axis (each over the keys up to its last
    query), padded beside shorter ones, one after a cached context, and (all four in one batch) one with no query
    in the last chunks: every row matches the reference, and one SDPA call over every key (chunking off) to 1e-5."""
    from dspark_cluster.model import attention

    block_size, lengths, cached = 16, [300, 280, 170, 150], [0, 0, 40, 0]
    seqs = random_prompts(lengths, seed=13)
    path = checkpoint(arch)
    model, tables = paged_model(path, lengths, block_size, num_blocks=64)
    hf = hf_model(path)
    with torch.no_grad():
        lens = torch.tensor([40])
        positions, meta = build_metadata(lens, lens, tables[2:], block_size)
        model(torch.tensor(seqs[2][:40]), positions, meta)
        q = torch.tensor([n - c for n, c in zip(lengths, cached)])
        ids = torch.tensor([t for s, c in zip(seqs, cached) for t in s[c:]])
        refs = [hf(torch.tensor([s])).logits[0, c:] for s, c in zip(seqs, cached)]
        positions, meta = build_metadata(q, torch.tensor(lengths), tables, block_size)
        # [300, 280] in 4 chunks; [130 over 40 cached, 150] skip under a fifth of their pairs in chunks: one call
        assert [(b.num_seqs, b.max_q, len(b.q_chunks)) for b in meta.batches] == [(2, 300, 4), (2, 150, 0)]
        keys = [c[2] for c in meta.batches[0].q_chunks]  # up to each chunk's last query's position
        assert keys == [75, 150, 225, 300]
        logits = model.compute_logits(model(ids, positions, meta))
        for chunk, ref in zip(logits.split(q.tolist()), refs):
            assert rel_err(chunk, ref) <= 1e-4
        # all four in one batch: 150 and 130 queries have none in the chunks past them (their padded rows attend key 0)
        monkeypatch.setattr(attention, "PAD_SLACK", 100.0)
        positions, one = build_metadata(q, torch.tensor(lengths), tables, block_size)
        (b,) = one.batches
        assert b.max_q == 300 and [c[2] for c in b.q_chunks] == [115, 170, 225, 300]
        together = model.compute_logits(model(ids, positions, one))
        torch.testing.assert_close(together, logits, rtol=1e-5, atol=1e-5)
        monkeypatch.setattr(attention, "QUERY_CHUNKS", 1)
        positions, whole = build_metadata(q, torch.tensor(lengths), tables, block_size)
        assert all(b.q_chunks == () for b in whole.batches)
        torch.testing.assert_close(logits, model.compute_logits(model(ids, positions, whole)), rtol=1e-5, atol=1e-5)
