"""Online calibration of the DSpark drafter on live verification rounds (OSD, Liu et al. 2024, for
a block drafter), asynchronous, with a shadow evaluation before publishing and rollback after.

Data path:
- the target's driver rank records each verify round of a request that lets it (`record_rounds`,
  in `execute_step`): the anchor, the drafts, what the round committed and the target's top-k
  log-probabilities at the verified positions (never the full vocabulary), and sends them with the
  step's context rows to the drafter that owns the sequence;
- that drafter keeps the sequence's rows and rounds until it ends, then hands one `SequenceSample`
  to the calibrator, whose `filter_sample` keeps what would not teach the drafter wrong;
- the calibrator (`Calibrator`, on its own device: a Ray actor, or a thread in process) distils a
  copy of the drafter on the `ReplayBuffer` (AdamW in a world of one: no comm backend to build),
  scores the candidate against the serving version on held-back sequences (`shadow_scores`) and
  offers it when it wins by a margin;
- the engine's `DrafterVersions` switches every drafter to it at a step boundary, watches live tau
  by version and rolls back. Verification stays lossless whatever the drafter does.

This module is the data side: the records, the filter, the replay buffer, the batches and the
losses (and the shadow scores made with them). The trainer, its loop and the engine's version
store are in `calibrator.py`.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from dataclasses import dataclass
from typing import Optional

import torch

from .records import RoundRecords

FINISH_DROPPED = {"error": "request_error", "abort": "request_aborted"}
REPEAT_WINDOW = 16  # committed tokens looked at for a degenerate repeat
MAX_CONTEXT = 512  # context rows a training round reads (the latest; positions stay absolute)
# rounds of one sequence in a training batch: they share one context forward (the costly part)
ROUNDS_PER_SEQUENCE = 8


# ---------------------------------------------------------------------------------------- records

def record_rounds(logits, draft_tokens, num_draft, out_tokens, num_tokens, temperature, anchor, anchor_pos,
                  seq_ids, top_logprobs: int) -> RoundRecords:
    """On the driver rank, after verification: logits [R, K+1, V] the target's raw logits at each
    round's verify positions (rows past num_draft are padding), the other arguments [R] / [R, K]
    as in `RoundRecords`. The law is the target's own (temperature 1): the drafter applies each
    request's temperature itself when it serves."""
    logp = logits.float().log_softmax(-1)
    entropy = -(logp.exp() * logp).nan_to_num(0.0).sum(-1)
    top = logp.topk(min(top_logprobs, logp.shape[-1]), dim=-1)
    return RoundRecords(seq_ids=seq_ids.long().cpu(), anchor_pos=anchor_pos.long().cpu(), anchor=anchor.long().cpu(),
                        draft_tokens=draft_tokens.long().cpu(), num_draft=num_draft.long().cpu(),
                        out_tokens=out_tokens.long().cpu(), num_tokens=num_tokens.long().cpu(),
                        greedy=(temperature == 0).cpu(), topk_ids=top.indices.cpu(),
                        topk_logprobs=top.values.float().cpu(), entropy=entropy.float().cpu())


@dataclass
class SequenceSample:
    """What one finished sequence gives the calibrator: its context rows (16-bit: the target's
    exported states of tokens row_offset .. row_offset + L - 1) and its recorded rounds."""

    seq_id: int
    rows: torch.Tensor  # [L, n_layers * H_target] float16 or bfloat16
    rounds: RoundRecords
    finish_reason: Optional[str]
    row_offset: int = 0  # the position of rows[0] (the buffer keeps only the rows its rounds read)

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size() + self.rounds.nbytes


# ---------------------------------------------------------------------------------------- filter

