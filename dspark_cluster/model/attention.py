"""Paged attention in plain PyTorch.

The KV cache is a pool of fixed-size blocks; a sequence's `block_table` lists its blocks in order,
and `slot_mapping[t] = block * block_size + offset` says where new token t's K/V is written.
Attention gathers each sequence's blocks into a padded [B, S] view and runs SDPA with a causal
mask built from positions, so a batch can mix prefill chunks and decodes of any lengths; decodes
and longer queries are padded separately, each in groups of similar size (`pad_groups`).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class AttentionBatch:
    """Sequences whose queries are padded together. B = sequences, S = padded keys."""

    rows: Optional[torch.Tensor]  # [T_b] which of the step's new tokens are this batch's queries; None = all, in order
    block_tables: torch.Tensor  # [B, blocks] (padded with block 0; masked out)
    blocks: torch.Tensor  # [B * blocks] the same, flat: what every layer gathers (made once per step)
    token_to_padded: torch.Tensor  # [T_b] index into the flattened [B * max_q] query layout
    padded_to_token: torch.Tensor  # [B * max_q] index into [T_b + 1]; T_b is a zero pad row
    attn_mask: torch.Tensor  # [B, 1, max_q, S] additive: 0 = attend, -inf = masked
    max_q: int
    num_seqs: int
    # every sequence has max_q queries (one prompt, verify rows of one draft length): the padded layout is the
    # tokens' own, so no pad row and no gathers in or out
    uniform: bool = False
    # long queries (prompt chunks) attended in chunks of the query axis, each over the keys up to its last query's
    # position: ((first query, end, keys), ...); () = one call over every key (`query_chunks`)
    q_chunks: tuple = ()
    _folded: dict = field(default_factory=dict)

    def to(self, device, dtype=torch.float32) -> "AttentionBatch":
        device = torch.device(device)
        if _on(self.attn_mask, device, dtype) and all(_on(v, device) for v in self.__dict__.values()):
            return self  # already there (the in-process step on the CPU): no copies, no ops
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items() if k != "_folded"}
        kw["attn_mask"] = self.attn_mask.to(device=device, dtype=dtype)
        return AttentionBatch(**kw)

    def folded_mask(self, group: int, chunk: Optional[int] = None) -> torch.Tensor:
        """The mask for `group` query heads folded into the query axis: [B, 1, group * max_q, S]; for
        decodes (one query each) every folded row has the same mask, so [B, 1, 1, S] broadcasts. chunk: the
        mask of query chunk `chunk` of `q_chunks` only, [B, 1, group * (end - first), keys]."""
        if chunk is None and (group == 1 or self.max_q == 1):
            return self.attn_mask
        if (group, chunk) not in self._folded:  # once per step, for every layer
            mask = self.attn_mask
            if chunk is not None:
                c0, c1, keys = self.q_chunks[chunk]
                mask = mask[:, :, c0:c1, :keys]
            self._folded[(group, chunk)] = mask.repeat(1, 1, group, 1)
        return self._folded[(group, chunk)]


@dataclass
class AttentionMetadata:
    """Per-step layout shared by every layer. Decodes (one query each) and longer queries (prefill
    chunks, verify rows) are separate batches: padding every decode to a prefill chunk's length and
    context would multiply their attention work by that chunk's length."""

    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    batches: list  # [AttentionBatch]
    num_tokens: int

    def to(self, device, dtype=torch.float32) -> "AttentionMetadata":
        device = torch.device(device)
        batches = [b.to(device, dtype) for b in self.batches]
        if _on(self.slot_mapping, device) and all(b is a for b, a in zip(batches, self.batches)):
            return self
        return AttentionMetadata(self.slot_mapping.to(device), batches, self.num_tokens)


def _on(v, device: torch.device, dtype=None) -> bool:
    """v (a tensor, or anything else) needs no `.to(device, dtype)`: checked in Python, no dispatch."""
    if not isinstance(v, torch.Tensor):
        return True
    same = v.device == device if device.index is not None or device.type == "cpu" else v.device.type == device.type
    return same and (dtype is None or v.dtype == dtype)


def _host(t: torch.Tensor) -> np.ndarray:
    """A host tensor as numpy without a copy (DLPack: no aten op dispatched, nothing waits; a device
    tensor is copied to the host first)."""
    if t.device.type != "cpu":
        t = t.cpu()
    return np.from_dlpack(t.contiguous() if not t.is_contiguous() else t)


