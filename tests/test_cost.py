"""The cost ledger's arithmetic, `dspark compare` on saved reports, and `dspark sweep` end to end."""

from __future__ import annotations

import csv
import json
import math
import shutil

import pytest

from dspark_cluster.cli import main
from dspark_cluster.cost import compare_runs, cost_ledger, ledger_metrics

GIB = 2**30


def fake_ledger(held_s=3600.0, gpus=2, throughput_memory=1.0):
    """Two GPU target workers and a Router on a CPU core, held an hour; known busy time and sizes."""
    devices = [{"role": "target", "rank": r, "kind": "gpu",
                "memory": {"weights": 10 * GIB, "kv_pool": int(20 * GIB * throughput_memory), "kv_peak_used": 5 * GIB}}
               for r in range(gpus)]
    devices.append({"role": "router", "rank": 0, "kind": "cpu", "memory": {}})
    busy = {"target": 0.5 * gpus * held_s, "router": 0.25 * held_s}
    tokens = {"prompt": 3_000_000, "output": 1_000_000, "drafted": 400_000, "accepted": 300_000, "recomputed": 1000}
    comm = {"all_reduce": 8_000_000_000, "all_to_all": 2_000_000_000, "hidden_state_export": 0}
    return cost_ledger(held_s, devices, busy, tokens, comm, {"gpu": 2.0, "cpu": 0.1}, num_requests=100)


def test_ledger_arithmetic_on_a_fake_run():
    c = fake_ledger()
    assert c["roles"]["target"]["devices"] == 2 and c["roles"]["target"]["kind"] == "gpu"
    assert c["roles"]["target"]["device_seconds"] == 7200 and c["device_seconds"] == 7200 + 3600
    assert c["roles"]["target"]["utilisation"] == pytest.approx(0.5)
    assert c["roles"]["router"]["utilisation"] == pytest.approx(0.25)
    assert c["roles"]["target"]["cost"] == pytest.approx(4.0) and c["roles"]["router"]["cost"] == pytest.approx(0.1)
    assert c["cost"] == pytest.approx(4.1)
    assert c["cost_per_million_output_tokens"] == pytest.approx(4.1)  # one million output tokens
    assert c["cost_per_request"] == pytest.approx(0.041)
    # memory: the KV peak is part of the pool, not more memory held
    assert c["memory"]["per_device"][0]["held_bytes"] == 30 * GIB
    assert c["memory"]["held_bytes"] == 60 * GIB and c["memory"]["max_device_bytes"] == 30 * GIB
    assert c["memory"]["by_kind"]["kv_peak_used"] == 10 * GIB
    assert c["comm_bytes"]["total"] == 10_000_000_000
    assert c["comm_bytes_per_output_token"]["all_reduce"] == pytest.approx(8000)
    assert c["comm_bytes_per_output_token"]["total"] == pytest.approx(10_000)
    assert c["tokens"]["recomputed"] == 1000
    # no output: the per-token figures are NaN, not a division error
    empty = cost_ledger(10.0, [], {"target": None}, {}, {}, {"gpu": 1.0}, 0)
    assert math.isnan(empty["cost_per_million_output_tokens"]) and math.isnan(empty["cost_per_request"])
    assert empty["roles"]["target"]["utilisation"] is None
    # the Prometheus table: one sample per gauge and label set, all finite
    samples = ledger_metrics(c)
    assert ("dspark_device_seconds", {"role": "target"}) in [(n, labels) for n, _, labels, _ in samples]
    assert all(math.isfinite(v) for *_, v in samples)


def _report(tokens_per_s, ledger, tpot_p99=0.02):
    return {"summary": {"output_tokens_per_s": tokens_per_s, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2,
                        "tpot_p50_s": 0.01, "tpot_p99_s": tpot_p99}, "cost": ledger}


