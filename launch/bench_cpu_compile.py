"""model.compile on the CPU against eager, in the LLM (issue 27; BENCHMARKS.md, session 34): the probes behind its
"measured again" paragraph.

    python launch/bench_cpu_compile.py tpot [--rounds 3] [--batch 1] [--modes off,on]
        TPOT (`bench_step.llm_tpot`: `batch` 128-token prompts, 128 greedy tokens, median of 5), two model.compile
        settings alternated in one process, the order rotating each round; and each engine's start-up seconds
    python launch/bench_cpu_compile.py serve [--rounds 4] [--workloads 0,0] [--warm-up 8] [--modes off,on]
        a batch of 64 requests (prompts of 8-256 tokens, 8-256 greedy tokens, workload seed s) run one after another
        in one engine, per compile mode, one process per (round, mode), the order rotating: output tok/s and minor
        page faults of each run (the first run of a fresh engine against a repeat; `--workloads 0,1,0,1
        --warm-up 0` tells a shape's first run from a generic warm-up). glibc's malloc thresholds are the
        environment's (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from dspark_cluster.config import ASSETS_DIR  # noqa: E402

MODEL = str(ASSETS_DIR / "tiny-moe")


def workload(seed: int, n: int = 64):
    from dspark_cluster import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(5, 2000) for _ in range(rng.randint(8, 256))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(8, 256), temperature=0, ignore_eos=True) for _ in range(n)]
    return prompts, params


def serve_runs(mode: str, seeds: list, warm_up: int) -> list:
    """One engine (model.compile `mode`): the workloads one after another -> [{seed, tok_s, faults}]."""
    from dspark_cluster import LLM

    llm = LLM(MODEL, config={"model": {"dtype": "float32", "compile": mode},
                             "parallel": {"executor": "local", "threads_per_worker": 1}})
    try:
        if warm_up:
            prompts, params = workload(seeds[0])
            llm.generate(prompts[:warm_up], params[:warm_up])
        out = []
        for seed in seeds:
            prompts, params = workload(seed)
            f0, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            outs = llm.generate(prompts, params)
            dt, f1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            out.append({"seed": seed, "tok_s": sum(len(o.token_ids) for o in outs) / dt, "faults": f1 - f0})
        return out
    finally:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["tpot", "serve"])
    ap.add_argument("--rounds", type=int, default=None, help="tpot: 3, serve: 4")
    ap.add_argument("--workloads", default="0,0", help="serve: workload seeds run in turn in each engine")
    ap.add_argument("--warm-up", type=int, default=8, help="serve: requests of the first workload run first")
    ap.add_argument("--modes", default="off,on", help="the two model.compile settings compared (e.g. off,auto)")
    ap.add_argument("--batch", type=int, default=1, help="tpot: sequences decoding together")
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # (serve: one engine, this process)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.workloads.split(",")]
    if args.mode:
        print(json.dumps(serve_runs(args.mode, seeds, args.warm_up)))
        return
    rounds = args.rounds or (3 if args.what == "tpot" else 4)
    a, b = args.modes.split(",")
    res = {a: [], b: []}
    for r in range(rounds):
        for mode in ((a, b) if r % 2 == 0 else (b, a)):
            if args.what == "tpot":
                from bench_step import llm_tpot

                o = llm_tpot(MODEL, mode, batch=args.batch)
                res[mode].append({"tpot_ms": o["tpot_ms"], "start_s": o["start_s"]})
                print(f"round {r} compile {mode}: TPOT {o['tpot_ms']:.3f} ms, start-up {o['start_s']:.1f} s",
                      flush=True)
            else:
                out = subprocess.run([sys.executable, __file__, "serve", "--mode", mode, "--workloads", args.workloads,
                                      "--warm-up", str(args.warm_up)], capture_output=True, text=True, check=True)
                runs = json.loads(out.stdout.strip().splitlines()[-1])
                res[mode].append(runs)
                print(f"round {r} compile {mode}: " + ", ".join(
                    f"seed {x['seed']} {x['tok_s']:.0f} tok/s {x['faults']} faults" for x in runs), flush=True)
    if args.what == "tpot":
        med = {m: statistics.median(x["tpot_ms"] for x in v) for m, v in res.items()}
        print(f"TPOT median (batch {args.batch}): {a} {med[a]:.3f} ms, {b} {med[b]:.3f} ms ({med[b] / med[a]:.3f}x)")
    else:
        for i in range(len(seeds)):
            med = {m: statistics.median(x[i]["tok_s"] for x in v) for m, v in res.items()}
            print(f"run {i} (seed {seeds[i]}): median {a} {med[a]:.0f}, {b} {med[b]:.0f} tok/s "
                  f"({med[b] / med[a]:.3f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
