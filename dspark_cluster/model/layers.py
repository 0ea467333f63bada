"""Decoder building blocks, sized for one tensor-parallel shard.

Every layer is built for `(tp_rank, tp_size)`: column-split projections hold 1/tp of the heads or
intermediate channels, row-split ones reduce through `comm.all_reduce`. With `LocalComm` (one
process) the reductions are no-ops; `parallel/` supplies the torch.distributed version.
Parameter names follow the HF checkpoints so the loader maps names one to one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, paged_attention
from .spec import ModelSpec


class LocalComm:
    """Collectives over a tensor-parallel group of one: identity."""

    tp_rank = 0
    tp_size = 1

    def all_reduce(self, x):
        return x

    def all_gather(self, x, dim=-1):
        return x


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions, inv_freq, scaling: float = 1.0, dtype=None):
    """positions [..., T] -> cos, sin [..., T, D] as cat(freqs, freqs), times the attention
    scaling, in `dtype` (None: fp32)."""
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos() * scaling, emb.sin() * scaling
    return (cos, sin) if dtype is None else (cos.to(dtype), sin.to(dtype))


def apply_rope(x, cos, sin, interleave=False):
    """x [..., T, H, D]; cos/sin [..., T, D] from `rope_cos_sin`. Computed in cos's dtype where it
    is wider than x's, and returned in x's. Interleaved checkpoints (DeepSeek) pair channels
    (0,1),(2,3)...; they are de-interleaved first, as transformers does, so q and k share one
    layout and the dot products are unchanged."""
    if interleave:
        x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    cos, sin = cos[..., None, :], sin[..., None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class ColumnParallelLinear(nn.Linear):
    """Holds this rank's slice of the output features (and bias). `share` ranks hold the same
    slice, for KV heads that are fewer than the ranks. The loader reads rows
    [(tp_rank // share) * out, +out) of the checkpoint tensor."""

    shard_dim = 0

    def __init__(self, in_features, out_features, bias=False, share=1):
        super().__init__(in_features, out_features, bias=bias)
        self.share = share


class RowParallelLinear(nn.Linear):
    """Holds this rank's slice of the input features; the caller all-reduces the partial sums.
    The bias is whole and added on rank 0 only."""

    shard_dim = 1
    share = 1


def _split(n, comm, what):
    if n % comm.tp_size:
        raise ValueError(f"{what}={n} is not divisible by tensor parallel size {comm.tp_size}")
    return n // comm.tp_size


class MLP(nn.Module):
    """SwiGLU MLP; gate/up column-split, down row-split (reduced by the caller's comm)."""

    def __init__(self, hidden, intermediate, comm, names=("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        inter = _split(intermediate, comm, "intermediate_size")
        self.names = names
        setattr(self, names[0], ColumnParallelLinear(hidden, inter))
        setattr(self, names[1], ColumnParallelLinear(hidden, inter))
        setattr(self, names[2], RowParallelLinear(inter, hidden, bias=False))

    def forward(self, x):  # partial sum over TP ranks
        g, u, d = (getattr(self, n) for n in self.names)
        return d(F.silu(g(x)) * u(x))


class GQAAttention(nn.Module):
    """Multi-head / grouped-query attention (Llama, Qwen2/3, Mixtral) over a paged KV cache."""

    def __init__(self, spec: ModelSpec, comm):
        super().__init__()
        self.comm = comm
        self.num_heads = _split(spec.num_heads, comm, "num_attention_heads")
        # KV heads are split when there are enough of them, replicated otherwise.
        self.num_kv_heads = max(1, spec.num_kv_heads // comm.tp_size)
        self.head_dim = spec.head_dim
        self.scale = spec.softmax_scale
        H, D = spec.hidden_size, spec.head_dim
        share = max(1, comm.tp_size // spec.num_kv_heads)  # ranks per KV head when heads < ranks
        self.q_proj = ColumnParallelLinear(H, self.num_heads * D, bias=spec.qkv_bias)
        self.k_proj = ColumnParallelLinear(H, self.num_kv_heads * D, bias=spec.qkv_bias, share=share)
        self.v_proj = ColumnParallelLinear(H, self.num_kv_heads * D, bias=spec.qkv_bias, share=share)
        self.o_proj = RowParallelLinear(self.num_heads * D, H, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(D, spec.rms_norm_eps)
            self.k_norm = RMSNorm(D, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.kv_cache = None  # (k_cache, v_cache) set by the engine

    def cache_shape(self, num_blocks, block_size):
        return [(num_blocks, block_size, self.num_kv_heads, self.head_dim)] * 2

    def forward(self, x, cos, sin, meta: AttentionMetadata):
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = paged_attention(q, k, v, self.kv_cache[0], self.kv_cache[1], meta, self.scale)
        out = F.linear(out.reshape(T, -1), self.o_proj.weight, self.o_proj.bias if self.comm.tp_rank == 0 else None)
        return self.comm.all_reduce(out)


class MLAttention(nn.Module):
    """DeepSeek multi-head latent attention. The cache holds the compressed latent and the shared
    rope key per token ([kv_lora_rank + rope_dim]); the up-projection kv_b_proj is absorbed into
    the query and the output, so attention runs as one-head MQA over the latent."""

    def __init__(self, spec: ModelSpec, comm):
        super().__init__()
        self.comm = comm
        self.num_heads = _split(spec.num_heads, comm, "num_attention_heads")
        self.nope, self.rope, self.vdim = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        self.rank = spec.kv_lora_rank
        self.scale = spec.softmax_scale
        self.interleave = spec.rope_interleave
        H, qk = spec.hidden_size, spec.qk_nope_head_dim + spec.qk_rope_head_dim
        if spec.q_lora_rank:
            self.q_a_proj = nn.Linear(H, spec.q_lora_rank, bias=spec.o_bias)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, spec.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(spec.q_lora_rank, self.num_heads * qk)
        else:
            self.q_proj = ColumnParallelLinear(H, self.num_heads * qk)
        self.q_lora = bool(spec.q_lora_rank)
        self.kv_a_proj_with_mqa = nn.Linear(H, self.rank + self.rope, bias=spec.o_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, spec.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(self.rank, self.num_heads * (self.nope + self.vdim))
        self.o_proj = RowParallelLinear(self.num_heads * self.vdim, H, bias=spec.o_bias)
        self.kv_cache = None  # (latent_cache, None)

    def cache_shape(self, num_blocks, block_size):
        return [(num_blocks, block_size, 1, self.rank + self.rope)]

    def forward(self, x, cos, sin, meta: AttentionMetadata):
        T = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(T, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_pe = apply_rope(q_pe, cos, sin, self.interleave)
        k_pe = apply_rope(k_pe[:, None, :], cos, sin, self.interleave)
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.vdim, self.rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        k_new = torch.cat([latent[:, None, :], k_pe], dim=-1)  # [T, 1, rank + rope]
        out = paged_attention(
            torch.cat([q_latent, q_pe], dim=-1), k_new, latent[:, None, :], self.kv_cache[0], None, meta, self.scale
        )  # [T, H, rank]
        out = torch.einsum("thr,hvr->thv", out, w_uv).reshape(T, -1)
        out = F.linear(out, self.o_proj.weight, self.o_proj.bias if self.comm.tp_rank == 0 else None)
        return self.comm.all_reduce(out)


def route(logits: torch.Tensor, spec: ModelSpec, correction_bias=None):
    """Top-k routing. logits [T, E] (fp32) -> (topk_weights [T, k] fp32, topk_ids [T, k] long).

    softmax: Mixtral / Qwen (optionally renormalised). sigmoid: DeepSeek-V3, choosing with the
    correction bias inside the best `topk_group` of `n_group` groups, weighting without it.
    """
    if spec.scoring == "softmax":
        probs = logits.softmax(dim=-1)
        weights, ids = probs.topk(spec.top_k, dim=-1)
        if spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    scores = logits.sigmoid()
    choice = scores + correction_bias.float() if correction_bias is not None else scores
    T, E = choice.shape
    if spec.n_group > 1:
        grouped = choice.view(T, spec.n_group, E // spec.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, n_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(spec.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // spec.n_group, dim=1), float("-inf"))
    ids = choice.topk(spec.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * spec.routed_scaling_factor, ids


def run_experts(xs, slots, w13, w2):
    """Run each row through the expert in its local slot, grouped per slot.

    xs [N, H]; slots [N] long in [0, n_slots); w13 [n_slots, 2I, H]; w2 [n_slots, H, I].
    Returns (ys [N, H] unweighted expert outputs, counts [n_slots] rows per slot).

    Rows are sorted by slot and each projection is one batched call over all slots: a bmm over
    slots padded to the fullest one when that at most doubles the work (decode batches), else a
    grouped matmul (slot e multiplies rows offs[e-1]:offs[e]), never a Python loop per slot.
    """
    order = torch.argsort(slots, stable=True)
    counts = torch.bincount(slots, minlength=w13.shape[0])
    xs_sorted = xs[order]
    n_slots, most = w13.shape[0], int(counts.max()) if counts.numel() else 0
    if 0 < n_slots * most <= 2 * xs.shape[0]:
        # few rows per slot (decode): one bmm over slots padded to the fullest slot costs at most 2x
        # the FLOPs but is one call, cheaper than a grouped matmul's per-slot calls at this size
        slot_sorted = slots[order]
        row = torch.arange(xs.shape[0], device=xs.device) - (torch.cumsum(counts, 0) - counts)[slot_sorted]
        padded = xs.new_zeros(n_slots, most, xs.shape[1])
        padded[slot_sorted, row] = xs_sorted
        gate, up = torch.bmm(padded, w13.transpose(1, 2)).chunk(2, dim=-1)
        ys_sorted = torch.bmm(F.silu(gate) * up, w2.transpose(1, 2))[slot_sorted, row]
    else:
        ys_sorted = _grouped_mm_experts(xs_sorted, counts, w13, w2)
        if ys_sorted is None:  # no grouped matmul for this layout: a loop of two matmuls per slot
            ys_sorted = torch.empty_like(xs_sorted)
            start = 0
            for e, n in enumerate(counts.tolist()):
                if n:
                    gate, up = (xs_sorted[start : start + n] @ w13[e].T).chunk(2, dim=-1)
                    ys_sorted[start : start + n] = (F.silu(gate) * up) @ w2[e].T
                    start += n
    ys = torch.empty_like(ys_sorted)
    ys[order] = ys_sorted
    return ys, counts


_NO_GROUPED_MM: set = set()


def _grouped_mm_experts(xs_sorted, counts, w13, w2):
    """Both expert projections as grouped matmuls, or None where torch has no grouped matmul for
    this device, dtype and shape (its kernels want 16-byte aligned rows, some CUDA archs none at all)."""
    key = (xs_sorted.device.type, xs_sorted.dtype, w13.shape[1:], w2.shape[1:])
    if key in _NO_GROUPED_MM:
        return None
    try:
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        gate, up = torch._grouped_mm(xs_sorted, w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)
    except (AttributeError, RuntimeError, NotImplementedError):
        _NO_GROUPED_MM.add(key)
        return None


class MoE(nn.Module):
    """Routed experts (+ optional shared experts). Gating runs on every rank; this module holds the
    experts listed in `expert_ids` as stacked tensors. `dispatch` moves tokens to the ranks holding
    their experts; the default runs everything locally."""

    def __init__(self, spec: ModelSpec, comm, expert_ids=None):
        super().__init__()
        self.spec = spec
        self.comm = comm
        E, H, I = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
        self.expert_ids = list(range(E)) if expert_ids is None else list(expert_ids)
        self.gate = nn.Linear(H, E, bias=False)
        if spec.correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))
        n = len(self.expert_ids)
        self.w13 = nn.Parameter(torch.empty(n, 2 * I, H))
        self.w2 = nn.Parameter(torch.empty(n, H, I))
        self.register_buffer("local_ids", torch.full((E,), -1, dtype=torch.long), persistent=False)
        # added to the gate logits; zero unless a hot-spot study sets it (workload.hot_experts)
        self.register_buffer("study_router_bias", torch.zeros(E), persistent=False)
        self.set_expert_ids(self.expert_ids)
        if spec.shared_intermediate_size:
            self.shared = MLP(H, spec.shared_intermediate_size, comm)
            if spec.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(H, 1, bias=False)
        self.dispatch = None  # parallel/ sets an expert-parallel dispatcher
        self.last_load = None  # [E] tokens routed to each logical expert in the last forward
        self.last_slot_load = None  # [n_slots] tokens this shard's expert slots computed

    def set_expert_ids(self, expert_ids):
        """Which logical experts the stacked w13/w2 rows hold, in order."""
        self.expert_ids = list(expert_ids)
        local = torch.full((self.spec.num_experts,), -1, dtype=torch.long)
        local[torch.tensor(self.expert_ids, dtype=torch.long)] = torch.arange(len(self.expert_ids))
        self.local_ids = local.to(self.local_ids.device)

    def run_local(self, xs, slots):
        """xs [N, H] rows for this shard's slots [N] -> (unweighted expert outputs [N, H], rows per
        slot); what an expert-parallel dispatcher calls once the rows have reached their rank."""
        return run_experts(xs, slots, self.w13, self.w2)

    def forward(self, x):
        logits = F.linear(x.float(), self.gate.weight.float()) + self.study_router_bias
        weights, ids = route(logits, self.spec, getattr(self, "e_score_correction_bias", None))
        self.last_load = torch.bincount(ids.flatten(), minlength=self.spec.num_experts)
        if self.dispatch is not None:
            routed = self.dispatch(self, x, ids, weights)
        else:  # every expert is local
            token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(ids.shape[1])
            ys, self.last_slot_load = self.run_local(x[token_of], self.local_ids[ids.flatten()])
            routed = torch.zeros_like(x).index_add_(0, token_of, ys * weights.flatten()[:, None].to(ys.dtype))
        if self.spec.shared_intermediate_size:
            shared = self.comm.all_reduce(self.shared(x))
            if self.spec.shared_expert_gate:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            routed = routed + shared
        return routed
