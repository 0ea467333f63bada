"""The topology simulator: the simulated engine decides as the real one on the same trace, the cost
model's terms add up on a hand-computed step, and `dspark simulate` / `dspark sweep --simulate`
run on the bundled config and on a real-checkpoint topology from its config.json alone."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import numpy as np
import pytest

from dspark_cluster import SamplingParams, load_config
from dspark_cluster.cli import main
from dspark_cluster.model.spec import load_spec
from dspark_cluster.sequence import Sequence
from dspark_cluster.simulate import SimOptions, get_device, load_catalog, simulate
from dspark_cluster.simulate.cost_model import (Precision, StepShape, Topology, all_to_all_time, gemm_time,
                                                step_time)
from dspark_cluster.simulate.engine import SimEngine
from dspark_cluster.simulate.hardware import Device
from dspark_cluster.simulate.run import build
from dspark_cluster.simulate.shapes import ModelShapes
from dspark_cluster.simulate.traffic import Acceptance, SimRequest

from conftest import random_prompts

REPO = Path(__file__).resolve().parents[1]
DEEPSEEK_V3 = REPO / "tests" / "fixtures" / "hf-configs" / "deepseek-v3"


# ---- the same decisions as the real engine ----------------------------------------------------
def _real_schedule(cfg, prompts, params):
    """Each step's (request, tokens) scheduled and the requests preempted, from a real in-process
    LLMEngine (the local executor: synchronous steps)."""
    from dspark_cluster.engine import LLMEngine

    engine = LLMEngine(cfg)
    record = []
    sched = engine.schedulers[0]
    schedule = sched.schedule

    def recording():
        out = schedule()
        if out.scheduled:
            record.append(([(s.seq.request_id, s.num_new_tokens) for s in out.scheduled],
                           [q.request_id for q in out.preempted]))
        return out

    sched.schedule = recording
    try:
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(p, sp, request_id=f"r{i}")
        while engine.has_unfinished():
            engine.step()
        return record, engine.num_steps, engine.num_blocks
    finally:
        engine.shutdown()


def _sim_schedule(cfg, prompts, params):
    from dspark_cluster.sequence import Sequence

    spec = load_spec(cfg.model.path, cfg.model.dtype)
    engine = SimEngine(cfg, spec, SimOptions(hardware="cpu", record_schedule=True), get_device("cpu"))
    reqs = [SimRequest(0.0, p, sp) for p, sp in zip(prompts, params)]
    names = iter(range(len(reqs)))
    engine.run(reqs, lambda r: Sequence(f"r{next(names)}", list(r.prompt_ids), len(r.prompt_ids), r.params,
                                        spec.eos_token_ids))
    return [(rows, pre) for _, rows, pre in engine.schedule_record], engine.num_steps, engine.num_blocks


@pytest.mark.parametrize("case", ["roomy", "tight_kv_preempts", "shared_prefixes"])
def test_simulated_scheduler_makes_the_real_engines_decisions(checkpoint, case):
    path = checkpoint("deepseek_v3")
    sched = {"block_size": 4, "max_num_seqs": 6, "max_num_batched_tokens": 40}
    lengths = [9, 14, 5, 11, 8, 13, 6, 10, 17, 3, 12, 7]
    prompts = random_prompts(lengths, seed=41)
    if case == "tight_kv_preempts":
        sched["num_kv_blocks"] = 22
    else:
        sched["num_kv_blocks"] = 200
    if case == "shared_prefixes":  # half the prompts begin with one 12-token system prompt: the cache reuses it
        head = random_prompts([12], seed=5)[0]
        prompts = [head + p if i % 2 else p for i, p in enumerate(prompts)]
    params = [SamplingParams(max_tokens=6 + 3 * (i % 5), temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    cfg = load_config({"model": {"path": str(path)}, "scheduler": sched})
    real, real_steps, real_blocks = _real_schedule(cfg, prompts, params)
    sim, sim_steps, sim_blocks = _sim_schedule(cfg, prompts, params)
    assert sim_blocks == real_blocks
    assert sim_steps == real_steps
    assert sim == real  # the same rows, chunks, order and preemptions, step by step
    preempted = sum(len(p) for _, p in real)
    assert (preempted > 0) == (case == "tight_kv_preempts")


def test_simulated_kv_pool_is_the_real_engines(checkpoint):
    """kv_cache_memory (bytes) gives the simulated CPU device the pool the real engine plans."""
    from dspark_cluster.engine import LLMEngine

    cfg = load_config({"model": {"path": str(checkpoint("qwen3_moe"))}, "scheduler": {"kv_cache_memory": "8MiB"}})
    engine = LLMEngine(cfg)
    try:
        real = engine.num_blocks
    finally:
        engine.shutdown()
    sim = SimEngine(cfg, load_spec(cfg.model.path, cfg.model.dtype), SimOptions(hardware="cpu"), get_device("cpu"))
    assert sim.num_blocks == real


# ---- the cost model, by hand ------------------------------------------------------------------
def _toy():
    dev = Device(name="toy", memory_bytes=1e9, flops={"bf16": 1e12}, flops_efficiency={"bf16": 0.5},
                 hbm_bandwidth=1e9, hbm_efficiency=1.0, gpus_per_node=2, nvlink_bandwidth=1e8,
                 network_bandwidth=1e7, collective_latency_s=1e-5, network_latency_s=1e-4, host_overhead_s=1e-3,
                 per_seq_overhead_s=1e-4)
    m = ModelShapes(hidden=4, vocab=10, num_layers=2, num_moe_layers=1, num_dense_layers=1, attention="gqa",
                    num_heads=2, num_kv_heads=2, head_dim=2, kv_lora_rank=0, qk_rope_head_dim=0, attn_params=100,
                    mlp_params=50, shared_params=20, gate_params=16, expert_params=30, num_experts=4, top_k=2,
                    lm_head_params=40, embed_params=40)
    topo = Topology(tensor=1, data=4, gpus_per_node=2, num_slots=4)
    shape = StepShape(tokens=np.array([3, 1, 1, 1.0]), sample_rows=np.ones(4), num_seqs=np.ones(4),
                      attn_pairs=np.array([6, 10, 5, 1.0]), kv_read=np.array([3, 10, 5, 1.0]),
                      rank_tokens=np.array([[6, 3, 2, 1.0]]), rank_active=np.ones((1, 4)))
    return dev, m, topo, shape, Precision()


def test_cost_model_terms_add_up_on_a_hand_computed_step():
    dev, m, topo, shape, prec = _toy()
    t = step_time(shape, m, topo, dev, prec)
    # 5e11 FLOP/s and 1e9 B/s achievable: every GEMM here reads its weights for a few tokens (bandwidth binds)
    attn_proj = 100 * 2 / 1e9  # 2e-7 (flops: 2 * 3 * 100 / 5e11 = 1.2e-9)
    attn_core = 10 * (2 * 2 * 2) * 2 / 1e9  # the group with 10 KV tokens: 8 elements x 2 bytes each = 1.6e-7
    mlp, shared_and_gate = 50 * 2 / 1e9, (20 + 16) * 2 / 1e9
    assert t["attention"] == pytest.approx(2 * attn_core)
    assert t["dense_gemm"] == pytest.approx(2 * attn_proj + 1 * mlp + 1 * shared_and_gate)
    assert t["lm_head"] == pytest.approx(40 * 2 / 1e9)
    assert t["moe"] == pytest.approx(30 * 2 / 1e9)  # the busiest rank: 6 tokens on one expert, its weights read
    # all-to-all: the busiest group sends 3 tokens x top-2 x 4 hidden x 2 bytes = 48 bytes each way; of 4
    # ranks on 2 nodes half goes over the network: 24 B / 1e7 B/s + the network's latency
    a2a = 1e-4 + 48 * 2 / 4 / 1e7
    assert t["ep_comm"] == pytest.approx(2 * a2a)
    assert t["tp_comm"] == 0.0 and t["overlap_saved"] == 0.0 and t["drafter"] == 0.0
    assert t["host"] == pytest.approx(1e-3 + 4 * 1e-4)
    hand = 2 * attn_core + 2 * attn_proj + mlp + shared_and_gate + 40 * 2 / 1e9 + 30 * 2 / 1e9 + 2 * a2a + 1.4e-3
    assert t["total"] == pytest.approx(hand) == pytest.approx(1.605832e-3)
    assert t["total"] == pytest.approx(sum(v for k, v in t.items() if k != "total"))


def test_cost_model_rooflines_and_overlap():
    dev, m, topo, shape, prec = _toy()
    # many tokens: compute binds (2 * 1e6 * 100 FLOPs / 5e11)
    assert float(gemm_time(1e6, 100, dev, prec)) == pytest.approx(4e-4)
    assert float(gemm_time(0, 100, dev, prec)) == 0.0  # no tokens, no weights read
    # one node: NVLink only, and the node's latency
    assert float(all_to_all_time(80, 2, 2, dev)) == pytest.approx(1e-5 + 80 / 2 / 1e8)
    plain = step_time(shape, m, topo, dev, prec)
    both = step_time(shape, m, topo, dev, prec, overlap=True)
    assert both["total"] == pytest.approx(sum(v for k, v in both.items() if k != "total"))
    compute = sum(both[k] for k in ("attention", "dense_gemm", "lm_head", "moe"))
    comm = both["ep_comm"] + both["tp_comm"]
    assert both["total"] == pytest.approx(max(compute, comm) + both["host"])
    # latency-bound (a few tokens): two micro-batches pay the all-to-all's latency twice, and lose
    assert both["total"] > plain["total"]
    big = StepShape(tokens=shape.tokens * 1e4, sample_rows=shape.sample_rows * 1e4, num_seqs=shape.num_seqs * 1e4,
                    attn_pairs=shape.attn_pairs * 1e4, kv_read=shape.kv_read * 1e4,
                    rank_tokens=shape.rank_tokens * 1e4, rank_active=shape.rank_active)
    big_plain, big_both = step_time(big, m, topo, dev, prec), step_time(big, m, topo, dev, prec, overlap=True)
    # bandwidth-bound: one half's compute hides under the other's transfer
    assert big_both["total"] < big_plain["total"]
    hidden = step_time(shape, m, topo, dev, prec, async_host=True)  # the host under the device's time
    assert hidden["total"] == pytest.approx(max(plain["total"] - plain["host"], plain["host"]))


def test_cost_model_sum_roofline_and_row_overhead():
    dev, m, topo, shape, prec = _toy()
    cpu = dev.model_copy(update={"roofline": "sum", "row_overhead_s": 1e-6})
    # compute and the weights' read one after the other: 4e-4 s of FLOPs + 200 B / 1e9 B/s
    assert float(gemm_time(1e6, 100, cpu, prec)) == pytest.approx(4e-4 + 2e-7)
    t = step_time(shape, m, topo, cpu, prec)
    assert t["rows"] == pytest.approx(2 * 1e-6 * 1)  # 2 layers x the busiest group's one row
    assert t["total"] == pytest.approx(sum(v for k, v in t.items() if k != "total"))
    assert step_time(shape, m, topo, dev, prec)["rows"] == 0.0


def test_cost_model_shared_host_cores():
    """Ranks that share a host's cores with other processes: each device term divided by the rank's
    share, cores / (ranks + other processes); the collectives, the host and one rank unchanged."""
    dev, m, _, _, prec = _toy()
    topo = Topology(tensor=2, data=1, gpus_per_node=2, num_slots=4)
    shape = StepShape(tokens=np.array([4.0]), sample_rows=np.array([2.0]), num_seqs=np.array([2.0]),
                      attn_pairs=np.array([10.0]), kv_read=np.array([6.0]),
                      rank_tokens=np.array([[5.0, 3.0]]), rank_active=np.array([[2.0, 2.0]]))
    shared = dev.model_copy(update={"host_cores": 2.0, "host_procs": 1.0, "layer_overhead_s": 1e-4})
    own = dev.model_copy(update={"layer_overhead_s": 1e-4})
    assert shared.rank_share(2) == pytest.approx(2 / 3) and shared.rank_share(1) == 1.0 and own.rank_share(2) == 1.0
    a, b = step_time(shape, m, topo, shared, prec), step_time(shape, m, topo, own, prec)
    for k in ("attention", "dense_gemm", "moe", "launch"):
        assert a[k] == pytest.approx(1.5 * b[k]) and b[k] > 0, k
    # lm_head: the GEMM slows, the logits' all-gather does not: 2 rows x 20 params a rank, 2 x 10 x 4 B gathered
    gemm, gather = 20 * 2 / 1e9, 1e-5 + 0.5 * 2 * 10 * 4 / 1e8
    assert b["lm_head"] == pytest.approx(gemm + gather) and a["lm_head"] == pytest.approx(1.5 * gemm + gather)
    for k in ("tp_comm", "ep_comm", "host"):
        assert a[k] == b[k] > 0, k
    assert a["total"] == pytest.approx(sum(v for k, v in a.items() if k != "total"))
    one = Topology(tensor=1, data=1, gpus_per_node=2, num_slots=4)  # one process: its figures are its own
    assert step_time(shape, m, one, shared, prec)["total"] == step_time(shape, m, one, own, prec)["total"]


def test_padded_attention_from_the_schedule(tmp_path):
    """The cpu entry's attention is the engine's padded kernel: decode rows one batch, the other rows
    another, each padded to its longest query and its longest context in whole blocks (16 tokens)."""
    from dspark_cluster.sequence import Sequence
    from dspark_cluster.simulate.cost_model import padded_attention_time
    from dspark_cluster.simulate.run import build

    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"arrival_s": 0.0, "prompt_len": n, "output_len": 3}) for n in (20, 40)))
    cfg = load_config(None, [f"report.out_dir={tmp_path}"])
    engine, requests = build(cfg, SimOptions(hardware="cpu", trace=str(trace), record_shapes=True))
    assert engine.dev.attention_kernel == "padded"
    names = iter(range(len(requests)))
    engine.run(requests, lambda r: Sequence(f"p{next(names)}", list(r.prompt_ids), len(r.prompt_ids), r.params,
                                            engine.spec.eos_token_ids, arrival_time=r.arrival_s))
    first, second = engine.shape_record[:2]
    # step 1: the two prompts, 40 queries x 48 keys each; step 2: two decodes over 48 keys (contexts 21, 41)
    assert (first.padded_pairs[0], first.padded_kv[0]) == (2 * 40 * 48, 2 * 48)
    assert (second.padded_pairs[0], second.padded_kv[0]) == (2 * 48, 2 * 48)
    assert first.attn_pairs[0] == 20 * 21 / 2 + 40 * 41 / 2  # the causal pairs a varlen kernel would compute
    m, dev, prec = engine.shapes, engine.dev, engine.prec
    heads, lat = m.num_heads, m.kv_lora_rank + m.qk_rope_head_dim  # MLA absorbed: q.k and p.v over the latent
    flops = 3840 * 4 * heads * lat
    bytes_ = 3 * 96 * lat * prec.kv_bytes + 3840 * heads * 4  # the gathered KV copied and read, the fp32 mask
    hand = flops / dev.achievable_flops("fp32") + bytes_ / dev.achievable_hbm  # roofline sum
    assert float(padded_attention_time(3840, 96, m, 1, dev, prec)) == pytest.approx(hand)
    t = step_time(first, m, engine.topo, dev, prec)
    assert t["attention"] == pytest.approx(m.num_layers * hand)


def _replayed_steps(tmp_path, overrides, dev_update, tag):
    """A 'real' run's step records made by a known device: the simulation's own replay of the
    bundled config with `overrides`, each step's execute_s the cost model's time on that device."""
    from dspark_cluster.sequence import Sequence
    from dspark_cluster.simulate.run import build

    cfg = load_config(None, [f"report.out_dir={tmp_path}", *overrides])
    engine, requests = build(cfg, SimOptions(hardware="cpu", record_shapes=True))
    names = iter(range(len(requests)))
    engine.run(requests, lambda r: Sequence(f"{tag}{next(names)}", list(r.prompt_ids), len(r.prompt_ids), r.params,
                                            engine.spec.eos_token_ids, arrival_time=r.arrival_s))
    dev = engine.dev.model_copy(update={"host_overhead_s": 0.0, "per_seq_overhead_s": 0.0, "per_token_overhead_s": 0.0,
                                        "roofline": "sum", **dev_update})
    return engine, [{"num_seqs": int(sh.num_seqs.sum()), "num_tokens": int(sh.tokens.sum()),
                     "execute_s": step_time(sh, engine.shapes, engine.topo, dev, engine.prec)["total"]}
                    for sh in engine.shape_record]


def test_cpu_fit_recovers_the_shared_host_figures(tmp_path):
    """fit_to_run over a one-process run and a tensor-2 run through Ray whose step times a known
    device made (its collective latency and the busy processes beside the ranks on 2 cores among its
    figures): the one least squares returns every figure, the per-row overhead (which each rank
    repeats) told apart from the work the ranks split."""
    from dspark_cluster.simulate.fit import FITTED, SHARED, fit_to_run

    truth = {"flops": 4e10, "hbm_bandwidth": 6e9, "layer_overhead_s": 1.5e-3, "row_overhead_s": 2e-5,
             "collective_latency_s": 1.2e-3, "host_procs": 2.5}
    assert set(truth) == set(FITTED + SHARED)
    dev = {**truth, "flops": {k: truth["flops"] for k in ("fp32", "bf16", "fp8")}, "host_cores": 2.0}
    one = ["workload.num_requests=16"]
    tp2 = ["parallel.tensor=2", "parallel.executor=ray", "workload.kind=synthetic", "workload.num_requests=16",
           "workload.prompt_len=[100,300]", "scheduler.max_num_seqs=8"]
    _, steps1 = _replayed_steps(tmp_path, one, dev, "a")
    engine, steps2 = _replayed_steps(tmp_path, tp2, dev, "b")
    assert engine.topo.world == 2 and any(st["num_tokens"] > 100 for st in steps2)  # prompt chunks and decodes
    stalled = [{**st, "execute_s": st["execute_s"] * 1.7} for st in steps2]  # a stalled repeat: the fastest counts
    fit = fit_to_run([(one, [{"steps": steps1}])], [(tp2, [{"steps": stalled}, {"steps": steps2}])], cores=2)
    assert fit["fitted_steps"] == len(steps1) and fit["shared_fitted_steps"] == len(steps2)
    assert fit["rms_log_error"] < 1e-3 and fit["shared_rms_log_error"] < 1e-3 and fit["host_cores"] == 2.0
    for k, v in truth.items():
        assert fit[k] == pytest.approx(v, rel=0.02), k


def test_cpu_fit_recovers_the_figures_that_made_the_step_times(tmp_path):
    """fit_to_run on a 'real' run whose step times a known device made (the simulation's own
    replay of the default config): the fitted figures are that device's."""
    from dspark_cluster.sequence import Sequence
    from dspark_cluster.simulate.fit import FITTED, fit_to_run
    from dspark_cluster.simulate.run import build

    truth = {"flops": 4e10, "hbm_bandwidth": 6e9, "layer_overhead_s": 1.5e-3, "row_overhead_s": 2e-5}
    cfg = load_config(None, [f"report.out_dir={tmp_path}", "workload.num_requests=16"])
    engine, requests = build(cfg, SimOptions(hardware="cpu", record_shapes=True))
    names = iter(range(len(requests)))
    engine.run(requests, lambda r: Sequence(f"t{next(names)}", list(r.prompt_ids), len(r.prompt_ids), r.params,
                                            engine.spec.eos_token_ids, arrival_time=r.arrival_s))
    dev = engine.dev.model_copy(update={"host_overhead_s": 0.0, "per_seq_overhead_s": 0.0, "per_token_overhead_s": 0.0,
                                        "roofline": "sum", "flops": {k: truth["flops"] for k in ("fp32", "bf16", "fp8")},
                                        **{k: v for k, v in truth.items() if k != "flops"}})
    steps = [{"num_seqs": int(sh.num_seqs.sum()), "num_tokens": int(sh.tokens.sum()),
              "execute_s": step_time(sh, engine.shapes, engine.topo, dev, engine.prec)["total"]}
             for sh in engine.shape_record]
    noisy = [{**st, "execute_s": st["execute_s"] * 1.7} for st in steps]  # a stalled repeat: the fastest counts
    fit = fit_to_run([(["workload.num_requests=16"], [{"steps": noisy}, {"steps": steps}])])
    assert fit["fitted_steps"] == len(steps) and fit["rms_log_error"] < 1e-3
    for k in FITTED:
        assert fit[k] == pytest.approx(truth[k], rel=0.02), k


