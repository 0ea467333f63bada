"""Decoder building blocks, sized for one tensor-parallel shard.

Every layer is built for `(tp_rank, tp_size)`: column-split projections hold 1/tp of the heads or
intermediate channels, row-split ones reduce through `comm.all_reduce`. With `LocalComm` (one
process) the reductions are no-ops; `parallel/` supplies the torch.distributed version.
Parameter names follow the HF checkpoints so the loader maps names one to one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, paged_attention
from .gemm import Linear, linear, plain_linear, use_onednn_experts
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
    """RMS norm as transformers computes it: normalised in fp32, cast back, then scaled. A float32
    input takes one fused op (`F.rms_norm`); `forward(x, residual)` adds the residual first and
    returns (normed, x + residual), the pre-norm layer's two ops in one call."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        else:
            out = self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)
        return out if residual is None else (out, x)


def rope_cos_sin(positions, inv_freq, scaling: float = 1.0, dtype=None):
    """positions [..., T] -> cos, sin [..., T, 1, D] (a head axis to broadcast over), times the
    attention scaling, in `dtype` (None: fp32). `sin` carries rotate_half's sign (its first half
    negated), so that `apply_rope` is x * cos + roll(x, D/2) * sin: three ops and a roll."""
    freqs = positions[..., None].float() * inv_freq
    cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
    cos, sin = torch.cat([cos, cos], dim=-1)[..., None, :], torch.cat([-sin, sin], dim=-1)[..., None, :]
    return (cos, sin) if dtype is None else (cos.to(dtype), sin.to(dtype))


