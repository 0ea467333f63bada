"""`dspark kv-plan`: the memory of each worker rank (its weights and its KV cache), computed from
the config and the checkpoint's config.json alone (no weights are loaded: each rank's shard is
built on the meta device, so its parameter shapes and bytes are those the worker will hold).

The arithmetic mirrors what the engine allocates (`kv_cache.kv_bytes_per_block` on a loaded
shard, `kv_cache.plan_num_blocks` for the count):
- GQA (Llama, Qwen, Mixtral): K and V per KV head per layer. Tensor parallelism splits the KV
  heads when there are at least `tensor` of them, and replicates one head per rank otherwise.
- MLA (DeepSeek-V3): one compressed latent (kv_lora_rank) plus the shared rope key
  (qk_rope_head_dim) per token per layer, with no separate V; it is replicated on every TP rank.

A DSpark drafter on the target (speculative.placement target) lives on each group's driver rank (TP rank 0):
its weights, the target's tables a second time where tensor parallelism splits the target's, its Markov factors,
every running sequence's context (a store of at most `drafter_context_rows` rows) and the sampled rows' draft laws
come off that rank's memory before its KV share (`drafter_bytes`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .config import Config
from .model import gemm
from .model.spec import ModelSpec

COLUMNS = (
    ("rank", "rank"),
    ("tp_rank", "tp"),
    ("dp_rank", "dp"),
    ("attention", "attn"),
    ("weight_bytes", "weights B"),
    ("kv_heads_per_rank", "kv heads"),
    ("kv_bytes_per_token_per_layer", "B/token/layer"),
    ("kv_bytes_per_token", "B/token"),
    ("block_size", "block"),
    ("kv_bytes_per_block", "B/block"),
    ("num_blocks", "blocks"),
    ("kv_pool_bytes", "KV B"),
    ("tokens_capacity", "tokens"),
    ("context_len", "context"),
    ("seqs_at_context_len", "seqs@context"),
)


def _dtype_bytes(dtype) -> int:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return torch.empty((), dtype=dtype).element_size()


class _Shard:
    """tp rank/size for building a shard on the meta device (no collective runs)."""

    def __init__(self, tp_rank, tp_size):
        self.tp_rank, self.tp_size = tp_rank, tp_size


def rank_weights(cfg: Config, spec: ModelSpec, rank: int, device_type: str = "cuda") -> dict:
    """The shard rank `rank` holds, built on the meta device as the worker builds it (TP slices of
    attention, dense MLPs and the vocabulary; its slots of the experts, spread over the whole world):
    {"weight_bytes", "expert_bytes", "num_params", "shapes": {name: shape}, "reordered_bytes"}: on a
    `device_type` "cpu" the loader's oneDNN copies of the linear weights too (model/gemm.py), else 0."""
    from .model.model import DecoderModel
    from .placement import default_placement

    tp, world = cfg.parallel.tensor, cfg.parallel.world_size
    expert_ids = None
    if spec.is_moe and world > 1:
        num_moe = sum(spec.moe_layers)
        placement = default_placement(num_moe, spec.num_experts, world, cfg.eplb.num_redundant_experts)
        expert_ids = [placement.rank_experts(layer, rank) for layer in range(num_moe)]
    with torch.device("meta"):
        model = DecoderModel(spec, _Shard(rank % tp, tp), expert_ids).to(spec.dtype)
    tensors = dict(model.named_parameters())
    tensors.update({k: v for k, v in model.named_buffers() if k.endswith("e_score_correction_bias")})
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    return {
        "weight_bytes": nbytes(tensors.values()),
        "expert_bytes": nbytes(t for n, t in tensors.items() if n.endswith((".w13", ".w2"))),
        "num_params": sum(t.numel() for t in tensors.values()),
        "shapes": {n: tuple(t.shape) for n, t in tensors.items()},
        "reordered_bytes": nbytes(gemm.linear_weights(model))
        if device_type == "cpu" and gemm.runs_dtype(spec.dtype) else 0,
    }


