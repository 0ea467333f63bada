"""Tiny HF checkpoints for every supported architecture, built with transformers per test session."""

from __future__ import annotations

import contextlib
import os
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

VOCAB = 160

ARCHS = {
    "deepseek_v3": lambda: __import__("transformers").DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_group=4,
        topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, initializer_range=0.1,
        max_position_embeddings=512,
    ),
    "deepseek_v3_noqlora": lambda: __import__("transformers").DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=2, num_experts_per_tok=2,
        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1,
        topk_group=1, first_k_dense_replace=0, norm_topk_prob=False, initializer_range=0.1,
        max_position_embeddings=512,
    ),
    "qwen3_moe": lambda: __import__("transformers").Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], initializer_range=0.1, max_position_embeddings=512,
    ),
    "qwen2_moe": lambda: __import__("transformers").Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0], initializer_range=0.1,
        max_position_embeddings=512,
    ),
    "mixtral": lambda: __import__("transformers").MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, initializer_range=0.1,
        max_position_embeddings=512,
    ),
    "llama": lambda: __import__("transformers").LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, initializer_range=0.1, max_position_embeddings=512,
    ),
    "qwen3": lambda: __import__("transformers").Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, initializer_range=0.1, max_position_embeddings=512,
    ),
}


def build_checkpoint(arch: str, path, seed: int = 0, **overrides):
    """Random-weight checkpoint of `arch`, saved as transformers saves it (per-expert tensors);
    `overrides` set config fields (e.g. num_hidden_layers)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = ARCHS[arch]()
    for key, value in overrides.items():
        setattr(cfg, key, value)
    cfg.eos_token_id = 1
    cfg.bos_token_id = 0
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # non-zero so the bias path is exercised
                buf.normal_(0, 0.3)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(arch) -> path of a tiny random checkpoint (built once per session)."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = build_checkpoint(arch, tmp_path_factory.mktemp(arch))
        return cache[arch]

    return get


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def random_prompts(lengths, seed=0, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="session")
def ray_cluster():
    """One Ray instance for the whole session: two simulated nodes of 4 CPUs each."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_worker_niceness", "0")  # as a private instance the engine starts (ensure_ray)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4})
    cluster.add_node(num_cpus=4)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(autouse=True)
def _ray_nodes_stay_up(request):
    """After each test that used the session's Ray: both simulated nodes must still be alive. A
    raylet that died (e.g. ray#63229, a compiled-graph channel written after its teardown) is
    reported at the test that killed it, with the raylet's own last words, instead of as confusing
    failures in every later test."""
    yield
    if "ray_cluster" not in request.fixturenames:
        return
    import glob

    import ray

    dead = [n for n in ray.nodes() if not n.get("Alive")]
    if dead:
        lines = []
        for log in glob.glob("/tmp/ray/session_latest/logs/raylet*"):
            with open(log, errors="replace") as f:
                lines += [line.strip() for line in f if "Check failed" in line or " F " in line][:3]
        pytest.fail(f"{len(dead)} Ray node(s) died during this test; raylet logs: {lines or 'nothing found'}")


@pytest.fixture(scope="module", autouse=True)
def _no_placement_group_left():
    """After each module: no placement group of ours is left on the session's Ray. One left holds its
    devices for the rest of the session, so every later test that needs them waits out its placement
    timeout and fails far from the cause: report it at the module that left it, and remove it."""
    yield
    import ray

    if not ray.is_initialized():
        return
    from ray.util.placement_group import get_placement_group, placement_group_table, remove_placement_group

    def left():
        return {i.get("name"): i.get("state") for i in placement_group_table().values()
                if (i.get("name") or "").startswith("dspark-") and i.get("state") != "REMOVED"}

    deadline = time.monotonic() + 10  # a removal the GCS has not recorded yet
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    leaked = left()
    for name in leaked:
        with contextlib.suppress(Exception):
            remove_placement_group(get_placement_group(name))
    if leaked:
        pytest.fail(f"placement groups left by this module (removed now): {leaked}")


def alive_actor_pids(class_name: str) -> list[int]:
    """The pids of the ALIVE actors of `class_name` in the Ray instance this process is connected to (the
    session's `ray_cluster`), read from its GCS. Not `ray.util.state.list_actors()`: without an address it
    asks the Ray instance started *last on this machine* (/tmp/ray/ray_current_cluster), through that
    instance's dashboard: with another test run's cluster up beside this one it lists that run's actors (a
    kill -9 test then kills another run's workers and none of its own), or raises when that instance has
    no dashboard (port 8265 was taken when it started)."""
    from ray._private.state import state as gcs

    return [a["Pid"] for a in gcs.actor_table(None, actor_state_name="ALIVE").values()
            if a["ActorClassName"] == class_name]


