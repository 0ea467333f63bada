"""The core's target worker (one for both executors), its narrow config, and the Ray call helper."""

import pickle

import pytest

from dspark_cluster import load_config
from dspark_cluster.errors import CheckpointError, ConfigError, DSparkError
from dspark_cluster.executor import LocalExecutor
from dspark_cluster.model.spec import load_spec
from dspark_cluster.worker import WorkerConfig


def test_a_worker_gets_only_the_sections_it_needs():
    cfg = load_config({"parallel": {"executor": "ray", "tensor": 2}, "eplb": {"num_redundant_experts": 2},
                       "workload": {"hot_experts": [1, 3], "hot_bias": 4.0}})
    w = WorkerConfig.of(cfg)
    assert {f for f in vars(w)} == {"model", "parallel", "scheduler", "num_redundant_experts", "hot_experts",
                                    "hot_bias", "export_layers", "record_top_logprobs", "context_window",
                                    "draft_model", "num_draft_tokens", "draft_passes", "compile_buckets",
                                    "verify_row_tokens", "verify_laws"}
    assert w.num_redundant_experts == 2 and w.hot_experts == (1, 3) and w.hot_bias == 4.0
    assert w.export_layers == () and w.record_top_logprobs == 20  # the run's speculative constants (no drafter)
    dspark = WorkerConfig.of(load_config({"speculative": {"method": "dspark", "draft_model": "tiny-dspark"}}))
    assert dspark.export_layers == (1, 2, 3)  # the bundled drafter's target_layer_ids, sent once at setup
    assert dspark.context_window == 512  # auto: the rows a block reads (what the worker keeps of an idle sequence)
    # placement auto: the DSpark drafter runs on the driver rank, which loads it
    assert dspark.draft_model.endswith("tiny-dspark") and dspark.num_draft_tokens == 4
    # model.compile's buckets reach a full batch's verify step (64 sequences x (1 + 4)), as the engine pads them
    assert w.compile_buckets[-1] == 64 and dspark.compile_buckets[-1] == 64 * 5
    # what the KV plan's profile run builds its verify step from (`Worker.activation_reserve`)
    assert (w.verify_row_tokens, w.verify_laws, dspark.verify_row_tokens, dspark.verify_laws) == (1, False, 5, True)
    # the bundled drafter takes a second pass where draft_passes resolves to it (auto: on CUDA; or asked for)
    for device, passes, want in (("cpu", "auto", 1), ("cuda", "auto", 2), ("cpu", 2, 2), ("cuda", 1, 1)):
        sp = {"method": "dspark", "draft_model": "tiny-dspark", "draft_passes": passes}
        assert WorkerConfig.of(load_config({"parallel": {"device": device}, "speculative": sp})).draft_passes == want
    grouped = WorkerConfig.of(load_config({"speculative": {"method": "dspark", "draft_model": "tiny-dspark",
                                                           "placement": "group"}}))
    assert grouped.draft_model == "" and grouped.num_draft_tokens == 0
    assert pickle.loads(pickle.dumps(w)) == w  # what the Cluster sends each ShardWorker


def test_the_local_executor_hosts_the_core_worker(checkpoint):
    path = checkpoint("qwen3_moe")
    cfg = load_config({"model": {"path": str(path)}, "scheduler": {"block_size": 4, "num_kv_blocks": 8},
                       "workload": {"hot_experts": [1], "hot_bias": 3.0}})
    ex = LocalExecutor(cfg, load_spec(cfg.model.path, cfg.model.dtype))
    try:
        assert ex.num_blocks == 8 and ex.model is ex.worker.model
        # the hot-spot study's bias applies in process too (it used to on Ray only)
        assert all(float(m.study_router_bias[1]) == 3.0 for m in ex.model.moe_layers)
        (dev,) = ex.device_reports()
        assert dev["expert_staging_bytes"] == 0  # one device never migrates experts
        assert dev["memory"]["kv_pool"] == 8 * dev["kv_bytes_per_block"] > 0
    finally:
        ex.shutdown()
    assert ex.model is None


def test_ray_errors_are_unwrapped_one_way():
    from ray.exceptions import RayActorError, RayTaskError

    from actors.calls import remote_error, unwrap

    own = RayTaskError("step", "Traceback ...", ConfigError("bad"))
    assert isinstance(unwrap(own), ConfigError) and isinstance(remote_error(own), ConfigError)
    other = RayTaskError("step", "Traceback ...", ValueError("boom"))
    assert unwrap(other) is other and isinstance(remote_error(other), ValueError)
    failed = unwrap(other, failed=lambda e: CheckpointError(f"failed: {e}"))
    assert isinstance(failed, CheckpointError)
    died = RayActorError()
    assert remote_error(died) is None and unwrap(died) is died
    assert isinstance(unwrap(died, lost=lambda e: DSparkError("died")), DSparkError)
    with pytest.raises(ValueError):
        raise unwrap(ValueError("not Ray's"), lost=lambda e: DSparkError("no"))
