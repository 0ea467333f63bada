"""The checks of a validated `Config` (config.py) against what is on disk: the checkpoint's
config.json and the drafter's, which the topology (tensor and data parallelism, expert slots, the
drafter's tensor parallelism) must divide. Each returns its problems as lines for one `ConfigError`;
`load_config` runs them after resolving the model paths.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

from .errors import CheckpointError
from .model.spec import load_spec


def read_hf_config(path: Union[str, Path]) -> Optional[dict]:
    f = Path(path) / "config.json"
    if not f.is_file():
        return None
    return json.loads(f.read_text())


def check_against_model(cfg) -> list[str]:
    """Checks that need the checkpoint's config.json: the topology must divide the model. cfg: a
    validated `Config` (not imported here: `config.load_config` runs these checks)."""
    problems = []
    hf = read_hf_config(cfg.model.path)
    if hf is None:
        return [f"model.path: got {cfg.model.path!r}; expected a folder with config.json and *.safetensors"]
    tp, world = cfg.parallel.tensor, cfg.parallel.world_size
    heads = hf.get("num_attention_heads")
    kv_heads = hf.get("num_key_value_heads") or heads
    if heads and heads % tp:
        problems.append(f"parallel.tensor: got {tp}; it must divide the model's {heads} attention heads")
    elif kv_heads and kv_heads % tp and tp % kv_heads:
        problems.append(f"parallel.tensor: got {tp}; it must divide, or be a multiple of, the {kv_heads} KV heads")
    experts = hf.get("n_routed_experts") or hf.get("num_local_experts") or hf.get("num_experts") or 0
    slots = experts + cfg.eplb.num_redundant_experts
    if experts and slots % world:
        problems.append(
            f"parallel: tensor x data = {world} must divide the {experts} experts + "
            f"{cfg.eplb.num_redundant_experts} redundant (eplb.num_redundant_experts) = {slots} expert slots"
        )
    bad_hot = [e for e in cfg.workload.hot_experts if not 0 <= e < max(experts, 1)]
    if bad_hot:
        problems.append(f"workload.hot_experts: got {bad_hot}; expert ids must be in [0, {experts})")
    if not experts and cfg.eplb.enabled:
        problems.append("eplb.enabled: got True; the model has no experts, set eplb.enabled=false")
    if cfg.eplb.num_redundant_experts and experts and cfg.eplb.num_redundant_experts > experts * (world - 1):
        problems.append(
            f"eplb.num_redundant_experts: got {cfg.eplb.num_redundant_experts}; at most {experts * (world - 1)} "
            "replicas fit without two copies of one expert on a rank"
        )
    max_pos = hf.get("max_position_embeddings")
    if cfg.scheduler.max_model_len and max_pos and cfg.scheduler.max_model_len > max_pos:
        problems.append(
            f"scheduler.max_model_len: got {cfg.scheduler.max_model_len}; the model supports at most {max_pos}"
        )
    if cfg.parallel.executor == "local" and world > 1:
        problems.append(f"parallel.executor: 'local' runs one device, but tensor x data = {world}; use executor: ray")
    if cfg.parallel.device == "cuda" and cfg.parallel.backend == "gloo" and world > 1:
        pass  # gloo on CUDA works (slowly); allowed for debugging
    if cfg.parallel.device == "cpu" and cfg.parallel.backend == "nccl":
        problems.append("parallel.backend: got 'nccl'; NCCL needs CUDA devices, use 'gloo' or 'auto' with device cpu")
    if cfg.speculative.draft_model and not (Path(cfg.speculative.draft_model) / "config.json").is_file():
        problems.append(f"speculative.draft_model: got {cfg.speculative.draft_model!r}; no config.json there")
    elif kind := check_drafter_kind(cfg):
        problems.append(kind)  # the topology checks would read it as the wrong kind of model
    else:
        problems += check_drafter_topology(cfg)
    return problems


DSPARK_MODEL_TYPE = "dspark_drafter"  # config.json's model_type of a DSpark drafter (speculative/dspark_model.py)


def check_drafter_kind(cfg) -> Optional[str]:
    """The draft model must be what the method runs: a DSpark drafter (config.json model_type
    "dspark_drafter") for method dspark, a plain causal LM for draft_model. None when it is."""
    sp = cfg.speculative
    if sp.method not in ("dspark", "draft_model") or not sp.draft_model:
        return None
    kind = (read_hf_config(sp.draft_model) or {}).get("model_type")
    if sp.method == "dspark" and kind != DSPARK_MODEL_TYPE:
        return (f"speculative.draft_model: got {sp.draft_model!r}, not a DSpark drafter (its config.json has "
                f"model_type {kind!r}, a DSpark drafter's is {DSPARK_MODEL_TYPE!r}); method dspark needs one (e.g. the "
                "bundled tiny-dspark): point draft_model at one, or use speculative.method: draft_model for a plain "
                "causal LM")
    if sp.method == "draft_model" and kind == DSPARK_MODEL_TYPE:
        return (f"speculative.draft_model: got {sp.draft_model!r}, a DSpark drafter; method draft_model needs a plain "
                "causal LM (e.g. the bundled tiny-draft): use speculative.method: dspark for this drafter, or point "
                "draft_model at a causal LM")
    return None


def check_drafter_topology(cfg) -> list[str]:
    """The drafter group's tensor parallelism: draft_tensor ranks per group must divide the group
    and the draft model, as parallel.tensor must divide the target."""
    sp = cfg.speculative
    dt, n = sp.draft_tensor, sp.draft_workers
    problems = []
    if n % dt:
        problems.append(
            f"speculative.draft_workers: got {n}, not a multiple of speculative.draft_tensor = {dt} (each "
            f"drafter tensor-parallel group has draft_tensor workers); use draft_workers: {dt * max(1, n // dt)}"
        )
    if dt == 1:
        return problems
    if sp.method != "draft_model":
        return problems + [(
            f"speculative.draft_tensor: got {dt}; only method 'draft_model' has a tensor-parallel drafter "
            f"(got method {sp.method!r}); use method: draft_model or draft_tensor: 1"
        )]
    if cfg.parallel.executor != "ray":
        problems.append(
            f"speculative.draft_tensor: got {dt}; a tensor-parallel drafter runs in its own Ray actors, "
            "set parallel.executor: ray or draft_tensor: 1"
        )
    try:
        spec = load_spec(sp.draft_model, cfg.model.dtype)
    except CheckpointError as e:
        return problems + [f"speculative.draft_model: {e}"]
    heads, kv_heads = spec.num_heads, spec.num_kv_heads
    if heads % dt:
        problems.append(f"speculative.draft_tensor: got {dt}; it must divide the draft model's {heads} attention heads")
    elif kv_heads % dt and dt % kv_heads:
        problems.append(
            f"speculative.draft_tensor: got {dt}; it must divide, or be a multiple of, the draft model's "
            f"{kv_heads} KV heads"
        )
    split = [  # what a drafter rank holds 1/draft_tensor of (experts are whole on every rank)
        ("intermediate_size", spec.intermediate_size if any(not m for m in spec.moe_layers) else 0),
        ("shared-expert intermediate size", spec.shared_intermediate_size),
        ("vocabulary (the embedding and LM head are split by token)", spec.vocab_size),
    ]
    for what, size in split:
        if size and size % dt:
            problems.append(f"speculative.draft_tensor: got {dt}; it must divide the draft model's {what}: {size}")
    return problems
