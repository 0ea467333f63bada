"""Published checkpoints' own config.json files (no weights): they parse, the shipped GPU
topologies build every rank's shard on the meta device with the right shapes and bytes, and
`dspark kv-plan` adds their memory up. Hugging Face names resolve through the local cache only."""

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from dspark_cluster import ConfigError, load_config
from dspark_cluster.kv_plan import format_kv_plan, kv_plan, rank_weights
from dspark_cluster.model.spec import load_spec

FIXTURES = Path(__file__).parent / "fixtures" / "hf-configs"
CONFIGS = Path(__file__).parent.parent / "configs"
H200, H100 = 141 * 10**9, 80 * 10**9

# fixture folder -> (Hugging Face name, parameters in billions as published)
MODELS = {
    "deepseek-v3": ("deepseek-ai/DeepSeek-V3", 671.0),
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B", 30.5),
    "qwen3-235b-a22b": ("Qwen/Qwen3-235B-A22B", 235.1),
    "mixtral-8x7b": ("mistralai/Mixtral-8x7B-v0.1", 46.7),
}
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """A Hugging Face cache laid out as huggingface_hub writes it, holding the fixtures' config.json."""
    hub = tmp_path / "hf" / "hub"
    for folder, (name, _) in MODELS.items():
        repo = hub / ("models--" + name.replace("/", "--"))
        (repo / "snapshots" / COMMIT).mkdir(parents=True)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(COMMIT)
        shutil.copy(FIXTURES / folder / "config.json", repo / "snapshots" / COMMIT / "config.json")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return hub


@pytest.mark.parametrize("folder", list(MODELS))
def test_published_configs_parse(folder, caplog):
    with caplog.at_level(logging.INFO, logger="dspark_cluster.model.spec"):
        spec = load_spec(FIXTURES / folder)
    cfg = load_config({"model": {"path": str(FIXTURES / folder)}})
    params = rank_weights(cfg, spec, 0)["num_params"] / 1e9
    assert params == pytest.approx(MODELS[folder][1], rel=0.005)
    ignored = [r for r in caplog.records if "auto_map" in r.getMessage()]
    if folder == "deepseek-v3":
        # the official checkpoint ships its own modelling code: ignored, with one log line; FP8 read
        assert len(ignored) == 1 and "ignored" in ignored[0].getMessage()
        assert spec.fp8_block == (128, 128) and spec.attention == "mla" and spec.moe_layers.count(False) == 3
        assert spec.n_group == 8 and spec.topk_group == 4 and spec.routed_scaling_factor == 2.5
        assert spec.softmax_scale == pytest.approx(192**-0.5 * (0.1 * __import__("math").log(40) + 1) ** 2)
    else:
        assert not ignored and spec.fp8_block is None