def test_catalog_entries_are_sourced():
    cat = load_catalog()
    assert {"H800", "H100", "H200", "B200", "cpu"} <= set(cat)
    for name, d in cat.items():
        extra = d.model_extra or {}
        for figure in ("memory", "flops", "hbm_bandwidth", "nvlink", "host_overhead"):
            assert any(k.startswith(f"source_{figure}") for k in extra), (name, figure)


def test_acceptance_draws_follow_the_survival_curve():
    acc = Acceptance([0.8, 0.6, 0.45], spread=0.0, seed=1)
    cond = acc.draw(200_000, 3)
    n = acc.accepted(cond, np.full(200_000, 3))
    survival = [(n > j).mean() for j in range(3)]
    assert survival == pytest.approx([0.8, 0.6, 0.45], abs=0.01)


# ---- end to end -------------------------------------------------------------------------------
def test_dspark_simulate_on_the_bundled_config(tmp_path, capsys):
    assert main(["simulate", "--set", f"report.out_dir={tmp_path}", "--set", "report.name=sim",
                 "--set", "workload.num_requests=8"]) == 0
    out = capsys.readouterr().out
    assert "SIMULATED on cpu" in out and "output tokens/s" in out
    report = json.loads((tmp_path / "sim" / "report.json").read_text())
    assert report["simulated"] and report["summary"]["simulated"] and report["summary"]["requests"] == 8
    assert report["summary"]["output_tokens"] == sum(r["num_output_tokens"] for r in report["requests"])
    assert report["cost"]["cost_per_million_output_tokens"] > 0
    assert (tmp_path / "sim" / "latency.png").is_file()