def filter_sample(sample: SequenceSample, vocab_size: int, max_entropy_share: float = 0.85,
                  tail_mass: float = 0.99) -> tuple[Optional[RoundRecords], Counter]:
    """Keep the rounds that would not teach the drafter wrong; count the others by reason.

    Dropped: every round of a request that ended in an error or was aborted; rounds whose context
    rows are missing; rounds inside a degenerate repeat (the last REPEAT_WINDOW committed tokens
    hold at most 2 distinct ids); rounds where the target's mean entropy over the verified positions
    exceeds max_entropy_share x ln V (it does not know: nothing to learn) or is not finite; and
    rounds whose recorded law contradicts what the target itself committed (a greedy round's token
    is not the law's top-1; a sampled round's token is outside the top-k while the top-k holds
    tail_mass of the law; top-k probabilities summing past 1): a corrupted or wrong law."""
    r = sample.rounds
    R = len(r)
    dropped = Counter()
    if R == 0:
        return None, dropped
    reason = FINISH_DROPPED.get(sample.finish_reason or "")
    if reason is not None:
        dropped[reason] = R
        return None, dropped
    keep = torch.ones(R, dtype=torch.bool)
    why = [None] * R

    def drop(mask, name):
        for i in torch.nonzero(mask & keep).flatten().tolist():
            why[i] = name
        keep.logical_and_(~mask)

    drop(r.anchor_pos > sample.row_offset + sample.rows.shape[0], "missing_context")
    if not bool(torch.isfinite(sample.rows).all()):  # a state beyond the storage type: its rounds would read inf
        dropped["invalid_context"] = R
        return None, dropped
    # law checks, over each round's verified positions 0 .. num_draft
    K1 = r.topk_ids.shape[1]
    j = torch.arange(K1)
    verified = j[None, :] <= r.num_draft[:, None]
    lse = torch.logsumexp(r.topk_logprobs, dim=-1)  # [R, K+1] log of the top-k mass
    finite = torch.isfinite(r.topk_logprobs).all(-1) & torch.isfinite(r.entropy)
    drop(~(finite | ~verified).all(1) | ((lse > 1e-3) & verified).any(1), "invalid_law")
    ent = (r.entropy.nan_to_num(0.0) * verified).sum(1) / verified.sum(1)
    drop(ent > max_entropy_share * math.log(vocab_size), "extreme_entropy")
    committed = j[None, :] < r.num_tokens[:, None]  # positions whose next token the round committed
    tok = r.out_tokens[:, :K1]
    hit = r.topk_ids == tok[..., None]  # [R, K+1, k]
    in_top = hit.any(-1)
    # a greedy token must be a top-1; by log-prob, not id: tied logits may list another id first
    tok_logp = torch.where(hit, r.topk_logprobs, torch.full_like(r.topk_logprobs, -math.inf)).amax(-1)
    top1 = in_top & (tok_logp >= r.topk_logprobs[..., 0] - 1e-6)
    bad = torch.where(r.greedy[:, None], ~top1, ~in_top & (lse.exp() >= tail_mass))
    drop((bad & committed).any(1), "inconsistent_law")
    # degenerate repeats: the committed tokens of the rounds in order, each round judged on the window before it
    order = torch.argsort(r.anchor_pos).tolist()
    recent: deque = deque(maxlen=REPEAT_WINDOW)
    for i in order:
        recent.append(int(r.anchor[i]))
        recent.extend(r.out_tokens[i, : int(r.num_tokens[i])].tolist())
        if len(recent) == REPEAT_WINDOW and len(set(recent)) <= 2:
            drop(torch.arange(R) == i, "degenerate_repeat")
    dropped.update(w for w in why if w is not None)
    return (r.select(keep) if bool(keep.any()) else None), dropped


# ---------------------------------------------------------------------------------------- buffer

