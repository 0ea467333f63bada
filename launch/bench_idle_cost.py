"""What an idle DSpark engine costs in process (issue 28): the confidence schedule drafting nothing against
plain decoding, two warm engines in one process, alternating.

    python launch/bench_idle_cost.py [--batches 8,32,48] [--pairs 12] [--placement target|group]
        [--context-window N] [--control]

Both engines: bundled tiny-moe, executor local, one thread, prefix caching off; the DSpark one with
`schedule: confidence` up to k = 6. Each warms up on 8 held-out prompts, then per batch --pairs pairs of one
`generate` of the first B held-out prompts (64 greedy tokens), the order within a pair alternating. Prints
the median of the per-pair tok/s ratios and the positions drafted (a ratio is an idle cost only where that
stays 0: at these loads the planner drafts nothing on this CPU), and per engine the medians of its decode
steps' host time (the step's time less its execution: scheduling, the plan, processing) and forward.
--control: a second plain engine in the same rotation, so that the spread between two instances of the same
policy reads beside the idle cost (the order of the engines then rotates).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dspark_cluster import LLM, SamplingParams  # noqa: E402
from dspark_cluster.workload import DEFAULT_PROMPTS, read_prompts  # noqa: E402
from launch.bench_schedule import config, timed  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="8,32,48")
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--placement", choices=("target", "group"), default=None)
    ap.add_argument("--context-window", type=int, default=None)
    ap.add_argument("--control", action="store_true", help="a second plain engine (two instances' spread)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    prompts = read_prompts(DEFAULT_PROMPTS)
    # bench_schedule's engine configs: one thread, prefix caching off (the pairs repeat their prompts)
    opts = argparse.Namespace(threads=1, no_prefix_cache=True)
    base, spec = config(opts), config(opts, "dspark", 6, "confidence")
    if args.placement:
        spec["speculative"]["placement"] = args.placement
    if args.context_window:
        spec["speculative"]["context_window"] = args.context_window
    llms = {"dspark": LLM(config=spec), "plain": LLM(config=base), **({"plain2": LLM(config=base)} if args.control else {})}
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for llm in llms.values():
        llm.generate(prompts[:8], params)
    try:
        for b in [int(x) for x in args.batches.split(",") if x]:
            tok_s, host, forward = ({n: [] for n in llms} for _ in range(3))
            names = list(llms)
            for i in range(args.pairs):
                for n in (names[i % len(names):] + names[:i % len(names)] if args.control
                          else ["dspark", "plain"] if i % 2 == 0 else ["plain", "dspark"]):
                    engine = llms[n].engine
                    first = engine.num_steps
                    tok_s[n].append(timed(llms[n], prompts[:b], params))
                    steps = list(engine.step_stats)[len(engine.step_stats) - (engine.num_steps - first):]
                    decodes = [s for s in steps if s["num_tokens"] == s["num_seqs"]]
                    host[n].append(statistics.median(s["step_time_s"] - s["execute_s"] for s in decodes))
                    forward[n].append(statistics.median(s["forward_s"] for s in decodes))
            for n in llms:
                if n == "plain":
                    continue
                r = [a / p for a, p in zip(tok_s[n], tok_s["plain"])]
                print(f"batch {b}: {n} / plain median {statistics.median(r):.3f} ({' '.join(f'{x:.2f}' for x in r)})"
                      + (f"; positions drafted so far {llms[n].engine.speculation.num_drafted}" if n == "dspark" else ""),
                      flush=True)
            print("    decode step medians, ms: " + "; ".join(
                f"{n} host {1e3 * statistics.median(host[n]):.3f} forward {1e3 * statistics.median(forward[n]):.3f}"
                for n in llms), flush=True)
    finally:
        for llm in llms.values():
            llm.shutdown()


if __name__ == "__main__":
    main()
