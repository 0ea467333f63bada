"""A compiled decode step of rank 0 of two (tensor 2, the experts split over both), at a target's depth: the step's
time eager and compiled, the graphs a step is cut into and whether its graphs are called without dynamo's guards.

    python launch/bench_parallel_compile.py --layers 61        # a random DeepSeek-V3-shaped model, tiny widths
    python launch/ab.py --script-here --trees HEAD~1,. --rounds 3 --keys compiled_ms,eager_ms,compiled_over_eager \
        -- launch/bench_parallel_compile.py --layers 61 --json {json}

--collectives stub (default): one process, rank 0 of a world of two whose collectives are local copies (c10d's calls
replaced: an all-reduce leaves its tensor, an all-to-all returns what it sends, an all-gather repeats this rank's
part), so the step's time is its compute and its host dispatch alone, without gloo's latency on a 2-core host (~1-2
ms a collective here, which would swamp the dispatch); the numbers it computes are not a world's. --collectives
gloo: two real ranks (gloo processes), rank 0 reports. The rank decodes one sequence (context 40) with
`Worker.execute`, compiled and eager alternating, --runs x --steps steps each (ms, median of each run, then the
median of the runs). Before the collectives were ops of the graph, each all-reduce and expert dispatch cut a
compiled step into another frame (its own guards, its own dispatch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

# after PYTHONPATH: `launch/ab.py --script-here` runs this script on older trees
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def stub_collectives():
    """Rank 0 of a world of two whose collectives are local copies (see the module's docstring)."""
    import torch.distributed as dist

    from parallel.state import ParallelState

    def all_gather(parts, x, group=None):
        for p in parts:
            p.copy_(x)

    def all_to_all_single(out, x, out_splits=None, in_splits=None, group=None):
        out.copy_(x)

    dist.all_reduce = lambda x, group=None: None
    dist.all_gather, dist.all_to_all_single = all_gather, all_to_all_single
    return ParallelState(rank=0, world_size=2, tp_size=2, tp_rank=0, dp_rank=0, tp_group=None, ep_group=None,
                         tp_ranks=[0, 1], device=torch.device("cpu"))


def rank_main(rank: int, port: int, path: str, q, runs: int = 6, steps: int = 50) -> None:
    torch.set_num_threads(1)
    from dspark_cluster.config import load_config
    from dspark_cluster.model.spec import load_spec
    from dspark_cluster.step import StepInput
    from dspark_cluster.worker import Worker, WorkerConfig
    from parallel.state import init_parallel, shutdown_parallel

    if port:
        state = init_parallel(rank, 2, 2, "127.0.0.1", port, "gloo", torch.device("cpu"))
    else:
        state = stub_collectives()
    spec = load_spec(path, "float32")
    cfg = load_config({"model": {"path": path, "dtype": "float32", "compile": "on"},
                       "parallel": {"tensor": 2, "executor": "ray"},
                       "scheduler": {"block_size": 4, "num_kv_blocks": 32, "max_num_seqs": 1}})
    worker = Worker(WorkerConfig.of(cfg), spec, "cpu", rank, 2, state)
    t0 = time.perf_counter()
    worker.allocate_kv(32)
    warm = time.perf_counter() - t0
    runner = worker.compiled
    tables = torch.arange(16).view(1, 16)
    from dspark_cluster.step_builder import expert_capacity

    # the padded all-to-all a decode step of one sequence gets from the engine (both ranks one token)
    capacity = expert_capacity([1], 2, spec.top_k, 2, spec.hidden_size * 4)

    def step():
        return StepInput(input_ids=torch.tensor([7]), query_lens=torch.tensor([1]), context_lens=torch.tensor([40]),
                         block_tables=tables, sample_rows=torch.arange(1), temperature=torch.zeros(1),
                         top_k=torch.zeros(1, dtype=torch.long), top_p=torch.ones(1), seeds=torch.full((1,), -1),
                         positions_out=torch.zeros(1, dtype=torch.long), block_size=4, expert_capacity=capacity)

    ms = {"compiled": [], "eager": []}
    for i in range(runs):
        for arm in (("compiled", "eager") if i % 2 == 0 else ("eager", "compiled")):
            worker.compiled = runner if arm == "compiled" else None
            for _ in range(5):
                worker.execute(step())
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                worker.execute(step())
                times.append((time.perf_counter() - t) * 1e3)
            ms[arm].append(statistics.median(times))
    stats = runner.stats()
    q.put((rank, {"compiled_ms_runs": ms["compiled"], "eager_ms_runs": ms["eager"], "warm_up_s": warm,
                  "warm_up_graphs": stats["compile_warm_up_graphs"], "direct_steps": stats.get("compile_direct_steps"),
                  "compiled_steps": stats["compile_steps"]}))
    if port:
        shutdown_parallel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--collectives", choices=["stub", "gloo"], default="stub")
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from parallel.state import open_rendezvous

    from bench_guards import deep_checkpoint  # (this script's folder: launch/)

    path = deep_checkpoint(args.layers)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    if args.collectives == "stub":
        rank_main(0, 0, path, q, args.runs, args.steps)
        got = dict([q.get(timeout=60)])
    else:
        rendezvous = open_rendezvous()
        procs = [ctx.Process(target=rank_main, args=(r, rendezvous.port, path, q, args.runs, args.steps))
                 for r in range(2)]
        for p in procs:
            p.start()
        got = dict(q.get(timeout=3600) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    r = got[0]
    r["compiled_ms"], r["eager_ms"] = statistics.median(r["compiled_ms_runs"]), statistics.median(r["eager_ms_runs"])
    r["compiled_over_eager"] = r["compiled_ms"] / r["eager_ms"]
    r["layers"] = args.layers
    r["collectives"] = args.collectives
    print(f"{args.layers} layers, tensor 2 ({args.collectives} collectives): compiled {r['compiled_ms']:.2f} ms a step "
          f"({', '.join(f'{x:.2f}' for x in r['compiled_ms_runs'])}), eager {r['eager_ms']:.2f} "
          f"({', '.join(f'{x:.2f}' for x in r['eager_ms_runs'])}): {r['compiled_over_eager']:.3f}x; warm-up "
          f"{r['warm_up_s']:.1f} s, {r['warm_up_graphs']} graphs; {r['direct_steps']} of {r['compiled_steps']} "
          f"compiled steps called directly", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
