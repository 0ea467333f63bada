"""The decoder: embeddings, layers (attention + dense MLP or MoE), final norm, LM head.

One class covers every supported family; `ModelSpec` says which attention and MLP each layer has.
`forward` takes a flat batch of new tokens (prefill chunks and decodes mixed) and returns hidden
states; `compute_logits` is applied only to the rows that are sampled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata
from .layers import MLP, ColumnParallelLinear, GQAAttention, LocalComm, MLAttention, MoE, RMSNorm, rope_cos_sin
from .spec import ModelSpec, rope_inv_freq


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, comm, expert_ids=None):
        super().__init__()
        self.comm = comm
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = (MLAttention if spec.attention == "mla" else GQAAttention)(spec, comm)
        self.is_moe = spec.moe_layers[layer_idx]
        if self.is_moe:
            self.mlp = MoE(spec, comm, expert_ids)
        else:
            self.mlp = MLP(spec.hidden_size, spec.intermediate_size, comm)

    def forward(self, x, residual, cos, sin, meta: AttentionMetadata, real=None):
        """x: the previous layer's output before its residual add (the embeddings for layer 0,
        residual None); returns (this layer's output, the residual stream), the add fused into the
        next norm as in vLLM: the residual stream after this layer is their sum."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        out = self.mlp(h, real) if self.is_moe else self.mlp(h)
        return (out if self.is_moe else self.comm.all_reduce(out)), residual


class VocabEmbedding(nn.Module):
    """Embedding table split along the vocabulary; out-of-shard ids contribute zeros, summed over TP."""

    shard_dim, share = 0, 1

    def __init__(self, vocab_size, hidden, comm):
        super().__init__()
        self.comm = comm
        self.shard = -(-vocab_size // comm.tp_size)
        self.start = comm.tp_rank * self.shard
        self.weight = nn.Parameter(torch.empty(min(self.shard, vocab_size - self.start), hidden))

    def forward(self, ids):
        if self.comm.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * inside[:, None]
        return self.comm.all_reduce(out)


class DecoderModel(nn.Module):
    """HF-compatible causal LM for one shard: parameter names match the checkpoint's."""

    def __init__(self, spec: ModelSpec, comm=None, expert_ids=None):
        super().__init__()
        self.spec = spec
        self.comm = comm or LocalComm()
        self.model = nn.Module()
        self.model.embed_tokens = VocabEmbedding(spec.vocab_size, spec.hidden_size, self.comm)
        # expert_ids: per MoE layer (in order), the logical experts this shard's slots hold
        moe_index = [sum(spec.moe_layers[:i]) for i in range(spec.num_layers)]
        self.model.layers = nn.ModuleList(
            DecoderLayer(spec, i, self.comm, expert_ids[moe_index[i]] if expert_ids is not None else None)
            for i in range(spec.num_layers)
        )
        self.model.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        # vocab-parallel LM head: each rank scores its slice of the vocabulary
        self.lm_head = ColumnParallelLinear(spec.hidden_size, self.model.embed_tokens.weight.shape[0])
        inv_freq, self.rope_scaling = rope_inv_freq(spec)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("rope_table", self._rope_table(inv_freq), persistent=False)

    def _rope_table(self, inv_freq):
        """cos and sin of every position the model takes ([2, max_position_embeddings, 1, D]), as
        `rope_cos_sin` computes them (elementwise, so row p is what it gives for position p): a step
        looks its positions up (one index_select) instead of computing them (~14 ops)."""
        positions = torch.arange(self.spec.max_position_embeddings, device=inv_freq.device)
        return torch.stack(rope_cos_sin(positions, inv_freq, self.rope_scaling))

    def reset_buffers(self):
        """Recompute derived (non-checkpoint) buffers after materialising from the meta device."""
        device = self.lm_head.weight.device
        self.inv_freq = rope_inv_freq(self.spec)[0].to(device)
        self.rope_table = self._rope_table(self.inv_freq)
        for moe in self.moe_layers:
            moe.set_expert_ids(moe.expert_ids)
            moe.study_router_bias = torch.zeros(self.spec.num_experts, device=device)

    def set_study_router_bias(self, experts, bias: float) -> None:
        """Hot-spot studies only: add `bias` to the gate logits of `experts` in every MoE layer.
        This changes the model's outputs; it exists to make chosen experts hot on purpose."""
        for moe in self.moe_layers:
            moe.study_router_bias.zero_()
            moe.study_router_bias[list(experts)] = float(bias)
            moe.study = bool(bias) and bool(list(experts))

    @property
    def attention_layers(self):
        return [layer.self_attn for layer in self.model.layers]

    @property
    def moe_layers(self):
        return [layer.mlp for layer in self.model.layers if layer.is_moe]

    def rope(self, positions, dtype):
        """cos, sin [T, 1, D] of positions [T] in `dtype`, from the table (positions must be below
        max_position_embeddings, which the config check holds max_model_len to)."""
        table = self.rope_table
        if table.dtype != dtype:  # the table is fp32 (as rope_cos_sin computes): cast after the lookup
            return tuple(t.to(dtype) for t in table.index_select(1, positions).unbind(0))
        return table.index_select(1, positions).unbind(0)

    def forward(self, input_ids, positions, meta: AttentionMetadata, capture: tuple = (), real=None):
        """input_ids, positions [T] -> hidden states [T, hidden] after the final norm. capture: decoder
        layers whose raw outputs (the residual stream) are kept in `self.captured` [T, len * hidden],
        concatenated in order (a DSpark drafter's context). real: [T] bool, the rows that are real
        tokens when a compiled step padded its batch (None: all)."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        kept, residual = [], None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, cos, sin, meta, real)
            if i in capture:
                kept.append(x + residual)
        self.captured = torch.cat(kept, dim=-1) if kept else None
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden):
        """hidden [N, hidden] -> fp32 logits [N, vocab] (gathered over the vocab shards)."""
        logits = self.lm_head(hidden)
        logits = logits if logits.dtype == torch.float32 else logits.float()
        if self.comm.tp_size > 1:
            logits = self.comm.all_gather(logits, dim=-1)[:, : self.spec.vocab_size]
        return logits

    def expert_load(self) -> torch.Tensor:
        """[num_moe_layers, num_experts] tokens routed per logical expert in the last forward."""
        loads = [m.last_load for m in self.moe_layers if m.last_load is not None]
        return torch.stack(loads) if loads else torch.zeros(0, self.spec.num_experts, dtype=torch.long)
