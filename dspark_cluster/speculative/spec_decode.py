"""Speculative decoding: lossless verification of draft tokens on the target's driver rank.

For each sequence the target scores its last token and d_1..d_k in one forward (k + 1 positions).
Greedy rows keep the longest prefix equal to the target's argmax, then the target's own next token.
Sampled rows accept d_i with probability min(1, p(d_i) / q(d_i)); at the first rejection they draw
from norm(max(0, p - q)); when all k survive they draw a bonus token from p. Temperature, top-k and
top-p are applied to p and q alike (`filter_logits`), so the output law is the target's.
"""

from __future__ import annotations

import torch

from ..sampling import ACCEPT, RESIDUAL, filter_logits, race_sample, seeded_generator


def verify(target_logits, draft_tokens, num_draft, draft_probs, temperature, top_k, top_p, seeds, positions):
    """Verify drafts for S sequences.

    target_logits [S, K+1, V] fp32 (row s uses positions 0..num_draft[s]); draft_tokens [S, K] long
    (padded); num_draft [S] long; draft_probs [S, K, V] or None (one-hot drafts); temperature,
    top_p [S] float; top_k [S] long; seeds [S] long (-1 unseeded); positions [S] long (output index
    of the first token produced); every tensor on the target logits' device. Returns (tokens
    [S, K+1] long, num_tokens [S] long): row s produced tokens[s, :num_tokens[s]], i.e.
    num_tokens - 1 accepted drafts plus one target token.
    """
    S, K1, V = target_logits.shape
    K = K1 - 1
    device = target_logits.device
    pos_idx = torch.arange(K, device=device)
    valid = pos_idx[None, :] < num_draft[:, None]  # [S, K]
    drafts = draft_tokens.clamp(min=0)
    greedy = temperature == 0

    # greedy: longest prefix matching the target's argmax
    argmax = target_logits.argmax(dim=-1)  # [S, K+1]
    accept_greedy = (drafts == argmax[:, :K]) & valid

    # sampled: accept d_i with probability min(1, p/q)
    rep = lambda t: t.repeat_interleave(K1)  # noqa: E731
    p = filter_logits(target_logits.reshape(S * K1, V), rep(temperature), rep(top_k), rep(top_p)).softmax(-1)
    p = p.view(S, K1, V)
    p_x = p[:, :K].gather(2, drafts[..., None]).squeeze(-1)  # [S, K]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(2, drafts[..., None]).squeeze(-1).clamp(min=1e-20)
    u = torch.rand(S, K, device=device)
    seeded = torch.nonzero(seeds >= 0).flatten().tolist()
    seed_of, pos_of = (seeds.tolist(), positions.tolist()) if seeded else ([], [])  # one read (a sync on GPUs)
    for s in seeded:
        u[s] = torch.rand(K, generator=seeded_generator(seed_of[s], pos_of[s], ACCEPT, device), device=device)
    accept_sampled = (u < p_x / q_x) & valid

    accept = torch.where(greedy[:, None], accept_greedy, accept_sampled)
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # leading accepts [S]

    # the token after the accepted prefix: argmax (greedy), residual (rejection) or bonus (all accepted)
    rows = torch.arange(S, device=device)
    p_next = p[rows, num_accepted]  # [S, V]
    rejected = num_accepted < num_draft
    if draft_probs is None:
        q_next = torch.zeros_like(p_next)
        q_next[rows, drafts[rows, num_accepted.clamp(max=max(K - 1, 0))]] = 1.0 if K else 0.0
    else:
        q_next = draft_probs[rows, num_accepted.clamp(max=max(K - 1, 0))] if K else torch.zeros_like(p_next)
    residual = (p_next - q_next).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
    law = torch.where(rejected[:, None], residual, p_next)
    # the residual / bonus draw is at the output index of the token it makes
    accepted_of = num_accepted.tolist() if seeded else []
    next_pos = [pos + acc for pos, acc in zip(pos_of, accepted_of)]
    sampled_next = race_sample(law, seed_of, next_pos, RESIDUAL)
    next_token = torch.where(greedy, argmax[rows, num_accepted], sampled_next)

    tokens = torch.cat([drafts, torch.zeros(S, 1, dtype=torch.long, device=device)], dim=1)
    tokens[rows, num_accepted] = next_token
    return tokens, num_accepted + 1
