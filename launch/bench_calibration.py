#!/usr/bin/env python
"""Online drafter calibration under a domain shift (issue 15).

    python launch/bench_calibration.py [--requests 480] [--max-tokens 64] [--batch 8] [--interval 15]
        [--draft-passes auto|1|2] [--out FILE] [--plot FILE]

The bundled tiny-dspark was trained on continuations of the standard library's modules. The stream
here is code it never saw: test functions from the installed packages' test suites (300 characters
from each `def test_`), which cut its tau from 2.98 (held-out stdlib prompts) to 2.46 (greedy, k=4);
tiny-moe continues each one (greedy, --max-tokens, ignore_eos). Two runs of the same stream, one process
each under Ray (executor ray: target worker, drafter and, when on, the calibrator, each its own
process), the drafter on `schedule: static`, k = 4 (so tau is the drafter's alone, not the verify
budget's): calibration off, then on (interval --interval s, 40 optimiser steps of 64 rounds an
update, 8 from each of 8 sequences, min_rounds 256, margin 0.02).

Reported: tau (tokens per verify round) over time and over requests for both runs; tau in the last
third of the stream (by requests finished), on / off; decode step time p99 of the calibrating run
while an update trains against the same run's steps while none does (and against the run without
calibration); the versions published and rolled back.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from dspark_cluster import LLM, SamplingParams  # noqa: E402
from dspark_cluster.config import ASSETS_DIR  # noqa: E402
from dspark_cluster.workload import WorkloadRequest  # noqa: E402


def shifted_prompts(n: int) -> list[str]:
    """Code the drafter never saw: the test suites of the installed packages (site-packages/*/tests),
    300 characters from each `def test_` on, files in name order, every n-th kept."""
    import glob
    import site

    out, seen = [], set()
    for root in site.getsitepackages():
        for f in sorted(glob.glob(f"{root}/**/tests/test_*.py", recursive=True)):
            try:
                text = open(f, encoding="utf-8").read()
            except (OSError, UnicodeDecodeError):
                continue
            for m in re.finditer(r"\ndef test_|\n    def test_", text):
                p = text[m.start() + 1 : m.start() + 301]
                if len(p) == 300 and p not in seen:
                    seen.add(p)
                    out.append(p)
    if len(out) < n:
        raise SystemExit(f"only {len(out)} test functions in the installed packages here; ask for fewer --requests")
    step = len(out) / n
    return [out[int(i * step)] for i in range(n)]


def config(args, calibrate: bool) -> dict:
    return {"model": {"path": str(ASSETS_DIR / "tiny-moe"), "dtype": "float32"},
            "parallel": {"executor": "ray", "threads_per_worker": 1},
            "scheduler": {"max_num_seqs": args.batch},
            "speculative": {"method": "dspark", "draft_model": str(ASSETS_DIR / "tiny-dspark"), "num_tokens": 4,
                            "schedule": "static", "draft_passes": args.draft_passes,
                            "calibration": {"enabled": calibrate, "interval_s": args.interval, "min_rounds": 256,
                                            "steps_per_update": args.steps_per_update,
                                            "batch_rounds": args.batch_rounds, "margin": args.margin,
                                            "learning_rate": args.lr, "window_rounds": 400}}}


def run(args, prompts, calibrate: bool) -> dict:
    import ray

    from actors.cluster import ray_get

    llm = LLM(config=config(args, calibrate))
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        ray_get(llm.router.generate.remote(prompts[:8], [params] * 8))  # warm-up (not in the stream)
        t_run = time.monotonic()
        out = ray_get(llm.router.run_workload.remote([WorkloadRequest(0.0, p, params) for p in prompts]))
        status = llm.drafter_status()
        updates = []
        if calibrate:
            name = next(n for n in ray.util.list_named_actors() if n.startswith("dspark-calibrator-"))
            updates = ray.get(ray.get_actor(name).updates_log.remote())
    finally:
        llm.shutdown()
    steps = [s for s in out["steps"] if s["time"] >= t_run]
    t0 = min(s["time"] - s["step_time_s"] for s in steps)
    finish = sorted(r["arrival_time"] + r["e2e_s"] for r in out["requests"])
    return {"steps": steps, "t0": t0, "finish": finish, "duration_s": out["duration_s"], "status": status,
            "updates": updates}


def tau_series(r: dict, bin_s: float) -> tuple[list, list]:
    t = np.array([s["time"] - r["t0"] for s in r["steps"]])
    rounds = np.array([s["spec_rounds"] for s in r["steps"]])
    tokens = np.array([s["spec_tokens"] for s in r["steps"]])
    edges = np.arange(0, t.max() + bin_s, bin_s)
    xs, ys = [], []
    for a, b in zip(edges, edges[1:]):
        m = (t >= a) & (t < b)
        if rounds[m].sum():
            xs.append((a + b) / 2)
            ys.append(tokens[m].sum() / rounds[m].sum())
    return xs, ys


def tau_by_requests(r: dict, bin_requests: int) -> tuple[list, list]:
    """tau per bin of the stream: steps binned by how many requests had finished when they ran."""
    done = np.searchsorted(np.array(r["finish"]), [s["time"] for s in r["steps"]])
    xs, ys = [], []
    for a in range(0, len(r["finish"]), bin_requests):
        m = (done >= a) & (done < a + bin_requests)
        rounds = sum(s["spec_rounds"] for s, k in zip(r["steps"], m) if k)
        if rounds:
            xs.append(a + bin_requests / 2)
            ys.append(sum(s["spec_tokens"] for s, k in zip(r["steps"], m) if k) / rounds)
    return xs, ys


def tau_after(r: dict, share: float) -> float:
    """tau over the steps after `share` of the requests finished."""
    cut = r["finish"][int(share * len(r["finish"]))]
    sel = [s for s in r["steps"] if s["time"] >= cut]
    return sum(s["spec_tokens"] for s in sel) / max(1, sum(s["spec_rounds"] for s in sel))


def p99(xs) -> float:
    return float(np.percentile(xs, 99)) if len(xs) else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=480)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--interval", type=float, default=15.0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps-per-update", type=int, default=40)
    ap.add_argument("--batch-rounds", type=int, default=64)
    ap.add_argument("--margin", type=float, default=0.02)
    ap.add_argument("--draft-passes", default="auto", type=lambda v: v if v == "auto" else int(v),
                    choices=["auto", 1, 2], help="speculative.draft_passes (auto: one on the CPU)")
    ap.add_argument("--out", default="runs/bench_calibration.json")
    ap.add_argument("--plot", default="docs/img/calibration_tau.png")
    args = ap.parse_args()
    import ray

    ray.init(num_cpus=4, log_to_driver=False)
    prompts = shifted_prompts(args.requests)
    res = {}
    for on in (False, True):
        t = time.perf_counter()
        res[on] = run(args, prompts, on)
        print(f"calibration {'on' if on else 'off'}: {len(res[on]['finish'])} requests in "
              f"{time.perf_counter() - t:.0f} s", flush=True)
    ray.shutdown()
    off, on = res[False], res[True]
    summary = {"requests": args.requests, "max_tokens": args.max_tokens, "batch": args.batch,
               "draft_passes": args.draft_passes, "interval_s": args.interval, "lr": args.lr,
               "steps_per_update": args.steps_per_update, "batch_rounds": args.batch_rounds, "margin": args.margin,
               "duration_s": {"off": off["duration_s"], "on": on["duration_s"]}}
    for share in (0.0, 1 / 3, 2 / 3):
        a, b = tau_after(off, share), tau_after(on, share)
        summary[f"tau_after_{share:.2f}"] = {"off": round(a, 4), "on": round(b, 4), "ratio": round(b / a, 4)}
    windows = [(u["t_start"], u["t_end"]) for u in on["updates"] if "t_start" in u]
    training = [s["step_time_s"] for s in on["steps"] if any(a <= s["time"] <= b for a, b in windows)]
    idle = [s["step_time_s"] for s in on["steps"] if not any(a <= s["time"] <= b for a, b in windows)]
    summary["step_p99_ms"] = {"on_while_training": round(1e3 * p99(training), 3), "on_not_training": round(1e3 * p99(idle), 3),
                              "off": round(1e3 * p99([s["step_time_s"] for s in off["steps"]]), 3),
                              "steps_while_training": len(training), "steps_not_training": len(idle)}
    summary["step_p99_ratio_training_vs_not"] = round(p99(training) / p99(idle), 4) if training else None
    summary["updates"] = [{k: u.get(k) for k in ("update", "outcome", "shadow", "serving_shadow", "seconds", "train_rounds")}
                          for u in on["updates"]]
    summary["events"] = [{k: e[k] for k in ("event", "from", "to", "step")} | {"t_s": round(e["monotonic"] - on["t0"], 1)}
                         for e in on["status"].get("events", [])]
    summary["history"] = on["status"].get("history")
    summary["buffer"] = (on["status"].get("calibrator") or {}).get("buffer")
    bin_requests = max(8, args.requests // 30)
    summary["series"] = {name: {"tau_by_time_10s": tau_series(r, 10.0), f"tau_by_requests_{bin_requests}": tau_by_requests(r, bin_requests)}
                         for name, r in (("off", off), ("on", on))}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2, default=str)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("history", "updates", "series")}, indent=2, default=str))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4))
    for r, label in ((off, "calibration off"), (on, "calibration on")):
        ax.plot(*tau_series(r, 10.0), marker=".", label=label)
        bx.plot(*tau_by_requests(r, bin_requests), marker=".", label=label)
    done = np.array(on["finish"])
    for e in on["status"].get("events", []):
        x = e["monotonic"] - on["t0"]
        color = "green" if e["event"] == "publish" else "red"
        for axis, pos in ((ax, x), (bx, int(np.searchsorted(done, e["monotonic"])))):
            axis.axvline(pos, color=color, alpha=0.4, lw=1)
            axis.text(pos, axis.get_ylim()[1], f" v{e['to']}", fontsize=7, va="top", rotation=90)
    ax.set_xlabel("seconds into the stream")
    ax.set_ylabel("tau (tokens per verify round)")
    ax.set_title("tau over time (10 s bins)")
    bx.set_xlabel("requests finished")
    bx.set_title(f"tau over the stream ({bin_requests} requests per point)")
    ax.legend()
    fig.suptitle("tiny-dspark on unseen test code, greedy, k=4: green = publish, red = rollback", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