class ReplayBuffer:
    """Kept rounds with their sequences' context rows, bounded by `max_rounds` (the oldest sequences
    go first). A share `holdout` of the sequences (by id, stable) is held back for shadow evaluation."""

    def __init__(self, max_rounds: int, holdout: float, seed: int = 0, max_entropy_share: float = 0.85,
                 max_bytes: int = 2**30):
        self.max_rounds, self.holdout, self.max_entropy_share = max_rounds, holdout, max_entropy_share
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.samples: deque = deque()  # (SequenceSample with kept rounds only, held_out)
        self.num_rounds = 0
        self.total_in = self.total_kept = 0  # rounds offered / kept, over the run
        self.dropped: Counter = Counter()
        self.evicted = 0
        self._salt = seed * 7919 + 17

    def held_out(self, seq_id: int) -> bool:
        return random.Random(seq_id * 1_000_003 + self._salt).random() < self.holdout

    def add(self, sample: SequenceSample, vocab_size: int) -> None:
        self.insert(*self.prepare(sample, vocab_size))

    def prepare(self, sample: SequenceSample, vocab_size: int) -> tuple:
        """The filtering and copying (no shared state: callers run it outside their lock)."""
        kept, dropped = filter_sample(sample, vocab_size, self.max_entropy_share)
        if kept is None:
            return None, dropped, len(sample.rounds)
        # only the rows some kept round reads (the MAX_CONTEXT before each anchor)
        lo = max(sample.row_offset, int(kept.anchor_pos.min()) - MAX_CONTEXT)
        hi = int(kept.anchor_pos.max())
        rows = sample.rows[lo - sample.row_offset : hi - sample.row_offset].clone()
        return SequenceSample(sample.seq_id, rows, kept, sample.finish_reason, lo), dropped, len(sample.rounds)

    def insert(self, trimmed: Optional[SequenceSample], dropped: Counter, offered: int) -> None:
        self.total_in += offered
        self.dropped.update(dropped)
        if trimmed is None:
            return
        self.total_kept += len(trimmed.rounds)
        self.samples.append((trimmed, self.held_out(trimmed.seq_id)))
        self.num_rounds += len(trimmed.rounds)
        self.num_bytes += trimmed.nbytes
        while (self.num_rounds > self.max_rounds or self.num_bytes > self.max_bytes) and len(self.samples) > 1:
            old, _ = self.samples.popleft()
            self.num_rounds -= len(old.rounds)
            self.num_bytes -= old.nbytes
            self.evicted += len(old.rounds)

    def rounds(self, held_out: bool) -> list[tuple[SequenceSample, int]]:
        return [(s, i) for s, h in list(self.samples) if h == held_out for i in range(len(s.rounds))]

    def state(self) -> dict:
        train = sum(len(s.rounds) for s, h in self.samples if not h)
        return {"rounds": self.num_rounds, "train_rounds": train, "holdout_rounds": self.num_rounds - train,
                "sequences": len(self.samples), "capacity_rounds": self.max_rounds, "capacity_bytes": self.max_bytes,
                "bytes": self.num_bytes, "rounds_offered": self.total_in,
                "rounds_kept": self.total_kept, "dropped": dict(self.dropped), "evicted": self.evicted}