def drafter_context_rows(window: int, block_size: int) -> int:
    """The most rows a sequence's DSpark context store holds (`DSparkProposer._make_room`): twice its window, the
    rows kept behind it and a block's rows past it."""
    from .speculative.dspark_proposer import KEEP_BEHIND

    return max(64, 2 * (window + KEEP_BEHIND + block_size))


def _context_len(cfg: Config, spec: ModelSpec, context_len: Optional[int]) -> int:
    """The sequence length a plan is for: given, else scheduler.max_model_len, else the model's positions."""
    return int(context_len or cfg.scheduler.max_model_len or spec.max_position_embeddings)


def drafter_bytes(cfg: Config, spec: ModelSpec, device_type: str = "cuda",
                  context_len: Optional[int] = None) -> dict:
    """What the DSpark drafter on a driver rank holds, in the target's dtype (what it serves in): {"weights" (built
    on the meta device), "tables" (the target's embedding and LM head again where tensor parallelism splits the
    target's: else it reads them in place), "markov" (its materialised factors W1 [V, r], W2 [r, V], the second in fp32),
    "context" (max_num_seqs sequences' stores of `drafter_context_rows`, each drafter layer's keys and values),
    "laws" (a draft law [num_tokens, V] a sampled row, held until verified), "rope" (its table of cos / sin for the
    positions served, fp32, grown by doubling to at most ROPE_TABLE_ROWS: for contexts of context_len), "reordered"
    (on a `device_type` "cpu", the oneDNN copies of its serving weights, model/gemm.py), "total"}; {} where no DSpark
    drafter runs on the target."""
    sp = cfg.speculative
    if not (sp.on_target and sp.method == "dspark"):
        return {}
    from pathlib import Path

    from .speculative.dspark_model import ROPE_TABLE_ROWS, DSparkConfig, DSparkDrafter, context_window_of

    c = DSparkConfig.load(Path(sp.draft_model) / "config.json")
    elem = _dtype_bytes(spec.dtype)
    with torch.device("meta"):
        drafter = DSparkDrafter(c)
        drafter.pack()
    weights = sum(p.numel() for p in drafter.parameters()) * elem
    reordered = 0
    if device_type == "cpu" and gemm.runs_dtype(spec.dtype):  # (each weight once, as `reorder_tensors` counts)
        served = {id(w): w for w in drafter.serving_weights(tables=False)}.values()
        # (and its own LM head's where tensor parallelism splits the target's; a shared one's copy is the target's)
        reordered = (sum(w.numel() for w in served) + (cfg.parallel.tensor > 1) * c.vocab_size
                     * c.target_hidden_size) * elem
    ctx = _context_len(cfg, spec, context_len)
    rope_rows = min(ROPE_TABLE_ROWS, max(256, 2 * (ctx + c.block_size)))
    rows = drafter_context_rows(context_window_of(sp.context_window, c), c.block_size)
    out = {"weights": weights,
           "tables": 0 if cfg.parallel.tensor == 1 else 2 * c.vocab_size * c.target_hidden_size * elem,
           "markov": c.vocab_size * c.markov_rank * (elem + 4),  # (W1 in the serving dtype, W2 in fp32)
           "context": cfg.scheduler.max_num_seqs * rows * c.num_layers * 2 * c.hidden_size * elem,
           "laws": cfg.scheduler.max_num_seqs * sp.num_tokens * c.vocab_size * elem,
           "rope": 2 * rope_rows * c.head_dim * 4, "reordered": reordered}
    return {**out, "total": sum(out.values())}