def test_gain_over_cost_verdicts():
    base = _report(100.0, fake_ledger())
    online = compare_runs(base, _report(200.0, fake_ledger()))
    assert online["gain_over_cost"] == pytest.approx(2.0) and online["verdict"] == "suits online serving"
    # twice the throughput for three times the memory: offline batches (the example)
    big = fake_ledger(throughput_memory=4.0)  # 10 + 80 GiB per device against 10 + 20 GiB: 3x
    offline = compare_runs(base, _report(200.0, big))
    assert offline["memory_gain"] == pytest.approx(3.0) and offline["gain_over_cost"] == pytest.approx(2 / 3)
    assert offline["verdict"] == "suits offline batches"
    # same gain/cost, but the latency doubled: offline too
    assert compare_runs(base, _report(200.0, fake_ledger(), tpot_p99=0.04))["verdict"] == "suits offline batches"
    # more devices (device cost per hour) for less than their worth
    # half the throughput for a quarter of the latency: still not worth it by gain/cost, and it says why
    slower = compare_runs(base, _report(50.0, fake_ledger(), tpot_p99=0.005))
    assert slower["verdict"] == "not worth it" and "latency win at 2.00x the cost per token" in slower["why"]
    worse = compare_runs(base, _report(101.0, fake_ledger(gpus=4)))
    assert worse["cost_rate_gain"] == pytest.approx(8.1 / 4.1) and worse["verdict"] == "not worth it"


def test_compare_two_saved_reports(tmp_path, capsys):
    for name, report in (("a", _report(100.0, fake_ledger())), ("b", _report(150.0, fake_ledger()))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps(report))
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b" / "report.json")]) == 0
    out = capsys.readouterr().out
    assert "gain / cost: 1.50" in out and "verdict: B suits online serving" in out
    row = next(line for line in out.splitlines() if line.startswith("output tokens/s"))
    assert row.split()[-3:] == ["100.0", "150.0", "1.50"]
    # a report from before the ledger, and a folder without one: a message, exit code 2
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "report.json").write_text(json.dumps({"summary": {}}))
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "old")]) == 2
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "no cost ledger" in err and "no report.json" in err


def test_sweep_end_to_end_survives_a_failed_point(tmp_path, capsys):
    """Two good points and a point whose checkpoint has no weights (fails when its engine starts):
    the sweep records the failure and goes on, and writes its table and plots."""
    from dspark_cluster.config import resolve_path

    tiny = resolve_path("tiny-moe")
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(tiny / "config.json", broken / "config.json")  # a config, no safetensors
    args = ["sweep", "--set", "workload.num_requests=4", "--set", "workload.output_len=[2,6]",
            "--set", f"report.out_dir={tmp_path}", "--name", "s",
            "--grid", "scheduler.max_num_seqs=1,4", "--grid", f"model.path={tiny},{broken}"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "[4/4]" in captured.err and "failed: CheckpointError" in captured.err
    out = tmp_path / "s"
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert [r["status"] for r in rows] == ["ok", "failed", "ok", "failed"]
    ok = [r for r in rows if r["status"] == "ok"]
    assert all(float(r["output_tokens_per_s"]) > 0 and float(r["cost_per_million_output_tokens"]) > 0 for r in ok)
    assert ok[0]["verdict"] == "baseline" and float(ok[0]["gain_over_cost"]) == 1.0
    assert "safetensors" in rows[1]["error"] or "weights" in rows[1]["error"].lower()
    assert any(r["pareto"] == "True" for r in ok)
    assert "| 0 |" in (out / "sweep.md").read_text() and "failed: CheckpointError" in (out / "sweep.md").read_text()
    for f in ("pareto.png", "cost.png", "memory.png", "p00/report.json", "p02/report.json", "p01.error.txt"):
        assert (out / f).stat().st_size > 0
    # each point's ledger agrees with its own run
    report = json.loads((out / "p02" / "report.json").read_text())
    c, s = report["cost"], report["summary"]
    assert c["tokens"]["output"] == s["output_tokens"] == sum(r["num_output_tokens"] for r in report["requests"])
    assert c["tokens"]["prompt"] == sum(r["num_prompt_tokens"] for r in report["requests"])
    assert c["held_s"] == pytest.approx(s["duration_s"], rel=0.05, abs=0.05)
    dev = c["memory"]["per_device"][0]
    # the pool and its peak are the same bytes per block
    assert dev["kv_peak_used"] * s["kv_blocks_total"] == dev["kv_pool"] * s["kv_blocks_peak"] > 0
    assert 0 < dev["kv_peak_used"] <= dev["kv_pool"] and dev["weights"] > 0
    assert 0 < c["roles"]["target"]["utilisation"] <= 1.0
