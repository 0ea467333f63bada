"""Run a configured experiment: build the engine, replay the workload in real time, summarise."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from .config import Config
from .engine import LLMEngine
from .workload import make_workload


def _pct(values, q):
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else float("nan")


def run_experiment(cfg: Config, progress: bool = True) -> dict:
    """Replay `cfg.workload` against a fresh engine; returns the report dict (also written to
    report.out_dir/<name>/report.json)."""
    engine = LLMEngine(cfg)
    requests = make_workload(cfg.workload, engine.spec.vocab_size)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="requests", unit="req")
    start = time.monotonic()
    pending = list(requests)
    ids, done = [], 0
    while pending or engine.has_unfinished():
        now = time.monotonic() - start
        while pending and pending[0].arrival_s <= now:
            r = pending.pop(0)
            ids.append(engine.add_request(r.prompt, r.params))
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(0.05, pending[0].arrival_s - now)))
            continue
        for ev in engine.step():
            if ev.finished:
                done += 1
                if bar is not None:
                    bar.update(1)
    elapsed = time.monotonic() - start
    if bar is not None:
        bar.close()
    per_request = [dict(request_id=rid, finish_reason=engine.seqs[rid].finish_reason, **engine.seqs[rid].metrics())
                   for rid in ids]
    out_tokens = sum(r["num_output_tokens"] for r in per_request)
    summary = {
        "requests": len(per_request),
        "duration_s": elapsed,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / elapsed if elapsed else float("nan"),
        "ttft_p50_s": _pct([r["ttft_s"] for r in per_request], 50),
        "ttft_p99_s": _pct([r["ttft_s"] for r in per_request], 99),
        "tpot_p50_s": _pct([r["tpot_s"] for r in per_request], 50),
        "tpot_p99_s": _pct([r["tpot_s"] for r in per_request], 99),
        "kv_blocks_total": engine.num_blocks,
        "kv_blocks_peak": max((s["kv_blocks_used"] for s in engine.step_stats), default=0),
        "preemptions": engine.scheduler.num_preemptions,
        "steps": len(engine.step_stats),
    }
    report = {"config": cfg.to_dict(), "summary": summary, "requests": per_request, "steps": engine.step_stats}
    name = cfg.report.name or time.strftime("run-%Y%m%d-%H%M%S")
    out_dir = Path(cfg.report.out_dir) / name
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1, default=str))
    report["out_dir"] = str(out_dir)
    return report


def format_summary(summary: dict) -> str:
    rows = [
        ("requests", f"{summary['requests']}"),
        ("output tokens/s", f"{summary['output_tokens_per_s']:.1f}"),
        ("TTFT p50 / p99 (ms)", f"{summary['ttft_p50_s'] * 1e3:.1f} / {summary['ttft_p99_s'] * 1e3:.1f}"),
        ("TPOT p50 / p99 (ms)", f"{summary['tpot_p50_s'] * 1e3:.1f} / {summary['tpot_p99_s'] * 1e3:.1f}"),
        ("KV blocks peak / total", f"{summary['kv_blocks_peak']} / {summary['kv_blocks_total']}"),
        ("preemptions", f"{summary['preemptions']}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
