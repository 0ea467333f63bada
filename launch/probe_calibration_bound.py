#!/usr/bin/env python
"""How far a drafter of the bundled size can follow the calibration stream's domain shift, offline (issue 28).

    python launch/probe_calibration_bound.py [--requests 1440] [--minutes 20] [--lr 5e-4] [--out runs/bound]

Online calibration on `bench_calibration.py`'s stream (test functions of the installed packages, which the
bundled tiny-dspark never saw) reads 1.07-1.11x tau in the stream's last third, against the goal of 1.25x. Is that
the drafter's capacity, or what the calibrator trains beside serving (~1-2k optimiser steps)? This probe gives
the calibrator everything online calibration could have had by then and more: the target's greedy continuations
(--max-tokens, as the stream) of the stream's first two thirds, and an offline fine-tune of the shipped drafter on
them alone (`train_dspark.py --init-from`, one rank, --minutes of wall time, the shipped recipe's loss: flat slot
weights, KL 0.5). Then tau at k = 4 (static schedule, greedy, one block pass as `draft_passes: auto` serves on the
CPU) of the shipped and the tuned drafter on the stream's last third (never trained on) and on a sample of the
first two thirds (trained on). tuned / shipped on the last third is an upper bound for what online calibration can
gain on this stream with this drafter, at this much training.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bench_calibration import shifted_prompts  # noqa: E402
from dspark_cluster import LLM, SamplingParams  # noqa: E402
from dspark_cluster.config import ASSETS_DIR  # noqa: E402


def continuations(prompts: list[str], max_tokens: int) -> list[tuple[list[int], int, float]]:
    """(prompt + greedy continuation ids, prompt length, 0.0) of each prompt: train_dspark's data format."""
    llm = LLM(str(ASSETS_DIR / "tiny-moe"), config={"scheduler": {"max_num_seqs": 64, "prefix_caching": False}})
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    finally:
        llm.shutdown()
    return [(o.prompt_token_ids + o.token_ids, len(o.prompt_token_ids), 0.0) for o in outs]


def tau(drafter: str, prompts: list[str], max_tokens: int) -> dict:
    """Greedy tau at k = 4 (static, one pass) over `prompts`, and the acceptance by position."""
    llm = LLM(str(ASSETS_DIR / "tiny-moe"), config={
        "scheduler": {"max_num_seqs": 64, "prefix_caching": False},
        "speculative": {"method": "dspark", "draft_model": drafter, "num_tokens": 4, "schedule": "static",
                        "draft_passes": 1}})
    try:
        llm.engine.drafter.stats.__init__(4)
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        st = llm.engine.drafter.stats.summary()
    finally:
        llm.shutdown()
    return {"tau": round(st["mean_accepted_length"], 4),
            "acceptance_by_position": [round(a, 4) for a in st["acceptance_by_position"]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1440, help="the stream's length (bench_calibration's --requests)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=20.0, help="the fine-tune's wall time")
    ap.add_argument("--steps", type=int, default=100000, help="the fine-tune's step cap (the LR schedule follows the "
                    "first of --steps and --minutes)")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--in-sample", type=int, default=240, help="prompts of the first two thirds scored as well")
    ap.add_argument("--out", default="runs/calibration_bound", help="folder: data, tuned drafter, result.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    prompts = shifted_prompts(args.requests)
    cut = 2 * len(prompts) // 3
    train, test = prompts[:cut], prompts[cut:]
    res = {"args": vars(args), "train_prompts": len(train), "test_prompts": len(test)}

    t = time.perf_counter()
    generated = continuations(train, args.max_tokens)
    res["continuations_s"] = round(time.perf_counter() - t, 1)
    data = os.path.join(args.out, "data.pt")
    # no text windows (--gen-fraction 1): train_dspark reads text_ids only for them
    torch.save(([0] * 1024, generated), data)
    print(f"{len(generated)} continuations in {res['continuations_s']} s", flush=True)

    tuned = os.path.join(args.out, "tuned")
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_dspark.py"),
           "--init-from", str(ASSETS_DIR / "tiny-dspark"), "--markov-gate", "--ranks", "1", "--data-cache", data,
           "--gen-fraction", "1.0", "--steps", str(args.steps), "--minutes", str(args.minutes), "--lr", str(args.lr),
           "--slot-decay", "1e9", "--kl-alpha", "0.5", "--seed", str(args.seed), "--out", tuned]
    res["train_command"] = " ".join(cmd)
    t = time.perf_counter()
    subprocess.run(cmd, check=True)
    res["train_s"] = round(time.perf_counter() - t, 1)
    with open(os.path.join(tuned, "training.json")) as f:
        hist = json.load(f)
    res["train_steps"] = hist.get("steps")

    sample = train[:: max(1, len(train) // args.in_sample)][: args.in_sample]
    for name, path in (("shipped", str(ASSETS_DIR / "tiny-dspark")), ("tuned", tuned)):
        res[name] = {"last_third": tau(path, test, args.max_tokens), "trained_on": tau(path, sample, args.max_tokens)}
        print(name, json.dumps(res[name]), flush=True)
    for part in ("last_third", "trained_on"):
        res[f"ratio_{part}"] = round(res["tuned"][part]["tau"] / res["shipped"][part]["tau"], 4)
    print(f"tuned / shipped, last third (never trained on): {res['ratio_last_third']:.3f}x; "
          f"on prompts trained on: {res['ratio_trained_on']:.3f}x", flush=True)
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