def test_simulate_deepseek_v3_from_its_config_json(tmp_path):
    """A shipped real-checkpoint topology, its model a config.json alone: EP 16 on 2 x 8 H200 under a
    skewed load; EPLB rebalances and raises balancedness."""
    cfg = load_config(REPO / "configs" / "deepseek-v3-fp8-2x8-h200.yaml",
                      [f"model.path={DEEPSEEK_V3}", "workload.num_requests=64", "workload.output_len=[32,64]",
                       f"report.out_dir={tmp_path}", "eplb.interval_steps=20", "eplb.window_steps=20"])
    skewed = SimOptions(hardware="H200", expert_load={"skew": 1.0}, record_steps=True)
    report = simulate(cfg, skewed)
    s = report["summary"]
    assert s["simulated"] and s["hardware"] == "H200" and s["devices"] == 16 and s["nodes"] == 2
    assert s["rebalances"] >= 1
    ex = report["experts"]
    assert ex["balancedness_last_tenth"] > ex["balancedness_first_tenth"]
    mem = report["simulation"]["memory_per_rank"]
    assert 100 * 2**30 < mem["weight_bytes"] < 125 * 2**30  # ~112.8 GiB a rank in bf16 (BENCHMARKS.md kv-plan)


def test_sweep_simulate(tmp_path, capsys):
    assert main(["sweep", "--simulate", "--grid", "scheduler.max_num_seqs=4,16", "--set", f"report.out_dir={tmp_path}",
                 "--set", "workload.num_requests=8", "--name", "s"]) == 0
    rows = (tmp_path / "s" / "sweep.csv").read_text().splitlines()
    assert len(rows) == 3

    points = list(csv.DictReader((tmp_path / "s" / "sweep.csv").open()))
    assert [p["status"] for p in points] == ["ok", "ok"]  # (a point that raises is written too, as failed)
    reports = sorted((tmp_path / "s").glob("*/report.json"))
    assert len(reports) == 2 and all(json.loads(r.read_text())["simulated"] for r in reports)  # not real runs


