"""The confidence schedule through Ray (issue 28): DSpark and draft_model against plain decoding.

    python launch/bench_schedule_ray.py [--drafters dspark,draft_model] [--batches 1,8,32,64] [--k 6]
        [--poisson 0.5,1.25] [--poisson-requests 96] [--max-tokens 64] [--repeats 2] [--threads 1]
        [--placement auto|target|group] [--out FILE]
    python launch/bench_schedule_ray.py --batches 1,8 --poisson "" --repeats 1 --max-tokens 16   # smoke test
    python launch/bench_schedule_ray.py --drafters dspark@target --batches 1,8 --poisson "" --repeats 6 --trace
        # (--trace: each speculative policy's planner state before each load)
    python launch/bench_schedule_ray.py --drafters dspark@target,dspark@group,draft_model   # both DSpark placements

The policies of launch/bench_schedule.py's confidence rows, each one engine on `executor: ray` (a Router
actor, one ShardWorker and, for speculation, one drafter actor, unless the drafter runs on the target:
`--placement`, offered where the config has `speculative.placement`) in one private Ray instance:
plain decoding, and per drafter `schedule: confidence` with num_tokens = --k (tiny-moe float32,
max_num_seqs 64, --threads torch threads per actor). One engine runs at a time (an idle engine's
compiled-graph worker polls its channel and takes a whole core): each repeat starts every policy
afresh, in a rotated order, warms it up and runs every load on it, so the ratios to plain come from
--repeats rounds of the same minutes:

1. all at once: B held-out prompts submitted together through `LLM.generate` (the Router's client:
   one call, all in the same first step), greedy, --max-tokens each (ignore_eos); output tokens/s as
   the driver sees it, best of --repeats.
2. Poisson arrivals at --poisson x saturation, where saturation is plain decoding's request rate at the
   largest batch (the all-at-once figure); --poisson-requests requests, once per policy, replayed by
   the Router itself (`Router.run_workload`: `dspark run`'s path on Ray); output tokens/s over the run
   and TPOT p50.

Ratios to plain: the best-of figures above, and per repeat (a policy's run over plain's run in the same repeat,
each a fresh engine): their median and geometric mean, which --repeats 8 or more makes a fair estimate where an
instance's own speed spreads wider than the effect (fresh engines of the same policy read 0.87-1.10 of each other).

Per policy and load, from the Router's stats over the measured runs (the difference of its counters):
tau (tokens per verify round), verify rounds, draft positions drafted and verified, steps, and the
Router's time in drafter calls per step. From a run's step records (`Router.run_workload`'s report: the
Poisson run itself; for all at once one more run of the same requests, submitted one by one at time 0,
not timed), the mean step split in ms per step: step, execute (submit + wait for the workers' round),
forward (the driver rank's own), wire (pickling the round), worker (the driver rank's time in its step
call), between (a worker's time from one output to the next input, each run's first step left out),
host (step - execute: the Router's scheduling, drafting and processing), turn (the Router's time from a
step's output to the next step's submission where nothing hid it - the step before verified drafts - over
those steps; the rest of `between` is pickling on the worker and the channels), and the DSpark context rows
exported to the drafter (kB per step).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import ray  # noqa: E402
import torch  # noqa: E402

from actors.cluster import num_actors, ray_get  # noqa: E402
from dspark_cluster import LLM, SamplingParams  # noqa: E402
from dspark_cluster.config import SpeculativeConfig, WorkloadConfig, load_config  # noqa: E402
from dspark_cluster.report import loadavg, machine_info, summarize  # noqa: E402
from dspark_cluster.workload import DEFAULT_PROMPTS, make_workload, read_prompts  # noqa: E402
from launch.bench_schedule import config as local_config, timed  # noqa: E402

HAS_PLACEMENT = "placement" in SpeculativeConfig.model_fields  # (being added to the config: offered when there)
SPLIT = {"step": "step_time_s", "execute": "execute_s", "forward": "forward_s", "wire": "wire_s",
         "worker": "worker_s", "between": "worker_between_s"}


def config(args, drafter=None) -> dict:
    """bench_schedule's engine config (the confidence schedule at k = --k), on Ray. drafter: a method
    (dspark, draft_model), or METHOD@PLACEMENT to set speculative.placement for that policy alone."""
    method, _, placement = (drafter or "").partition("@")
    cfg = local_config(args, method or None, args.k, "confidence")
    cfg["parallel"] = {"executor": "ray", "threads_per_worker": args.threads}
    if args.no_prefix_cache:  # the loads repeat their prompts: plain decoding would skip their prefill
        cfg["scheduler"]["prefix_caching"] = False
    placement = placement or getattr(args, "placement", None)
    if method and placement:
        cfg["speculative"]["placement"] = placement
    return cfg


def requests(n: int, rate: float, max_tokens: int) -> list:
    """n held-out prompts, greedy, max_tokens each; Poisson arrivals at `rate` (0: all at time 0)."""
    return make_workload(WorkloadConfig(kind="prompts", num_requests=n, request_rate=rate,
                                        output_len=[max_tokens, max_tokens]), 0)


class Engine:
    """One policy's warm engine behind its Router, and the Router's counters."""

    def __init__(self, cfg: dict):
        before = _drafter_actors()
        self.llm = LLM(config=cfg)
        self.drafter_actors = len(_drafter_actors() - before)
        sp = self.llm.config.speculative
        self.placement = "none" if not sp.enabled else "target" if getattr(sp, "on_target", False) else "group"

    def counters(self) -> dict:
        """Since the engine started, from the Router's stats: steps, verify rounds and their tokens,
        draft positions drafted and verified, the Router's seconds in drafter calls."""
        s = ray_get(self.llm.router.stats.remote())
        sp = s["speculative"] or {}
        rounds = sp.get("verify_rounds", 0)
        return {"steps": s["steps"], "verify_rounds": rounds,
                "tokens": rounds * sp["mean_accepted_length"] if rounds else 0.0,
                "drafted": sp.get("num_drafted_positions", 0), "verified": sp.get("num_draft_tokens", 0),
                "draft_s": sp.get("draft_time_s", 0.0)}

    def run(self, reqs) -> dict:
        """The Router replays `reqs` at their arrival offsets (Router.run_workload, as `dspark run` on
        Ray): its run report, summarized, with the run's step records."""
        raw = ray_get(self.llm.router.run_workload.remote(reqs))
        s = summarize(raw["requests"], raw["steps"], raw["duration_s"], raw["kv_blocks_total"], raw["preemptions"])
        return {**s, "step_records": raw["steps"]}


