"""Run a configured experiment: start the engine (in process, or the Router actor on Ray), replay
the workload in real time, and write the report."""

from __future__ import annotations

import asyncio

from .async_engine import AsyncEngine
from .config import Config
from .backends import backend
from .model.spec import load_spec
from .report import add_expert_summary, save_report, summarize
from .workload import make_workload


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req")


def prepare_backends(cfgs: list) -> None:
    """Before several runs in one process (a sweep): each backend they use set up once (Ray joined
    or started, sized for the run with the most actors)."""
    for name in sorted({c.parallel.executor for c in cfgs} - {"local"}):
        backend(name).prepare([c for c in cfgs if c.parallel.executor == name])


def run_experiment(cfg: Config, progress: bool = True) -> dict:
    """Replay `cfg.workload`; returns the report dict, also written under report.out_dir/<name>/."""
    requests = make_workload(cfg.workload, load_spec(cfg.model.path, cfg.model.dtype).vocab_size)
    bar = _progress(len(requests), progress)
    if cfg.parallel.executor != "local":  # the Router runs the workload; this process only shows progress

        def on_progress(finished: int) -> None:
            if bar is not None:
                bar.n = finished
                bar.refresh()

        raw = backend(cfg.parallel.executor).run_workload(cfg, requests, on_progress)
    else:
        engine = AsyncEngine(cfg)
        try:
            raw = asyncio.run(engine.run_workload(requests, on_finish=lambda _: bar.update(1) if bar else None))
        finally:
            engine.shutdown()
    if bar is not None:
        bar.n = len(requests)
        bar.close()
    summary = summarize(raw["requests"], raw["steps"], raw["duration_s"], raw["kv_blocks_total"], raw["preemptions"])
    if raw.get("speculative"):
        summary["speculative"] = raw["speculative"]
    if raw.get("compile"):
        summary["compile"] = raw["compile"]
    experts = raw.get("experts")
    add_expert_summary(summary, experts, cfg.parallel.world_size)
    report = {"config": raw.get("config") or cfg.to_dict(), "summary": summary, "cost": raw["cost"],
              "requests": raw["requests"], "steps": raw["steps"], "experts": experts}
    return save_report(report, cfg, "run")
