"""What an idle DSpark engine costs in process (issue 28): the confidence schedule drafting nothing against
plain decoding, two warm engines in one process, alternating.

    python launch/bench_idle_cost.py [--batches 8,32,48] [--pairs 12] [--placement target|group]
        [--context-window N] [--parts]

Both engines: bundled tiny-moe, executor local, one thread, prefix caching off; the DSpark one with
`schedule: confidence` up to k = 6. Each warms up on 8 held-out prompts, then per batch --pairs pairs of one
`generate` of the first B held-out prompts (64 greedy tokens), the order within a pair alternating. Prints
the median of the per-pair tok/s ratios and the positions drafted (a ratio is an idle cost only where that
stays 0: at these loads the planner drafts nothing on this CPU). --parts: also the DSpark engine's time per
step in each speculation call the engine makes (the Router's side) and in the worker's context stash, and
both engines' time per step in `step` and in the model's forward, over the pairs of each batch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dspark_cluster import LLM, SamplingParams  # noqa: E402
from dspark_cluster.workload import DEFAULT_PROMPTS, read_prompts  # noqa: E402
from launch.bench_schedule import config, timed  # noqa: E402


def timed_calls(llms) -> dict:
    """Wrap the calls --parts times: name -> [seconds, calls], filled as the engines run."""
    spent: dict = {}

    def wrap(obj, attr, name):
        f = getattr(obj, attr)

        def timed_call(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                got = spent.setdefault(name, [0.0, 0])
                got[0] += time.perf_counter() - t
                got[1] += 1
        setattr(obj, attr, timed_call)

    for n, llm in llms.items():
        wrap(llm.engine, "step", f"{n} step")
        wrap(llm.engine.executor.worker.model, "forward", f"{n} forward")
    sp = llms["dspark"].engine.speculation
    for attr in ("poll", "plan", "attach", "step_fields", "ingest", "observe", "step_stats", "observe_step_cost",
                 "observe_delivery", "collect", "free"):
        wrap(sp, attr, f"dspark speculation.{attr}")
    stash = getattr(llms["dspark"].engine.executor.worker, "stash", None)
    for attr in ("keep_step", "route", "free") if stash is not None else ():
        wrap(stash, attr, f"dspark stash.{attr}")
    return spent


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="8,32,48")
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--placement", choices=("target", "group"), default=None)
    ap.add_argument("--context-window", type=int, default=None)
    ap.add_argument("--parts", action="store_true", help="time per step of each speculation call (see above)")
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
    llms = {"dspark": LLM(config=spec), "plain": LLM(config=base)}
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for llm in llms.values():
        llm.generate(prompts[:8], params)
    spent = timed_calls(llms) if args.parts else None
    try:
        for b in [int(x) for x in args.batches.split(",") if x]:
            if spent is not None:
                spent.clear()
            tok_s = {n: [] for n in llms}
            for i in range(args.pairs):
                for n in (["dspark", "plain"] if i % 2 == 0 else ["plain", "dspark"]):
                    tok_s[n].append(timed(llms[n], prompts[:b], params))
            r = [a / p for a, p in zip(tok_s["dspark"], tok_s["plain"])]
            print(f"batch {b}: dspark / plain median {statistics.median(r):.3f} ({' '.join(f'{x:.2f}' for x in r)}); "
                  f"positions drafted so far {llms['dspark'].engine.speculation.num_drafted}", flush=True)
            if spent is not None:
                steps = {n: spent[f"{n} step"][1] for n in llms}
                print("  ms per step: " + ", ".join(f"{k} {1e3 * t / steps[k.split()[0]]:.4f}"
                                                   for k, (t, _) in sorted(spent.items())), flush=True)
    finally:
        for llm in llms.values():
            llm.shutdown()


if __name__ == "__main__":
    main()
