"""The DSpark drafter against the bundled 2-layer drafter and plain decoding, held-out prompts, one process.

    python launch/bench_dspark.py [--threads 1] [--max-tokens 64] [--prompts 16] [--dtype float32] [--tau-only]
    python launch/bench_dspark.py --ablation no-markov=/tmp/no-markov --ablation no-confidence=/tmp/no-conf
    python launch/bench_dspark.py --tau-only --context-windows 512,32,16   # tau by the rows a block reads

Reports, in one run:
1. tau (tokens per verify round) at k = 4 of tiny-dspark and tiny-draft (and any --ablation drafters),
   greedy and temperature 1, batch 16 so the rounds are many; the ratio to tiny-draft; acceptance and
   mean confidence by position;
2. the drafter's cost per round against one target decode step at batch 1 (time in `propose`,
   measured inside the engine, over the target's plain decode step's wall time);
3. the wall-clock speed-up over plain decoding at batch 1 (interleaved runs, medians), k = 2, 4, 6,
   greedy, with the prediction tau / (c + r): c the drafter's cost per round, r a verify step's time
   over a decode step's (both measured; in process the drafter runs inside the verify step, on the
   target's device, so its time is taken out of the step's for r), and the ceiling tau / r, the speed-up
   with a drafter that cost nothing;
4. the bytes per step the hidden-state export adds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dspark_cluster import LLM, SamplingParams  # noqa: E402
from dspark_cluster.config import ASSETS_DIR  # noqa: E402
from dspark_cluster.speculative.dspark_model import DSparkConfig  # noqa: E402
from dspark_cluster.workload import DEFAULT_PROMPTS, read_prompts  # noqa: E402


def timed(llm, prompts, params):
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, outs


def spec_llm(args, method, draft, k, context_window=None):
    sp = {"method": method, "draft_model": draft, "num_tokens": k, "schedule": "static"}
    if context_window:
        sp["context_window"] = context_window
    if method == "dspark":  # the passes the drafter was trained for, or fewer (--draft-passes)
        own = DSparkConfig.load(Path(draft) / "config.json").draft_passes
        sp["draft_passes"] = min(own, args.draft_passes or own)
    return LLM(args.target, config={"model": {"dtype": args.dtype}, "parallel": {"threads_per_worker": args.threads},
                                    "speculative": sp})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=str(ASSETS_DIR / "tiny-moe"))
    ap.add_argument("--dspark", default=str(ASSETS_DIR / "tiny-dspark"))
    ap.add_argument("--draft", default=str(ASSETS_DIR / "tiny-draft"))
    ap.add_argument("--ablation", action="append", default=[], help="name=path of another DSpark drafter")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tau-only", action="store_true", help="only part 1")
    ap.add_argument("--context-windows", default="", help="part 1 also with tiny-dspark reading at most these many "
                    "context rows a block (speculative.context_window), e.g. 32,16")
    ap.add_argument("--dtype", default="float32", help="model.dtype of the speculative engines (the DSpark drafter "
                    "serves in it too)")
    ap.add_argument("--draft-passes", type=int, default=None,
                    help="at most this many DSpark block passes (default: each drafter's own draft_passes, whatever "
                         "speculative.draft_passes' auto would pick on this machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = read_prompts(DEFAULT_PROMPTS)[: args.prompts]
    print(f"target {args.target}, {len(prompts)} held-out prompts, {args.max_tokens} new tokens, "
          f"threads {args.threads}, torch {torch.__version__}")

    # 1. tau at k = 4
    drafters = [("tiny-draft", "draft_model", args.draft), ("tiny-dspark", "dspark", args.dspark)]
    drafters += [(a.split("=", 1)[0], "dspark", a.split("=", 1)[1]) for a in args.ablation]
    drafters += [(f"tiny-dspark W={w}", "dspark", args.dspark, int(w)) for w in args.context_windows.split(",") if w]
    print("\n| drafter | temp | tau (k=4) | vs tiny-draft | acceptance by position | mean confidence by position |")
    print("|---|---|---|---|---|---|")
    base_tau = {}
    for name, method, path, *window in drafters:
        llm = spec_llm(args, method, path, 4, *window)
        for temp in (0.0, 1.0):
            params = [SamplingParams(max_tokens=args.max_tokens, temperature=temp, seed=i if temp else None,
                                     ignore_eos=True) for i in range(len(prompts))]
            llm.engine.drafter.stats.__init__(4)
            llm.generate(prompts, params)
            st = llm.engine.drafter.stats.summary()
            tau = st["mean_accepted_length"]
            base_tau.setdefault(temp, tau)
            acc = " ".join(f"{a:.2f}" for a in st["acceptance_by_position"])
            conf = " ".join(f"{c:.2f}" for c in st["mean_confidence_by_position"]) if method == "dspark" else "-"
            print(f"| {name} | {temp:g} | {tau:.2f} | {tau / base_tau[temp]:.2f}x | {acc} | {conf} |", flush=True)
        llm.shutdown()

    if args.tau_only:
        return
    # 2-4. batch 1, greedy: cost per round, speed-up, export bytes
    plain = LLM(args.target, config={"model": {"dtype": "float32"}, "parallel": {"threads_per_worker": args.threads}})
    g = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    p1 = prompts[:4]
    timed(plain, p1[:1], g)
    first = len(plain.engine.step_stats)
    tpot = statistics.median(timed(plain, [p], g)[1][0].metrics["tpot_s"] for p in p1)
    # a step's wall time (its execution and the engine's work around it), as a verify round's below
    t_decode = statistics.median(s["step_time_s"] for s in list(plain.engine.step_stats)[first:] if s["num_tokens"] == 1)
    print(f"\ntarget decode step, batch 1: {t_decode * 1e3:.2f} ms a step (TPOT {tpot * 1e3:.2f} ms)")
    print("\n| k | tau | drafter ms / round | c = drafter / decode step | verify ms / round | r = verify / decode | "
          "plain tok/s | dspark tok/s | speed-up | predicted tau/(c+r) | ceiling tau/r | export B / step | same output |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for k in (2, 4, 6):
        spec = spec_llm(args, "dspark", args.dspark, k)
        timed(spec, p1[:1], g)
        t_plain, t_spec = [], []
        spec.engine.drafter.stats.__init__(k)
        first = len(spec.engine.step_stats)
        for _ in range(args.repeats):
            for p in p1:  # batch 1: one request at a time
                tp_, outs_p = timed(plain, [p], g)
                ts_, outs_s = timed(spec, [p], g)
                t_plain.append(tp_)
                t_spec.append(ts_)
                same = outs_p[0].token_ids == outs_s[0].token_ids
                if not same:
                    print("OUTPUT DIFFERS", flush=True)
        st = spec.engine.drafter.stats.summary()
        steps = list(spec.engine.step_stats)[first:]
        verify = [s["step_time_s"] for s in steps if s["verify_budget"] == k + 1]  # decode + k drafts, batch 1
        export = [s["export_bytes"] for s in steps if s["verify_budget"] == k + 1]
        rounds = st["verify_rounds"]
        draft_ms = st["draft_time_s"] / rounds * 1e3
        c = draft_ms / 1e3 / t_decode
        # a drafter on the target's device drafts inside the verify step: the step's time less its drafting
        on_target = spec.engine.speculation.on_target
        verify = [v - (draft_ms / 1e3 if on_target else 0.0) for v in verify]
        r = statistics.median(verify) / t_decode
        tau = st["mean_accepted_length"]
        n_tok = args.max_tokens
        sp = statistics.median(t_plain) / statistics.median(t_spec)
        print(f"| {k} | {tau:.2f} | {draft_ms:.2f} | {c:.3f} | {statistics.median(verify) * 1e3:.2f} | {r:.2f} | "
              f"{n_tok / statistics.median(t_plain):.0f} | {n_tok / statistics.median(t_spec):.0f} | {sp:.2f}x | "
              f"{tau / (c + r):.2f}x | {tau / r:.2f}x | {statistics.mean(export):.0f} | {same} |", flush=True)
        spec.shutdown()


if __name__ == "__main__":
    main()
