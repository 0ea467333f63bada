"""What the cost model needs of a model and a topology: parameter counts per operation, KV bytes
per token, each rank's weight bytes. From a ModelSpec alone (a config.json is enough; no weights).

Counts are parameters (multiply-adds per token), not bytes; bytes = parameters x the weight dtype's
size, chosen by the simulation (the checkpoint's dtype, or fp8 for DeepSeek's deployment).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model.spec import ModelSpec


@dataclass(frozen=True)
class ModelShapes:
    hidden: int
    vocab: int
    num_layers: int
    num_moe_layers: int
    num_dense_layers: int
    attention: str  # gqa | mla
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    attn_params: int  # per layer: q/k/v (or MLA's q_a, q_b, kv_a, kv_b) and o projections
    mlp_params: int  # per dense layer: gate, up, down
    shared_params: int  # per MoE layer: the shared experts
    gate_params: int  # per MoE layer: the router (hidden x E)
    expert_params: int  # one routed expert: gate, up, down
    num_experts: int
    top_k: int
    lm_head_params: int
    embed_params: int
    qk_nope_head_dim: int = 0  # MLA: for prompt chunks, which run it unabsorbed
    v_head_dim: int = 0

    def prefill_pair_flops(self, tp: int) -> float:
        """FLOPs per pair for a prompt chunk: MLA unabsorbed (keys and values up-projected from the
        latent, `kv_up_params`, then attention over nope + rope and v), as prefill kernels run it; GQA
        as in decode."""
        if self.attention != "mla":
            return self.attn_pair_flops(tp)
        heads = self.num_heads / tp
        return 2 * heads * (self.qk_nope_head_dim + self.qk_rope_head_dim) + 2 * heads * self.v_head_dim

    @property
    def kv_up_params(self) -> int:
        """MLA: the latent's up-projection to keys and values (kv_b_proj), per layer; 0 for GQA."""
        if self.attention != "mla":
            return 0
        return self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)

    def attn_pair_flops(self, tp: int) -> float:
        """FLOPs per (query token, key token) pair per layer on one TP rank (its heads): GQA
        q.k and p.v over head_dim; MLA absorbed as decode kernels run it (FlashMLA): q.[c; k_rope]
        over kv_lora + rope, then p.c over kv_lora."""
        heads = self.num_heads / tp
        if self.attention == "mla":
            return 2 * heads * (self.kv_lora_rank + self.qk_rope_head_dim) + 2 * heads * self.kv_lora_rank
        return 4 * heads * self.head_dim

    def padded_pair_flops(self, tp: int) -> float:
        """FLOPs per (query, key) pair per layer on one TP rank in this engine's eager kernel
        (model/attention.py): MLA absorbed for every row, its values the keys themselves (SDPA needs equal
        widths): q.k and p.v over kv_lora + rope; GQA as attn_pair_flops."""
        if self.attention == "mla":
            return 4 * self.num_heads / tp * (self.kv_lora_rank + self.qk_rope_head_dim)
        return self.attn_pair_flops(tp)

    def kv_elems_per_token_layer(self, tp: int) -> int:
        """KV elements one token holds per layer on one TP rank (kv_plan's arithmetic): MLA's latent
        and rope key, replicated on every rank; GQA's K and V of this rank's KV heads."""
        if self.attention == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        heads = self.num_kv_heads // tp if self.num_kv_heads >= tp else 1
        return 2 * heads * self.head_dim

    def rank_weight_params(self, tp: int, world: int, num_slots: int) -> dict:
        """Parameters one rank holds, by kind: dense parts split over the TP group, experts spread
        over the whole world (num_slots / world slots a rank, every MoE layer)."""
        dense = (self.num_layers * self.attn_params + self.num_dense_layers * self.mlp_params
                 + self.num_moe_layers * self.shared_params + self.lm_head_params + self.embed_params) / tp
        dense += self.num_moe_layers * self.gate_params
        slots = num_slots / world if world > 1 else self.num_experts
        experts = self.num_moe_layers * slots * self.expert_params
        return {"dense": dense, "experts": experts, "total": dense + experts}


def model_shapes(spec: ModelSpec) -> ModelShapes:
    h = spec.hidden_size
    if spec.attention == "mla":
        qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        if spec.q_lora_rank:
            q = h * spec.q_lora_rank + spec.q_lora_rank * spec.num_heads * qk
        else:
            q = h * spec.num_heads * qk
        kv = h * (spec.kv_lora_rank + spec.qk_rope_head_dim) + spec.kv_lora_rank * spec.num_heads * (
            spec.qk_nope_head_dim + spec.v_head_dim)
        attn = q + kv + spec.num_heads * spec.v_head_dim * h
    else:
        attn = h * (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim + spec.num_heads * spec.head_dim * h
    n_moe = sum(spec.moe_layers)
    return ModelShapes(
        hidden=h, vocab=spec.vocab_size, num_layers=spec.num_layers, num_moe_layers=n_moe,
        num_dense_layers=spec.num_layers - n_moe, attention=spec.attention, num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, kv_lora_rank=spec.kv_lora_rank,
        qk_rope_head_dim=spec.qk_rope_head_dim, attn_params=attn, mlp_params=3 * h * spec.intermediate_size,
        shared_params=3 * h * spec.shared_intermediate_size, gate_params=h * spec.num_experts if n_moe else 0,
        expert_params=3 * h * spec.moe_intermediate_size, num_experts=spec.num_experts, top_k=spec.top_k,
        lm_head_params=spec.vocab_size * h, embed_params=0 if spec.tie_word_embeddings else spec.vocab_size * h,
        qk_nope_head_dim=spec.qk_nope_head_dim, v_head_dim=spec.v_head_dim)


def dense_params(num_layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
                 vocab: int) -> int:
    """A dense decoder's parameters (a drafter's), for its forward's cost."""
    return num_layers * (hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
                         + 3 * hidden * intermediate) + vocab * hidden