def apply_rope(x, cos, sin):
    """x [..., T, H, D]; cos/sin [..., T, 1, D] from `rope_cos_sin`, rotating channel pairs
    (i, i + D/2) (rotate_half; interleaved checkpoints have their rows reordered at load, see
    `deinterleave_rows`). Computed in cos's dtype where it is wider than x's, returned in x's."""
    out = x * cos + x.roll(x.shape[-1] // 2, -1) * sin  # (addcmul would save an op, but rounds differently)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def deinterleave_rows(rope_dim: int) -> torch.Tensor:
    """Row order that turns an interleaved rope projection (DeepSeek: channel pairs (0,1),(2,3)...)
    into rotate_half's layout (pairs (i, i + D/2)): what transformers does to q and k at every step,
    done once to the weights. Applied to q's and k's rope rows alike, it leaves q.k unchanged."""
    return torch.cat([torch.arange(0, rope_dim, 2, device="cpu"), torch.arange(1, rope_dim, 2, device="cpu")])


@dataclass(frozen=True)
class Part:
    """One checkpoint projection packed into a `PackedLinear`: its module name in the checkpoint,
    the rows this rank holds, how many ranks hold the same rows (KV heads fewer than ranks), whether
    it is split over the TP ranks at all, and an optional reordering of the rows read."""

    name: str
    size: int
    share: int = 1
    split: bool = True
    row_order: Optional[torch.Tensor] = None


class ColumnParallelLinear(Linear):
    """Holds this rank's slice of the output features (and bias). `share` ranks hold the same
    slice, for KV heads that are fewer than the ranks. The loader reads rows
    [(tp_rank // share) * out, +out) of the checkpoint tensor."""

    shard_dim = 0

    def __init__(self, in_features, out_features, bias=False, share=1):
        super().__init__(in_features, out_features, bias=bias)
        self.share = share


class PackedLinear(Linear):
    """Several checkpoint projections of the same input as one matmul (q/k/v, gate/up, DeepSeek's
    q_a and kv_a): the rows of each `Part`, this rank's slice of each when it is split, one after
    another. The loader fills each part from its own checkpoint tensor (nano-vllm's packed modules)."""

    shard_dim = 0
    share = 1

    def __init__(self, in_features, parts, bias=False):
        super().__init__(in_features, sum(p.size for p in parts), bias=bias)
        self.parts = tuple(parts)
        self.sizes = [p.size for p in parts]


class RowParallelLinear(Linear):
    """Holds this rank's slice of the input features; the caller all-reduces the partial sums.
    The bias is whole and added on rank 0 only."""

    shard_dim = 1
    share = 1


# The module values a compiled step's graphs read that may change while a runner serves (compiled.TRACED_VALUES: the
# study flag, the slot map, the dispatcher, the expert ids, the KV cache) are `Traced` attributes: every assignment
# of one sets a process-wide mark to a value never used before, which a runner's direct call compares before each step
# (one read, where comparing the values themselves was ~5 reads a layer: 121 us a step at DeepSeek-V3's 61 layers on
# a CPU host). The values are replaced, never changed in place (the expert ids a new list each time, the caches a new
# tuple of tensors).
_marks = itertools.count(1)  # (next() is one C call: two threads never take the same mark)
_traced_writes = [0]


def traced_writes() -> int:
    """The mark of the latest assignment of a `Traced` attribute in this process: it differs from every mark read
    before that assignment."""
    return _traced_writes[0]


def _mark() -> None:
    """After a traced value is stored (marked first, a step between could find its graphs again under the new mark
    with the old value, and keep them)."""
    _traced_writes[0] = next(_marks)


class Traced:
    """A module attribute whose assignments are marked (`traced_writes`): a data descriptor without a getter, so a
    read is the instance's own value (a dict lookup, as dynamo's guards read it) and only a store runs Python. For
    plain values only (a module assigned to one would go to `_modules`, unmarked, and reads would return this
    descriptor; a parameter or buffer of its name is refused)."""

    def __set_name__(self, owner, name):
        self.name = name

    def __set__(self, obj, value):
        obj.__dict__[self.name] = value
        _mark()


class _PagedCache:
    """`kv_cache` as the engine sets it, plus the flat per-slot views every step writes through,
    made once when it is set (a view per layer per step is an op each). Its assignments are marked (`Traced`)."""

    @property
    def kv_cache(self):
        return self.__dict__.get("_kv_cache")

    @kv_cache.setter
    def kv_cache(self, value):
        self.__dict__["_kv_cache"] = value
        self.__dict__["kv_flat"] = None if value is None else tuple(
            None if c is None else self.flat_view(c) for c in value)
        _mark()

    def flat_view(self, cache):  # [num_blocks, block_size, Hkv, D] -> [slots, Hkv, D]
        return cache.view(-1, *cache.shape[2:])


def _split(n, comm, what):
    if n % comm.tp_size:
        raise ValueError(f"{what}={n} is not divisible by tensor parallel size {comm.tp_size}")
    return n // comm.tp_size


class MLP(nn.Module):
    """SwiGLU MLP; gate and up packed into one column-split matmul, down row-split (reduced by the
    caller's comm)."""

    def __init__(self, hidden, intermediate, comm, names=("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        inter = _split(intermediate, comm, "intermediate_size")
        self.gate_up_proj = PackedLinear(hidden, [Part(names[0], inter), Part(names[1], inter)])
        setattr(self, names[2], RowParallelLinear(inter, hidden, bias=False))
        self.down_name = names[2]

    def forward(self, x):  # partial sum over TP ranks
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return getattr(self, self.down_name)(F.silu(gate) * up)


class GQAAttention(_PagedCache, nn.Module):
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
        self.qkv_proj = PackedLinear(H, [Part("q_proj", self.num_heads * D), Part("k_proj", self.num_kv_heads * D, share),
                                         Part("v_proj", self.num_kv_heads * D, share)], bias=spec.qkv_bias)
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
        Hq, Hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(T, Hq + 2 * Hkv, self.head_dim)
        q, k, v = qkv.split([Hq, Hkv, Hkv], dim=1)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
            qk = apply_rope(torch.cat([q, k], dim=1), cos, sin)
        else:  # q and k side by side in the packed output: one rotation for both
            qk = apply_rope(qkv[:, : Hq + Hkv], cos, sin)
        q, k = qk.split([Hq, Hkv], dim=1)
        out = paged_attention(q, k, v, self.kv_cache[0], self.kv_cache[1], meta, self.scale, flat=self.kv_flat)
        out = linear(out.reshape(T, -1), self.o_proj.weight, self.o_proj.bias if self.comm.tp_rank == 0 else None)
        return self.comm.all_reduce(out)


class MLAttention(_PagedCache, nn.Module):
    """DeepSeek multi-head latent attention. The cache holds the compressed latent and the shared
    rope key per token ([kv_lora_rank + rope_dim]); the up-projection kv_b_proj is absorbed into
    the query and the output, so attention runs as one-head MQA over the latent. The projections
    of x (q_a and kv_a) are one packed matmul; interleaved rope rows are reordered at load."""

    def __init__(self, spec: ModelSpec, comm):
        super().__init__()
        self.comm = comm
        self.num_heads = _split(spec.num_heads, comm, "num_attention_heads")
        self.nope, self.rope, self.vdim = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        self.rank = spec.kv_lora_rank
        self.scale = spec.softmax_scale
        H, qk = spec.hidden_size, spec.qk_nope_head_dim + spec.qk_rope_head_dim
        # rows of one head (q) / of the latent + rope key (kv_a) in rotate_half's rope layout
        q_rows = kv_rows = None
        if spec.rope_interleave:
            # on the CPU even while the model is built on the meta device: the loader reads them
            head = torch.cat([torch.arange(self.nope, device="cpu"), self.nope + deinterleave_rows(self.rope)])
            q_rows = (torch.arange(self.num_heads, device="cpu")[:, None] * qk + head).flatten()
            kv_rows = torch.cat([torch.arange(self.rank, device="cpu"), self.rank + deinterleave_rows(self.rope)])
        kv_a = Part("kv_a_proj_with_mqa", self.rank + self.rope, split=False, row_order=kv_rows)
        self.q_lora = bool(spec.q_lora_rank)
        if self.q_lora:
            self.qkv_a_proj = PackedLinear(H, [Part("q_a_proj", spec.q_lora_rank, split=False), kv_a], bias=spec.o_bias)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, spec.rms_norm_eps)
            self.q_b_proj = PackedLinear(spec.q_lora_rank, [Part("q_b_proj", self.num_heads * qk, row_order=q_rows)])
        else:
            self.q_proj = PackedLinear(H, [Part("q_proj", self.num_heads * qk, row_order=q_rows)])
            self.qkv_a_proj = PackedLinear(H, [kv_a], bias=spec.o_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, spec.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(self.rank, self.num_heads * (self.nope + self.vdim))
        self.kv_b_proj.onednn = False  # never called: read as the absorbed views (no reordered copy, gemm.py)
        self.o_proj = RowParallelLinear(self.num_heads * self.vdim, H, bias=spec.o_bias)
        self.kv_cache = None  # (latent_cache, None)

    def cache_shape(self, num_blocks, block_size):
        return [(num_blocks, block_size, 1, self.rank + self.rope)]

    def flat_view(self, cache):  # [slots, 1, rank + rope], what k_new is
        return cache.view(-1, 1, cache.shape[-1])

    def absorbed(self):
        """kv_b_proj as the two absorbed matrices, views of its weight made once (their storage is
        the parameter's, so an in-place reload shows through): w_uk [H, nope, rank], w_uv^T [H, rank, v]."""
        w = self.kv_b_proj.weight
        if torch.compiler.is_compiling():  # views in the graph (no cache check: data_ptr breaks the graph)
            v = w.view(self.num_heads, self.nope + self.vdim, self.rank)
            return v[:, : self.nope], v[:, self.nope :].transpose(1, 2)
        cached = self.__dict__.get("_absorbed")  # in __dict__: not a registered parameter or buffer
        if cached is None or cached[0] is not w or cached[1].data_ptr() != w.data_ptr():
            v = w.view(self.num_heads, self.nope + self.vdim, self.rank)
            cached = self.__dict__["_absorbed"] = (w, v[:, : self.nope], v[:, self.nope :].transpose(1, 2))
        return cached[1:]

    def forward(self, x, cos, sin, meta: AttentionMetadata):
        T, Hh = x.shape[0], self.num_heads
        # the packed projection viewed [T, 1, ...]: the latent and the rope key come with their head axis
        if self.q_lora:
            q_a, latent, k_pe = self.qkv_a_proj(x).view(T, 1, -1).split(
                [self.qkv_a_proj.sizes[0], self.rank, self.rope], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        else:
            latent, k_pe = self.qkv_a_proj(x).view(T, 1, -1).split([self.rank, self.rope], dim=-1)
            q = self.q_proj(x)
        q_nope, q_pe = q.view(T, Hh, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [T, 1, rank]
        pe = apply_rope(torch.cat([q_pe, k_pe], dim=1), cos, sin)  # q's heads and the shared key
        w_uk, w_uv_t = self.absorbed()
        # bmm over the heads (transposes are views; einsum would be one op where these are three,
        # but it costs 2-3x the time of the three on the CPU at these sizes)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, rank]
        k_new = torch.cat([latent, pe[:, Hh:]], dim=-1)  # [T, 1, rank + rope]: the flat cache's row
        out = paged_attention(torch.cat([q_latent, pe[:, :Hh]], dim=-1), k_new, latent,
                              self.kv_cache[0], None, meta, self.scale, flat=self.kv_flat)  # [T, H, rank]
        out = torch.bmm(out.transpose(0, 1), w_uv_t).transpose(0, 1).reshape(T, -1)
        out = linear(out, self.o_proj.weight, self.o_proj.bias if self.comm.tp_rank == 0 else None)
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
    if correction_bias is not None:
        choice = scores + (correction_bias if correction_bias.dtype == torch.float32 else correction_bias.float())
    else:
        choice = scores
    T, E = choice.shape
    if 1 < spec.n_group and spec.topk_group < spec.n_group:  # else every group is kept: no mask at all
        grouped = choice.view(T, spec.n_group, E // spec.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1, keepdim=True)  # [T, n_group, 1]
        # the groups outside the best topk_group (below the topk_group-th best group score): -inf for
        # every expert in them. One threshold compare in place of topk + scatter of the group ids:
        # the same groups unless two groups' scores tie exactly at the threshold (then both stay)
        kth = group_scores.kthvalue(spec.n_group - spec.topk_group + 1, dim=1, keepdim=True).values
        choice = grouped.masked_fill(group_scores < kth, float("-inf")).view(T, E)
    ids = choice.topk(spec.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * spec.routed_scaling_factor, ids


def count_ids(ids: torch.Tensor, n: int, weights=None) -> torch.Tensor:
    """[n] occurrences of each id in [0, n) (weighted: summed weights). bincount eager; a scatter-add
    when compiled (bincount's output length depends on the values, which a graph cannot have)."""
    if weights is None and not torch.compiler.is_compiling():
        return torch.bincount(ids, minlength=n)
    w = torch.ones_like(ids) if weights is None else weights.to(torch.long)
    return torch.zeros(n, dtype=torch.long, device=ids.device).scatter_add_(0, ids, w)


def run_experts(xs, slots, w13, w2, w13t=None, w2t=None, padding: bool = True):
    """Run each row through the expert in its local slot, grouped per slot.

    xs [N, H]; slots [N] long in [0, n_slots], n_slots meaning a padding row (its output is left
    unspecified); w13 [n_slots, 2I, H]; w2 [n_slots, H, I].
    Returns (ys [N, H] unweighted expert outputs, counts [n_slots] rows per slot).

    Rows are sorted by slot and each projection is one grouped matmul (slot e multiplies rows
    offs[e-1]:offs[e]) whose offsets stay on the device: nothing here waits for the host, whatever
    the routing. Where torch has no grouped matmul for the device/dtype/layout, a loop of two
    matmuls per slot (which reads the counts on the host) is the fallback. w13t / w2t: the weights'
    [n_slots, H, 2I] / [n_slots, I, H] transposed views, made once by the caller (None: here).
    padding False: no row is a padding row (every slot < n_slots), which saves cutting the count off.
    """
    n_slots = w13.shape[0]
    order = torch.argsort(slots, stable=True)
    # slot n_slots marks padding (expert parallelism's fixed-size buffers): sorted last, never computed
    counts = count_ids(slots, n_slots + 1)[:n_slots] if padding else count_ids(slots, n_slots)
    xs_sorted = xs.index_select(0, order)
    if torch.compiler.is_compiling():  # an opaque op to the compiler (its grouped matmul has no fp32 trace)
        ys_sorted = torch.ops.dspark.grouped_experts(xs_sorted, counts, w13, w2)
    else:  # eager: the function itself (an op's dispatch costs ~10 us a call)
        ys_sorted = grouped_experts(xs_sorted, counts, w13, w2, w13t, w2t)
    # back in the rows' order: out-of-place index_copy (row order[i] := sorted row i; order is a
    # permutation, so every row is written), one op where empty + index_copy_ are two
    if torch.compiler.is_compiling():  # the compiler may write the copy in place over its source
        return torch.empty_like(ys_sorted).index_copy_(0, order, ys_sorted), counts
    return torch.index_copy(ys_sorted, 0, order, ys_sorted), counts


def grouped_experts(xs_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    w13t: Optional[torch.Tensor] = None, w2t: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows sorted by slot, counts [n_slots] rows per slot -> each row through its slot's expert
    (rows past the last slot's are left unspecified): a grouped matmul a projection; on the CPU with many rows a
    slot, oneDNN's product slot by slot (`gemm.use_onednn_experts`: torch's CPU grouped matmul is a loop of slower
    products; the counts are read on the host, which on the CPU waits for nothing)."""
    if use_onednn_experts(xs_sorted, counts, w13):
        return experts_by_slot(xs_sorted, counts, w13, w2, plain_linear)
    ys_sorted = _grouped_mm_experts(xs_sorted, counts, w13, w2, w13t, w2t)
    if ys_sorted is None:  # no grouped matmul for this layout
        ys_sorted = experts_by_slot(xs_sorted, counts, w13, w2, F.linear)
    return ys_sorted


def experts_by_slot(xs_sorted, counts, w13, w2, product=F.linear) -> torch.Tensor:
    """`grouped_experts` as a loop over the slots, two `product(x, weight)` calls a slot with rows (the rows past
    the last slot's are zeros)."""
    ys_sorted = torch.empty_like(xs_sorted)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            gate, up = product(xs_sorted[start : start + n], w13[e]).chunk(2, dim=-1)
            ys_sorted[start : start + n] = product(F.silu(gate) * up, w2[e])
            start += n
    ys_sorted[start:].zero_()
    return ys_sorted


def _grouped_experts_op(xs_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return grouped_experts(xs_sorted, counts, w13, w2)


torch.library.custom_op("dspark::grouped_experts", _grouped_experts_op, mutates_args=()).register_fake(
    lambda xs_sorted, counts, w13, w2: torch.empty_like(xs_sorted))


_NO_GROUPED_MM: set = set()


def _grouped_mm_experts(xs_sorted, counts, w13, w2, w13t=None, w2t=None):
    """Both expert projections as grouped matmuls, or None where torch has no grouped matmul for
    this device, dtype and shape (its kernels want 16-byte aligned rows, some CUDA archs none at all)."""
    key = (xs_sorted.device.type, xs_sorted.dtype, w13.shape[1:], w2.shape[1:])
    if key in _NO_GROUPED_MM:
        return None
    try:
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        gate, up = torch._grouped_mm(xs_sorted, w13.transpose(1, 2) if w13t is None else w13t, offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2) if w2t is None else w2t, offs=offs)
    except (AttributeError, RuntimeError, NotImplementedError):
        _NO_GROUPED_MM.add(key)
        return None


def grouped_mm_available(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the experts of these stacked weights ([n, 2I, H], [n, H, I]) run as grouped matmuls on their device
    (else slot by slot, with the counts read on the host): tried once on two rows."""
    xs = torch.zeros(2, w13.shape[-1], dtype=w13.dtype, device=w13.device)
    counts = torch.zeros(w13.shape[0], dtype=torch.long, device=w13.device)
    counts[0] = 2
    return _grouped_mm_experts(xs, counts, w13, w2) is not None


class MoE(nn.Module):
    """Routed experts (+ optional shared experts). Gating runs on every rank; this module holds the
    experts listed in `expert_ids` as stacked tensors. `dispatch` moves tokens to the ranks holding
    their experts; the default runs everything locally."""

    # what the steps' compiled graphs read that may change while serving (compiled.TRACED_VALUES)
    study, identity_slots, dispatch, expert_ids = Traced(), Traced(), Traced(), Traced()

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
        self.study = False  # set with the bias: the add is skipped otherwise
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
        # a new list, replaced and never changed in place (`Traced`); a list, not a tuple: the graphs read its
        # length only (a tuple's values would be guarded: every migration would recompile)
        self.expert_ids = list(expert_ids)
        local = torch.full((self.spec.num_experts,), -1, dtype=torch.long)
        local[torch.tensor(self.expert_ids, dtype=torch.long)] = torch.arange(len(self.expert_ids))
        self.local_ids = local.to(self.local_ids.device)
        # one shard holding every expert in order: a logical id is its slot (no lookup, load = slot load)
        self.identity_slots = self.expert_ids == list(range(self.spec.num_experts))

    def transposed(self):
        """w13 and w2 as the grouped matmul takes them ([n, H, 2I], [n, I, H]), views made once (their
        storage is the parameters': in-place loads and expert migrations show through)."""
        w13, w2 = self.w13, self.w2
        c = self.__dict__.get("_transposed")  # in __dict__: not a registered parameter or buffer
        if c is None or c[0] is not w13 or c[1] is not w2 or c[2].data_ptr() != w13.data_ptr() \
                or c[3].data_ptr() != w2.data_ptr():
            c = self.__dict__["_transposed"] = (w13, w2, w13.transpose(1, 2), w2.transpose(1, 2))
        return c[2:]

    def run_local(self, xs, slots, padding: bool = True):
        """xs [N, H] rows for this shard's slots [N] -> (unweighted expert outputs [N, H], rows per
        slot); what an expert-parallel dispatcher calls once the rows have reached their rank.
        padding False: no row has the padding slot (n_slots)."""
        if torch.compiler.is_compiling():  # the grouped matmul is an opaque op there: no views needed
            return run_experts(xs, slots, self.w13, self.w2, padding=padding)
        return run_experts(xs, slots, self.w13, self.w2, *self.transposed(), padding=padding)

    def forward(self, x, real=None):
        """real: [T] bool, the rows that are real tokens (None: all; row 0 is real); a compiled step pads its
        batch to a bucket, and the padding rows stay out of the load statistics and reach no expert of their own."""
        xf = x if x.dtype == torch.float32 else x.float()
        gate_w = self.gate.weight if self.gate.weight.dtype == torch.float32 else self.gate.weight.float()
        logits = F.linear(xf, gate_w)  # (small, and for a 16-bit model gate_w is a new fp32 tensor a call)
        if self.study:
            logits = logits + self.study_router_bias
        weights, ids = route(logits, self.spec, getattr(self, "e_score_correction_bias", None))
        if real is not None:  # padding rows (their outputs dropped) take row 0's experts: no expert read for them alone
            ids = torch.where(real[:, None], ids, ids[:1])
        T, k = ids.shape
        flat = ids.flatten()
        real_rows = None if real is None else real.repeat_interleave(k)
        if self.dispatch is not None:
            self.last_load = count_ids(flat, self.spec.num_experts, real_rows)
            routed = self.dispatch(self, x, ids, weights, real)
        else:  # every expert is local: token t's k assignments are rows t*k .. t*k+k-1
            slots = flat if self.identity_slots else self.local_ids[flat]
            ys, self.last_slot_load = self.run_local(x.repeat_interleave(k, dim=0), slots, padding=False)
            if real_rows is not None:
                self.last_slot_load = count_ids(slots, len(self.expert_ids), real_rows)
            self.last_load = self.last_slot_load if self.identity_slots else count_ids(
                flat, self.spec.num_experts, real_rows)
            w = weights if weights.dtype == ys.dtype else weights.to(ys.dtype)
            routed = (ys.view(T, k, -1) * w[:, :, None]).sum(1)
        if self.spec.shared_intermediate_size:
            shared = self.comm.all_reduce(self.shared(x))
            if self.spec.shared_expert_gate:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            routed = routed + shared
        return routed