def _drafter_actors() -> set:
    return {n for n in ray.util.list_named_actors() if n.startswith("dspark-drafter-")}


def figures(before: dict, after: dict, steps: list) -> dict:
    """A policy's figures at one load: the Router's counters over the measured runs (after - before),
    and the mean step split (ms per step) of one run's step records (between leaves out the first
    step, whose gap is the idle time before the run)."""
    d = {k: after[k] - before[k] for k in before}
    out = {"tau": d["tokens"] / d["verify_rounds"] if d["verify_rounds"] else float("nan"),
           **{k: d[k] for k in ("verify_rounds", "drafted", "verified", "steps")}}
    n = max(1, len(steps))
    ms = {k: 1e3 * sum(s[f] for s in steps) / n for k, f in SPLIT.items()}
    ms["between"] = 1e3 * sum(s["worker_between_s"] for s in steps[1:]) / max(1, len(steps) - 1)
    ms["host"] = ms["step"] - ms["execute"]
    turns = [s["early_host_s"] for s in steps if s.get("early_host_s") is not None]  # (trees before session 24: none)
    ms["turn"] = 1e3 * sum(turns) / len(turns) if turns else 0.0
    ms["draft"] = 1e3 * d["draft_s"] / max(1, d["steps"])
    out["split_steps"], out["mean_batch"] = len(steps), sum(s["num_seqs"] for s in steps) / n
    out["ms_per_step"] = {k: round(v, 3) for k, v in ms.items()}
    out["export_kb_per_step"] = sum(s["export_bytes"] for s in steps) / n / 1e3
    return out