def alive_actors(class_name: str) -> int:
    return len(alive_actor_pids(class_name))


def wait_until_drafting(llm, timeout: float = 60) -> None:
    """Until the Ray Router of `llm` has verified a drafted round (so a kill lands mid-speculation)."""
    import ray

    deadline = time.monotonic() + timeout
    while not ray.get(llm.router.stats.remote())["speculative"]["verify_rounds"]:
        assert time.monotonic() < deadline, "no drafted round was verified"
        time.sleep(0.02)


def wait_until_drafting_resumes(llm, prompt, params, want, what: str, timeout: float = 120) -> None:
    """Generate `prompt` again until a run drafts (a restarted drafter took over), each run's tokens `want`."""
    deadline = time.monotonic() + timeout
    while True:
        out = llm.generate([prompt], params)[0]
        assert out.token_ids == want
        if out.metrics["num_draft_tokens"] > 0:
            return
        assert time.monotonic() < deadline, f"the restarted {what} never took over"
        time.sleep(0.5)


def build_dspark(target_path, out_dir, **kw):
    """A random DSpark drafter for the test checkpoint at `target_path` (dspark_model.random_drafter)."""
    from dspark_cluster.speculative.dspark_model import random_drafter

    return random_drafter(target_path, out_dir, **kw)


# The DSpark placement and idle-drafter tests (test_draft_on_target, test_idle_drafter): the deepseek_v3
# checkpoint, one random DSpark drafter of it reading layers 0 and 1, and plain decoding's greedy tokens of
# the requesting module's `prompts` (block size 4, as those modules' speculative configs)
@pytest.fixture(scope="session")
def target(checkpoint):
    return checkpoint("deepseek_v3")


@pytest.fixture(scope="session")
def drafter(target, tmp_path_factory):
    return build_dspark(target, tmp_path_factory.mktemp("dspark-dsv3"), layers=(0, 1))


@pytest.fixture(scope="module")
def plain(target, prompts):
    from dspark_cluster import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    return [o.token_ids for o in LLM(target, config={"scheduler": {"block_size": 4}}).generate(prompts, greedy)]


def dspark_proposer(llm):
    """An in-process engine's DSpark proposer: the drafter group's, or (placement target) the worker's."""
    if llm.engine.speculation.on_target:
        return llm.engine.executor.worker.drafter.proposer
    return llm.engine.drafter.backend.proposer


def outputs_overwritten_by_the_next_call(steps, draft=None) -> list:
    """As one thread's CUDA graph tree does on a GPU: each compiled call (the target's step, the drafter's round)
    reuses the memory of the outputs the previous one returned. Here those outputs (hidden states, captured rows,
    expert loads; drafted tokens, confidences, laws) are filled with garbage (NaN, -1) before each call, so anything
    read past the next compiled call changes what the CPU computes too. Inputs the graphs read in place (parameters,
    buffers, the KV cache) are not outputs and are left alone. Returns the calls counted by runner ("steps",
    "draft")."""
    model = steps.model
    inputs = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    inputs |= {t.untyped_storage().data_ptr() for a in model.attention_layers for t in a.kv_cache if t is not None}
    live, calls = [], {"steps": 0, "draft": 0}

    def overwriting(fn, outputs, runner):
        def call(*args, **kwargs):
            for t in live:
                t.fill_(float("nan") if t.is_floating_point() else -1)
            live.clear()
            out = fn(*args, **kwargs)
            calls[runner] += 1
            live.extend(t for t in outputs(out) if isinstance(t, torch.Tensor)
                        and t.untyped_storage().data_ptr() not in inputs)
            return out
        return call

    def step_outputs(hidden):
        return [hidden, model.captured, *(m.last_load for m in model.moe_layers),
                *(m.last_slot_load for m in model.moe_layers)]

    steps.forward = overwriting(steps.forward, step_outputs, "steps")
    if draft is not None:
        draft.padded_round = overwriting(draft.padded_round, list, "draft")
    return calls


def rows_by_position(seen) -> dict:
    """The ContextRows a drafter ingested, as seq_id -> {position: that token's exported row}."""
    by_seq = {}
    for rows in seen:
        for sid, start, h in rows:
            by_seq.setdefault(sid, {}).update({start + i: h[i] for i in range(h.shape[0])})
    return by_seq


def hf_context_states(hf, seq, layers=(1, 2)) -> torch.Tensor:
    """transformers' hidden states of `seq` after the given decoder layers (hidden_states[i] is layer
    i - 1's output), concatenated as a DSpark export: [len(seq), len(layers) * H]."""
    with torch.no_grad():
        hs = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in layers], dim=-1)[0]
