"""Paged KV cache: a block manager (free list + per-sequence block tables) and the KV tensors.

The block manager is pure bookkeeping on the scheduler's side; the tensors live with the model.
GQA layers store K and V per KV head; MLA layers store one compressed latent (+ rope key) per token.
"""

from __future__ import annotations

from collections import deque

import torch


class BlockManager:
    """Fixed-size blocks handed out from a free list. A sequence's block table covers its tokens."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks = deque(range(num_blocks))
        self.block_tables: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        have = len(self.block_tables.get(seq_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_tokens) <= len(self.free_blocks)

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow seq's block table to hold num_tokens tokens. Caller checks can_allocate first."""
        need = self.blocks_needed(seq_id, num_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError(f"KV cache out of blocks: need {need}, have {len(self.free_blocks)}")
        table = self.block_tables.setdefault(seq_id, [])
        table.extend(self.free_blocks.popleft() for _ in range(need))
        return table

    def free(self, seq_id: int) -> None:
        for b in reversed(self.block_tables.pop(seq_id, [])):
            self.free_blocks.appendleft(b)  # most recently freed are reused first (warm in cache)


def kv_bytes_per_block(model, block_size: int) -> int:
    """Bytes one block takes across all attention layers of this shard."""
    elem = model.lm_head.weight.element_size()
    total = 0
    for attn in model.attention_layers:
        for shape in attn.cache_shape(1, block_size):
            n = 1
            for s in shape:
                n *= s
            total += n * elem
    return total


def allocate_kv_cache(model, num_blocks: int, block_size: int, device) -> None:
    """Create the cache tensors and attach them to each attention layer (zeros so unused padded
    slots never hold NaNs)."""
    dtype = model.lm_head.weight.dtype
    for attn in model.attention_layers:
        tensors = [torch.zeros(shape, dtype=dtype, device=device) for shape in attn.cache_shape(num_blocks, block_size)]
        attn.kv_cache = (tensors[0], tensors[1] if len(tensors) > 1 else None)


def plan_num_blocks(model, block_size: int, memory_bytes: int, num_kv_blocks="auto") -> int:
    """Blocks that fit the memory budget (or the explicit count)."""
    if num_kv_blocks != "auto":
        return int(num_kv_blocks)
    return max(1, int(memory_bytes) // kv_bytes_per_block(model, block_size))
