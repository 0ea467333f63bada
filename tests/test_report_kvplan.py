"""Run report files (report.py) and the per-rank KV cache plan (kv_plan.py)."""

from __future__ import annotations

import csv
import json
import math

import pytest

from dspark_cluster.config import load_config
from dspark_cluster.kv_plan import format_kv_plan, kv_plan
from dspark_cluster.report import REQUEST_COLUMNS, format_summary, summarize, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _request(i, ttft, tpot, n_out=4, itl=None):
    return {
        "request_id": f"req-{i}", "finish_reason": "length", "arrival_time": 100.0 + i, "ttft_s": ttft,
        "tpot_s": tpot, "e2e_s": None if ttft is None else ttft + tpot * (n_out - 1),
        "itl_s": itl if itl is not None else [tpot] * (n_out - 1), "num_prompt_tokens": 8,
        "num_output_tokens": n_out, "num_preemptions": i % 2, "num_draft_tokens": 0, "num_accepted_tokens": 0,
    }


def _steps(n):
    return [{"time": 1000.0 + 0.01 * k, "step_time_s": 0.005 + 0.001 * (k % 3), "num_seqs": 1 + k % 4,
             "num_tokens": 4 + k, "kv_blocks_used": min(k, 12), "num_preempted": 0} for k in range(n)]


# ---- report -------------------------------------------------------------------------------------
def test_write_report_files(tmp_path):
    requests = [_request(i, 0.01 * (i + 1), 0.002 * (i + 1)) for i in range(5)]
    requests.append(_request(5, None, 0.0, n_out=0, itl=[]))  # never got a token
    steps = _steps(40)
    summary = summarize(requests, steps, duration_s=2.0, kv_blocks_total=16, preemptions=2)
    report = {"config": {"model": {"path": "x"}}, "summary": summary, "requests": requests, "steps": steps}
    paths = write_report(report, tmp_path / "run")
    names = [p.name for p in paths]
    assert names == ["report.json", "requests.csv", "latency.png", "kv_usage.png", "step_time.png"]
    assert all(p.parent == tmp_path / "run" and p.is_file() for p in paths)

    assert json.loads((tmp_path / "run" / "report.json").read_text())["summary"]["kv_blocks_total"] == 16
    with (tmp_path / "run" / "requests.csv").open() as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == REQUEST_COLUMNS and "itl_s" not in rows[0]
    assert len(rows) == 1 + len(requests)
    assert rows[1][0] == "req-0" and rows[-1][REQUEST_COLUMNS.index("ttft_s")] == ""
    for name in ("latency.png", "kv_usage.png", "step_time.png"):
        data = (tmp_path / "run" / name).read_bytes()
        assert len(data) > 1000 and data[:8] == PNG_MAGIC
    col = REQUEST_COLUMNS.index("arrival_s")  # seconds since the first arrival, not the engine's clock
    assert [float(r[col]) for r in rows[1:]] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_one_rank_reports_expert_skew_not_balancedness():
    from dspark_cluster.report import expert_max_over_mean

    assert expert_max_over_mean([[1, 1, 1, 1], [4, 0, 0, 0]]) == pytest.approx((1 + 4) / 2)
    text = format_summary({"expert_load_max_over_mean": 2.5})
    assert "expert load max / mean (one rank)  2.50" in text and "balancedness" not in text


def test_kv_panel_shows_a_small_use_of_a_large_pool():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dspark_cluster.report import _plot_kv_usage

    steps = _steps(40)  # at most 12 blocks used
    fig = _plot_kv_usage(plt, [], steps, 13107)
    ax = fig.axes[0]
    assert ax.get_ylim()[1] < 20 and "peak 12 = 0.1% of 13107" in ax.get_title()
    fig = _plot_kv_usage(plt, [], steps, 14)  # a pool the run nearly fills: its line is drawn
    assert fig.axes[0].get_ylim()[1] > 14
    plt.close("all")