def test_auto_map_of_an_unsupported_architecture_is_still_refused(tmp_path):
    raw = json.loads((FIXTURES / "deepseek-v3" / "config.json").read_text())
    raw.update(model_type="deepseek_v4_experimental", architectures=["DeepseekV4ForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(Exception, match="'deepseek_v4_experimental'.*not supported"):
        load_spec(tmp_path)


def test_hugging_face_names_resolve_through_the_local_cache(hf_home):
    cfg = load_config({"model": {"path": "Qwen/Qwen3-30B-A3B"}})
    assert cfg.model.path == str(hf_home / "models--Qwen--Qwen3-30B-A3B" / "snapshots" / COMMIT)
    assert load_spec(cfg.model.path).num_experts == 128


def test_a_name_not_in_the_cache_says_where_it_looked(hf_home):
    with pytest.raises(ConfigError) as e:
        load_config({"model": {"path": "Qwen/Qwen3-Coder-480B-A35B"}})
    msg = str(e.value)
    assert "model.path" in msg and str(hf_home) in msg and "HF_HOME" in msg and "nothing is downloaded" in msg
    with pytest.raises(ConfigError, match="speculative.draft_model.*not in the Hugging Face cache"):
        load_config({"speculative": {"method": "draft_model", "draft_model": "someone/tiny-draft"}})


def _topology(name, hf_home, tmp_path):
    overrides = {}
    if name == "qwen3-30b-a3b-dspark":  # the drafter is trained by the user: a config.json stands in
        target = load_spec(hf_home / "models--Qwen--Qwen3-30B-A3B" / "snapshots" / COMMIT)
        drafter = tmp_path / "drafter"
        drafter.mkdir()
        (drafter / "config.json").write_text(json.dumps({
            "model_type": "dspark_drafter", "target_hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
            "target_layer_ids": [1, 23, 46], "hidden_size": 2048, "num_layers": 2, "num_heads": 16,
            "intermediate_size": 6144, "block_size": 7, "markov_rank": 256, "mask_token_id": 151669}))
        overrides["speculative.draft_model"] = str(drafter)
    return load_config(CONFIGS / f"{name}.yaml", overrides)


# shipped topology -> (device memory, per-rank shapes that must hold, ranks)
TOPOLOGIES = {
    # q, k, v packed: (q + 2 kv) rows; gate and up packed: 2 x intermediate rows
    "qwen3-30b-a3b-1gpu": (H200, 1, {"model.layers.0.self_attn.qkv_proj.weight": (4096 + 2 * 512, 2048),
                                     "model.layers.0.mlp.w13": (128, 1536, 2048)}),
    "qwen3-30b-a3b-2gpu": (H200, 2, {"model.layers.0.self_attn.qkv_proj.weight": (2048 + 2 * 256, 2048),
                                     "model.layers.0.mlp.w13": (68, 1536, 2048),  # (128 + 8) / 2 slots
                                     "lm_head.weight": (75968, 2048)}),
    "qwen3-30b-a3b-dspark": (H200, 2, {"model.layers.47.mlp.w2": (68, 2048, 768)}),
    "mixtral-8x7b-tp4": (H100, 4, {"model.layers.0.self_attn.qkv_proj.weight": (1024 + 2 * 256, 4096),
                                   "model.layers.0.self_attn.o_proj.weight": (4096, 1024),
                                   "model.layers.0.mlp.w13": (2, 28672, 4096)}),
    "deepseek-v3-fp8-2x8-h200": (H200, 16, {"model.layers.0.self_attn.q_b_proj.weight": (128 * 192, 1536),
                                            "model.layers.0.self_attn.kv_b_proj.weight": (128 * 256, 512),
                                            "model.layers.0.mlp.gate_up_proj.weight": (2 * 18432, 7168),
                                            "model.layers.3.mlp.w13": (17, 4096, 7168),  # (256 + 16) / 16
                                            "model.layers.3.mlp.shared.gate_up_proj.weight": (2 * 2048, 7168),
                                            "model.embed_tokens.weight": (129280, 7168)}),
}


def test_every_shipped_gpu_topology_is_tested():
    shipped = {p.stem for p in CONFIGS.glob("*.yaml")} - {"tiny", "hotspot-tp4", "hotspot-natural-tp4"}
    assert shipped == set(TOPOLOGIES)


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_shipped_topologies_build_on_meta_and_plan_memory_that_adds_up(name, hf_home, tmp_path):
    memory, world, shapes = TOPOLOGIES[name]
    cfg = _topology(name, hf_home, tmp_path)
    assert cfg.parallel.world_size == world and cfg.scheduler.kv_cache_memory == 0.9
    spec = load_spec(cfg.model.path, cfg.model.dtype)
    ranks = [rank_weights(cfg, spec, r) for r in range(world)]
    for key, shape in shapes.items():
        assert ranks[0]["shapes"][key] == shape, key
    # bytes: every expert slot is held once over the world; everything else once per TP group
    elem = 2  # bf16
    per_expert = sum(spec.moe_layers) * 3 * spec.hidden_size * spec.moe_intermediate_size * elem
    slots = spec.num_experts + cfg.eplb.num_redundant_experts
    assert sum(r["expert_bytes"] for r in ranks) == slots * per_expert
    # the rest: split over the TP group, whole on each rank where it is replicated (norms, router)
    whole = rank_weights(load_config({"model": {"path": cfg.model.path, "dtype": cfg.model.dtype}}), spec, 0)
    tp = cfg.parallel.tensor
    numel = lambda shape: __import__("math").prod(shape)  # noqa: E731
    replicated = sum(numel(s) * elem for n, s in ranks[0]["shapes"].items()
                     if s == whole["shapes"][n] and not n.endswith((".w13", ".w2")))
    dense = sum(r["weight_bytes"] - r["expert_bytes"] for r in ranks[:tp])  # one TP group
    assert dense == whole["weight_bytes"] - whole["expert_bytes"] + (tp - 1) * replicated
    assert cfg.parallel.data * tp == world
    # kv-plan: weights + KV + headroom = the device; KV = 0.9 of what the weights leave, in blocks
    rows = kv_plan(cfg, spec, device_memory=memory)
    for row, r in zip(rows, ranks):
        assert row["weight_bytes"] == r["weight_bytes"]
        left = memory - row["weight_bytes"]
        assert left > 0, f"{name}: rank {row['rank']}'s weights do not fit the device"
        assert row["num_blocks"] == int(0.9 * left) // row["kv_bytes_per_block"]
        assert row["kv_pool_bytes"] == row["num_blocks"] * row["kv_bytes_per_block"]
        assert row["weight_bytes"] + row["kv_pool_bytes"] + row["headroom_bytes"] == memory
        assert 0.09 * left <= row["headroom_bytes"] <= 0.1 * left + row["kv_bytes_per_block"]
    text = format_kv_plan(rows)
    assert f"rank 0: weights {rows[0]['weight_bytes'] / 2**30:,.2f} GiB" in text
    assert f"= device {memory / 2**30:,.2f} GiB" in text


def test_deepseek_v3_kv_per_device_with_mla(hf_home, tmp_path):
    cfg = _topology("deepseek-v3-fp8-2x8-h200", hf_home, tmp_path)
    spec = load_spec(cfg.model.path, cfg.model.dtype)
    (row, *_) = kv_plan(cfg, spec, device_memory=H200)
    assert row["attention"] == "mla" and row["kv_bytes_per_token"] == (512 + 64) * 2 * 61 == 70272
    assert 200_000 < row["tokens_capacity"] < 300_000  # what the config's header says: 255k tokens a device


def test_kv_plan_cli_plans_a_gpu_topology_from_this_machine(hf_home, capsys):
    from dspark_cluster.cli import main

    assert main(["kv-plan", str(CONFIGS / "mixtral-8x7b-tp4.yaml"), "--device-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "= device 74.51 GiB" in out and out.count("\n   ") >= 3
    assert main(["kv-plan", str(CONFIGS / "mixtral-8x7b-tp4.yaml"), "--device-memory", "lots"]) == 2
    assert "--device-memory: got 'lots'" in capsys.readouterr().err


def test_kv_cache_memory_as_a_share_of_what_the_weights_leave(checkpoint, monkeypatch):
    from dspark_cluster import LLM
    from dspark_cluster import kv_cache
    from dspark_cluster.kv_cache import kv_budget_bytes

    gib = 2**30
    assert kv_budget_bytes(0.5, "cuda", 10 * gib) == 5 * gib
    assert kv_budget_bytes("auto", "cuda", 10 * gib) == 9 * gib  # vLLM's 0.9
    assert kv_budget_bytes("auto", "cpu", 10 * gib) == 256 * 2**20  # the host is shared: a fixed default
    assert kv_budget_bytes(0.5, "cpu", 10 * gib, sharing=4) == 10 * gib // 8  # CPU workers of one host split it
    assert kv_budget_bytes(3 * gib, "cuda", lambda: 1 / 0) == 3 * gib  # bytes never measure the device
    for bad in (1.5, 0.0, "0", "-2GiB"):
        with pytest.raises(ConfigError, match="scheduler.kv_cache_memory"):
            load_config({"scheduler": {"kv_cache_memory": bad}})
    # on CUDA, what the allocator caches unused from loading is returned before the driver is asked
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: calls.append(str(device)) or (7 * gib, 80 * gib))
    assert kv_cache.free_device_memory("cuda:0") == 7 * gib and calls == ["empty_cache", "cuda:0"]
    # in process: the share is of the memory free after the weights are loaded (measured then)
    seen = []
    monkeypatch.setattr(kv_cache, "free_device_memory", lambda device: seen.append(str(device)) or 64 * 2**20)
    llm = LLM(checkpoint("qwen3_moe"), config={"scheduler": {"kv_cache_memory": 0.5, "block_size": 4}})
    per_block = kv_cache.kv_bytes_per_block(llm.engine.executor.model, 4)
    assert seen == ["cpu"] and llm.engine.num_blocks == 32 * 2**20 // per_block
    assert llm.generate([[3, 4, 5]], __import__("dspark_cluster").SamplingParams(max_tokens=3))[0].token_ids


def test_the_kv_pool_leaves_the_largest_steps_room(checkpoint, monkeypatch):
    """A share of kv_cache_memory is of what the weights leave less what the largest steps hold on top (activations,
    logits, captured layers, draft laws, the sampler's sorts: vLLM's profile run), or the first long prompt chunk or
    full verify step after start-up runs out of device memory. The steps are the largest the scheduler builds: a prompt
    chunk of max_num_batched_tokens (of sequences no longer than the model's positions), and max_num_seqs verify rows
    of 1 + num_tokens tokens with their drafts' laws, all sampled with top-p, random tokens (zeros would send every
    token to the same experts), on a pool just large enough, taken off the peak and dropped before the real one is
    made. Measured by CUDA's allocator statistics (stood in here: the CPU keeps none, and off CUDA nothing runs);
    the steps themselves run here, for real."""
    from dspark_cluster import LLM, SamplingParams, kv_cache, worker

    gib = 2**30
    alloc = {"now": 5 * gib, "peak": 0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: alloc.update(peak=alloc["now"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: alloc["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: alloc["peak"])
    assert kv_cache.peak_bytes_during(lambda: alloc.update(peak=alloc["now"] + 3 * gib), "cuda:0") == 3 * gib
    assert kv_cache.peak_bytes_during(lambda: 1 / 0, "cpu") == 0  # not run where nothing measures it

    steps, pools = [], []
    execute_step = worker.execute_step

    def measured(run, device):  # the steps run; the peak read as their pool and 16 MiB on top
        def recording(model, step, *args, **kwargs):
            laws = None if step.draft_probs is None else (tuple(step.draft_probs.shape), step.draft_probs.dtype)
            steps.append((step.query_lens.tolist(), None if step.num_draft is None else step.num_draft.tolist(),
                          step.temperature.tolist(), laws, step.input_ids.unique().numel() > 1))
            pools.append(model.attention_layers[0].kv_cache[0].shape[0] * kv_cache.kv_bytes_per_block(model, 4))
            return execute_step(model, step, *args, **kwargs)

        monkeypatch.setattr(worker, "execute_step", recording)
        run()
        monkeypatch.setattr(worker, "execute_step", execute_step)
        return pools[0] + 16 * 2**20

    monkeypatch.setattr(worker, "peak_bytes_during", measured)
    monkeypatch.setattr(kv_cache, "free_device_memory", lambda device: 64 * 2**20)
    config = {"scheduler": {"kv_cache_memory": 0.5, "block_size": 4, "max_num_batched_tokens": 1100, "max_num_seqs": 4},
              "speculative": {"method": "draft_model", "draft_model": str(checkpoint("llama")), "num_tokens": 3}}
    llm = LLM(checkpoint("qwen3_moe"), config=config)
    try:
        ex = llm.engine.executor
        per_block = kv_cache.kv_bytes_per_block(ex.model, 4)
        assert llm.engine.num_blocks == (64 - 16) * 2**20 // 2 // per_block
        assert ex.worker.memory_report()["activation_reserve_bytes"] == 16 * 2**20
        # a prompt chunk of 1100 tokens, of sequences no longer than the model's 512 positions, each sampling its last
        # token; 4 verify rows of 1 + 3 tokens with their drafts' laws [4, 3, V]; both sampled, random tokens, on a
        # pool of 128 + 128 + 19 blocks
        V = ex.model.spec.vocab_size
        assert steps == [([512, 512, 76], None, [1.0] * 3, None, True),
                         ([4] * 4, [3] * 4, [1.0] * 4, ((4, 3, V), torch.float32), True)]
        assert pools == [275 * per_block] * 2
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        assert len(llm.generate([[3, 4, 5, 3, 4, 5]], params)[0].token_ids) == 6  # on the pool made after
    finally:
        llm.shutdown()
    steps.clear()
    LLM(checkpoint("qwen3_moe"), config={"scheduler": {"num_kv_blocks": 40}}).shutdown()  # a count: nothing measured
    assert steps == []
