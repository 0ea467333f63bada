"""The CPU's matmul choice (model/gemm.py) measured where it is used: inside forwards, not alone.

    python launch/bench_gemm.py [--thresholds 0.4e6,1e6,1.5e6,2e6,3e6] [--forwards 1600] [--rounds 600]

1. The threshold: bench_step's forward (tiny-moe, one thread, context 128; 7 new tokens at batches 1 and 4, decodes
   at 16, 32 and 64) in one process, `gemm.ONEDNN_MIN_WORK` switched every 50 forwards between no oneDNN and each
   threshold; median ms and the ratio to no oneDNN.
2. In the engine: one LLM with tiny-dspark on the target (k = 6), a 7-token verify forward (no logits) then a drafting
   round, the kernel choice (the module's threshold, or none) switched every 100 iterations; and the verify forward
   back to back, without the rounds between.
Medians; session 26's figures are in BENCHMARKS.md ("oneDNN's matmul on the CPU").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import bench_drafter_parts as parts  # noqa: E402
from bench_step import ASSETS_DIR, decode_forward, load_model, load_spec  # noqa: E402
from dspark_cluster.model import gemm  # noqa: E402

NONE = float("inf")


def ms(xs) -> float:
    return round(1e3 * statistics.median(xs), 3)


def threshold_sweep(thresholds: list, forwards: int) -> None:
    spec = load_spec(str(ASSETS_DIR / "tiny-moe"), "float32")
    arms = [NONE] + thresholds
    kept = gemm.ONEDNN_MIN_WORK
    try:
        for batch, query in ((1, 7), (4, 7), (16, 1), (32, 1), (64, 1)):
            run = decode_forward(load_model(str(ASSETS_DIR / "tiny-moe"), spec), batch, 128, query=query)
            times = {a: [] for a in arms}
            for i in range(forwards if batch < 64 else forwards // 2):
                arm = arms[(i // 50) % len(arms)]
                gemm.ONEDNN_MIN_WORK = arm
                t = time.perf_counter()
                run()
                times[arm].append(time.perf_counter() - t)
            base = statistics.median(times[NONE])
            print(f"batch {batch}, {query} new token(s) a sequence, ms (ratio to no oneDNN): " + ", ".join(
                f"{'none' if a == NONE else f'{a:g}'} {ms(v)} ({statistics.median(v) / base:.3f})"
                for a, v in times.items()), flush=True)
    finally:
        gemm.ONEDNN_MIN_WORK = kept


def in_engine(rounds: int) -> None:
    llm = parts.LLM(config={**parts.BASE, "speculative": {"method": "dspark", "draft_model": "tiny-dspark",
                                                          "num_tokens": 6, "schedule": "static"}})
    seen = parts.spied(llm)
    llm.generate(parts.read_prompts(parts.DEFAULT_PROMPTS)[:1],
                 parts.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    worker = llm.engine.executor.worker
    verify = next(s for s in reversed(seen) if s.num_draft is not None and int(s.query_lens.sum()) == 7)
    forward, drafting = parts.forward_of(worker.model, verify), parts.Rounds(worker.drafter)
    on = gemm._ONEDNN
    try:
        for between in (True, False):
            fwd, rnd = {True: [], False: []}, {True: [], False: []}
            with torch.inference_mode():
                for i in range(rounds):
                    arm = (i // 100) % 2 == 0
                    gemm._ONEDNN = on and arm
                    t = time.perf_counter()
                    forward()
                    fwd[arm].append(time.perf_counter() - t)
                    worker.model.captured = None
                    if between:
                        rnd[arm].append(drafting())
            line = ", ".join(f"{name} verify forward {ms(fwd[arm])}" + (f", drafting round {ms(rnd[arm])}" if between
                                                                         else "")
                             for name, arm in (("torch", False), ("oneDNN", True)))
            print(f"in the engine, {'a drafting round between' if between else 'back to back'}, ms: {line}", flush=True)
    finally:
        gemm._ONEDNN = on
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--thresholds", default="0.4e6,1e6,1.5e6,2e6,3e6")
    ap.add_argument("--forwards", type=int, default=1600)
    ap.add_argument("--rounds", type=int, default=1200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    threshold_sweep([float(t) for t in args.thresholds.split(",")], args.forwards)
    in_engine(args.rounds)


if __name__ == "__main__":
    main()