def trace_line(e: Engine, rep: int, name: str, batch: int, c0: dict) -> str:
    """--trace: before a load, what the policy's planner holds (positions drafted so far, its mean survival and
    refits, its drafting-step ratios, what it believes a drafter forward and a step cost by size, the prior gate's
    predicted gain by rows)."""
    cal = (ray_get(e.llm.router.stats.remote()).get("speculative") or {}).get("calibration") or {}
    cost = cal.get("step_cost") or {}
    steps = {t: round(1e3 * x, 2) for t, x in zip(cost.get("tokens", []), cost.get("live_s", []))}
    return (f"  repeat {rep} {name}, before batch {batch}: drafted {c0['drafted']}, mean survival "
            f"{cal.get('mean_survival')}, refits {cal.get('refits')}, drafting-step ratio "
            f"{cal.get('drafting_step_ratio')}, draft forward ms {cal.get('draft_forward_ms')}, step ms {steps}, "
            f"prior gain {cal.get('prior_gain')}")


def paired_ratios(runs: dict) -> dict:
    """policy -> [tok/s per repeat] -> policy -> {per-repeat ratios to plain, their median and geometric mean}."""
    out = {}
    for n, xs in runs.items():
        if n == "plain":
            continue
        r = [x / p for x, p in zip(xs, runs["plain"]) if p]
        out[n] = {"ratios": [round(v, 4) for v in r], "median": statistics.median(r) if r else float("nan"),
                  "geomean": math.exp(statistics.fmean(math.log(v) for v in r)) if r else float("nan")}
    return out


def line(label: str, row: dict, paired: dict | None = None) -> str:
    plain = row["plain"]["tok_s"]
    rest = " | ".join(f"{n} {v['tok_s'] / plain:.2f}x (tau {v['tau']:.2f}, drafted {v['drafted']}, "
                      f"verified {v['verified']})" for n, v in row.items() if isinstance(v, dict) and n != "plain")
    out = f"{label}: plain {plain:.0f} tok/s | {rest}"
    for n, r in (paired or {}).items():
        out += (f"\n    {n} per repeat: {' '.join(f'{v:.2f}' for v in r['ratios'])}; median {r['median']:.3f}x, "
                f"geometric mean {r['geomean']:.3f}x")
    return out


