"""Build a step's `StepInput` from the scheduler's output, whole, in one call: token ids, positions,
block tables, the sampling parameters of the rows that sample, drafts to verify, log-probability
requests, and the run-time fields the engine's parts decide (DSpark export, round recording, the
expert placement handshake)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .scheduler import ScheduledSeq
from .step import StepInput


def build_step_input(scheduled: list[ScheduledSeq], block_tables: dict[int, list[int]], block_size: int,
                     prev_rows: Optional[dict[int, int]] = None, **fields) -> StepInput:
    """The whole StepInput of one group's step. prev_rows (async scheduling): seq_id -> its sample
    row in the step still in flight, whose token is this step's input for that sequence. fields: the
    run-time fields the engine's parts decide (`Speculation.step_fields`, `ExpertBalancer.step_fields`,
    share_sampled), passed through to the StepInput."""
    input_ids, query_lens, context_lens, tables = [], [], [], []
    rows, temps, ks, ps, seeds, pos_out, lps = [], [], [], [], [], [], []
    drafts, draft_probs = [], []
    prev_pos, prev_row = [], []
    plp_pos, plp_target, plp_row, plp_index, plp_top = [], [], [], [], 0
    for b, s in enumerate(scheduled):
        seq, start = s.seq, s.start
        k = seq.params.prompt_logprobs
        if k is not None:  # position t's law scores prompt token t + 1
            last = min(start + s.num_new_tokens, seq.num_prompt_tokens - 1)
            if last > start:
                plp_pos.extend(range(len(input_ids), len(input_ids) + last - start))
                plp_target.extend(seq.token_ids[start + 1 : last + 1])
                plp_index.extend(range(start + 1, last + 1))
                plp_row.extend([b] * (last - start))
                plp_top = max(plp_top, k)
        known = seq.token_ids[start : start + s.num_new_tokens]
        input_ids.extend(known)
        if len(known) < s.num_new_tokens:  # the last token is still being sampled by the step in flight
            prev_pos.append(len(input_ids))
            prev_row.append(prev_rows[seq.seq_id])
            input_ids.append(0)
        if s.proposal is not None:  # the drafts follow the last known token
            input_ids.extend(s.proposal.tokens)
        query_lens.append(s.num_new_tokens + s.num_draft)
        context_lens.append(start + s.num_new_tokens + s.num_draft)
        tables.append(block_tables[seq.seq_id])
        if s.samples:
            p = seq.params
            rows.append(b)
            temps.append(p.temperature)
            ks.append(p.top_k)
            ps.append(p.top_p)
            seeds.append(-1 if p.seed is None else p.seed)
            pos_out.append(seq.num_output_tokens + seq.num_pending - 1)  # pending counts this row's own token
            lps.append(-1 if p.logprobs is None else p.logprobs)
            drafts.append(s.proposal.tokens if s.proposal is not None else [])
            draft_probs.append(s.proposal.probs if s.proposal is not None else None)
    width = max((len(t) for t in tables), default=1)
    bt = np.zeros((len(tables), width), dtype=np.int64)  # numpy: ~1 us per row against ~5 for torch.tensor
    for b, t in enumerate(tables):
        bt[b, : len(t)] = t
    long = lambda x: torch.from_numpy(np.array(x, dtype=np.int64))  # noqa: E731
    real = lambda x: torch.from_numpy(np.array(x, dtype=np.float32))  # noqa: E731
    return StepInput(
        input_ids=long(input_ids),
        query_lens=long(query_lens),
        context_lens=long(context_lens),
        block_tables=torch.from_numpy(bt),
        sample_rows=long(rows),
        temperature=real(temps),
        top_k=long(ks),
        top_p=real(ps),
        seeds=long(seeds),
        positions_out=long(pos_out),
        block_size=block_size,
        prev_token_pos=long(prev_pos) if prev_pos else None,
        prev_token_row=long(prev_row) if prev_pos else None,
        logprobs=long(lps) if any(k >= 0 for k in lps) else None,
        **({"prompt_lp_pos": long(plp_pos), "prompt_lp_target": long(plp_target), "prompt_lp_row": long(plp_row),
            "prompt_lp_index": long(plp_index), "prompt_lp_top": plp_top} if plp_pos else {}),
        **_draft_fields(drafts, draft_probs),
        **fields,
    )


# the padded expert all-to-all's buffers, all ranks' together, at most this many bytes a layer; above,
# exact splits (whose counts cost a host round trip per layer, which a step this large amortises)
EXPERT_PADDED_MAX_BYTES = 32 * 2**20


def expert_capacity(tokens_per_group: list[int], tensor: int, top_k: int, world: int, row_bytes: int) -> int:
    """Rows per rank pair of the padded expert all-to-all for a step whose data-parallel groups run
    `tokens_per_group` tokens (0: use exact splits). A rank sends at most its share of its group's
    tokens (ceil(T / tensor)) times top_k assignments, all to one rank in the worst case: that is the
    capacity, the same for every rank (every group's StepInput carries it), so no rank needs to know
    another's counts before the all-to-all."""
    cap = max((-(-t // tensor) for t in tokens_per_group), default=0) * top_k
    return cap if 0 < cap and world * world * cap * row_bytes <= EXPERT_PADDED_MAX_BYTES else 0


def _fresh_rows(lens: list[int], block_size: int, num_blocks: int = 0) -> StepInput:
    """A step of sequences with nothing cached, row i of lens[i] tokens (id 0), each sampling its last token greedily;
    each row's KV in blocks of its own, from block 0 on (modulo num_blocks where given)."""
    S, nb = len(lens), [-(-n // block_size) for n in lens]
    tables = torch.zeros(S, max(nb), dtype=torch.long)
    for i, n in enumerate(nb):
        tables[i, :n] = torch.arange(sum(nb[:i]), sum(nb[: i + 1]))
    return StepInput(
        input_ids=torch.zeros(sum(lens), dtype=torch.long), query_lens=torch.tensor(lens),
        context_lens=torch.tensor(lens), block_tables=tables % num_blocks if num_blocks > 0 else tables,
        sample_rows=torch.arange(S), temperature=torch.zeros(S), top_k=torch.zeros(S, dtype=torch.long),
        top_p=torch.ones(S), seeds=torch.full((S,), -1), positions_out=torch.zeros(S, dtype=torch.long),
        block_size=block_size)


def profile_input(num_rows: int, tokens_per_row: int, block_size: int, num_blocks: int) -> StepInput:
    """A step of num_rows greedy verify rows of tokens_per_row tokens each (the last tokens_per_row - 1
    of them drafts), for timing the step at start-up. Its KV goes to the pool's first blocks, which
    hold nothing yet (a sequence overwrites its slots before it reads them)."""
    q = tokens_per_row
    out = _fresh_rows([q] * num_rows, block_size, max(num_blocks, 1))
    if q > 1:
        out.draft_tokens, out.num_draft = torch.zeros(num_rows, q - 1, dtype=torch.long), torch.full((num_rows,), q - 1)
    return out


def memory_profile_steps(max_tokens: int, max_seqs: int, row_tokens: int, max_positions: int, block_size: int,
                         vocab_size: int, law_dtype=None, seed: int = 0) -> tuple[list[StepInput], int]:
    """The largest steps the scheduler builds, to measure what a step holds on the device (`Worker.activation_reserve`):
    a prompt chunk of max_tokens tokens (sequences of at most max_positions, each sampling its last token), then
    max_seqs verify rows of row_tokens tokens (the last row_tokens - 1 of them drafts, each draft with a law of
    law_dtype [K, V] where given, as a drafter with one sends it), every row sampled at temperature 1 with top-p and
    named (`seq_ids`: a DSpark drafter's layers are captured). Token ids are random, the same for a seed, so every rank
    of a world builds the same steps (all-zero ids would route every token to the same experts). Returns the steps and
    the KV blocks the larger takes (each step writes from block 0)."""
    g = torch.Generator().manual_seed(seed)
    L = min(max_tokens, max_positions)
    q = min(row_tokens, max_tokens)
    chunk = [L] * (max_tokens // L) + ([max_tokens % L] if max_tokens % L else [])
    steps, blocks = [], 0
    for lens, K in ((chunk, 0), ([q] * max(1, min(max_seqs, max_tokens // q)), q - 1)):
        step, S = _fresh_rows(lens, block_size), len(lens)
        blocks = max(blocks, sum(-(-n // block_size) for n in lens))
        step.input_ids = torch.randint(vocab_size, (sum(lens),), generator=g)
        step.temperature, step.top_p, step.seq_ids = torch.ones(S), torch.full((S,), 0.9), torch.arange(S)
        if K:
            step.draft_tokens, step.num_draft = torch.randint(vocab_size, (S, K), generator=g), torch.full((S,), K)
            if law_dtype is not None:
                step.draft_probs = torch.full((S, K, vocab_size), 1 / vocab_size, dtype=law_dtype)
                step.draft_law_rows = torch.arange(S)
        steps.append(step)
    return steps, blocks


def _draft_fields(drafts: list[list[int]], probs: list) -> dict:
    """Per sample row its drafts and, for the rows whose proposal has a draft law (sampled rows of a
    drafter with one; greedy rows carry none), that law in the drafter's dtype, padded to K."""
    K = max((len(d) for d in drafts), default=0)
    if K == 0:
        return {}
    S = len(drafts)
    tokens = torch.zeros(S, K, dtype=torch.long)
    for i, d in enumerate(drafts):
        tokens[i, : len(d)] = torch.tensor(d, dtype=torch.long)
    out = {"draft_tokens": tokens, "num_draft": torch.tensor([len(d) for d in drafts], dtype=torch.long)}
    rows = [i for i, (d, p) in enumerate(zip(drafts, probs)) if d and p is not None]
    if rows:
        first = probs[rows[0]]
        law = torch.zeros(len(rows), K, first.shape[-1], dtype=first.dtype)
        for j, i in enumerate(rows):
            law[j, : len(drafts[i])] = probs[i]
        out["draft_probs"], out["draft_law_rows"] = law, torch.tensor(rows, dtype=torch.long)
    return out