def test_simulated_speculation_verifies_drafts_under_the_confidence_schedule(tmp_path):
    cfg = load_config(None, [f"report.out_dir={tmp_path}", "workload.num_requests=8", "speculative.method=dspark",
                             "speculative.draft_model=tiny-dspark", "speculative.num_tokens=4"])
    report = simulate(cfg, SimOptions(hardware="cpu", acceptance={"survival": [0.9, 0.8, 0.7, 0.6]}), write=False)
    spec = report["summary"]["speculative"]
    assert spec["num_verified"] > 0 and spec["num_accepted_tokens"] > 0
    assert 1.0 < spec["mean_accepted_length"] <= 5.0
    # acceptance by position is what the verify rounds drew (the engine's SpecStats), not the curve given
    assert spec["survival_given"] == pytest.approx([0.9, 0.8, 0.7, 0.6])
    first = spec["acceptance_by_position"][0]
    assert first != pytest.approx(0.9, abs=1e-9) and abs(first - 0.9) < 0.2
    assert report["cost"]["tokens"]["drafted"] >= spec["num_verified"]
    assert report["simulation"]["time_by_term_s"]["drafter"] > 0


def test_simulated_planner_learns_each_sequences_offset_as_the_engines_does(tmp_path, monkeypatch):
    """acceptance.sequence_spread: each sequence's drafts survive more or less than their confidences say. The
    simulator's planner chooses with each sequence's offset and learns it from that sequence's rounds, as the
    engine's (Speculation.attach / observe / free): at a sequence's end the offset it learned follows the hidden one,
    and the sequence is forgotten by both. Without the spread nothing is hidden and the offsets stay near 0."""
    from dspark_cluster.speculative.verify_budget import VerifyPlanner

    learned = {}  # seq_id -> (offset learned, hidden offset) when the sequence finished
    forget = VerifyPlanner.forget

    def recording(self, seq_ids):
        for sid in seq_ids:
            learned[sid] = (float(self.sequence_offsets([sid])[0]), engine.acceptance.offsets.get(sid, 0.0))
        forget(self, seq_ids)

    chosen_with = []  # the offsets each step's verify lengths were chosen with
    verify_lengths = VerifyPlanner.verify_lengths

    def choosing(self, raw, base_tokens, base_expected, draft_s, offsets=None):
        chosen_with.append(offsets)
        return verify_lengths(self, raw, base_tokens, base_expected, draft_s, offsets)

    monkeypatch.setattr(VerifyPlanner, "forget", recording)
    monkeypatch.setattr(VerifyPlanner, "verify_lengths", choosing)
    cfg = load_config(None, [f"report.out_dir={tmp_path}", "workload.num_requests=24", "workload.output_len=[192,192]",
                             "scheduler.max_num_seqs=2",  # a load where drafting pays on the simulated CPU
                             "speculative.method=dspark", "speculative.draft_model=tiny-dspark",
                             "speculative.num_tokens=4", "speculative.schedule=confidence"])
    for spread in (1.0, 0.0):
        learned.clear()
        chosen_with.clear()
        engine, reqs = build(cfg, SimOptions(hardware="cpu", acceptance={"survival": [0.9, 0.8, 0.7, 0.6],
                                                                         "sequence_spread": spread}))
        names = iter(range(len(reqs)))
        seqs = engine.run(reqs, lambda r: Sequence(f"r{next(names)}", list(r.prompt_ids), len(r.prompt_ids),
                                                   r.params, engine.spec.eos_token_ids))
        assert len(seqs) == 24 and engine.tokens["drafted"] > 0
        got, hidden = np.array([v[0] for v in learned.values()]), np.array([v[1] for v in learned.values()])
        assert len(got) == 24 and not engine.planner._seq and not engine.acceptance.offsets  # all forgotten
        assert chosen_with and all(d is not None for d in chosen_with)
        if spread:
            # (0 until a sequence's first round)
            assert sum(bool(np.any(d)) for d in chosen_with) > len(chosen_with) / 2
            assert hidden.std() > 0.5 and np.corrcoef(got, hidden)[0, 1] > 0.8, (got, hidden)
        else:
            assert not hidden.any() and np.abs(got).max() < 0.5, got


