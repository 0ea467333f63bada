"""Checkpoint loading: a shard reads only its own slices; bad checkpoints name what is wrong."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_cluster import CheckpointError, LLM, SamplingParams
from dspark_cluster.model.loader import load_model
from dspark_cluster.model.spec import load_spec


class ShardInfo:
    """tp rank/size for building one shard (no collectives are run in these tests)."""

    def __init__(self, rank, size):
        self.tp_rank, self.tp_size = rank, size

    def all_reduce(self, x):
        raise AssertionError("not used")

    all_gather = all_reduce


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe", "qwen2_moe", "mixtral"])
def test_shard_reads_only_its_slices(arch, checkpoint):
    path = checkpoint(arch)
    spec = load_spec(path, "float32")
    full = load_file(str(path / "model.safetensors"))
    total = sum(t.numel() * t.element_size() for t in full.values())
    experts = [1, 3]
    shard = load_model(path, spec, ShardInfo(1, 2), expert_ids=[experts] * sum(spec.moe_layers))
    params = dict(shard.named_parameters())
    # split tensors hold the rank's half, replicated ones the whole tensor, experts only their own
    # q is packed (with k and v: qkv_proj) or has its rope rows in rotate_half's order (q_b_proj)
    q = "q_b_proj" if arch == "deepseek_v3" else "q_proj"
    ref = full[f"model.layers.1.self_attn.{q}.weight"]
    packed = shard.get_submodule(f"model.layers.1.self_attn.{'q_b_proj' if arch == 'deepseek_v3' else 'qkv_proj'}")
    part = packed.parts[0]
    assert part.name == q
    half = ref[ref.shape[0] // 2 :]
    if part.row_order is not None:
        half = half[part.row_order]
    assert torch.equal(packed.weight[: part.size], half)
    o = full["model.layers.1.self_attn.o_proj.weight"]
    assert torch.equal(params["model.layers.1.self_attn.o_proj.weight"], o[:, o.shape[1] // 2 :])
    assert torch.equal(params["model.norm.weight"], full["model.norm.weight"])
    moe = shard.moe_layers[0]
    layer = [i for i, l in enumerate(shard.model.layers) if l.is_moe][0]
    prefix = f"model.layers.{layer}.{spec.expert_prefix}.experts"
    g, u, d = spec.expert_names
    assert moe.w13.shape[0] == 2
    assert torch.equal(moe.w13[1], torch.cat([full[f"{prefix}.3.{g}.weight"], full[f"{prefix}.3.{u}.weight"]]))
    assert torch.equal(moe.w2[0], full[f"{prefix}.1.{d}.weight"])
    # bytes actually read: replicated + half of the split tensors + 2 of the experts
    expert_bytes = sum(t.numel() * 4 for k, t in full.items() if ".experts." in k)
    expected = 0
    for k, t in full.items():
        nbytes = t.numel() * 4
        if ".experts." in k:
            continue
        split = any(s in k for s in ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "o_proj", "gate_proj",
                                      "up_proj", "down_proj", "embed_tokens", "lm_head"))
        expected += nbytes // 2 if split else nbytes
    expected += expert_bytes * len(experts) // spec.num_experts
    assert shard.bytes_read == expected
    assert shard.bytes_read < 0.75 * total


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError, match="'gpt2'.*supported model_type"):
        load_spec(tmp_path)


def test_missing_tensor_is_named(checkpoint, tmp_path):
    src = checkpoint("mixtral")
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.block_sparse_moe\.experts\.2\.w3\.weight.*missing"):
        LLM(dst)


def test_wrong_shape_is_named(checkpoint, tmp_path):
    src = checkpoint("llama")
    dst = tmp_path / "reshaped"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*shape \(3,\)"):
        LLM(dst)


def test_tokenizer_text_prompts_and_streaming(checkpoint, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    src = checkpoint("llama")
    dst = tmp_path / "with_tok"
    shutil.copytree(src, dst)
    words = ["<s>", "</s>"] + [f"w{i}" for i in range(150)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(str(dst))
    llm = LLM(dst, config={"scheduler": {"block_size": 4, "num_kv_blocks": 64}})
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    out = llm.generate(["w5 w17 w3"], params)[0]
    assert out.prompt_token_ids == [7, 19, 5]
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True) and out.text
    pieces = list(llm.stream("w5 w17 w3", params))
    assert [t for p in pieces for t in p.token_ids] == out.token_ids
    assert "".join(p.text for p in pieces) == out.text
    assert pieces[-1].finished and not any(p.finished for p in pieces[:-1])
    # stopping a stream early frees its KV
    gen = llm.stream("w5 w17 w3", params)
    next(gen)
    gen.close()
    assert llm.engine.block_manager.num_free == llm.engine.num_blocks
    assert out.metrics["ttft_s"] > 0 and out.metrics["num_draft_tokens"] == 0


@pytest.mark.parametrize("command", ["run", "serve"])
def test_a_truncated_checkpoint_is_one_error_line_from_the_cli(command, tmp_path, monkeypatch, capsys):
    """A download or copy that stopped midway: `dspark run` / `dspark serve` print one CheckpointError
    line naming the file and the fix, not safetensors' traceback."""
    from dspark_cluster.cli import main
    from dspark_cluster.config import ASSETS_DIR

    dst = tmp_path / "truncated"
    shutil.copytree(ASSETS_DIR / "tiny-moe", dst)
    f = dst / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    monkeypatch.chdir(tmp_path)
    assert main([command, "--set", f"model.path={dst}", *(["--no-progress"] if command == "run" else [])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"error: {f}: not a readable safetensors file") and "truncated" in err[0]
    assert "download or save the checkpoint again" in err[0]
