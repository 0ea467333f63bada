"""Prefix caching, measured: TTFT and throughput with and without it, in one run.

    python launch/bench_prefix_cache.py [--requests 64] [--prefix 512] [--suffix 16] [--rate 4] [--repeats 3]

Two workloads over the bundled tiny-moe, in process, greedy, `--output` tokens each:
- shared: every prompt is the same `--prefix`-token prefix and `--suffix` distinct tokens;
- unshared: prompts of the same length with nothing in common.
Each runs with `scheduler.prefix_caching` on and off, arms interleaved, `--repeats` times: once
with Poisson arrivals at `--rate` requests/s (TTFT) and once with every request at t=0
(throughput). A fresh engine per run (its cache starts empty: the first shared request computes
the prefix). Prints a table of medians and the on/off ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from dspark_cluster.async_engine import AsyncEngine
from dspark_cluster.config import load_config
from dspark_cluster.report import loadavg, machine_info, summarize
from dspark_cluster.sampling import SamplingParams
from dspark_cluster.workload import WorkloadRequest


def prompts(kind: str, n: int, prefix: int, suffix: int, vocab: int, seed: int) -> list[list[int]]:
    r = random.Random(seed)
    shared = [r.randrange(3, vocab) for _ in range(prefix)]
    out = []
    for _ in range(n):
        head = shared if kind == "shared" else [r.randrange(3, vocab) for _ in range(prefix)]
        out.append(head + [r.randrange(3, vocab) for _ in range(suffix)])
    return out


def run(caching: bool, ps: list[list[int]], rate: float, output: int, seed: int) -> dict:
    cfg = load_config(None, {"scheduler.prefix_caching": caching, "scheduler.max_num_seqs": 64,
                             "parallel.threads_per_worker": 1})
    r = random.Random(seed)
    params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
    t, reqs = 0.0, []
    for p in ps:
        reqs.append(WorkloadRequest(t, p, params))
        if rate > 0:
            t += r.expovariate(rate)
    engine = AsyncEngine(cfg)
    try:
        raw = asyncio.run(engine.run_workload(reqs))
    finally:
        engine.shutdown()
    return summarize(raw["requests"], raw["steps"], raw["duration_s"], raw["kv_blocks_total"], raw["preemptions"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--suffix", type=int, default=16)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals for the TTFT runs (requests/s)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    vocab = 2048
    print(machine_info(), "; load average", loadavg(), flush=True)
    t0 = time.monotonic()
    results = {}  # (workload, mode, caching) -> [summaries]
    for rep in range(args.repeats):
        for kind in ("shared", "unshared"):
            ps = prompts(kind, args.requests, args.prefix, args.suffix, vocab, seed=rep)
            for mode, rate in (("poisson", args.rate), ("t=0", 0.0)):
                arms = [True, False] if rep % 2 == 0 else [False, True]  # order alternates
                for caching in arms:
                    s = run(caching, ps, rate, args.output, seed=rep)
                    results.setdefault((kind, mode, caching), []).append(s)
                    print(f"rep {rep} {kind} {mode} caching={'on' if caching else 'off'}: TTFT p50 "
                          f"{1e3 * s['ttft_p50_s']:.1f} ms, {s['output_tokens_per_s']:.0f} tok/s, hit rate "
                          f"{100 * s['prefix_cache_hit_rate']:.1f}%", flush=True)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    print(f"\n{args.requests} requests, prefix {args.prefix} + suffix {args.suffix} tokens, {args.output} output tokens, "
          f"{args.repeats} repeats (medians); Poisson at {args.rate} req/s for TTFT, all at t=0 for throughput")
    print("| workload | caching | hit rate | TTFT p50 / p99 (ms), Poisson | output tok/s, t=0 | TTFT p50 off / on | tok/s on / off |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("shared", "unshared"):
        row = {}
        for caching in (True, False):
            pois, burst = results[(kind, "poisson", caching)], results[(kind, "t=0", caching)]
            row[caching] = (med([s["ttft_p50_s"] for s in pois]), med([s["ttft_p99_s"] for s in pois]),
                            med([s["output_tokens_per_s"] for s in burst]), med([s["prefix_cache_hit_rate"] for s in pois]))
        for caching in (True, False):
            p50, p99, tps, hit = row[caching]
            ratios = (f"**{row[False][0] / row[True][0]:.2f}x** | **{row[True][2] / row[False][2]:.3f}x**"
                      if caching else " | ")
            print(f"| {kind} | {'on' if caching else 'off'} | {100 * hit:.1f}% | {1e3 * p50:.1f} / {1e3 * p99:.1f} | "
                  f"{tps:.0f} | {ratios} |")
    print(f"\ntotal {time.monotonic() - t0:.0f} s; load average at the end {loadavg()}")


if __name__ == "__main__":
    main()