def test_report_of_a_calibrating_run_plots_tau_by_drafter_version(tmp_path):
    steps = _steps(120)
    for k, s in enumerate(steps):
        s.update(spec_rounds=2, spec_tokens=4 + (k > 60), drafter_version=int(k > 60) if k < 100 else 0,
                 num_drafted=8, num_verified=8, verify_budget=12)
    summary = summarize([_request(0, 0.01, 0.002)], steps, duration_s=2.0, kv_blocks_total=16, preemptions=0)
    summary["speculative"] = {"mean_accepted_length": 2.2, "acceptance_by_position": [0.6], "draft_time_s": 0.1,
                              "verify_time_s": 0.2, "drafter_versions": {
                                  "serving_version": 0, "pinned": False, "events": [{"event": "publish"}, {"event": "auto rollback"}],
                                  "history": [{"version": 0, "live_tau": 2.0, "live_acceptance": 0.25},
                                              {"version": 1, "live_tau": 2.5, "live_acceptance": 0.37}]}}
    paths = write_report({"config": {}, "summary": summary, "requests": [], "steps": steps}, tmp_path)
    assert (tmp_path / "drafter_versions.png").read_bytes()[:8] == PNG_MAGIC
    assert "drafter_versions.png" in [p.name for p in paths]
    text = format_summary(summary)
    assert "v0 2.00 / 0.25, v1 2.50 / 0.37" in text and "2 publish/rollback events" in text


def test_write_report_empty(tmp_path):
    summary = summarize([], [], duration_s=0.0, kv_blocks_total=8, preemptions=0)
    paths = write_report({"config": {}, "summary": summary, "requests": [], "steps": []}, tmp_path)
    assert len(paths) == 5
    assert (tmp_path / "requests.csv").read_text().strip() == ",".join(REQUEST_COLUMNS)
    for p in paths[2:]:
        assert p.read_bytes()[:8] == PNG_MAGIC
    text = format_summary(summary)
    assert "n/a" in text and "0 / 8" in text


def test_summarize_percentiles():
    # TTFT 1..100 ms: numpy linear percentiles p50 = 50.5 ms, p99 = 99.01 ms
    requests = [_request(i, (i + 1) / 1000, 0.01, n_out=3, itl=[0.01, 0.03]) for i in range(100)]
    requests.append(_request(100, None, 0.0, n_out=1, itl=[]))  # no TTFT; TPOT undefined (1 token)
    steps = _steps(10)
    s = summarize(requests, steps, duration_s=4.0, kv_blocks_total=32, preemptions=3)
    assert s["requests"] == 101 and s["steps"] == 10
    assert s["output_tokens"] == 301 and s["output_tokens_per_s"] == pytest.approx(301 / 4)
    assert s["ttft_p50_s"] == pytest.approx(0.0505) and s["ttft_p99_s"] == pytest.approx(0.09901)
    assert s["tpot_p50_s"] == pytest.approx(0.01) and s["tpot_p99_s"] == pytest.approx(0.01)
    assert s["itl_p50_s"] == pytest.approx(0.02) and s["itl_p99_s"] == pytest.approx(0.03)
    assert s["e2e_p50_s"] == pytest.approx(0.0705)
    assert s["kv_blocks_peak"] == 9 and s["kv_blocks_total"] == 32 and s["preemptions"] == 3
    assert s["mean_batch_size"] == pytest.approx(sum(1 + k % 4 for k in range(10)) / 10)

    empty = summarize([], [], duration_s=0.0, kv_blocks_total=4, preemptions=0)
    for key in ("output_tokens_per_s", "ttft_p50_s", "tpot_p99_s", "itl_p50_s", "e2e_p99_s", "mean_batch_size"):
        assert math.isnan(empty[key]), key
    assert empty["kv_blocks_peak"] == 0 and empty["steps"] == 0

    lines = format_summary(s).splitlines()
    assert [ln.split("  ")[0] for ln in lines] == [
        "requests", "output tokens/s", "TTFT p50 / p99 (ms)", "TPOT p50 / p99 (ms)", "KV blocks peak / total",
        "preemptions", "prefix cache hits / tokens reused"]
    assert lines[-1].endswith("0.0% / 0")  # these requests reused nothing
    col = len("prefix cache hits / tokens reused") + 2  # values start in one column
    assert all(ln[col - 2:col] == "  " and ln[col] != " " for ln in lines)
    assert "50.5 / 99.0" in lines[2] and "9 / 32" in lines[4]


# ---- kv plan ------------------------------------------------------------------------------------
def _loaded_bytes_per_block(path, block_size):
    from dspark_cluster.kv_cache import kv_bytes_per_block
    from dspark_cluster.model.loader import load_model
    from dspark_cluster.model.spec import load_spec

    return kv_bytes_per_block(load_model(path, load_spec(path, "float32")), block_size)


