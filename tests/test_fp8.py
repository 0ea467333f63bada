"""FP8 block-quantized checkpoints (DeepSeek-V3's format) load as the function they encode.

A tiny DeepSeek-V3 checkpoint is written with e4m3 projections and 16 x 16 block scales; its dims
leave partial edge blocks, and tensor-parallel slices that start inside a block. The reference is
transformers on the dequantized weights (computed here independently of the loader).
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_cluster import CheckpointError, LLM, SamplingParams
from dspark_cluster.model.fp8 import quantize_fp8, write_fp8_checkpoint
from dspark_cluster.model.loader import load_model
from dspark_cluster.model.spec import load_spec

from conftest import VOCAB, hf_model, random_prompts

BLOCK = (16, 16)


def tiny_v3_config():
    from transformers import DeepseekV3Config

    # intermediate 72 (TP 2: 36 rows a rank, the second starts inside a block), moe_intermediate 24,
    # kv_a_proj 16 + 8 = 24 rows, kv_b 4 x 28 = 112 rows (TP 2: 56, inside a block), o_proj 48 columns
    return DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=72, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_group=4,
        topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, initializer_range=0.1,
        max_position_embeddings=512, eos_token_id=1, bos_token_id=0,
    )


def reference_dequantize(q, scale):
    """Independent of the loader: each block's scale spread with a Kronecker product, then cropped."""
    R, C = q.shape
    full = torch.kron(scale.float(), torch.ones(BLOCK))
    return q.float() * full[:R, :C]


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory):
    """(fp8 checkpoint, its dequantized fp32 twin, the original fp32 checkpoint)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("fp8")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_v3_config(), dtype=torch.float32)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.3)
    model.save_pretrained(str(root / "orig"))
    write_fp8_checkpoint(root / "orig", root / "fp8", BLOCK)
    # the twin, dequantized here by the reference formula
    twin = root / "twin"
    shutil.copytree(root / "orig", twin)
    stored = load_file(str(root / "fp8" / "model.safetensors"))
    plain = {k: (reference_dequantize(v, stored[k + "_scale_inv"]) if v.dtype == torch.float8_e4m3fn else v)
             for k, v in stored.items() if not k.endswith("_scale_inv")}
    save_file(plain, str(twin / "model.safetensors"), metadata={"format": "pt"})
    return root / "fp8", twin, root / "orig"


def test_fp8_checkpoint_is_really_fp8_with_partial_blocks(fp8_pair):
    fp8, _, _ = fp8_pair
    stored = load_file(str(fp8 / "model.safetensors"))
    kv_a = stored["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert kv_a.dtype == torch.float8_e4m3fn and kv_a.shape == (24, 64)
    assert stored["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (2, 4)  # 24 rows: 1.5 blocks
    assert stored["model.embed_tokens.weight"].dtype == torch.float32  # tables and norms stay unquantized
    assert json.loads((fp8 / "config.json").read_text())["quantization_config"]["weight_block_size"] == list(BLOCK)


def test_the_loaded_weights_are_the_dequantized_ones(fp8_pair):
    """Every parameter, whole and in each TP-2 shard (slices that start inside a block), equals the
    dequantized twin's, bit for bit; experts too."""
    fp8, twin, _ = fp8_pair
    spec = load_spec(fp8, "float32")
    assert spec.fp8_block == BLOCK

    class Shard:
        def __init__(self, rank, size):
            self.tp_rank, self.tp_size = rank, size

    for comm, experts in ((None, None), (Shard(0, 2), [0, 5]), (Shard(1, 2), [3, 7])):
        ids = None if experts is None else [experts] * sum(spec.moe_layers)
        ours = load_model(fp8, spec, comm, ids)
        ref = load_model(twin, load_spec(twin, "float32"), comm, ids)
        ref_params = dict(ref.named_parameters())
        for name, p in ours.named_parameters():
            assert torch.equal(p, ref_params[name]), name
        # fp8 bytes (1 per value) + scales, not 4 per value
        assert ours.bytes_read < 0.5 * ref.bytes_read


def test_fp8_logits_and_greedy_match_transformers_on_the_dequantized_weights(fp8_pair):
    fp8, twin, orig = fp8_pair
    prompts = random_prompts([5, 17, 9], seed=7)
    hf = hf_model(twin)
    llm = LLM(fp8, config={"model": {"dtype": "float32"}, "scheduler": {"block_size": 4, "num_kv_blocks": 64}})
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=1))
    errs = []
    with torch.no_grad():
        for p, out in zip(prompts, outs):
            ref = hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            assert out.token_ids == ref
            # prompt log-probabilities: the target's law at every prompt position, against transformers'
            ref_lp = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)
            for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
                errs.append(abs(entry.logprob - float(ref_lp[i - 1, p[i]])))
    assert max(errs) <= 1e-4
    # and the fp8 model is close to the unquantized one it came from (quantisation error, not a bug):
    # the same prompt's next-token law, compared in total variation
    with torch.no_grad():
        a = torch.softmax(hf(torch.tensor([prompts[1]])).logits[0, -1], -1)
        b = torch.softmax(hf_model(orig)(torch.tensor([prompts[1]])).logits[0, -1], -1)
    assert 0 < 0.5 * float((a - b).abs().sum()) < 0.1


def test_fp8_through_ray_at_tensor_2_matches_transformers(fp8_pair, ray_cluster):
    fp8, twin, _ = fp8_pair
    prompts = random_prompts([6, 13], seed=8)
    hf = hf_model(twin)
    llm = LLM(fp8, config={"model": {"dtype": "float32"}, "parallel": {"executor": "ray", "tensor": 2},
                           "scheduler": {"block_size": 4, "num_kv_blocks": 64}})
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    finally:
        llm.shutdown()
    for p, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert out.token_ids == ref


def test_quantizer_round_trip_and_edge_blocks():
    w = torch.randn(37, 21) * torch.logspace(-3, 1, 21)  # columns of very different magnitude
    q, s = quantize_fp8(w, (16, 8))
    assert q.shape == (37, 21) and s.shape == (3, 3)
    back = q.float() * torch.kron(s, torch.ones(16, 8))[:37, :21]
    assert float(((back - w).abs() / w.abs().clamp(min=1e-6)).median()) < 0.07  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("quant, message", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported.*fp8"),
    ({"quant_method": "awq"}, "'awq' is not supported"),
    ({"quant_method": "mxfp4"}, "'mxfp4' is not supported"),
    ({"quant_method": "fp8"}, "weight_block_size: got None"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "fmt: got 'e5m2'"),
])
def test_other_quantizations_are_refused_by_name(fp8_pair, tmp_path, quant, message):
    fp8, _, _ = fp8_pair
    dst = shutil.copytree(fp8, tmp_path / "q")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=message):
        load_spec(dst)


def test_fp8_weights_without_scales_or_config_are_refused(fp8_pair, tmp_path):
    fp8, _, _ = fp8_pair
    no_cfg = shutil.copytree(fp8, tmp_path / "no_cfg")
    cfg = json.loads((no_cfg / "config.json").read_text())
    del cfg["quantization_config"]
    (no_cfg / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="is fp8.*no quantization_config"):
        LLM(no_cfg)
    no_scale = shutil.copytree(fp8, tmp_path / "no_scale")
    tensors = load_file(str(no_scale / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.3.down_proj.weight_scale_inv"]
    save_file(tensors, str(no_scale / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts\.3\.down_proj\.weight.*no block scales"):
        LLM(no_scale)
