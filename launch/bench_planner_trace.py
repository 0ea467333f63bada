"""The confidence planner's decisions over a run, in process (issue 28): what it drafted, load by load, and
what that cost against plain decoding in the same process.

    python launch/bench_planner_trace.py [--method dspark|draft_model] [--loads 1,8,8,8,32] [--k 6]
        [--max-tokens 64] [--no-plain] [--no-warm-up] [--json OUT]
    python launch/bench_planner_trace.py --loads 1x32,1x32,1x32,1x32,1x32,1x32 --no-plain   # one request at a time

Two engines (`executor: local`, bundled tiny-moe, prefix caching off, one thread): plain decoding and the
drafter with `schedule: confidence` up to --k. Both warm up on 8 held-out prompts at once (not with --no-warm-up:
then the first load meets a fresh planner, as a new engine's first requests do). Then each load in
order: `B` is one `generate` of B held-out prompts at once, `BxN` N of them one after the other (the next B
prompts each time), greedy, --max-tokens each. Per load: output tok/s (and / plain, measured right after on the
same prompts), the steps that verified drafts out of all steps, positions drafted, the planner's drafting-step
ratio (`VerifyPlanner.drafting_ratio`, by rows) and its mean survival by position (None: still learning), and
the plain decode step's cost it believes at the load beside the plain engine's measured one (median execute time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# after PYTHONPATH: `launch/ab.py --script-here` runs this script on older trees
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dspark_cluster import LLM, SamplingParams  # noqa: E402
from dspark_cluster.config import ASSETS_DIR  # noqa: E402
from dspark_cluster.workload import DEFAULT_PROMPTS, read_prompts  # noqa: E402
from launch.bench_schedule import DRAFTERS  # noqa: E402


def run_load(llm, groups, params) -> tuple[float, list]:
    """tok/s over one generate per group of prompts, in order, and the step records."""
    llm.engine.step_record = []
    t0 = time.perf_counter()
    tokens = 0
    for group in groups:
        outs = llm.generate(group, params)
        tokens += sum(len(o.token_ids) for o in outs)
    records, llm.engine.step_record = llm.engine.step_record, None
    return tokens / (time.perf_counter() - t0), records


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", choices=sorted(d for d, path in DRAFTERS.items() if path), default="dspark")
    ap.add_argument("--loads", default="1,8,8,8,32")
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-plain", action="store_true", help="no plain engine (no ratios): the drafter's engine alone")
    ap.add_argument("--no-warm-up", action="store_true", help="no warm-up generate: the planner starts fresh")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    held_out = read_prompts(DEFAULT_PROMPTS)
    base = {"model": {"path": str(ASSETS_DIR / "tiny-moe"), "dtype": "float32"},
            "parallel": {"executor": "local", "threads_per_worker": 1},
            "scheduler": {"max_num_seqs": 64, "prefix_caching": False}}
    spec = {**base, "speculative": {"method": args.method, "draft_model": str(ASSETS_DIR / DRAFTERS[args.method]),
                                    "num_tokens": args.k, "schedule": "confidence"}}
    llms = {"spec": LLM(config=spec)}
    if not args.no_plain:
        llms["plain"] = LLM(config=base)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    for llm in ([] if args.no_warm_up else llms.values()):
        llm.generate(held_out[:8], params)
    planner = llms["spec"].engine.speculation.planner
    out, nxt = [], 0
    print(f"{args.method}, confidence up to k={args.k}, {args.max_tokens} tokens a request", flush=True)
    for load in args.loads.split(","):
        b, _, n = load.partition("x")
        b, n = int(b), int(n or 1)
        groups = [[held_out[(nxt + i * b + j) % len(held_out)] for j in range(b)] for i in range(n)]
        nxt += b * n
        tok_s, records = run_load(llms["spec"], groups, params)
        row = {"load": load, "tok_s": tok_s, "steps": len(records),
               "drafting_steps": sum(r["num_verified"] > 0 for r in records),
               "drafted": sum(r["num_drafted"] for r in records),
               "drafting_step_ratio": planner.summary()["drafting_step_ratio"],
               "mean_survival": None if planner.mean_survival is None else planner.mean_survival.round(3).tolist(),
               # what the planner believes a plain decode step at this load costs (its theta_0)
               "plain_step_ms_believed": 1e3 * float(planner.step_cost(b))}
        if "plain" in llms:
            row["plain_tok_s"], plain_records = run_load(llms["plain"], groups, params)
            row["ratio"] = tok_s / row["plain_tok_s"]
            decode = [r["execute_s"] for r in plain_records if r["num_tokens"] == r["num_seqs"] == b]
            row["plain_step_ms"] = 1e3 * statistics.median(decode) if decode else None  # what it costs there
        out.append(row)
        ratio = f", {row['ratio']:.3f}x plain" if "ratio" in row else ""
        print(f"load {load}: {tok_s:.0f} tok/s{ratio}; drafting steps {row['drafting_steps']} of {row['steps']}, "
              f"{row['drafted']} positions; drafting-step ratio {row['drafting_step_ratio']}; survival "
              f"{row['mean_survival']}; a plain step believed {row['plain_step_ms_believed']:.2f} ms"
              + (f", measured {row['plain_step_ms']:.2f} ms" if row.get("plain_step_ms") else ""), flush=True)
    for llm in llms.values():
        llm.shutdown()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "loads": out}, fh, indent=1)


if __name__ == "__main__":
    main()
