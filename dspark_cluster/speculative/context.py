"""What the target's workers export to a DSpark drafter: the chosen layers' hidden states of the
tokens a step committed (never rejected drafts, never the token just sampled: the target has not
run it yet; it is the next block's anchor)."""

from __future__ import annotations

import torch

from .records import ContextRows


def committed_rows(captured, seq_ids, query_lens, context_lens, sample_rows, num_draft, num_tokens) -> ContextRows:
    """Select the committed rows of a step's captured states.

    captured [T, F] (one row per input token, sequences in order); seq_ids, query_lens,
    context_lens [B]; sample_rows [S] (indices into B); num_draft [S] or None; num_tokens [S] (tokens
    each sample row produced: accepted drafts + 1). A sequence commits all its input tokens but the
    drafts; a verify row also commits its accepted drafts (num_tokens - 1 of them). A sequence id of
    -1 (a request that does not speculate) exports nothing."""
    committed = query_lens.clone()
    if num_draft is not None and sample_rows.numel():
        committed[sample_rows] -= num_draft - (num_tokens - 1)
    committed = torch.where(seq_ids >= 0, committed, 0)
    starts = context_lens - query_lens
    first = torch.cumsum(query_lens, 0) - query_lens
    idx = torch.repeat_interleave(first, committed) + (
        torch.arange(int(committed.sum())) - torch.repeat_interleave(torch.cumsum(committed, 0) - committed, committed))
    keep = committed > 0
    return ContextRows(seq_ids[keep], starts[keep], committed[keep], captured[idx.to(captured.device)].cpu())