def split_table(results: dict) -> list[str]:
    keys = list(SPLIT) + ["host", "turn", "draft"]
    out = ["step split (ms per step; export kB per step): load, policy: steps, mean batch, " + " ".join(keys)
           + " export"]
    for kind, loads in results.items():
        for load, row in loads.items():
            for name, v in row.items():
                if isinstance(v, dict) and name != "paired":
                    ms = " ".join(f"{v['ms_per_step'][k]:.2f}" for k in keys)
                    out.append(f"  {kind} {load}, {name}: {v['split_steps']} steps, batch {v['mean_batch']:.1f}, {ms} "
                               f"{v['export_kb_per_step']:.1f}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", default="dspark,draft_model")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--poisson", default="0.5,1.25")
    ap.add_argument("--poisson-requests", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker and drafter actor")
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="prefix caching off for every policy (the loads repeat the same held-out prompts; a DSpark "
                         "request recomputes their last 32 tokens while it drafts: this isolates speculation)")
    if HAS_PLACEMENT:
        ap.add_argument("--placement", choices=["auto", "target", "group"], default=None,
                        help="speculative.placement of the drafters (default: the config's)")
    ap.add_argument("--draft-passes", default="auto", type=lambda v: v if v == "auto" else int(v),
                    choices=["auto", 1, 2], help="DSpark's speculative.draft_passes (auto: as the cluster's devices "
                    "resolve it, one on a CPU cluster)")
    ap.add_argument("--trace", action="store_true", help="before each load, print each speculative policy's planner "
                    "state (what it has drafted and believes)")
    ap.add_argument("--out", default=None, help="results as JSON")
    args = ap.parse_args()
    torch.set_num_threads(1)  # this process only submits and reads
    drafters = [d for d in args.drafters.split(",") if d]
    batches = [int(b) for b in args.batches.split(",") if b]
    fractions = [float(x) for x in args.poisson.split(",") if x]
    cfgs = {"plain": config(args), **{f"{d} confidence": config(args, d) for d in drafters}}
    # every engine's actors at once: a worker (1 CPU) each, a drafter (1 CPU) per speculative one
    cpus = sum(num_actors(load_config(c)) for c in cfgs.values()) + 1
    os.environ.setdefault("RAY_worker_niceness", "0")  # as the engine's own private instance (ensure_ray)
    ray.init(address="local", num_cpus=cpus, log_to_driver=False)
    held_out = read_prompts(DEFAULT_PROMPTS)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    results = {"all_at_once": {}, "poisson": {}}
    meta = {"args": vars(args), "machine": machine_info(), "ray_cpus": cpus, "loadavg_start": loadavg(),
            "engines": {}}
    print(f"{meta['machine']}; Ray {cpus} CPUs; load {meta['loadavg_start']}; tiny-moe, confidence up to "
          f"k={args.k}, {args.max_tokens} tokens per request, threads {args.threads}", flush=True)
    names = list(cfgs)
    best = {b: dict.fromkeys(names, 0.0) for b in batches}
    runs = {b: {n: [] for n in names} for b in batches}  # tok/s per repeat
    spent = {b: {} for b in batches}  # policy -> the Router's counters over its timed runs, summed
    profile = {b: {} for b in batches}
    pois = {f: {n: [] for n in names} for f in fractions}

    def engine(name, first):
        t0 = time.perf_counter()
        e = Engine(cfgs[name])
        timed(e.llm, held_out[:8], params)  # warm-up (and history for the confidence planners)
        if first:
            meta["engines"][name] = {"placement": e.placement, "drafter_actors": e.drafter_actors}
            print(f"{name}: drafter placement {e.placement}, {e.drafter_actors} drafter actor(s), "
                  f"started and warmed in {time.perf_counter() - t0:.1f} s", flush=True)
        return e

    try:
        # one engine at a time: an idle engine's compiled-graph worker polls its channel and takes a whole
        # core (measured: 1.0 core a ShardWorker), which on 2 cores would slow whichever engine is measured
        for rep in range(args.repeats):  # each repeat starts every policy afresh, in a rotated order
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                e = engine(name, rep == 0)
                try:
                    for b in batches:
                        prompts = [held_out[i % len(held_out)] for i in range(b)]
                        c0 = e.counters()
                        if args.trace and name != "plain":
                            print(trace_line(e, rep, name, b, c0), flush=True)
                        runs[b][name].append(timed(e.llm, prompts, params))
                        best[b][name] = max(best[b][name], runs[b][name][-1])
                        d = {k: v - c0[k] for k, v in e.counters().items()}
                        spent[b][name] = {k: spent[b].get(name, {}).get(k, 0) + v for k, v in d.items()}
                        if rep == args.repeats - 1:
                            profile[b][name] = e.run(requests(b, 0.0, args.max_tokens))["step_records"]
                finally:
                    e.llm.shutdown()
        for b in batches:
            zero = dict.fromkeys(next(iter(spent[b].values())), 0)
            row = {n: {"tok_s": best[b][n], "tok_s_runs": runs[b][n], **figures(zero, spent[b][n], profile[b][n])}
                   for n in names}
            paired = paired_ratios(runs[b])
            results["all_at_once"][b] = {**row, "paired": paired}
            print(line(f"batch {b:3d}", row, paired), flush=True)
        sat = best[max(batches)]["plain"] / args.max_tokens if batches else 0.0
        if fractions and not sat:
            raise SystemExit("--poisson needs --batches (saturation is plain's rate at the largest batch)")
        for rep in range(args.repeats if fractions else 0):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                e = engine(name, False)
                try:
                    for f in fractions:
                        c0 = e.counters()
                        r = e.run(requests(args.poisson_requests, f * sat, args.max_tokens))
                        pois[f][name].append({"tok_s": r["output_tokens_per_s"], "tpot_p50_ms": 1e3 * r["tpot_p50_s"],
                                              **figures(c0, e.counters(), r["step_records"])})
                finally:
                    e.llm.shutdown()
        for f in fractions:  # each policy's best run (the shared machine only ever adds time)
            row = {n: max(pois[f][n], key=lambda x: x["tok_s"]) for n in names}
            paired = paired_ratios({n: [x["tok_s"] for x in pois[f][n]] for n in names})
            results["poisson"][f] = {"rate_req_s": f * sat, **row, "paired": paired}
            print(line(f"poisson {f}x saturation ({f * sat:.1f} req/s), TPOT p50 plain "
                       f"{row['plain']['tpot_p50_ms']:.1f} ms", row, paired), flush=True)
    finally:
        ray.shutdown()
    meta["loadavg_end"] = loadavg()
    print("\n".join(split_table(results)), f"\nload average at the end: {meta['loadavg_end']}", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({**meta, **results}, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
