"""Speculative decoding on the bundled target and drafter, held-out prompts, one process.

    python launch/bench_spec.py [--threads 1] [--max-tokens 64] [--prompts 16]

Reports, per k: accepted length tau (tokens per verify round) and acceptance by position; the
wall-clock speedup over plain decoding at batch 1 and 16, temperature 0 and 1 (same run,
interleaved); the measured draft/target cost ratio c (one drafter step vs one target decode step)
and the speedup the standard formula predicts, tau / (k c + 1).
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
from dspark_cluster.config import ASSETS_DIR  # noqa: E402
from dspark_cluster.workload import DEFAULT_PROMPTS, read_prompts  # noqa: E402


def run(llm, prompts, params):
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, outs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=str(ASSETS_DIR / "tiny-moe"))
    ap.add_argument("--draft", default=str(ASSETS_DIR / "tiny-draft"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = read_prompts(DEFAULT_PROMPTS)[: args.prompts]
    base_cfg = {"model": {"dtype": "float32"}, "parallel": {"threads_per_worker": args.threads}}
    plain = LLM(args.target, config=base_cfg)
    print(f"target {args.target}, drafter {args.draft}, {len(prompts)} held-out prompts, "
          f"{args.max_tokens} new tokens, threads {args.threads}")

    # cost ratio: one drafter decode step vs one target decode step, batch 1
    draft_only = LLM(args.draft, config=base_cfg)
    p1 = [prompts[0]]
    g = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    run(plain, p1, g), run(draft_only, p1, g)
    t_target = statistics.median(run(plain, p1, g)[1][0].metrics["tpot_s"] for _ in range(3))
    t_draft = statistics.median(run(draft_only, p1, g)[1][0].metrics["tpot_s"] for _ in range(3))
    c = t_draft / t_target
    print(f"\ndecode step, batch 1: target {t_target * 1e3:.2f} ms, drafter {t_draft * 1e3:.2f} ms, c = {c:.3f}\n")
    draft_only.shutdown()

    print("| k | temp | batch | tau | acceptance by position | plain tok/s | spec tok/s | speedup | predicted tau/(kc+1) | draft / verify s | same output |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for k in (2, 4, 6):
        spec = LLM(args.target, config={**base_cfg, "speculative": {"method": "draft_model", "draft_model": args.draft,
                                                                     "num_tokens": k, "schedule": "static"}})
        for temp in (0.0, 1.0):
            for batch in (1, 16):
                ps = (prompts * 16)[:batch]
                params = [SamplingParams(max_tokens=args.max_tokens, temperature=temp, seed=i if temp else None,
                                         ignore_eos=True) for i in range(batch)]
                run(spec, ps[:1], params[:1])  # warm-up
                t_plain, t_spec = [], []
                spec.engine.drafter.stats.__init__(k)
                for _ in range(args.repeats):
                    tp_, outs_p = run(plain, ps, params)
                    ts_, outs_s = run(spec, ps, params)
                    t_plain.append(tp_)
                    t_spec.append(ts_)
                st = spec.engine.drafter.stats.summary()
                n_tok = batch * args.max_tokens
                tau = st["mean_accepted_length"]
                same = sum(a.token_ids == b.token_ids for a, b in zip(outs_p, outs_s)) if temp == 0 else "n/a"
                acc = " ".join(f"{a:.2f}" for a in st["acceptance_by_position"])
                print(f"| {k} | {temp:g} | {batch} | {tau:.2f} | {acc} | {n_tok / statistics.median(t_plain):.0f} | "
                      f"{n_tok / statistics.median(t_spec):.0f} | {statistics.median(t_plain) / statistics.median(t_spec):.2f}x | "
                      f"{tau / (k * c + 1):.2f}x | {st['draft_time_s']:.2f} / {st['verify_time_s']:.2f} | "
                      f"{f'{same}/{batch}' if temp == 0 else 'n/a'} |")
        spec.shutdown()


if __name__ == "__main__":
    main()
