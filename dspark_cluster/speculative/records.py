"""The speculative records that cross process boundaries: what the target's workers export to a
DSpark drafter (`ContextRows`), the verify rounds recorded for online calibration (`RoundRecords`),
and a drafter's proposal for one sequence (`Proposal`). Plain data over torch: the step contract
(`step.py`) carries them, so this module imports nothing of the engine, the scheduler or the trainer."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch


@dataclass
class RoundRecords:
    """R verify rounds of one step. K: most drafts of a round in the step; k: top_logprobs.
    Verify position j (0 .. num_draft) holds the target's law of the token after the anchor's j-th
    successor, i.e. what drafter slot j proposes, given the drafts before it."""

    seq_ids: torch.Tensor  # [R] long
    anchor_pos: torch.Tensor  # [R] long, the anchor's position (= context rows the drafter read)
    anchor: torch.Tensor  # [R] long, the last committed token before the drafts
    draft_tokens: torch.Tensor  # [R, K] long
    num_draft: torch.Tensor  # [R] long, drafts verified
    out_tokens: torch.Tensor  # [R, K+1] long, what the round committed: accepted drafts, then the target's token
    num_tokens: torch.Tensor  # [R] long (accepted + 1)
    greedy: torch.Tensor  # [R] bool
    topk_ids: torch.Tensor  # [R, K+1, k] long, the target's top-k tokens (temperature 1) per verify position
    topk_logprobs: torch.Tensor  # [R, K+1, k] float32
    entropy: torch.Tensor  # [R, K+1] float32, the target's entropy (nats) per verify position

    def __len__(self) -> int:
        return int(self.seq_ids.shape[0])

    def __getstate__(self):  # numpy on the wire: torch's pickling of small tensors is ~20x slower
        return {f.name: getattr(self, f.name).numpy() for f in fields(self)}

    def __setstate__(self, state):
        for k, v in state.items():
            setattr(self, k, torch.from_numpy(v if v.flags.writeable else v.copy()))

    def by_sequence(self) -> dict[int, "RoundRecords"]:
        """seq_id -> its rounds (one gather and one split per field, not one per sequence)."""
        ids, order = torch.sort(self.seq_ids, stable=True)
        uniq, counts = torch.unique_consecutive(ids, return_counts=True)
        parts = {f.name: getattr(self, f.name)[order].split(counts.tolist()) for f in fields(self)}
        return {sid: RoundRecords(**{k: v[i] for k, v in parts.items()}) for i, sid in enumerate(uniq.tolist())}

    def select(self, idx) -> "RoundRecords":
        return RoundRecords(*(getattr(self, f.name)[idx] for f in fields(self)))

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, f.name).numel() * getattr(self, f.name).element_size() for f in fields(self))

    @staticmethod
    def cat(parts: list["RoundRecords"]) -> "RoundRecords":
        """Rounds of several steps (K may differ: padded to the largest)."""
        K = max(p.draft_tokens.shape[1] for p in parts)

        def pad(t, dim_len, dim):
            if t.shape[dim] == dim_len:
                return t
            shape = list(t.shape)
            shape[dim] = dim_len - t.shape[dim]
            return torch.cat([t, t.new_zeros(shape)], dim=dim)

        out = {}
        for f in fields(RoundRecords):
            ts = [getattr(p, f.name) for p in parts]
            if f.name == "draft_tokens":
                ts = [pad(t, K, 1) for t in ts]
            elif f.name in ("out_tokens", "topk_ids", "topk_logprobs", "entropy"):
                ts = [pad(t, K + 1, 1) for t in ts]
            out[f.name] = torch.cat(ts)
        return RoundRecords(**out)


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

    def select(self, keep: torch.Tensor) -> "ContextRows":
        """The sequences `keep` ([B] bool) marks, their rows with them (no rounds)."""
        rows = torch.repeat_interleave(keep, self.counts).to(self.hidden.device)
        return ContextRows(self.seq_ids[keep], self.starts[keep], self.counts[keep], self.hidden[rows])

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


@dataclass
class Proposal:
    """Draft tokens for one sequence, with the draft law at each position (None: the tokens were
    proposed deterministically, i.e. q is one-hot at each token, as for n-gram lookup)."""

    tokens: list[int]
    probs: Optional[torch.Tensor] = None  # [len(tokens), vocab]
    # the drafter's confidence that each token is accepted given the one before it was (DSpark's
    # confidence head; otherwise the draft law's top probability at the position), raw, before calibration;
    # it may read the tokens before its own, never its own token (see verify_budget.py)
    confidences: Optional[torch.Tensor] = None  # [len(tokens)]
