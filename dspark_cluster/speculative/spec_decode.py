"""Speculative decoding: lossless verification of draft tokens on the target's driver rank.

For each sequence the target scores its last token and d_1..d_k in one forward (k + 1 positions).
Greedy rows keep the longest prefix equal to the target's argmax, then the target's own next token.
Sampled rows accept d_i with probability min(1, p(d_i) / q(d_i)); at the first rejection they draw
from norm(max(0, p - q)); when all k survive they draw a bonus token from p. Temperature, top-k and
top-p are applied to p and q alike (`filter_logits`), so the output law is the target's.

The draft law q travels only for the rows that need it: a greedy row's verification reads the
target's argmax and the draft tokens alone, and a row without a law (n-gram lookup) has a one-hot q
at each draft token. So `draft_probs` holds the laws of some rows (`law_rows`) and every other row
is one-hot. A law in 16 bits (the drafter's dtype) is read in fp32 and renormalised: the drafter
drew its token from that rounded law, so verifying against it is exact.
"""

from __future__ import annotations

import torch

from ..sampling import ACCEPT, RESIDUAL, filter_logits, greedy_rows, race_sample, seeded_generator


def verify(target_logits, draft_tokens, num_draft, draft_probs, temperature, top_k, top_p, seeds, positions,
           law_rows=None):
    """Verify drafts for S sequences.

    target_logits [S, K+1, V] fp32 (row s uses positions 0..num_draft[s]); draft_tokens [S, K] long
    (padded); num_draft [S] long; draft_probs: None (one-hot drafts), [S, K, V] (every row's law;
    law_rows None) or [R, K, V] with law_rows [R] long, the rows (into S) they belong to, every
    other row one-hot; fp32, or 16-bit (read in fp32, renormalised); temperature, top_p [S] float;
    top_k [S] long; seeds [S] long (-1 unseeded); positions [S] long (output index of the first
    token produced); every tensor on the target logits' device. Returns (tokens [S, K+1] long,
    num_tokens [S] long): row s produced tokens[s, :num_tokens[s]], i.e. num_tokens - 1 accepted
    drafts plus one target token.
    """
    S, K1, V = target_logits.shape
    K = K1 - 1
    device = target_logits.device
    pos_idx = torch.arange(K, device=device)
    valid = pos_idx[None, :] < num_draft[:, None]  # [S, K]
    drafts = draft_tokens.clamp(min=0)
    greedy = greedy_rows(temperature)  # the rule `sample` uses: a temperature below GREEDY_TEMPERATURE is greedy
    if draft_probs is not None:
        draft_probs = _full_precision(draft_probs)
        if law_rows is None:
            law_rows = torch.arange(S, device=device)

    # greedy: longest prefix matching the target's argmax
    argmax = target_logits.argmax(dim=-1)  # [S, K+1]
    accept_greedy = (drafts == argmax[:, :K]) & valid
    rows = torch.arange(S, device=device)
    if bool(greedy.all()):  # (as `sample`): no law to build and nothing to draw, the common case
        num_accepted = accept_greedy.long().cumprod(dim=1).sum(dim=1)
        return _with_next(drafts, rows, num_accepted, argmax[rows, num_accepted]), num_accepted + 1

    # sampled: accept d_i with probability min(1, p/q)
    rep = lambda t: t.repeat_interleave(K1)  # noqa: E731
    p = filter_logits(target_logits.reshape(S * K1, V), rep(temperature), rep(top_k), rep(top_p)).softmax(-1)
    p = p.view(S, K1, V)
    p_x = p[:, :K].gather(2, drafts[..., None]).squeeze(-1)  # [S, K]
    q_x = torch.ones_like(p_x)  # one-hot at each draft token
    if draft_probs is not None:
        q_x[law_rows] = draft_probs.gather(2, drafts[law_rows][..., None]).squeeze(-1).clamp(min=1e-20)
    u = torch.rand(S, K, device=device)
    seeded = torch.nonzero(seeds >= 0).flatten().tolist()
    seed_of, pos_of = (seeds.tolist(), positions.tolist()) if seeded else ([], [])  # one read (a sync on GPUs)
    for s in seeded:
        u[s] = torch.rand(K, generator=seeded_generator(seed_of[s], pos_of[s], ACCEPT, device), device=device)
    accept_sampled = (u < p_x / q_x) & valid

    accept = torch.where(greedy[:, None], accept_greedy, accept_sampled)
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # leading accepts [S]

    # the token after the accepted prefix: argmax (greedy), residual (rejection) or bonus (all accepted)
    p_next = p[rows, num_accepted]  # [S, V]
    rejected = num_accepted < num_draft
    q_next = torch.zeros_like(p_next)
    if K:
        at = num_accepted.clamp(max=K - 1)  # the rejected position (rejected rows only read it)
        q_next[rows, drafts[rows, at]] = 1.0
        if draft_probs is not None:
            q_next[law_rows] = draft_probs[torch.arange(law_rows.numel(), device=device), at[law_rows]]
    residual = (p_next - q_next).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
    law = torch.where(rejected[:, None], residual, p_next)
    # the residual / bonus draw is at the output index of the token it makes
    accepted_of = num_accepted.tolist() if seeded else []
    next_pos = [pos + acc for pos, acc in zip(pos_of, accepted_of)]
    sampled_next = race_sample(law, seed_of, next_pos, RESIDUAL)
    next_token = torch.where(greedy, argmax[rows, num_accepted], sampled_next)
    return _with_next(drafts, rows, num_accepted, next_token), num_accepted + 1


def _with_next(drafts, rows, num_accepted, next_token) -> torch.Tensor:
    """[S, K+1]: each row's drafts with the target's token after its accepted prefix."""
    tokens = torch.cat([drafts, drafts.new_zeros(drafts.shape[0], 1)], dim=1)
    tokens[rows, num_accepted] = next_token
    return tokens


def _full_precision(q: torch.Tensor) -> torch.Tensor:
    """A draft law as fp32: unchanged when it came in fp32 (or fp64); a 16-bit law renormalised per
    position, since its rounded values are what the drafter drew from (padding positions stay 0)."""
    if q.dtype in (torch.float32, torch.float64):
        return q
    q = q.float()
    return q / q.sum(-1, keepdim=True).clamp(min=1e-30)
