"""`dspark kv-plan`: how much KV cache each worker rank holds, computed from the config and the
checkpoint's config.json alone (no weights are loaded).

The arithmetic mirrors what the engine allocates (`kv_cache.kv_bytes_per_block` on a loaded
shard, `kv_cache.plan_num_blocks` for the count):
- GQA (Llama, Qwen, Mixtral): K and V per KV head per layer. Tensor parallelism splits the KV
  heads when there are at least `tensor` of them, and replicates one head per rank otherwise.
- MLA (DeepSeek-V3): one compressed latent (kv_lora_rank) plus the shared rope key
  (qk_rope_head_dim) per token per layer, with no separate V; it is replicated on every TP rank.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .config import Config
from .model.spec import ModelSpec

COLUMNS = (
    ("rank", "rank"),
    ("tp_rank", "tp"),
    ("dp_rank", "dp"),
    ("attention", "attn"),
    ("kv_heads_per_rank", "kv heads"),
    ("kv_bytes_per_token_per_layer", "B/token/layer"),
    ("kv_bytes_per_token", "B/token"),
    ("block_size", "block"),
    ("kv_bytes_per_block", "B/block"),
    ("num_blocks", "blocks"),
    ("tokens_capacity", "tokens"),
    ("context_len", "context"),
    ("seqs_at_context_len", "seqs@context"),
)


def _dtype_bytes(dtype) -> int:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return torch.empty((), dtype=dtype).element_size()


def kv_plan(cfg: Config, spec: ModelSpec, context_len: Optional[int] = None) -> list[dict]:
    """One dict per worker rank (world = tensor x data; rank = dp_rank * tensor + tp_rank)."""
    tp, dp = cfg.parallel.tensor, cfg.parallel.data
    sc = cfg.scheduler
    elem = _dtype_bytes(spec.dtype)
    if spec.attention == "mla":
        kv_heads = 1  # the latent is shared by all heads and replicated on every TP rank
        per_layer = (spec.kv_lora_rank + spec.qk_rope_head_dim) * elem
    else:
        kv_heads = spec.num_kv_heads // tp if spec.num_kv_heads >= tp else 1
        per_layer = 2 * kv_heads * spec.head_dim * elem
    per_token = per_layer * spec.num_layers
    per_block = per_token * sc.block_size
    if isinstance(sc.num_kv_blocks, int):
        num_blocks = sc.num_kv_blocks
    else:  # "auto": as kv_cache.plan_num_blocks
        num_blocks = max(1, int(sc.kv_cache_memory) // per_block)
    ctx = int(context_len or sc.max_model_len or spec.max_position_embeddings)
    blocks_per_seq = math.ceil(ctx / sc.block_size)
    rows = []
    for rank in range(tp * dp):
        rows.append(
            {
                "rank": rank,
                "tp_rank": rank % tp,
                "dp_rank": rank // tp,
                "attention": spec.attention,
                "kv_heads_per_rank": kv_heads,
                "kv_bytes_per_token_per_layer": per_layer,
                "kv_bytes_per_token": per_token,
                "block_size": sc.block_size,
                "kv_bytes_per_block": per_block,
                "num_blocks": num_blocks,
                "tokens_capacity": num_blocks * sc.block_size,
                "context_len": ctx,
                "seqs_at_context_len": num_blocks // blocks_per_seq,
            }
        )
    return rows


def _note(rows: list[dict]) -> str:
    kind = rows[0]["attention"].upper()
    return (f"note ({kind} here): GQA caches K and V for each KV head per token and layer; TP splits the KV heads\n"
            "  across ranks (one head is replicated per rank when there are fewer heads than ranks).\n"
            "  MLA caches one compressed latent (kv_lora_rank) + the shared rope key per token and layer, no\n"
            "  separate V, replicated on every TP rank: more TP ranks do not shrink the per-rank cache.")


def format_kv_plan(rows: list[dict]) -> str:
    """Aligned text table, one line per rank, plus a note on MLA vs GQA."""
    if not rows:
        return "(no ranks)"
    headers = [h for _, h in COLUMNS]
    cells = [[f"{r[k]:,}" if isinstance(r[k], int) else str(r[k])
              for k, _ in COLUMNS] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]

    def align(i, text):  # numbers right-aligned, the attention kind left-aligned
        return text.ljust(widths[i]) if COLUMNS[i][0] == "attention" else text.rjust(widths[i])

    lines = ["  ".join(align(i, h) for i, h in enumerate(headers))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(align(i, c) for i, c in enumerate(row)) for row in cells]
    r = rows[0]
    mib = r["num_blocks"] * r["kv_bytes_per_block"] / 2**20
    lines.append("")
    lines.append(f"per rank: {mib:,.1f} MiB of KV cache = {r['num_blocks']:,} blocks x {r['kv_bytes_per_block']:,} B; "
                 f"B = bytes, seqs@context = sequences of {r['context_len']:,} tokens that fit at once")
    lines.append(_note(rows))
    return "\n".join(lines)