def collate(groups: list[tuple[SequenceSample, list[int]]], block_size: int, device) -> dict:
    """Rounds, grouped by sequence ((sample, round indices) each) -> the padded tensors
    `DSparkDrafter.forward_rounds` takes ([B, ...] per sequence, [B, A, ...] per round) and those
    `round_losses` takes (flattened to [B * A, ...]; `valid` marks the rounds that are not padding).
    Each round reads the MAX_CONTEXT rows before its anchor (`forward_rounds(window=MAX_CONTEXT)`);
    a sequence's rows are laid out once for all its rounds."""
    B, A = len(groups), max(len(idx) for _, idx in groups)
    ends = [int(s.rounds.anchor_pos[idx].max()) for s, idx in groups]
    starts = [max(s.row_offset, int(s.rounds.anchor_pos[idx].min()) - MAX_CONTEXT) for s, idx in groups]
    C = max(1, max(e - s0 for e, s0 in zip(ends, starts)))
    F = groups[0][0].rows.shape[1]
    hidden = torch.zeros(B, C, F)
    pos = torch.zeros(B, C, dtype=torch.long)
    valid_ctx = torch.zeros(B, C, dtype=torch.bool)
    for b, ((s, _), s0, e) in enumerate(zip(groups, starts, ends)):
        hidden[b, : e - s0] = s.rows[s0 - s.row_offset : e - s.row_offset].float()
        pos[b, : e - s0] = torch.arange(s0, e)
        valid_ctx[b, : e - s0] = True
    # per round, padded to A rounds per sequence (a padding round repeats the sequence's first, weight 0)
    rec = RoundRecords.cat([s.rounds.select(idx + [idx[0]] * (A - len(idx))) for s, idx in groups])
    valid = torch.tensor([i < len(idx) for _, idx in groups for i in range(A)])
    S = block_size
    K1 = rec.topk_ids.shape[1]
    R = B * A
    # slot j's previous token: the anchor, then the drafts (what the Markov head read when serving)
    prev = torch.cat([rec.anchor[:, None], rec.draft_tokens], dim=1)
    prev = torch.cat([prev, prev.new_zeros(R, max(0, S - prev.shape[1]))], dim=1)[:, :S]
    P = min(S, K1)
    j = torch.arange(P)
    out = {"hidden": hidden, "ctx_pos": pos, "ctx_valid": valid_ctx, "anchors": rec.anchor.view(B, A),
           "anchor_pos": rec.anchor_pos.view(B, A), "prev": prev.view(B, A, S),
           "topk_ids": rec.topk_ids[:, :P], "topk_logprobs": rec.topk_logprobs[:, :P],
           "verified": (j[None, :] <= rec.num_draft[:, None]) & valid[:, None], "num_draft": rec.num_draft,
           "num_accepted": rec.num_tokens - 1, "out_tokens": rec.out_tokens[:, :P],
           "committed": (j[None, :] < rec.num_tokens[:, None]) & valid[:, None], "valid": valid}
    return {k: v.to(device) for k, v in out.items()}


def group_rounds(items: list[tuple[SequenceSample, int]], per_sequence: int) -> list[tuple[SequenceSample, list[int]]]:
    """(sample, round) pairs -> (sample, up to per_sequence round indices) groups, in order."""
    by_seq: dict[int, tuple[SequenceSample, list[int]]] = {}
    for s, i in items:
        by_seq.setdefault(id(s), (s, []))[1].append(i)
    return [(s, idx[k : k + per_sequence]) for s, idx in by_seq.values() for k in range(0, len(idx), per_sequence)]


def forward(model, b: dict):
    """forward_rounds on a collated batch, flattened to rounds: (z [R, S, V], conf [R, S] or None)."""
    z, conf = model.forward_rounds(b["hidden"], b["ctx_pos"], b["ctx_valid"], b["anchors"], b["anchor_pos"], b["prev"],
                                   window=MAX_CONTEXT)
    return z.flatten(0, 1), None if conf is None else conf.flatten(0, 1)


# ---------------------------------------------------------------------------------------- loss

def topk_law_distances(z, topk_ids, topk_logprobs):
    """Drafter logits z [..., V] against the target's top-k law (ids [..., k], log-probs [..., k]),
    the rest of the target's mass one bucket. Returns (tv [...], kl(p || q) [...], q at the top-k
    [..., k]). Exact when k = V."""
    logq = z.float().log_softmax(-1)
    logq_k = logq.gather(-1, topk_ids)
    q_k, p_k = logq_k.exp(), topk_logprobs.exp()
    q_rest = (1 - q_k.sum(-1)).clamp(min=0)
    p_rest = (1 - p_k.sum(-1)).clamp(min=0)
    tv = 0.5 * ((q_k - p_k).abs().sum(-1) + (q_rest - p_rest).abs())
    kl = (p_k * (topk_logprobs - logq_k)).sum(-1) + p_rest * (torch.log(p_rest + 1e-12) - torch.log(q_rest + 1e-12))
    return tv, kl, q_k


