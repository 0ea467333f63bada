"""ModelSpec: one normalised description of every supported architecture, read from an HF config.

transformers parses config.json (aliases, rope parameters, defaults); this file only decides what
our decoder has to build: attention kind, which layers are MoE, the routing rule, shared experts.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from ..errors import CheckpointError

log = logging.getLogger(__name__)

# model_type -> family. Dense families exist for drafters.
SUPPORTED = {
    "deepseek_v3": "deepseek_v3",
    "qwen3_moe": "qwen3_moe",
    "qwen2_moe": "qwen2_moe",
    "mixtral": "mixtral",
    "llama": "llama",
    "qwen3": "qwen3",
    "qwen2": "qwen2",
}


@dataclass(frozen=True)
class ModelSpec:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str
    intermediate_size: int  # dense MLP layers
    # attention
    attention: str = "gqa"  # gqa | mla
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    # MLA (DeepSeek-V3)
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    softmax_scale: float = 1.0
    # MoE
    moe_layers: tuple = ()  # bool per layer
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    scoring: str = "softmax"  # softmax | sigmoid
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    expert_prefix: str = "mlp"  # HF module name holding gate/experts ("block_sparse_moe" for Mixtral)
    expert_names: tuple = ("gate_proj", "up_proj", "down_proj")
    shared_prefix: str = "shared_experts"
    dtype: torch.dtype = torch.float32
    eos_token_ids: tuple = ()
    # fp8 checkpoints: the (rows, cols) block of each `*.weight_scale_inv` entry; None = not quantized
    fp8_block: Optional[tuple] = None
    hf_config: object = field(default=None, repr=False, compare=False)

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def ignore_remote_code(path, filename: str) -> bool:
    """Whether `filename` maps classes to the checkpoint's own Python code (`auto_map`), which this
    package never runs (trust_remote_code=False): an architecture we implement is loaded with our
    code, and one log line says the checkpoint's own was ignored."""
    f = Path(path) / filename
    if not f.is_file():
        return False
    try:
        auto_map = json.loads(f.read_text()).get("auto_map")
    except (ValueError, AttributeError) as e:
        raise CheckpointError(f"{f}: not a JSON object ({e}); fix or remove the file") from None
    if auto_map:
        log.info("%s: 'auto_map' names the checkpoint's own code (%s); it is ignored, the built-in implementation "
                 "is used (remote code never runs)", f, ", ".join(sorted(auto_map)))
    return bool(auto_map)


# quant_method -> what we do with it; anything else is refused by name
QUANTIZATION = {"fp8": "e4m3 weights with block scales (weight_block_size), dequantized per shard at load"}


def checkpoint_quantization(path, raw: dict) -> Optional[tuple]:
    """config.json's `quantization_config` -> the fp8 weight block (rows, cols), or None for an
    unquantized checkpoint. Any other scheme is refused by name: a quantized tensor must never be
    copied into a parameter as if it were the weight."""
    q = raw.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    supported = "; ".join(f"{k}: {v}" for k, v in QUANTIZATION.items())
    if method not in QUANTIZATION:
        raise CheckpointError(f"{path}: quantization_config.quant_method {method!r} is not supported (supported: "
                              f"{supported}); use a bf16/fp16/fp32 checkpoint or a supported quantization")
    block = q.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"{path}: quantization_config.weight_block_size: got {block!r}; fp8 checkpoints are "
                              "supported with block scales, weight_block_size: [rows, cols] (DeepSeek-V3: [128, 128])")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"{path}: quantization_config.fmt: got {fmt!r}; only e4m3 fp8 weights are supported")
    return tuple(block)


