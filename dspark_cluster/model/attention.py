"""Paged attention in plain PyTorch.

The KV cache is a pool of fixed-size blocks; a sequence's `block_table` lists its blocks in order,
and `slot_mapping[t] = block * block_size + offset` says where new token t's K/V is written.
Attention gathers each sequence's blocks into a padded [B, S] view and runs SDPA with a causal
mask built from positions, so a batch can mix prefill chunks and decodes of any lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step layout shared by every layer. T = new tokens, B = sequences, S = padded keys."""

    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] (padded with block 0; masked out)
    token_to_padded: torch.Tensor  # [T] index into the flattened [B * max_q] query layout
    padded_to_token: torch.Tensor  # [B * max_q] index into [T + 1]; T is a zero pad row
    attn_mask: torch.Tensor  # [B, 1, max_q, S] additive: 0 = attend, -inf = masked
    max_q: int
    num_seqs: int
    _folded: dict = field(default_factory=dict)

    def to(self, device, dtype=torch.float32) -> "AttentionMetadata":
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items() if k != "_folded"}
        kw["attn_mask"] = self.attn_mask.to(device=device, dtype=dtype)
        return AttentionMetadata(**kw)

    def folded_mask(self, group: int) -> torch.Tensor:
        """The mask for `group` query heads folded into the query axis: [B, 1, group * max_q, S]."""
        if group not in self._folded:
            self._folded[group] = self.attn_mask.repeat(1, 1, group, 1) if group > 1 else self.attn_mask
        return self._folded[group]


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
        attn_mask=torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, float("-inf"))[:, None],
        max_q=max_q,
        num_seqs=B,
    )
    return positions, meta


def paged_attention(q, k_new, v_new, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    """q [T, Hq, Dk]; k_new [T, Hkv, Dk], v_new [T, Hkv, Dv] are this step's keys/values.
    k_cache [num_blocks, block_size, Hkv, Dk], v_cache [..., Dv] (v_cache may be None: then the
    values are the first Dv channels of the keys, as in MLA's latent cache). Returns [T, Hq, Dv].
    SDPA's fused CPU kernel needs equal key and value widths, hence values = keys for MLA.

    The G = Hq / Hkv query heads that share a KV head are folded into the query axis, so SDPA
    runs with Hkv heads and no KV copies (its own GQA path is many times slower on CPU).
    """
    T, Hq, Dk = q.shape
    Hkv, Dv = k_new.shape[1], v_new.shape[-1]
    G = Hq // Hkv
    # index_copy_ / index_select: several times faster on CPU than advanced indexing for the same rows
    k_cache.view(-1, Hkv, Dk).index_copy_(0, meta.slot_mapping, k_new)
    if v_cache is not None:
        v_cache.view(-1, Hkv, Dv).index_copy_(0, meta.slot_mapping, v_new)
    B, max_q = meta.num_seqs, meta.max_q
    blocks = meta.block_tables.flatten()
    keys = k_cache.index_select(0, blocks).view(B, -1, Hkv, Dk).transpose(1, 2)  # [B, Hkv, S, Dk]
    if v_cache is not None:
        values = v_cache.index_select(0, blocks).view(B, -1, Hkv, Dv).transpose(1, 2)
    else:
        values = keys  # MLA: the latent is the key's head; the extra rope channels are cut below
    if max_q == 1:  # decodes only: one query per sequence, already in sequence order
        q_pad = q.view(B, Hkv, G, Dk)
    else:
        q_pad = torch.cat([q, q.new_zeros(1, Hq, Dk)]).index_select(0, meta.padded_to_token)  # [B * max_q, Hq, Dk]
        q_pad = q_pad.view(B, max_q, Hkv, G, Dk).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * max_q, Dk)
    out = F.scaled_dot_product_attention(q_pad, keys, values, attn_mask=meta.folded_mask(G), scale=scale)  # [B, Hkv, G*max_q, Dv]
    if max_q == 1:
        return out[..., :Dv].reshape(B, Hq, Dv)
    out = out[..., :Dv].reshape(B, Hkv, G, max_q, Dv).permute(0, 3, 1, 2, 4).reshape(B * max_q, Hq, Dv)
    return out.index_select(0, meta.token_to_padded)
