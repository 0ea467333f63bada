"""Paged attention in plain PyTorch.

The KV cache is a pool of fixed-size blocks; a sequence's `block_table` lists its blocks in order,
and `slot_mapping[t] = block * block_size + offset` says where new token t's K/V is written.
Attention gathers each sequence's blocks into a padded [B, S] view and runs SDPA with a causal
mask built from positions, so a batch can mix prefill chunks and decodes of any lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step layout shared by every layer. T = new tokens, B = sequences, S = padded keys."""

    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] (padded with block 0; masked out)
    token_to_padded: torch.Tensor  # [T] index into the flattened [B * max_q] query layout
    padded_to_token: torch.Tensor  # [B * max_q] index into [T + 1]; T is a zero pad row
    attn_mask: torch.Tensor  # [B, 1, max_q, S] bool, True = attend
    max_q: int
    num_seqs: int

    def to(self, device) -> "AttentionMetadata":
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return AttentionMetadata(**kw)


def build_metadata(query_lens: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int):
    """Positions and attention layout for one step.

    query_lens [B]: new tokens per sequence; context_lens [B]: KV length after this step;
    block_tables [B, max_blocks] long. Returns (positions [T], AttentionMetadata).
    """
    B = query_lens.numel()
    T = int(query_lens.sum())
    max_q = int(query_lens.max())
    seq_of_token = torch.repeat_interleave(torch.arange(B), query_lens)  # [T]
    starts = torch.cumsum(query_lens, 0) - query_lens
    idx_in_seq = torch.arange(T) - starts[seq_of_token]  # [T]
    positions = (context_lens - query_lens)[seq_of_token] + idx_in_seq
    block_idx = block_tables[seq_of_token, positions // block_size]
    slot_mapping = block_idx * block_size + positions % block_size

    token_to_padded = seq_of_token * max_q + idx_in_seq
    padded_to_token = torch.full((B * max_q,), T, dtype=torch.long)
    padded_to_token[token_to_padded] = torch.arange(T)

    S = block_tables.shape[1] * block_size
    q_pos = (context_lens - query_lens)[:, None] + torch.arange(max_q)[None, :]  # [B, max_q]
    key_pos = torch.arange(S)
    mask = key_pos[None, None, :] <= q_pos[:, :, None]  # causal; also keeps keys < context_len
    pad_rows = torch.arange(max_q)[None, :] >= query_lens[:, None]
    mask[pad_rows] = key_pos == 0  # padded query rows attend to one key so softmax is finite
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        token_to_padded=token_to_padded,
        padded_to_token=padded_to_token,
        attn_mask=mask[:, None],
        max_q=max_q,
        num_seqs=B,
    )
    return positions, meta


def paged_attention(q, k_new, v_new, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    """q [T, Hq, Dk]; k_new [T, Hkv, Dk], v_new [T, Hkv, Dv] are this step's keys/values.
    k_cache [num_blocks, block_size, Hkv, Dk], v_cache [..., Dv] (v_cache may be None: then the
    values are the first Dv channels of the keys, as in MLA's latent cache). Returns [T, Hq, Dv].
    """
    T, Hq, Dk = q.shape
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    k_flat[meta.slot_mapping] = k_new
    if v_cache is not None:
        v_cache.view(-1, *v_cache.shape[2:])[meta.slot_mapping] = v_new
    B, nb = meta.block_tables.shape
    keys = k_cache[meta.block_tables].view(B, -1, *k_cache.shape[2:])  # [B, S, Hkv, Dk]
    if v_cache is not None:
        values = v_cache[meta.block_tables].view(B, -1, *v_cache.shape[2:])
    else:
        values = keys[..., : v_new.shape[-1]]
    q_pad = torch.cat([q, q.new_zeros(1, Hq, Dk)])[meta.padded_to_token].view(B, meta.max_q, Hq, Dk)
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=meta.attn_mask,
        scale=scale,
        enable_gqa=keys.shape[2] != Hq,
    )  # [B, Hq, max_q, Dv]
    out = out.transpose(1, 2).reshape(B * meta.max_q, Hq, -1)
    return out[meta.token_to_padded]
