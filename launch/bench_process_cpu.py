"""Where the cores go through Ray: each process's CPU (cores busy) while an engine idles and while it
serves batches of held-out prompts, per policy, one engine at a time (issue 28: does an idle drafter
actor cost anything?).

    python launch/bench_process_cpu.py [--arms plain,draft_model,plain,draft_model] [--batch 64] [--runs 4]

An arm is `plain` or a drafter as launch/bench_schedule_ray.py names it (dspark, dspark@group,
draft_model, ...), with its config (confidence schedule, k = 6, one torch thread an actor, prefix
caching off). Per arm: output tok/s of each of --runs batches, the median step of one more run of the
same requests (an engine instance's own pace: on a shared VM some run slow for their whole life), and
the five busiest processes (cores, from psutil's user + system time) over 3 s idle and over the runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_worker_niceness", "0")  # as the engine's own private instance

import psutil  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from dspark_cluster import SamplingParams  # noqa: E402
from dspark_cluster.workload import DEFAULT_PROMPTS, read_prompts  # noqa: E402
from launch.bench_schedule import timed  # noqa: E402
from launch.bench_schedule_ray import Engine, config, requests  # noqa: E402


def cpu_seconds() -> dict:
    """pid -> (process title, user + system seconds so far)."""
    out = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            t = p.cpu_times()
            out[p.pid] = (" ".join(p.info["cmdline"] or [])[:40].strip(), t.user + t.system)
        except psutil.Error:
            pass
    return out


def busiest(before: dict, after: dict, seconds: float, n: int = 5) -> list:
    rows = [((after[p][1] - before[p][1]) / seconds, before[p][0]) for p in before if p in after]
    return [(round(c, 2), name) for c, name in sorted(rows, reverse=True)[:n]]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default="plain,draft_model,plain,draft_model")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    args.k, args.threads, args.no_prefix_cache, args.placement = 6, 1, True, None
    torch.set_num_threads(1)
    ray.init(address="local", num_cpus=7, log_to_driver=False)
    held = read_prompts(DEFAULT_PROMPTS)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    prompts = [held[i % len(held)] for i in range(args.batch)]
    try:
        for arm in [a for a in args.arms.split(",") if a]:
            e = Engine(config(args, None if arm == "plain" else arm))
            try:
                timed(e.llm, held[:8], params)
                timed(e.llm, prompts, params)  # warm-up at the batch measured
                a = cpu_seconds()
                time.sleep(3.0)
                idle = busiest(a, cpu_seconds(), 3.0)
                a, t0 = cpu_seconds(), time.perf_counter()
                tok = [timed(e.llm, prompts, params) for _ in range(args.runs)]
                busy = busiest(a, cpu_seconds(), time.perf_counter() - t0)
                steps = e.run(requests(args.batch, 0.0, args.max_tokens))["step_records"]  # this engine's own pace
                median_ms = 1e3 * statistics.median(s["step_time_s"] for s in steps)
            finally:
                e.llm.shutdown()
            print(f"{arm}: tok/s {[round(x) for x in tok]}, median step {median_ms:.2f} ms\n  idle: {idle}\n"
                  f"  busy: {busy}", flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
