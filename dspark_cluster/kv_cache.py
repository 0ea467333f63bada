"""Paged KV cache: a block manager (free list + per-sequence block tables) and the KV tensors.

The block manager is pure bookkeeping on the scheduler's side; the tensors live with the model.
GQA layers store K and V per KV head; MLA layers store one compressed latent (+ rope key) per token.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Optional

import numpy as np

import torch


def block_hashes(token_ids, block_size: int, num_blocks: int, parent: Optional[bytes] = None) -> list[bytes]:
    """The chained digest of each of the first num_blocks full blocks: blake2b over the parent's
    digest and this block's token ids, so a block's digest names its whole prefix. A cryptographic
    digest, as vLLM's sha256 option: a prefix one request can collide on could hand it another's KV."""
    out = []
    for i in range(num_blocks):
        h = hashlib.blake2b(parent or b"", digest_size=16)
        h.update(np.asarray(token_ids[i * block_size : (i + 1) * block_size], dtype=np.int64).tobytes())
        parent = h.digest()
        out.append(parent)
    return out


class BlockManager:
    """Fixed-size blocks handed out from a free list. A sequence's block table covers its tokens.

    With prefix caching, a full block whose tokens are committed is registered under the hash of its
    prefix (`commit`); a new sequence reuses the longest run of registered blocks its prompt starts
    with (`match_prefix`), sharing them (reference counts). A block whose count falls to 0 stays
    registered among the free blocks, least recently freed first in line to be reused: it is
    evicted (unregistered) only when the pool hands it out again. Without prefix caching the most
    recently freed block is reused first (warm in the CPU's cache)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.free_blocks: OrderedDict = OrderedDict.fromkeys(range(num_blocks))  # in reuse order, LRU first
        self.block_tables: dict[int, list[int]] = {}
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[Optional[bytes]] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # prefix digest -> block
        self._committed: dict[int, tuple[int, Optional[bytes]]] = {}  # seq -> (blocks registered, last digest)
        self.num_evicted = 0

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

    def _take(self) -> int:
        b, _ = self.free_blocks.popitem(last=False)  # the head: least recently freed with caching, else most
        if self.block_hash[b] is not None:  # evicted: its prefix is no longer cached
            del self.cached[self.block_hash[b]]
            self.block_hash[b] = None
            self.num_evicted += 1
        self.ref_counts[b] = 1
        return b

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow seq's block table to hold num_tokens tokens. Caller checks can_allocate first."""
        need = self.blocks_needed(seq_id, num_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError(f"KV cache out of blocks: need {need}, have {len(self.free_blocks)}")
        table = self.block_tables.setdefault(seq_id, [])
        table.extend(self._take() for _ in range(need))
        return table

    def match_prefix(self, seq_id: int, token_ids, max_tokens: int) -> int:
        """A sequence with no blocks yet takes the registered blocks its first max_tokens tokens
        start with; returns the tokens they hold (a multiple of block_size; 0 without caching)."""
        if not self.prefix_caching or seq_id in self.block_tables:
            return 0
        table, parent = [], None
        for h in block_hashes(token_ids, self.block_size, max_tokens // self.block_size):
            b = self.cached.get(h)
            if b is None:
                break
            if self.ref_counts[b] == 0:
                del self.free_blocks[b]
            self.ref_counts[b] += 1
            table.append(b)
            parent = h
        if table:
            self.block_tables[seq_id] = table
            self._committed[seq_id] = (len(table), parent)
        return len(table) * self.block_size

    def commit(self, seq_id: int, token_ids, num_tokens: int) -> None:
        """The first num_tokens tokens of seq have their KV written: register its full blocks among
        them (a prefix another block already holds keeps that block)."""
        if not self.prefix_caching:
            return
        table = self.block_tables.get(seq_id)
        if table is None:
            return
        done, parent = self._committed.get(seq_id, (0, None))
        full = min(num_tokens // self.block_size, len(table))
        if full <= done:
            return
        hashes = block_hashes(token_ids[done * self.block_size :], self.block_size, full - done, parent)
        for b, h in zip(table[done:full], hashes):
            if h not in self.cached and self.block_hash[b] is None:
                self.cached[h] = b
                self.block_hash[b] = h
        self._committed[seq_id] = (full, hashes[-1])

    def free(self, seq_id: int) -> None:
        """Release seq's blocks; those no one else holds become free (last block first in line, so
        a prompt's shared head is evicted last)."""
        self._committed.pop(seq_id, None)
        for b in reversed(self.block_tables.pop(seq_id, [])):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_blocks[b] = None  # at the tail: a cached prefix is reused last (LRU)
                if not self.prefix_caching or self.block_hash[b] is None:
                    self.free_blocks.move_to_end(b, last=False)  # holds nothing reusable: handed out first


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
        shapes = attn.cache_shape(num_blocks, block_size)
        tensors = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        attn.kv_cache = (tensors[0], tensors[1] if len(tensors) > 1 else None)


# scheduler.kv_cache_memory: auto
AUTO_KV_SHARE_CUDA = 0.9  # of the device memory left after the weights, as vLLM's gpu_memory_utilization
AUTO_KV_BYTES_CPU = 256 * 2**20  # on CPU the "device" is the host's memory, which every process shares


def free_device_memory(device) -> int:
    """Bytes free on `device` now: CUDA's free memory, or the host's available memory on CPU. On CUDA the
    caching allocator first returns the blocks it holds unused (loading's temporaries: an FP8 checkpoint's
    dequantised slices, a shard's staging copies), which the driver would otherwise count as used and the
    KV pool would lose for good."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def kv_budget_bytes(kv_cache_memory, device_type: str, free_bytes, sharing: int = 1) -> int:
    """scheduler.kv_cache_memory -> bytes for one worker's KV pool.

    kv_cache_memory: bytes (int), a share in (0, 1] of `free_bytes` (the device memory left after the
    weights), or "auto" (0.9 of it on CUDA, 256 MiB on CPU). free_bytes: an int, or a callable that
    measures it (only called for a share). sharing: processes that share this free memory (CPU
    workers on one host), each taking its part of the share."""
    if kv_cache_memory == "auto":
        if device_type != "cuda":
            return AUTO_KV_BYTES_CPU
        kv_cache_memory = AUTO_KV_SHARE_CUDA
    if isinstance(kv_cache_memory, float):
        free = free_bytes() if callable(free_bytes) else free_bytes
        return int(kv_cache_memory * free / max(1, sharing))
    return int(kv_cache_memory)


def plan_num_blocks(model, block_size: int, kv_cache_memory, num_kv_blocks="auto", device="cpu",
                    sharing: int = 1, reserve=None) -> int:
    """Blocks that fit the memory budget (or the explicit count). Called after the weights are
    loaded, so a share is of what they left free on `device`, less `reserve()` bytes (called first,
    and only for a share: what the largest steps hold on top, `Worker.activation_reserve`)."""
    if num_kv_blocks != "auto":
        return int(num_kv_blocks)
    device = torch.device(device)

    def free_bytes():
        held = reserve() if reserve is not None else 0  # (its memory returned before the free memory is read)
        return max(0, free_device_memory(device) - held)

    budget = kv_budget_bytes(kv_cache_memory, device.type, free_bytes, sharing)
    return max(1, budget // kv_bytes_per_block(model, block_size))


def peak_bytes_during(run, device) -> int:
    """Bytes `run()` holds on `device` at its peak beyond what was held before it (CUDA's allocator statistics:
    every tensor it makes, freed or not). 0 off CUDA, where nothing counts them: `run` is not called there."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return max(0, int(torch.cuda.max_memory_allocated(device)) - before)
