"""What the target's workers export to a DSpark drafter: the chosen layers' hidden states of the
tokens a step committed (never rejected drafts, never the token just sampled: the target has not
run it yet; it is the next block's anchor)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .calibration import RoundRecords


@dataclass
class ContextRows:
    """Rows of `hidden` belong to sequences in order: seq_ids[i] owns counts[i] rows, the states
    of its tokens at positions starts[i] .. starts[i] + counts[i] - 1."""

    seq_ids: torch.Tensor  # [B] long
    starts: torch.Tensor  # [B] long
    counts: torch.Tensor  # [B] long
    hidden: torch.Tensor  # [sum(counts), n_layers * H_target]
    rounds: Optional[RoundRecords] = None  # online calibration: this step's recorded verify rounds

    @property
    def nbytes(self) -> int:
        rows = sum(t.numel() * t.element_size() for t in (self.seq_ids, self.starts, self.counts, self.hidden))
        return rows + (self.rounds.nbytes if self.rounds is not None else 0)

    def split(self, num_parts: int) -> list["ContextRows"]:
        """By sequence id modulo num_parts (the drafter group that owns each sequence)."""
        owner = self.seq_ids % num_parts
        row_owner = torch.repeat_interleave(owner, self.counts).to(self.hidden.device)
        parts = [ContextRows(self.seq_ids[owner == g], self.starts[owner == g], self.counts[owner == g],
                             self.hidden[row_owner == g]) for g in range(num_parts)]
        if self.rounds is not None:
            round_owner = self.rounds.seq_ids % num_parts
            for g, part in enumerate(parts):
                if bool((round_owner == g).any()):
                    part.rounds = self.rounds.select(round_owner == g)
        return parts

    def __iter__(self):
        """(seq_id, start, hidden rows) per sequence."""
        offset = 0
        for sid, start, n in zip(self.seq_ids.tolist(), self.starts.tolist(), self.counts.tolist()):
            yield sid, start, self.hidden[offset : offset + n]
            offset += n


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
