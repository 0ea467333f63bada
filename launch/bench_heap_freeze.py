"""Garbage collection off the step (issue 27): the heap frozen at start-up (dspark_cluster/heap.py) against
not frozen, in process, a fresh process per run, arms alternating.

    python launch/bench_heap_freeze.py [--rounds 3] [--generates 5]

Each run: the bundled config in process, then --generates x `generate` of 48 prompts x 64 greedy tokens;
the first generate's and the later ones' wall ms, the slowest and p99 step, and the collections the gc
callbacks saw (generation-2 count, total ms). "off" replaces the freeze with a no-op in that process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one(freeze: bool, generates: int) -> dict:
    import gc

    sys.path.insert(0, str(REPO))
    import dspark_cluster.engine as engine_mod
    import dspark_cluster.worker as worker_mod

    if not freeze:
        engine_mod.freeze_heap = worker_mod.freeze_heap = lambda: 0
    from dspark_cluster import LLM, SamplingParams

    llm = LLM(config=str(REPO / "configs/tiny.yaml"))
    seen, started = [], {}

    def timer(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            seen.append((info["generation"], time.perf_counter() - started["t"]))

    gc.callbacks.append(timer)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    walls = []
    for _ in range(generates):
        t = time.perf_counter()
        llm.generate([f"def f{i}(x):" for i in range(48)], params)
        walls.append(time.perf_counter() - t)
    steps = sorted(s["step_time_s"] for s in llm.engine.step_stats)
    llm.shutdown()
    return {"freeze": freeze, "first_ms": round(1e3 * walls[0]), "later_ms": [round(1e3 * w) for w in walls[1:]],
            "step_max_ms": round(1e3 * steps[-1], 1), "step_p99_ms": round(1e3 * steps[int(0.99 * len(steps))], 1),
            "gen2_collections": sum(1 for g, _ in seen if g == 2), "gc_ms": round(1e3 * sum(d for _, d in seen), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--generates", type=int, default=5)
    ap.add_argument("--one", choices=["on", "off"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one == "on", args.generates)), flush=True)
        return
    for _ in range(args.rounds):
        for arm in ("off", "on"):
            out = subprocess.run([sys.executable, __file__, "--one", arm, "--generates", str(args.generates)],
                                 capture_output=True, text=True, check=True).stdout
            print(next(line[7:] for line in out.splitlines() if line.startswith("RESULT ")), flush=True)


if __name__ == "__main__":
    main()