def test_trace_with_shared_prefixes_hits_the_prefix_cache(tmp_path):
    trace = tmp_path / "trace.jsonl"
    lines = [{"arrival_s": 0.5 * i, "prompt_len": 64, "output_len": 4, "prefix_group": i % 2, "prefix_len": 48}
             for i in range(8)]
    trace.write_text("\n".join(json.dumps(x) for x in lines))
    cfg = load_config(None, [f"report.out_dir={tmp_path}"])
    s = simulate(cfg, SimOptions(hardware="cpu", trace=str(trace)), write=False)["summary"]
    assert s["requests"] == 8 and s["output_tokens"] == 32
    # the 6 later requests of the two groups find the 48-token prefix (3 blocks of 16) cached
    assert s["prefix_cached_tokens"] == 6 * 48


def test_simulated_idle_drafter_exports_nothing_and_catches_up(tmp_path):
    """As the engine with the workers' ContextStash: steps that draft nothing export no rows; a
    static schedule (drafting every step) exports every committed row. (Also: rows the verify budget
    cut to nothing are outcomes, as in the engine: else a drafter this poor keeps it learning.)"""
    # (32 requests: learning exports a fixed ~3 MB here, its 4 rows' contexts, which 16 requests' run is too short to
    # leave under the bound since the prior gate learns at 16 rows)
    base = [f"report.out_dir={tmp_path}", "workload.num_requests=32", "speculative.method=dspark",
            "speculative.draft_model=tiny-dspark", "speculative.num_tokens=4", "speculative.placement=group"]
    exported = {}
    for schedule, survival in (("static", [0.9, 0.8, 0.7, 0.6]), ("confidence", [0.02, 0.01, 0.005, 0.001])):
        cfg = load_config(None, [*base, f"speculative.schedule={schedule}"])
        rep = simulate(cfg, SimOptions(hardware="cpu", acceptance={"survival": survival}), write=False)
        exported[schedule] = (rep["cost"]["comm_bytes"]["hidden_state_export"],
                              rep["cost"]["tokens"]["prompt"] + rep["cost"]["tokens"]["output"])
    static_bytes, static_tokens = exported["static"]
    idle_bytes, _ = exported["confidence"]
    assert static_bytes > 0.5 * static_tokens * 2 * 256 * 4  # ~every row: 2 layers x hidden 256 x fp32
    # the schedule learns on 4 rows (they export), then drafts and exports nothing
    assert idle_bytes < 0.4 * static_bytes
    # and the planner's exploration is paced in simulated time: the same run again, however slow this
    # machine is meanwhile, explores as often
    time.sleep(0.2)
    cfg = load_config(None, [*base, "speculative.schedule=confidence"])
    again = simulate(cfg, SimOptions(hardware="cpu", acceptance={"survival": [0.02, 0.01, 0.005, 0.001]}), write=False)
    assert again["cost"]["comm_bytes"]["hidden_state_export"] == idle_bytes


