"""The bundled tiny model family (dspark_cluster/assets): loads, tokenizes, fits.

Fast (no training): the checkpoints come from launch/train_tiny_models.py.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import pathlib

import pytest
import torch

ASSETS = pathlib.Path(__file__).resolve().parents[1] / "dspark_cluster" / "assets"
TARGET = ASSETS / "tiny-moe"
DRAFT = ASSETS / "tiny-draft"
DSPARK = ASSETS / "tiny-dspark"
PROMPTS = ASSETS / "prompts" / "heldout.jsonl"
MAX_BYTES = 25 * 1024 * 1024


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="module")
def models():
    from transformers import AutoModelForCausalLM

    return {
        "target": AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval(),
        "draft": AutoModelForCausalLM.from_pretrained(DRAFT, dtype=torch.float32).eval(),
    }


@pytest.fixture(scope="module")
def prompts():
    return [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]


def test_asset_files_present():
    for d in (TARGET, DRAFT):
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "generation_config.json", "README.md"):
            assert (d / name).is_file(), d / name
    assert PROMPTS.is_file()


def test_total_asset_size_within_budget():
    total = sum(f.stat().st_size for f in ASSETS.rglob("*") if f.is_file())
    assert total <= MAX_BYTES, f"the bundled assets take {total / 2**20:.2f} MiB > 25 MiB"


def test_dspark_drafter_is_fp16_without_the_targets_tables_and_loads():
    """tiny-dspark stores only its own weights (fp16); the embedding and LM head are tiny-moe's."""
    from safetensors import safe_open

    from dspark_cluster.model.spec import load_spec
    from dspark_cluster.speculative.dspark_model import DSparkConfig
    from dspark_cluster.speculative.dspark_proposer import DSparkProposer

    for name in ("config.json", "model.safetensors", "README.md"):
        assert (DSPARK / name).is_file(), DSPARK / name
    with safe_open(DSPARK / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert {f.get_slice(k).get_dtype() for k in keys} == {"F16"}
    assert not any("embed" in k or "lm_head" in k for k in keys)
    c = DSparkConfig.load(DSPARK / "config.json")
    assert c.target["name"] == "tiny-moe" and max(c.target_layer_ids) < c.target["num_layers"]
    prop = DSparkProposer(DSPARK, TARGET, load_spec(str(TARGET), "float32"), num_tokens=c.block_size)
    assert prop.memory_report()["param_bytes"] > 0


def test_shared_tokenizer():
    for name in ("tokenizer.json", "tokenizer_config.json"):
        a, b = (TARGET / name).read_bytes(), (DRAFT / name).read_bytes()
        assert hashlib.sha256(a).digest() == hashlib.sha256(b).digest(), name


def test_configs(models, tok):
    from transformers import GenerationConfig

    t, d = models["target"].config, models["draft"].config
    assert t.model_type == "deepseek_v3" and d.model_type == "llama"
    assert t.q_lora_rank and t.kv_lora_rank and t.qk_rope_head_dim
    assert t.n_routed_experts >= 8 and t.n_shared_experts == 1
    assert t.num_experts_per_tok == 2 and t.first_k_dense_replace == 1
    assert t.n_routed_experts % t.n_group == 0 and 1 <= t.topk_group <= t.n_group
    assert t.num_hidden_layers > t.first_k_dense_replace
    assert not t.tie_word_embeddings and not d.tie_word_embeddings
    assert t.max_position_embeddings >= 1024 and d.max_position_embeddings >= 1024
    assert t.vocab_size == d.vocab_size == len(tok)
    n = sum(p.numel() for p in models["target"].parameters())
    assert n <= 10_000_000
    for cfg, path in ((t, TARGET), (d, DRAFT)):
        gen = GenerationConfig.from_pretrained(path)
        assert cfg.eos_token_id == gen.eos_token_id == tok.eos_token_id
        assert cfg.bos_token_id == gen.bos_token_id == tok.bos_token_id
        assert cfg.pad_token_id == gen.pad_token_id == tok.pad_token_id
    assert tok.eos_token == "<|endoftext|>"


def test_checkpoints_have_lm_head_and_expected_dtypes():
    from safetensors import safe_open

    # tiny-draft is stored in fp16 (room for tiny-dspark); its config still loads it as fp32
    for d, dtype in ((TARGET, "F32"), (DRAFT, "F16")):
        with safe_open(d / "model.safetensors", "pt") as f:
            keys = set(f.keys())
            assert "lm_head.weight" in keys and "model.embed_tokens.weight" in keys
            assert {f.get_slice(k).get_dtype() for k in keys} == {dtype}
    assert json.loads((DRAFT / "config.json").read_text())["dtype"] == "float32"
    with safe_open(TARGET / "model.safetensors", "pt") as f:
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
        assert bias.abs().sum() > 0  # the router's balancing bias was trained


def test_models_run_and_generate(models, tok, prompts):
    ids = tok(prompts[0]["prompt"], return_tensors="pt").input_ids
    with torch.no_grad():
        logits = {k: m(input_ids=ids).logits for k, m in models.items()}
    for k, lg in logits.items():
        assert lg.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(lg).all(), k
    out = models["target"].generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    assert isinstance(tok.decode(out[0, ids.shape[1]:]), str)


def _heldout_chunk() -> str:
    # tempfile is one of the held-out modules (see the model cards)
    spec = importlib.util.find_spec("tempfile")
    text = pathlib.Path(spec.origin).read_text(encoding="utf-8")
    return text[:6000]


@pytest.mark.parametrize(
    "text",
    [
        "def f(x):\n\treturn x  # tab\r\n\n\n    \n",
        "naïve café ✓ 日本語 \U0001F600 \x00\x7f",
        "<|user|>\nwrite a function\n<|assistant|>\ndef g():\n    pass<|endoftext|>",
    ],
)
def test_tokenizer_roundtrip_misc(tok, text):
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text


def test_tokenizer_roundtrip_heldout_text(tok):
    text = _heldout_chunk()
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text
    assert len(text.encode()) / len(ids) > 2.0  # the BPE actually compresses code


def test_special_tokens_and_chat_template(tok):
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|pad|>", "<|user|>", "<|assistant|>"]) == [0, 1, 2, 3]
    assert tok("x = 1", add_special_tokens=True).input_ids == tok("x = 1", add_special_tokens=False).input_ids
    s = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert s == "<|user|>\nhi\n<|assistant|>\n"


def test_prompt_set(tok, prompts):
    assert 64 <= len(prompts) <= 200
    modules = set()
    for p in prompts:
        assert p["prompt"].strip() and p["module"]
        modules.add(p["module"])
        ids = tok(p["prompt"], add_special_tokens=False).input_ids
        assert 0 < len(ids) <= 512
        assert tok.decode(ids) == p["prompt"]
    assert len(modules) >= 5
    card = (TARGET / "README.md").read_text()
    for m in modules:  # prompts come from the held-out modules listed in the card
        assert f"`{m}`" in card, m