@pytest.mark.parametrize("arch, attention", [("deepseek_v3", "mla"), ("qwen3_moe", "gqa")])
def test_kv_plan_matches_engine(checkpoint, arch, attention):
    from dspark_cluster.model.spec import load_spec

    path = checkpoint(arch)
    spec = load_spec(path, "float32")
    cfg1 = load_config({"model": {"path": str(path), "dtype": "float32"}, "scheduler": {"block_size": 8}})
    (row,) = kv_plan(cfg1, spec)
    assert row["attention"] == attention and row["rank"] == 0 and row["tp_rank"] == 0
    assert row["kv_bytes_per_block"] == _loaded_bytes_per_block(path, 8)
    assert row["kv_bytes_per_token"] == row["kv_bytes_per_token_per_layer"] * spec.num_layers
    # on the CPU the loader's oneDNN copies of the linear weights (model/gemm.py) are planned as the engine makes them
    from dspark_cluster.model.loader import load_model

    assert row["reordered_weight_bytes"] == load_model(path, spec).reordered_bytes
    assert row["device_type"] != "cpu" or row["headroom_bytes"] == row["device_memory"] - row["weight_bytes"] \
        - row["reordered_weight_bytes"] - row["kv_pool_bytes"]

    cfg2 = load_config({"model": {"path": str(path), "dtype": "float32"}, "scheduler": {"block_size": 8},
                        "parallel": {"tensor": 2, "executor": "ray"}})
    rows = kv_plan(cfg2, spec)
    assert [r["rank"] for r in rows] == [0, 1] and [r["tp_rank"] for r in rows] == [0, 1]
    if attention == "gqa":  # qwen3_moe: 2 KV heads -> 1 per rank, half the bytes, twice the blocks
        assert row["kv_heads_per_rank"] == 2 and rows[0]["kv_heads_per_rank"] == 1
        assert rows[0]["kv_bytes_per_block"] * 2 == row["kv_bytes_per_block"]
        assert rows[0]["kv_bytes_per_token_per_layer"] == 2 * 1 * spec.head_dim * 4
    else:  # the MLA latent is replicated: same bytes on every rank
        assert row["kv_heads_per_rank"] == rows[0]["kv_heads_per_rank"] == 1
        assert rows[0]["kv_bytes_per_block"] == row["kv_bytes_per_block"]
        assert rows[0]["kv_bytes_per_token_per_layer"] == (spec.kv_lora_rank + spec.qk_rope_head_dim) * 4
    text = format_kv_plan(rows)
    assert "MLA" in text and "GQA" in text and len(text.splitlines()) >= 2 + len(rows)


def test_kv_plan_capacity_arithmetic(checkpoint):
    from dspark_cluster.model.spec import load_spec

    path = checkpoint("qwen3_moe")
    spec = load_spec(path, "float32")  # 3 layers, 2 KV heads x 16 dims, fp32 -> 768 B/token at tp 1
    cfg = load_config({"model": {"path": str(path)}, "scheduler": {"block_size": 16, "num_kv_blocks": 100},
                       "parallel": {"data": 2, "executor": "ray"}})
    rows = kv_plan(cfg, spec, context_len=100)
    assert len(rows) == 2 and [r["dp_rank"] for r in rows] == [0, 1] and [r["tp_rank"] for r in rows] == [0, 0]
    r = rows[0]
    assert r["kv_bytes_per_token"] == 2 * 2 * 16 * 4 * 3 == 768
    assert r["num_blocks"] == 100 and r["tokens_capacity"] == 1600
    assert r["context_len"] == 100 and r["seqs_at_context_len"] == 100 // 7  # ceil(100 / 16) = 7 blocks

    # auto blocks from the memory budget; context from max_model_len, then the model's max positions
    cfg = load_config({"model": {"path": str(path)}, "scheduler": {"block_size": 16, "kv_cache_memory": 1_000_000,
                                                                    "max_model_len": 256}})
    (r,) = kv_plan(cfg, spec)
    assert r["kv_bytes_per_block"] == 768 * 16 and r["num_blocks"] == 1_000_000 // (768 * 16) == 81
    assert r["context_len"] == 256 and r["seqs_at_context_len"] == 81 // 16
    cfg = load_config({"model": {"path": str(path)}})
    assert kv_plan(cfg, spec)[0]["context_len"] == spec.max_position_embeddings == 512
