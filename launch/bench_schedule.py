"""Confidence-scheduled verification against plain decoding and fixed k, across loads (issue 14).

    python launch/bench_schedule.py [--drafters draft_model,dspark] [--batches 1,8,32,64]
        [--static 2,4,6] [--k 6] [--poisson 0.5,1.25] [--max-tokens 64] [--repeats 2] [--no-prefix-cache] [--out FILE]
        [--plot-dir DIR] [--calib-requests 512] [--calib-stream cycle|cut] [--calibration isotonic]
        [--calib-compare sts,platt,platt_log_loss] [--draft-passes auto|1|2] [--serial N] [--compile auto|on|off]

For each drafter (the bundled tiny-draft as `draft_model`, tiny-dspark as `dspark`), one engine per
policy is started once and kept warm: plain decoding, `schedule: static` at each fixed k, and
`schedule: confidence` with num_tokens = --k as the largest k. Then, in one run, interleaved:

1. all-at-once loads: B held-out prompts submitted together (max_num_seqs 64), greedy, --max-tokens
   each; output tokens/s, best of --repeats; ratios against plain decoding measured in the same round.
   --serial N: also a batch-1 stream, N held-out prompts one at a time through each engine (the order of
   engines rotating per prompt), output tokens/s over the stream: where drafting pays, over many requests
   of different difficulty, not a best-of.
2. Poisson arrivals at --poisson x saturation, where saturation is plain decoding's request rate at
   batch 64 (the all-at-once figure); output tokens/s over the run and TPOT p50.
3. The confidence engines' calibration on their live outcomes: a fresh window, then --calib-requests
   held-out prompts one at a time, the schedule run by --calibration; ECE by position before (raw
   confidences) and after for it and for each of --calib-compare, all fitted on the same windows and
   scored on the same rounds (each round with the fits in force when it ran, made on earlier rounds),
   beside the noise floor and the Brier score. --calib-stream cut: no request repeats an earlier one's text
   (but for the one prompt the held-out file holds twice): the c-th pass over the prompts cuts each to
   1 - 0.18 c of its length, at a space, so a window of several thousand rounds never holds the scored
   request's own identical greedy rounds (with `cycle`, the default, it does after the first 131 requests).
   --calib-draft-all: part 3 drafts k every step (at batch 1 on this CPU drafting is a marginal gain, and the
   planner can stop drafting mid-run, leaving a few thousand rounds to score); `--calib-draft-all verify` also
   verifies every drafted position (the budget verifies a late position only where its calibrated survival pays
   for it: the ECE then reads the rounds it chose, fewer at the late positions).

One process, executor local, --threads torch threads per engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dspark_cluster import LLM, SamplingParams  # noqa: E402
from dspark_cluster.config import ASSETS_DIR, WorkloadConfig, load_config  # noqa: E402
from dspark_cluster.report import summarize  # noqa: E402
from dspark_cluster.speculative.confidence import describe_params  # noqa: E402
from dspark_cluster.workload import DEFAULT_PROMPTS, make_workload, read_prompts  # noqa: E402

DRAFTERS = {"draft_model": "tiny-draft", "dspark": "tiny-dspark", "ngram": None}  # (ngram: prompt lookup, no model)


def config(args, method=None, k=0, schedule="static") -> dict:
    cfg = {"model": {"path": str(ASSETS_DIR / "tiny-moe"), "dtype": "float32",
                     "compile": getattr(args, "compile", "auto")},
           "parallel": {"executor": "local", "threads_per_worker": args.threads},
           "scheduler": {"max_num_seqs": 64}}
    if args.no_prefix_cache:  # the loads repeat their prompts: plain decoding would skip their prefill
        cfg["scheduler"]["prefix_caching"] = False
    if method is not None:
        cfg["speculative"] = {"method": method, "num_tokens": k, "schedule": schedule}
        if DRAFTERS[method]:
            cfg["speculative"]["draft_model"] = str(ASSETS_DIR / DRAFTERS[method])
        if method == "dspark":
            cfg["speculative"]["draft_passes"] = getattr(args, "draft_passes", "auto")
    return cfg


def timed(llm, prompts, params) -> float:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def poisson(cfg: dict, rate: float, n: int, max_tokens: int, warm_prompts) -> dict:
    """One engine, warmed up, then n requests at `rate` per second; output tok/s and TPOT p50."""
    from dspark_cluster.async_engine import AsyncEngine

    c = load_config(cfg)
    wl = WorkloadConfig(kind="prompts", num_requests=n, request_rate=rate, output_len=[max_tokens, max_tokens])
    requests = make_workload(wl, 0)
    engine = AsyncEngine(c)

    async def main():
        await engine.generate(warm_prompts, [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)]
                              * len(warm_prompts))
        return await engine.run_workload(requests)

    try:
        raw = asyncio.run(main())
    finally:
        engine.shutdown()
    s = summarize(raw["requests"], raw["steps"], raw["duration_s"], raw["kv_blocks_total"], raw["preemptions"])
    return {"tok_s": s["output_tokens_per_s"], "tpot_p50_ms": 1e3 * s["tpot_p50_s"]}


def calibration_prompt(prompts: list[str], i: int, stream: str) -> str:
    """Part 3's i-th request: the held-out prompts in turn; with stream "cut", the c-th pass cuts each to
    1 - 0.18 c of its length (at least a quarter, and shorter than the pass before), at the last space before."""
    text, c = prompts[i % len(prompts)], i // len(prompts)
    if stream == "cycle" or c == 0:
        return text
    prev = calibration_prompt(prompts, i - len(prompts), stream)
    cut = min(len(prev) - 1, max(len(text) // 4, int(len(text) * (1 - 0.18 * c))))
    space = max(text.rfind(" ", 0, cut), text.rfind("\n", 0, cut))
    return text[: space if space > len(text) // 8 else cut]  # shorter than the pass before: never a repeat


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafters", default="draft_model,dspark")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--static", default="2,4,6")
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--poisson", default="0.5,1.25")
    ap.add_argument("--poisson-requests", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", default="auto", choices=("auto", "on", "off"), help="model.compile of every engine")
    ap.add_argument("--draft-passes", default="auto", type=lambda v: v if v == "auto" else int(v),
                    choices=["auto", 1, 2], help="DSpark's speculative.draft_passes (auto: one on the CPU)")
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="prefix caching off for every policy (the loads repeat the same held-out prompts; a DSpark "
                         "request recomputes their last 32 tokens while it drafts: this isolates speculation)")
    ap.add_argument("--calib-requests", type=int, default=512, help="batch-1 requests for the calibration figures")
    ap.add_argument("--calib-stream", choices=("cycle", "cut"), default="cycle",
                    help="part 3's prompts: the held-out ones cycled, or cut shorter on each pass (no repeats)")
    ap.add_argument("--calib-draft-all", nargs="?", const="budget", choices=("budget", "verify"), default=None,
                    help="part 3 drafts k positions every step: the calibration measured on as many rounds whatever the "
                         "planner's cost model decides at batch 1 on this machine, where drafting is a marginal gain; "
                         "the verify budget picks what to verify by the calibrated confidences (budget), or every "
                         "drafted position is verified (verify: the rounds are not censored by the budget)")
    ap.add_argument("--calibration", default=None, help="the calibration in force in part 3 (default: the planner's)")
    ap.add_argument("--calib-compare", default="sts,platt,platt_log_loss",
                    help="calibrations scored beside it on the same live rounds")
    ap.add_argument("--serial", type=int, default=0, help="a batch-1 stream of this many held-out prompts, one at a time")
    ap.add_argument("--out", default=None, help="results as JSON")
    ap.add_argument("--plot-dir", default=None, help="write verify_budget_<drafter>.png here")
    ap.add_argument("--rounds-out", default=None,
                    help="part 3's verify outcomes, step by step, to <this>.<drafter>.npz (for launch/replay_calibration.py)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    drafters = [d for d in args.drafters.split(",") if d]
    batches = [int(b) for b in args.batches.split(",")]
    statics = [int(k) for k in args.static.split(",") if k]
    held_out = read_prompts(DEFAULT_PROMPTS)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    print(f"target tiny-moe, drafters {drafters}, static k {statics}, confidence up to k={args.k}, "
          f"{args.max_tokens} tokens per request, threads {args.threads}", flush=True)

    policies = {"plain": LLM(config=config(args))}
    for d in drafters:
        for k in statics:
            policies[f"{d} k={k}"] = LLM(config=config(args, d, k))
        policies[f"{d} confidence"] = LLM(config=config(args, d, args.k, "confidence"))
    for name, llm in policies.items():  # warm-up (and history for the confidence planners)
        timed(llm, held_out[:8], params)

    for name, llm in policies.items():
        llm.engine.step_record = []  # every step of the loads below, for the verify-budget plot
    results = {"all_at_once": {}, "poisson": {}, "calibration": {}}
    for b in batches:
        prompts = [held_out[i % len(held_out)] for i in range(b)]
        best = {name: 0.0 for name in policies}
        for _ in range(args.repeats):
            for name, llm in policies.items():
                best[name] = max(best[name], timed(llm, prompts, params))
        results["all_at_once"][b] = best
        line = " ".join(f"{n}: {v / best['plain']:.2f}x" for n, v in best.items() if n != "plain")
        print(f"batch {b:3d}: plain {best['plain']:.0f} tok/s | {line}", flush=True)

    if args.serial:  # one prompt at a time, engines interleaved by prompt; tokens/s over the whole stream
        names, spent, made = list(policies), dict.fromkeys(policies, 0.0), dict.fromkeys(policies, 0)
        for i in range(args.serial):
            prompt = [held_out[(8 + i) % len(held_out)]]  # (after the warm-up's 8)
            for name in names[i % len(names):] + names[: i % len(names)]:
                t0 = time.perf_counter()
                made[name] += len(policies[name].generate(prompt, params)[0].token_ids)
                spent[name] += time.perf_counter() - t0
        results["serial"] = {n: made[n] / spent[n] for n in names}
        line = " ".join(f"{n}: {v / results['serial']['plain']:.2f}x" for n, v in results["serial"].items() if n != "plain")
        print(f"serial {args.serial} requests: plain {results['serial']['plain']:.0f} tok/s | {line}", flush=True)

    sat = results["all_at_once"][max(batches)]["plain"] / args.max_tokens  # requests/s
    for f in [float(x) for x in args.poisson.split(",") if x]:
        rate = f * sat
        row = {}
        for name in policies:
            method = None if name == "plain" else name.split()[0]
            k = 0 if name == "plain" else (args.k if name.endswith("confidence") else int(name.split("k=")[1]))
            schedule = "confidence" if name.endswith("confidence") else "static"
            row[name] = poisson(config(args, method, k, schedule), rate, args.poisson_requests, args.max_tokens,
                                held_out[:8])
        results["poisson"][f] = {"rate_req_s": rate, **row}
        line = " ".join(f"{n}: {v['tok_s'] / row['plain']['tok_s']:.2f}x" for n, v in row.items() if n != "plain")
        print(f"poisson {f}x saturation ({rate:.1f} req/s): plain {row['plain']['tok_s']:.0f} tok/s, "
              f"TPOT p50 {row['plain']['tpot_p50_ms']:.1f} ms | {line}", flush=True)

    for d in drafters:  # calibration on live outcomes: a fresh window, one request at a time (it drafts there)
        llm = policies[f"{d} confidence"]
        p = llm.engine.planner
        p.reset_calibration(args.calibration, tuple(m for m in args.calib_compare.split(",") if m))
        draft_len, verify_lengths = p.draft_len, p.verify_lengths
        if args.calib_draft_all:  # every request drafts up to k: as many rounds whatever the cost model decides
            p.exploring = p._learning = False
            p.draft_len = lambda num_rows: p.k
            if args.calib_draft_all == "verify":  # and every drafted position is verified: rounds not censored
                p.verify_lengths = lambda raw, *_, **__: (~np.isnan(raw)).sum(1)
        load = [open("/proc/loadavg").read().split()[:3]] if os.path.exists("/proc/loadavg") else []
        steps, observe, prompt = [], p.observe, [0]
        if args.rounds_out:  # every step's outcomes, as the planner saw them, the prompt and sequences they came from
            p.observe = lambda raw, ver, acc, seq_ids=None, offsets=None: (
                steps.append((raw, ver, acc, prompt[0], np.full(len(raw), -1) if seq_ids is None else seq_ids)),
                observe(raw, ver, acc, seq_ids, offsets))
        for i in range(args.calib_requests):
            prompt[0] = i % len(held_out)
            llm.generate([calibration_prompt(held_out, i, args.calib_stream)], params)
        p.observe, p.draft_len, p.verify_lengths = observe, draft_len, verify_lengths
        if args.rounds_out:
            np.savez(f"{args.rounds_out}.{d}.npz", conf=np.concatenate([x[0] for x in steps]),
                     verified=np.concatenate([np.asarray(x[1]) for x in steps]),
                     accepted=np.concatenate([np.asarray(x[2]) for x in steps]),
                     step_rows=np.array([len(x[0]) for x in steps]), step_prompt=np.array([x[3] for x in steps]),
                     seq_ids=np.concatenate([np.asarray(x[4], dtype=np.int64) for x in steps]))
        load += [open("/proc/loadavg").read().split()[:3]] if load else []
        spec = llm.engine.speculative_summary()
        cal = {**spec["calibration"], **p.calibration_report(floors=True)}
        results["calibration"][d] = {"verified_share": spec["verified_share"], "loadavg_before_after": load, **cal}
        print(f"{d} confidence: verified share {spec['verified_share']:.2f}, {cal['live_rounds']} live rounds, by "
              f"position {cal.get('rounds_by_position')}, load average before/after {load}", flush=True)
        pct = lambda xs: " ".join(f"{100 * x:.1f}" for x in xs)  # noqa: E731
        print(f"  {'raw':15s} ECE % {pct(cal.get('ece_before_by_position', []))} | Brier sum "
              f"{sum(cal['brier_by_method']['raw']) if cal.get('brier_by_method') else float('nan'):.4f}")
        for m in p.methods if "ece_by_method" in cal else ():
            desc = describe_params(m, p.params[m])
            if m.startswith("isotonic"):  # its knots are in the JSON; here their count per position
                desc = {**desc, "knots": [None if kn is None else len(kn[0]) for kn in desc["knots"]]}
            print(f"  {m + (' (in force)' if m == p.calibration else ''):15s} ECE % {pct(cal['ece_by_method'][m])} "
                  f"| floor % {pct(cal['ece_floor_by_method'][m])} | Brier sum {sum(cal['brier_by_method'][m]):.4f}"
                  f" | {desc}", flush=True)
    if args.plot_dir:  # the verify budget each confidence engine chose, against batch size
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from dspark_cluster.report import _plot_verify_budget

        os.makedirs(args.plot_dir, exist_ok=True)
        for d in drafters:
            fig = _plot_verify_budget(plt, [], policies[f"{d} confidence"].engine.step_record, None)
            fig.axes[0].set_title(f"Verify budget against batch size: {d}, confidence schedule, k <= {args.k}")
            fig.savefig(os.path.join(args.plot_dir, f"verify_budget_{d}.png"), dpi=100)
            plt.close(fig)
    for llm in policies.values():
        llm.shutdown()
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