def round_losses(z, conf, batch: dict, reject_weight: float, gamma: float = 4.0, ce_alpha: float = 0.1,
                 l1_alpha: float = 0.9, conf_alpha: float = 1.0):
    """DSpark's loss on recorded rounds: 0.1 CE on the committed tokens + 0.9 L1 (= 2 TV) toward the
    target's top-k law + BCE of the confidence toward 1 - TV, weighted exp(-j / gamma) by slot and
    (1 + reject_weight) at each round's first rejected position, where OSD puts its weight.
    z [R, S, V], conf [R, S] or None. Returns (loss, metrics)."""
    P = batch["topk_ids"].shape[1]
    z = z[:, :P]
    tv, _, _ = topk_law_distances(z, batch["topk_ids"], batch["topk_logprobs"])
    j = torch.arange(P, device=z.device)
    rejected = (j[None, :] == batch["num_accepted"][:, None]) & (batch["num_accepted"] < batch["num_draft"])[:, None]
    w = batch["verified"].float() * torch.exp(-j.float() / gamma)[None, :] * (1 + reject_weight * rejected.float())
    wsum = w.sum().clamp(min=1e-6)
    ce = -z.float().log_softmax(-1).gather(-1, batch["out_tokens"][..., None]).squeeze(-1)
    wc = w * batch["committed"].float()
    loss = ce_alpha * (ce * wc).sum() / wc.sum().clamp(min=1e-6) + l1_alpha * 2 * (tv * w).sum() / wsum
    metrics = {"tv": float((tv * w).sum().detach() / wsum)}
    if conf is not None:
        bce = torch.nn.functional.binary_cross_entropy_with_logits(conf[:, :P].float(), (1 - tv).clamp(0, 1).detach(),
                                                                   reduction="none")
        loss = loss + conf_alpha * (bce * w).sum() / wsum
        metrics["bce"] = float((bce * w).sum().detach() / wsum)
    return loss, metrics


@torch.no_grad()
def shadow_scores(model, items: list, block_size: int, device, batch_rounds: int = 64) -> dict:
    """What a drafter would have done on recorded rounds, with their verify lengths: `tau` the
    expected tokens per round (1 + sum over the verified positions of the products of 1 - TV toward
    the recorded laws), `tv` the mean TV per verified position, and `match` the share of committed
    positions whose token is the drafter's top-1 (checked against what the target really produced,
    so a wrong recorded law cannot raise it)."""
    if not items:
        return {"tau": float("nan"), "tv": float("nan"), "match": float("nan"), "rounds": 0}
    was = model.training
    model.eval()
    tau = tv_sum = n_pos = match = n_commit = 0.0
    groups = group_rounds(items, ROUNDS_PER_SEQUENCE)
    step = max(1, batch_rounds // ROUNDS_PER_SEQUENCE)
    for i in range(0, len(groups), step):
        b = collate(groups[i : i + step], block_size, device)
        z, _ = forward(model, b)
        P = b["topk_ids"].shape[1]
        tv, _, _ = topk_law_distances(z[:, :P], b["topk_ids"], b["topk_logprobs"])
        ver = b["verified"].float()
        # position j < num_draft is a draft; the survival chain runs over the drafts verified
        draft = ver * (torch.arange(P, device=device)[None, :] < b["num_draft"][:, None]).float()
        surv = torch.cumprod(torch.where(draft > 0, 1 - tv, torch.ones_like(tv)), dim=1) * draft
        tau += float(((1 + surv.sum(1)) * b["valid"]).sum())
        tv_sum += float((tv * ver).sum())
        n_pos += float(ver.sum())
        com = b["committed"].float()
        match += float(((z[:, :P].argmax(-1) == b["out_tokens"]).float() * com).sum())
        n_commit += float(com.sum())
    model.train(was)
    return {"tau": tau / len(items), "tv": tv_sum / max(n_pos, 1), "match": match / max(n_commit, 1),
            "rounds": len(items)}