def test_simulated_drafter_on_the_target_has_no_devices_and_exports_nothing(tmp_path):
    """speculative.placement target: the drafter drafts on the target's driver rank (its time is the
    target's, on the target's device); group on Ray: drafter devices of their own, and the context rows
    cross to them."""
    base = [f"report.out_dir={tmp_path}", "workload.num_requests=8", "speculative.method=dspark",
            "speculative.draft_model=tiny-dspark", "speculative.num_tokens=4", "speculative.schedule=static",
            "parallel.executor=ray"]
    reps = {p: simulate(load_config(None, [*base, f"speculative.placement={p}"]),
                        SimOptions(hardware="cpu", acceptance={"survival": [0.9, 0.8, 0.7, 0.6]}), write=False)
            for p in ("target", "group")}
    target, group = reps["target"]["cost"], reps["group"]["cost"]
    assert "drafter" not in target["roles"] and group["roles"]["drafter"]["devices"] == 1
    assert target["comm_bytes"]["hidden_state_export"] == 0 < group["comm_bytes"]["hidden_state_export"]
    assert reps["target"]["simulation"]["time_by_term_s"]["drafter"] > 0
    assert reps["target"]["simulation"]["time_by_term_s"]["export"] == 0


def test_simulated_planner_reads_the_prior_gate_from_the_config(tmp_path):
    """speculative.prior_acceptance reaches the simulator's planner as the engine's: a prior under which no load
    pays keeps the gate shut before any outcome (nothing learnt, nothing exported), null learns at once."""
    base = [f"report.out_dir={tmp_path}", "workload.num_requests=16", "speculative.method=dspark",
            "speculative.draft_model=tiny-dspark", "speculative.num_tokens=4", "speculative.placement=group",
            "speculative.schedule=confidence"]
    exported = {}
    for prior in ("null", "0.01"):
        cfg = load_config(None, [*base, f"speculative.prior_acceptance={prior}"])
        rep = simulate(cfg, SimOptions(hardware="cpu", acceptance={"survival": [0.9, 0.8, 0.7, 0.6]}), write=False)
        exported[prior] = rep["cost"]["comm_bytes"]["hidden_state_export"]
    assert exported["0.01"] < exported["null"] and exported["null"] > 0


def test_the_simulated_drafter_takes_the_passes_its_hardware_would(tmp_path):
    """speculative.draft_passes auto resolves as the simulated hardware would: the bundled drafter's second
    pass on a GPU, one pass on the CPU; an explicit value is kept."""
    import json
    import shutil

    from dspark_cluster.config import ASSETS_DIR, load_config
    from dspark_cluster.simulate.options import SimOptions
    from dspark_cluster.simulate.run import drafter_figures

    drafter = tmp_path / "d"
    shutil.copytree(ASSETS_DIR / "tiny-dspark", drafter)
    raw = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**raw, "draft_passes": 2}))
    sets = ["speculative.method=dspark", f"speculative.draft_model={drafter}"]
    cfg = load_config(None, sets)
    assert drafter_figures(cfg, SimOptions(hardware="H200")).draft_passes == 2
    assert drafter_figures(cfg, SimOptions(hardware="cpu")).draft_passes == 1
    cfg1 = load_config(None, sets + ["speculative.draft_passes=1"])
    assert drafter_figures(cfg1, SimOptions(hardware="H200")).draft_passes == 1
