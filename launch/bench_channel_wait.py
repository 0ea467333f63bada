"""What a Ray compiled-graph worker does while it waits, and what a second thread in it gets done meanwhile.

    OMP_WAIT_POLICY=PASSIVE python launch/bench_channel_wait.py [--host-ms 0.8] [--steps 200]

1. CPU while waiting: a compiled graph of one actor whose step only records time; the driver sleeps 50 ms
   between executions. Printed: the actor process's CPU seconds per wall second between two steps (1.0: its
   channel read busy-polls a whole core).
2. A thread beside the step loop: the actor's step runs `work(250)` (a chain of small tensor operations, Python-
   heavy as a drafter's round is) and, arm `seq`, `work(150)` after it, or, arm `thread`, starts `work(150)` in a
   thread and joins it at the next step; the driver spins --host-ms between executions (the Router's turn).
   Printed: the median period per arm and how much of the host's turn the thread hid.

Session 25 (2-core machine): 1.00 CPU second per second waiting; the thread hid ~0.57 of a 0.8 ms turn. With the
Router's wait and the worker's wait each busy-polling a core, a third busy thread shares a core instead of running
beside them (BENCHMARKS.md, "Drafting beside the Router's turn").
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import ray
import torch
from ray.dag import InputNode


@ray.remote
class _Clock:
    def __init__(self):
        self.last = None

    def step(self, _):
        now = (time.process_time(), time.perf_counter())
        out = None if self.last is None else (now[0] - self.last[0]) / (now[1] - self.last[1])
        self.last = now
        return out


@ray.remote
class _Worker:
    def __init__(self):
        torch.set_num_threads(1)
        self.w, self.x, self.t = torch.randn(64, 64), torch.randn(1, 64), None

    def work(self, n: int):
        x = self.x
        for _ in range(n):
            x = torch.tanh((x @ self.w)[:, :64]) * 0.5 + x.sum() * 0.0
        return x

    def step(self, mode: str) -> bytes:
        if self.t is not None:
            self.t.join()
            self.t = None
        if mode == "seq":
            self.work(150)
        self.work(250)
        if mode == "thread":
            self.t = threading.Thread(target=self.work, args=(150,), daemon=True)
            self.t.start()
        return b"x" * 1000


def _compiled(actor):
    with InputNode() as inp:
        dag = actor.step.bind(inp)
    return dag.experimental_compile()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host-ms", type=float, default=0.8)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    cd = _compiled(_Clock.remote())
    shares = []
    for i in range(8):
        r = ray.get(cd.execute(i))
        if r is not None:
            shares.append(r)
        time.sleep(0.05)
    cd.teardown()
    print(f"waiting for its input, the actor process spends {statistics.median(shares):.2f} CPU s per wall s")
    cd = _compiled(_Worker.remote())
    periods = {}
    for mode in ["seq", "thread", "seq", "thread"]:
        for _ in range(20):
            ray.get(cd.execute(mode))
        ts = []
        for _ in range(args.steps):
            t = time.perf_counter()
            ray.get(cd.execute(mode))
            end = time.perf_counter() + args.host_ms / 1e3
            while time.perf_counter() < end:  # the host's turn
                pass
            ts.append(time.perf_counter() - t)
        periods.setdefault(mode, []).append(statistics.median(ts))
    cd.teardown()
    seq, thr = min(periods["seq"]), min(periods["thread"])
    print(f"period ms: work after the step {1e3 * seq:.3f}, in a thread {1e3 * thr:.3f}; the thread hid "
          f"{1e3 * (seq - thr):.2f} of the host's {args.host_ms:.2f} ms turn")


if __name__ == "__main__":
    main()