def load_spec(path, dtype: str = "auto") -> ModelSpec:
    """Read config.json (through transformers) into a ModelSpec. Raises CheckpointError."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json; model.path must be a local HF checkpoint folder")
    raw = json.loads((path / "config.json").read_text())
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED:
        raise CheckpointError(
            f"{path}: architecture {model_type!r} ({raw.get('architectures')}) is not supported; "
            f"supported model_type values: {', '.join(SUPPORTED)}"
        )
    ignore_remote_code(path, "config.json")
    fp8_block = checkpoint_quantization(path, raw)
    hf = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    family = SUPPORTED[model_type]
    g = lambda name, default=None: getattr(hf, name, default)  # noqa: E731
    if g("use_sliding_window", False) or (family == "mixtral" and g("sliding_window")):
        raise CheckpointError(f"{path}: sliding-window attention is not supported (sliding_window={g('sliding_window')})")

    num_heads = hf.num_attention_heads
    common = dict(
        family=family,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=g("num_key_value_heads") or num_heads,
        head_dim=g("head_dim") or hf.hidden_size // num_heads,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=g("max_position_embeddings", 4096),
        tie_word_embeddings=bool(g("tie_word_embeddings", False)),
        hidden_act=g("hidden_act", "silu"),
        intermediate_size=g("intermediate_size", 0),
        hf_config=hf,
        fp8_block=fp8_block,
    )
    if common["hidden_act"] != "silu":
        raise CheckpointError(f"{path}: hidden_act {common['hidden_act']!r} is not supported (only silu)")

    ckpt_dtype = raw.get("dtype") or raw.get("torch_dtype") or torch.float32  # raw: transformers warns on torch_dtype
    if isinstance(ckpt_dtype, str):
        ckpt_dtype = _DTYPES.get(ckpt_dtype, torch.float32)
    common["dtype"] = ckpt_dtype if dtype == "auto" else _DTYPES[dtype]

    eos = g("eos_token_id")
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id", eos)
    common["eos_token_ids"] = tuple(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))

    L = common["num_layers"]
    if family == "deepseek_v3":
        qk_head_dim = hf.qk_nope_head_dim + hf.qk_rope_head_dim
        scale = qk_head_dim**-0.5
        rope = g("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
            import math

            factor = rope["factor"]
            mscale = 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
            scale = scale * mscale * mscale
        n_experts = hf.n_routed_experts
        return ModelSpec(
            **common,
            attention="mla",
            o_bias=bool(g("attention_bias", False)),
            q_lora_rank=g("q_lora_rank"),
            kv_lora_rank=hf.kv_lora_rank,
            qk_nope_head_dim=hf.qk_nope_head_dim,
            qk_rope_head_dim=hf.qk_rope_head_dim,
            v_head_dim=hf.v_head_dim,
            rope_interleave=bool(g("rope_interleave", True)),
            softmax_scale=scale,
            moe_layers=tuple(bool(n_experts) and i >= hf.first_k_dense_replace for i in range(L)),
            num_experts=n_experts,
            top_k=hf.num_experts_per_tok,
            moe_intermediate_size=hf.moe_intermediate_size,
            scoring="sigmoid",
            norm_topk_prob=bool(g("norm_topk_prob", True)),
            n_group=g("n_group") or 1,
            topk_group=g("topk_group") or 1,
            routed_scaling_factor=float(g("routed_scaling_factor", 1.0)),
            correction_bias=True,
            shared_intermediate_size=hf.moe_intermediate_size * (g("n_shared_experts") or 0),
            shared_prefix="shared_experts",
        )
    common["softmax_scale"] = common["head_dim"] ** -0.5
    if family in ("qwen3_moe", "qwen2_moe"):
        n_experts = g("num_experts") or g("num_local_experts")
        mlp_only = set(g("mlp_only_layers") or [])
        step = g("decoder_sparse_step", 1) or 1
        moe_layers = tuple(i not in mlp_only and n_experts > 0 and (i + 1) % step == 0 for i in range(L))
        extra = dict(qk_norm=True) if family == "qwen3_moe" else dict(qkv_bias=bool(g("qkv_bias", True)))
        if family == "qwen3_moe" and g("attention_bias", False):
            extra.update(qkv_bias=True, o_bias=True)
        shared = g("shared_expert_intermediate_size", 0) if family == "qwen2_moe" else 0
        return ModelSpec(
            **common,
            **extra,
            moe_layers=moe_layers,
            num_experts=n_experts,
            top_k=hf.num_experts_per_tok,
            moe_intermediate_size=hf.moe_intermediate_size,
            norm_topk_prob=bool(g("norm_topk_prob", False)),
            shared_intermediate_size=shared,
            shared_expert_gate=bool(shared),
            shared_prefix="shared_expert",
        )
    if family == "mixtral":
        return ModelSpec(
            **common,
            moe_layers=(True,) * L,
            num_experts=hf.num_local_experts,
            top_k=hf.num_experts_per_tok,
            moe_intermediate_size=hf.intermediate_size,
            norm_topk_prob=True,
            expert_prefix="block_sparse_moe",
            expert_names=("w1", "w3", "w2"),
        )
    # dense drafters
    extra = {}
    if family == "qwen3":
        extra = dict(qk_norm=True, qkv_bias=bool(g("attention_bias", False)), o_bias=bool(g("attention_bias", False)))
    elif family == "qwen2":
        extra = dict(qkv_bias=True)
    else:  # llama
        extra = dict(qkv_bias=bool(g("attention_bias", False)), o_bias=bool(g("attention_bias", False)))
        if g("mlp_bias", False):
            raise CheckpointError(f"{path}: llama mlp_bias=True is not supported")
    return ModelSpec(**common, **extra, moe_layers=(False,) * L)


def rope_frequencies(dim: int, theta: float, device=None) -> torch.Tensor:
    """The default rope's inverse frequencies [dim / 2], fp32 (the target's and the DSpark drafter's)."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)


def rope_inv_freq(spec: ModelSpec) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, computed by transformers for any rope type."""
    hf = spec.hf_config
    params = getattr(hf, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(hf, "rope_theta", 10000.0)}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return rope_frequencies(spec.rope_dim, params["rope_theta"]), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise CheckpointError(f"rope_type {rope_type!r} is not supported")
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf)
    return inv.float(), float(scaling)