def _tensor(a: np.ndarray) -> torch.Tensor:
    """numpy -> torch sharing memory. A 1-D array through the buffer protocol (`torch.frombuffer`
    dispatches nothing; `from_numpy` dispatches `lift_fresh`); others (and empty ones) `from_numpy`."""
    a = np.ascontiguousarray(a)
    if a.ndim == 1 and a.size and a.dtype in _TORCH_DTYPE:
        return torch.frombuffer(a, dtype=_TORCH_DTYPE[a.dtype])
    return torch.from_numpy(a)


_TORCH_DTYPE = {np.dtype(np.int64): torch.int64, np.dtype(np.float32): torch.float32}


def build_metadata(query_lens: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                   group_decodes: bool = True):
    """Positions and attention layout for one step.

    query_lens [B]: new tokens per sequence; context_lens [B]: KV length after this step;
    block_tables [B, max_blocks] long; group_decodes: decodes in groups of similar context (`DECODE_PAD`), or
    False: one batch (what the groups are measured against). Returns (positions [T], AttentionMetadata).
    Index arithmetic runs in numpy: these arrays are tiny, and a numpy op costs ~1 us against
    ~5-10 us for a torch op, which adds up over the ~30 of them per step.
    """
    q, ctx, bt = (_host(t) for t in (query_lens, context_lens, block_tables))
    B = q.shape[0]
    T = int(q.sum())
    if B and (q == 1).all():  # decodes only: the common step, in fewer numpy ops
        positions = ctx.astype(np.int64) - 1
        slot_mapping = bt[np.arange(B), positions // block_size] * block_size + positions % block_size
        groups = decode_groups(np.arange(B), ctx, block_size, *DECODE_PAD) if group_decodes and B > 1 else []
        groups = groups if len(groups) > 1 else [None]  # None: one batch of every row in order
        batches = [_decode_batch(g if g is None else _tensor(g), ctx if g is None else ctx[g],
                                 bt if g is None else bt[g], block_size) for g in groups]
        return _tensor(positions), AttentionMetadata(_tensor(slot_mapping), batches, T)
    seq_of_token = np.repeat(np.arange(B), q)  # [T]
    idx_in_seq = np.arange(T) - (np.cumsum(q) - q)[seq_of_token]
    positions = (ctx - q)[seq_of_token] + idx_in_seq
    slot_mapping = bt[seq_of_token, positions // block_size] * block_size + positions % block_size
    decode = q == 1
    # decodes and longer queries apart, each in groups of similar size (decodes in one batch if asked)
    decodes = np.flatnonzero(decode)
    first_token = np.cumsum(q) - q  # a decode's one token
    batches = [_decode_batch(_tensor(first_token[g]), ctx[g], bt[g], block_size) for g in
               (decode_groups(decodes, ctx, block_size, *DECODE_PAD) if group_decodes else [decodes] if len(decodes) else [])]
    for seqs in pad_groups(np.flatnonzero(~decode), q, ctx, block_size, PAD_SLACK, PAD_MIN_PAIRS):
        rows = _tensor(np.flatnonzero(np.isin(seq_of_token, seqs)))
        batches.append(_batch(rows, q[seqs], ctx[seqs], bt[seqs], block_size))
    return _tensor(positions), AttentionMetadata(_tensor(slot_mapping), batches, T)


# A batch's padded attention (every sequence's queries and keys padded to the batch's longest) may cost this
# much more than its sequences' own (slack x own + the pairs an extra batch's ops cost): a prompt chunk of 256
# tokens padded beside one of 24 would attend 10x its keys; a few short verify rows stay together (their padding
# costs less than another batch's ops).
PAD_SLACK, PAD_MIN_PAIRS = 1.25, 4096
# A batch of long queries (prompt chunks) is attended in up to QUERY_CHUNKS chunks of the query axis, each over the
# keys up to its last query's position only (causal attention needs no more): SDPA's CPU kernel skips masked keys in
# blocks of hundreds only, so a 256-token prompt attends all 256 x 256 pairs where it needs half. Chunks of at least
# QUERY_CHUNK_MIN queries, and only where they skip at least a fifth of the pairs (a cached context before the new
# queries leaves less to skip). BENCHMARKS.md "Prompt queries attend in chunks".
QUERY_CHUNKS, QUERY_CHUNK_MIN, QUERY_CHUNK_SAVES = 8, 64, 0.2


def query_chunks(q: np.ndarray, ctx: np.ndarray, max_q: int, S: int) -> tuple:
    """((first query, end, keys), ...) for a padded batch of query lengths q [B], contexts ctx [B] (after the step),
    max_q queries and S keys each: the query axis cut in equal chunks, each with the keys up to the latest position
    a query of the chunk attends (a padded query row attends key 0 only); () where chunking does not pay."""
    n = min(QUERY_CHUNKS, max_q // QUERY_CHUNK_MIN)
    if n < 2:
        return ()
    cuts = np.linspace(0, max_q, n + 1).astype(np.int64)
    chunks = []
    for c0, c1 in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
        real = q > c0  # sequences with a query in this chunk
        chunks.append((c0, c1, int(min(S, max(1, (ctx[real] - q[real] + np.minimum(c1, q[real])).max())))))
    saved = sum((c1 - c0) * (S - keys) for c0, c1, keys in chunks) / (max_q * S)
    return tuple(chunks) if saved >= QUERY_CHUNK_SAVES else ()


# Decodes: another batch costs fewer ops (no query padding or permutes: ~6 a layer), and a padded key is a gathered
# cache row and its dot products, so they split sooner. Measured on the bundled model (contexts 16-512, one padded
# batch against groups; `launch/bench_decode_groups.py`): 64 decodes in 3 groups 0.85x the forward's time, 128 in 4
# 0.62x; 8 decodes split in two at 1,024 (736 fewer padded pairs) were 1.06x: hence 2,048 (BENCHMARKS.md "Decodes
# attend in groups of similar context")
DECODE_PAD = (1.05, 2048)


def pad_groups(seqs: np.ndarray, q: np.ndarray, ctx: np.ndarray, block_size: int, slack: float = PAD_SLACK,
               min_pairs: int = PAD_MIN_PAIRS) -> list:
    """Split sequences `seqs` (indices into q [B] query lengths, ctx [B] context lengths) into padded
    batches: largest key span first, a sequence joins the open batch while the batch's padded query-key
    pairs stay within slack x its own + min_pairs. Returns index arrays, each in ascending order
    (the step's token order)."""
    if len(seqs) < 2:
        return [seqs] if len(seqs) else []
    span = -(-ctx[seqs] // block_size) * block_size  # keys a sequence's batch gathers
    order = np.lexsort((-q[seqs], -span))
    groups, cur, max_q, max_s, own = [], [], 0, 0, 0
    for i in order.tolist():
        qi, si = int(q[seqs[i]]), int(span[i])
        mq, ms, o = max(max_q, qi), max(max_s, si), own + qi * si
        if cur and (len(cur) + 1) * mq * ms > slack * o + min_pairs:
            groups.append(np.sort(seqs[cur]))
            cur, mq, ms, o = [], qi, si, qi * si
        cur.append(i)
        max_q, max_s, own = mq, ms, o
    groups.append(np.sort(seqs[cur]))
    return groups


def decode_groups(seqs: np.ndarray, ctx: np.ndarray, block_size: int, slack: float, min_pairs: int) -> list:
    """`pad_groups` of decodes (one query each), in numpy: per group, the first sequence (largest key span) that
    breaks the rule starts the next."""
    span = -(-ctx[seqs] // block_size) * block_size
    order = np.argsort(-span, kind="stable")
    s = span[order]
    own = np.concatenate([[0], np.cumsum(s)])
    groups, start = [], 0
    while start < len(s):
        n = np.arange(1, len(s) - start + 1)
        bad = np.flatnonzero(n * s[start] > slack * (own[start + 1:] - own[start]) + min_pairs)
        end = start + (int(bad[0]) if len(bad) else len(n))
        groups.append(np.sort(seqs[order[start:end]]))
        start = end
    return groups


def _decode_batch(rows, ctx, bt, block_size) -> AttentionBatch:
    """`_batch` of decodes (one query each: no query padding), from numpy ctx [B], bt [B, blocks]."""
    B = ctx.shape[0]
    bt = np.ascontiguousarray(bt[:, : -(-int(ctx.max()) // block_size)])
    S = bt.shape[1] * block_size
    order = _tensor(np.arange(B))
    return AttentionBatch(
        rows=rows,
        block_tables=torch.from_numpy(bt),
        blocks=_tensor(bt.reshape(-1)),
        token_to_padded=order,
        padded_to_token=order,
        # key j is attended by the query at position ctx - 1: j < ctx
        attn_mask=torch.from_numpy(np.where(np.arange(S) < ctx[:, None], np.float32(0), np.float32(-np.inf))
                                   .reshape(B, 1, 1, S)),
        max_q=1,
        num_seqs=B,
        uniform=True,
    )


def _batch(rows, q, ctx, bt, block_size) -> AttentionBatch:
    """One padded batch from numpy q [B], ctx [B], bt [B, blocks]."""
    B = q.shape[0]
    T = int(q.sum())
    max_q = int(q.max())
    seq_of_token = np.repeat(np.arange(B), q)
    idx_in_seq = np.arange(T) - (np.cumsum(q) - q)[seq_of_token]
    token_to_padded = seq_of_token * max_q + idx_in_seq
    padded_to_token = np.full(B * max_q, T, dtype=np.int64)
    padded_to_token[token_to_padded] = np.arange(T)
    # only the blocks that hold context (tables can be longer: lookahead slots for drafts)
    bt = np.ascontiguousarray(bt[:, : -(-int(ctx.max()) // block_size)])
    S = bt.shape[1] * block_size
    q_pos = (ctx - q)[:, None] + np.arange(max_q)[None, :]  # [B, max_q]
    key_pos = np.arange(S)
    mask = key_pos[None, None, :] <= q_pos[:, :, None]  # causal; also keeps keys < context_len
    pad_rows = np.arange(max_q)[None, :] >= q[:, None]
    mask[pad_rows] = key_pos == 0  # padded query rows attend to one key so softmax is finite
    return AttentionBatch(
        rows=rows,
        block_tables=torch.from_numpy(bt),
        blocks=_tensor(bt.reshape(-1)),
        token_to_padded=_tensor(token_to_padded),
        padded_to_token=_tensor(padded_to_token),
        attn_mask=torch.from_numpy(np.where(mask, np.float32(0), np.float32(-np.inf))[:, None]),
        max_q=max_q,
        num_seqs=B,
        uniform=bool((q == max_q).all()),
        q_chunks=query_chunks(q, ctx, max_q, S) if max_q > 1 else (),
    )


def paged_attention(q, k_new, v_new, k_cache, v_cache, meta: AttentionMetadata, scale: float, flat=None):
    """q [T, Hq, Dk]; k_new [T, Hkv, Dk], v_new [T, Hkv, Dv] are this step's keys/values (one KV
    head: [T, Dk], [T, Dv] also do). k_cache [num_blocks, block_size, Hkv, Dk], v_cache [..., Dv]
    (v_cache may be None: then the values are the first Dv channels of the keys, as in MLA's latent
    cache). flat: the caches viewed per slot in k_new's / v_new's shape ([slots, *k_new.shape[1:]]),
    made once by the caller (None: viewed here). Returns [T, Hq, Dv]. q may also come as
    [T, Hkv, G, Dk] (SDPA's layout of a decode step, G = Hq / Hkv); then a decode-only step attended
    as one batch returns [T, Hkv, G, Dv] (no reshape either way), any other [T, Hq, Dv].
    SDPA's fused CPU kernel needs equal key and value widths, hence values = keys for MLA.
    """
    if meta is None:  # a compiled step: one op opaque to the compiler, the metadata from `step_context`
        return torch.ops.dspark.step_attention(q, k_new, v_new, k_cache, v_cache, scale)
    Dv = v_new.shape[-1]
    if q.dim() == 4 and not (len(meta.batches) == 1 and meta.batches[0].max_q == 1):
        q = q.flatten(1, 2)  # queries of several tokens: the [T, Hq, Dk] path below
    if flat is None:
        flat = (k_cache.view(-1, *k_new.shape[1:]), None if v_cache is None else v_cache.view(-1, *v_new.shape[1:]))
    # index_copy_ / index_select: several times faster on CPU than advanced indexing for the same rows
    flat[0].index_copy_(0, meta.slot_mapping, k_new)
    if v_cache is not None:
        flat[1].index_copy_(0, meta.slot_mapping, v_new)
    if len(meta.batches) == 1:
        return _attend(q, k_cache, v_cache, meta.batches[0], scale, Dv)
    out = q.new_empty(q.shape[0], q.shape[1], Dv)
    for b in meta.batches:
        out.index_copy_(0, b.rows, _attend(q.index_select(0, b.rows), k_cache, v_cache, b, scale, Dv))
    return out


def _attend(q, k_cache, v_cache, b: AttentionBatch, scale: float, Dv: int):
    """Attention of one batch's queries q [T_b, Hq, Dk] over its sequences' cached keys -> [T_b, Hq, Dv].

    The G = Hq / Hkv query heads that share a KV head are folded into the query axis, so SDPA
    runs with Hkv heads and no KV copies (its own GQA path is many times slower on CPU).
    """
    T, Dk = q.shape[0], q.shape[-1]
    Hq = q.shape[1] * q.shape[2] if q.dim() == 4 else q.shape[1]
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    B, max_q = b.num_seqs, b.max_q
    blocks = b.blocks
    if Hkv == 1:  # one KV head (MLA): [B, 1, S, Dk] is a view of the gathered blocks
        keys = k_cache.index_select(0, blocks).view(B, 1, -1, Dk)
    else:
        keys = k_cache.index_select(0, blocks).view(B, -1, Hkv, Dk).transpose(1, 2)  # [B, Hkv, S, Dk]
    if v_cache is not None:
        values = v_cache.index_select(0, blocks).view(B, -1, Hkv, Dv).transpose(1, 2)
    else:
        values = keys  # MLA: the latent is the key's head; the extra rope channels are cut below
    if max_q == 1:  # decodes only: one query per sequence, already in sequence order
        q_pad = q if q.dim() == 4 else q.view(B, Hkv, G, Dk)
        out = F.scaled_dot_product_attention(q_pad, keys, values, attn_mask=b.folded_mask(G), scale=scale)  # [B, Hkv, G, Dv]
        return out[..., :Dv] if q.dim() == 4 else out[..., :Dv].reshape(B, Hq, Dv)
    if not b.uniform:  # [B * max_q, Hq, Dk], each sequence's queries padded with a zero row
        q = torch.cat([q, q.new_zeros(1, Hq, Dk)]).index_select(0, b.padded_to_token)
    q = q.reshape(B, max_q, Hkv, G, Dk)
    if not b.q_chunks:
        out = F.scaled_dot_product_attention(q.permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * max_q, Dk), keys, values,
                                             attn_mask=b.folded_mask(G), scale=scale)  # [B, Hkv, G*max_q, Dv]
        out = out[..., :Dv].reshape(B, Hkv, G, max_q, Dv)
    else:  # each chunk of queries over the keys it can attend: [B, Hkv, G, chunk, Dv] each
        out = torch.cat([F.scaled_dot_product_attention(
            q[:, c0:c1].permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * (c1 - c0), Dk), keys[:, :, :s], values[:, :, :s],
            attn_mask=b.folded_mask(G, i), scale=scale)[..., :Dv].reshape(B, Hkv, G, c1 - c0, Dv)
            for i, (c0, c1, s) in enumerate(b.q_chunks)], dim=3)
    out = out.permute(0, 3, 1, 2, 4).reshape(B * max_q, Hq, Dv)
    return out if b.uniform else out.index_select(0, b.token_to_padded)


_step = threading.local()  # the metadata of the compiled step running on this thread


@contextlib.contextmanager
def step_context(meta: AttentionMetadata):
    """Run a compiled step with this metadata (its real tokens'): `step_attention` reads it. The graphs take none
    (as vLLM's forward context): what they see of a step is its padded token count only, so a step of any
    composition (decodes, verify rows, prompt chunks) replays the graphs of its bucket, and the key length,
    which changes every block_size tokens, never reaches them."""
    prev, _step.meta = getattr(_step, "meta", None), meta
    try:
        yield
    finally:
        _step.meta = prev


def step_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """`paged_attention` of the compiled step in `step_context`, over its first meta.num_tokens rows (the real
    tokens; the padding rows after them write no KV and attend nothing: zeros). q [Tp, H, Dk] -> [Tp, H, Dv]."""
    meta = getattr(_step, "meta", None)
    if meta is None:
        raise RuntimeError("dspark::step_attention ran outside attention.step_context: a compiled step's attention "
                           "reads its metadata there (CompiledSteps sets it around each step)")
    return on_real_rows(meta.num_tokens, (*q.shape[:-1], v_new.shape[-1]),
                        lambda q, k, v: paged_attention(q, k, v, k_cache, v_cache, meta, scale), q, k_new, v_new)


def on_real_rows(n: int, out_shape, run, *xs: torch.Tensor) -> torch.Tensor:
    """run(*xs) over the first n rows of a compiled call's padded batch (xs [Np, ...]: the real rows first), as a new
    tensor of out_shape ([Np, ...]) whose padding rows are zeros: what an opaque op of the graphs returns (never a view
    of its inputs)."""
    if n == xs[0].shape[0]:
        return run(*xs).contiguous()
    out = xs[0].new_zeros(out_shape)
    if n:
        out[:n] = run(*(x[:n] for x in xs))
    return out


torch.library.custom_op("dspark::step_attention", step_attention, mutates_args=("k_cache", "v_cache")).register_fake(
    lambda q, k_new, v_new, k_cache, v_cache, scale: q.new_empty(*q.shape[:-1], v_new.shape[-1]))