def kv_plan(cfg: Config, spec: ModelSpec, context_len: Optional[int] = None,
            device_memory: Optional[int] = None) -> list[dict]:
    """One dict per worker rank (world = tensor x data; rank = dp_rank * tensor + tp_rank).

    device_memory: bytes of one target device (e.g. an H200's) to plan a GPU topology from any
    machine; a share of kv_cache_memory (and auto, 0.9) is then of what the rank's weights leave.
    None: the device this machine would use (`parallel.device`)."""
    from .executor import resolve_device
    from .kv_cache import free_device_memory, kv_budget_bytes

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
    if device_memory is not None:
        device_type, total = "cuda", int(device_memory)
    else:
        device = resolve_device(cfg.parallel.device)
        device_type = device.type
        total = (int(torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda"
                 else free_device_memory(device))
    ctx = _context_len(cfg, spec, context_len)
    blocks_per_seq = math.ceil(ctx / sc.block_size)
    drafter = drafter_bytes(cfg, spec, device_type, context_len)
    rows = []
    for rank in range(tp * dp):
        w = rank_weights(cfg, spec, rank, device_type)
        drafter_here = drafter.get("total", 0) if rank % tp == 0 else 0  # (the driver rank of its group)
        held = w["weight_bytes"] + w["reordered_bytes"] + drafter_here
        left = max(0, total - held)
        # CPU: the host's memory is shared by every worker on it (all of them, at worst)
        sharing = 1 if device_type == "cuda" else tp * dp
        if isinstance(sc.num_kv_blocks, int):
            num_blocks = sc.num_kv_blocks
        else:  # "auto": as kv_cache.plan_num_blocks
            num_blocks = max(1, kv_budget_bytes(sc.kv_cache_memory, device_type, left, sharing) // per_block)
        rows.append(
            {
                "rank": rank,
                "tp_rank": rank % tp,
                "dp_rank": rank // tp,
                "attention": spec.attention,
                "weight_bytes": w["weight_bytes"],
                "reordered_weight_bytes": w["reordered_bytes"],  # the CPU's oneDNN copies (model/gemm.py)
                "drafter_bytes": drafter_here,  # a DSpark drafter on this driver rank (`drafter_bytes`)
                "expert_bytes": w["expert_bytes"],
                "num_params": w["num_params"],
                "kv_heads_per_rank": kv_heads,
                "kv_bytes_per_token_per_layer": per_layer,
                "kv_bytes_per_token": per_token,
                "block_size": sc.block_size,
                "kv_bytes_per_block": per_block,
                "num_blocks": num_blocks,
                "kv_pool_bytes": num_blocks * per_block,
                "tokens_capacity": num_blocks * sc.block_size,
                "context_len": ctx,
                "seqs_at_context_len": num_blocks // blocks_per_seq,
                "device_type": device_type,
                "device_memory": total,
                "headroom_bytes": total - held - num_blocks * per_block,
                # the pool a share of the memory left (measured at start-up, less the largest steps' activations)
                "kv_share": not isinstance(sc.num_kv_blocks, int) and (
                    sc.kv_cache_memory == "auto" and device_type == "cuda" or isinstance(sc.kv_cache_memory, float)),
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
    gib = lambda b: f"{b / 2**30:,.2f} GiB"  # noqa: E731
    lines.append("")
    lines.append(f"per rank: {gib(r['kv_pool_bytes'])} of KV cache = {r['num_blocks']:,} blocks x "
                 f"{r['kv_bytes_per_block']:,} B; B = bytes, seqs@context = sequences of {r['context_len']:,} tokens "
                 "that fit at once")
    what = "device" if r["device_type"] == "cuda" else "host memory available (shared by the workers)"
    distinct: dict = {}
    for row in rows:  # one line per distinct rank layout (the first rank that has it)
        distinct.setdefault((row["weight_bytes"], row["kv_pool_bytes"], row["drafter_bytes"]), row)
    for x in distinct.values():
        copies = f" + their oneDNN copies {gib(x['reordered_weight_bytes'])}" if x["reordered_weight_bytes"] else ""
        copies += f" + the DSpark drafter {gib(x['drafter_bytes'])}" if x["drafter_bytes"] else ""
        lines.append(f"rank {x['rank']}: weights {gib(x['weight_bytes'])} (experts {gib(x['expert_bytes'])}){copies} + KV "
                     f"{gib(x['kv_pool_bytes'])} + headroom {gib(x['headroom_bytes'])} = {what} "
                     f"{gib(x['device_memory'])}")
    if r["device_type"] == "cuda" and r["kv_share"]:
        lines.append("the KV share is planned here before the largest steps' activations: on the GPUs each worker "
                     "measures them at start-up\n  (activation_reserve_bytes in its memory report) and takes its "
                     "share of what is left after them")
    lines.append(_note(rows))
    return "\n".join(lines)
