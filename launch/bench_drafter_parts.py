"""The DSpark drafter on the target at batch 1, by part, in the worker's own process (the bundled config, k = 6,
one pass), and what an idle DSpark worker does beside plain decoding.

    OMP_WAIT_POLICY=PASSIVE python launch/bench_drafter_parts.py [--rounds 300] [--compile]

1. A drafting round (`TargetDrafter.propose`, one sequence with 32 context rows, one new row a round), alternating:
   right after a 7-token target forward (a verify step's), and right after the last round (warm caches).
2. A round back to back, by part: the block's context (`block_context`), the block forward (two layers, the fuse,
   the base logits over the vocabulary), the rest (Markov loop, confidences, packing).
3. --compile: the same back-to-back round with the drafter's layers and head under torch.compile(dynamic=True),
   and the compile's seconds.
4. An idle DSpark worker's own work at 8 and 32 rows: the target forward of one decode step with the three exported
   layers captured against without (alternating), and the stash's `keep_step` a step.
Medians; session 25's figures are in BENCHMARKS.md ("Drafting beside the Router's turn").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from dspark_cluster import LLM, SamplingParams  # noqa: E402
from dspark_cluster.model.attention import build_metadata  # noqa: E402
from dspark_cluster.speculative.context import ContextStash  # noqa: E402
from dspark_cluster.speculative.records import ContextRows  # noqa: E402
from dspark_cluster.workload import DEFAULT_PROMPTS, read_prompts  # noqa: E402

BASE = {"model": {"dtype": "float32"}, "scheduler": {"prefix_caching": False, "max_num_seqs": 64}}


def ms(xs) -> float:
    return round(1e3 * statistics.median(xs), 3)


def spied(llm) -> list:
    """The StepInputs the engine submits from here on."""
    ex, seen = llm.engine.executor, []
    submit = ex.submit
    ex.submit = lambda step: (seen.append(step), submit(step))[1]
    return seen


def forward_of(model, step):
    positions, meta = build_metadata(step.query_lens, step.context_lens, step.block_tables, step.block_size)
    meta = meta.to("cpu", model.lm_head.weight.dtype)
    return lambda capture=(): model(step.input_ids, positions, meta, capture=capture)


class Rounds:
    """Drafting rounds of one synthetic sequence on the worker's drafter, a new context row before each."""

    def __init__(self, drafter):
        self.d, self.p, self.i = drafter, drafter.proposer, 0
        self.width = self.p.c.target_hidden_size * len(self.p.layer_ids)
        self.ids = torch.tensor([-(1 << 41)])
        self.p.ingest(ContextRows(self.ids, torch.tensor([0]), torch.tensor([32]), torch.randn(32, self.width)))

    def __call__(self) -> float:
        i, full = self.i, lambda v, dtype=torch.long: torch.full((1,), v, dtype=dtype)  # noqa: E731
        self.p.ingest(ContextRows(self.ids, torch.tensor([32 + i]), torch.tensor([1]), torch.randn(1, self.width)))
        t = time.perf_counter()
        self.d.propose(full(6), self.ids, full(34 + i), full(2), full(0.0, torch.float32), full(0),
                       full(1.0, torch.float32), full(-1), full(i))
        self.i += 1
        return time.perf_counter() - t


def timed_parts(obj, names: list, seconds: dict) -> None:
    for name in names:
        inner = getattr(obj, name)

        def spy(*a, _inner=inner, _name=name, **kw):
            t = time.perf_counter()
            out = _inner(*a, **kw)
            seconds.setdefault(_name, []).append(time.perf_counter() - t)
            return out

        setattr(obj, name, spy)


def drafter_parts(args) -> None:
    llm = LLM(config={**BASE, "speculative": {"method": "dspark", "draft_model": "tiny-dspark", "num_tokens": 6,
                                              "schedule": "static"}})
    seen = spied(llm)
    llm.generate(read_prompts(DEFAULT_PROMPTS)[:1], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    worker = llm.engine.executor.worker
    verify = next(s for s in reversed(seen) if s.num_draft is not None and int(s.query_lens.sum()) == 7)
    forward, rounds = forward_of(worker.model, verify), Rounds(worker.drafter)
    after, warm = [], []
    with torch.inference_mode():
        for i in range(args.rounds):
            if i % 2 == 0:
                forward()
                worker.model.captured = None
            (after if i % 2 == 0 else warm).append(rounds())
    print(f"drafting round, ms: right after a 7-token target forward {ms(after[10:])}, after the last round "
          f"{ms(warm[10:])}")
    seconds: dict = {}
    timed_parts(rounds.p, ["block_context", "block_forward", "draft"], seconds)
    with torch.inference_mode():
        whole = [rounds() for _ in range(args.rounds)][10:]
    ctx, block, draft = (ms(seconds[k][10:]) for k in ("block_context", "block_forward", "draft"))
    print(f"back to back, ms: a round {ms(whole)} (its draft {draft}): block context {ctx}, block forward {block}, "
          f"the rest of the draft {round(draft - ctx - block, 3)}")
    if args.compile:
        model = rounds.p.model
        t0 = time.perf_counter()
        for layer in model.layers:
            layer.forward = torch.compile(layer.forward, dynamic=True)
        model.head = torch.compile(model.head, dynamic=True)
        with torch.inference_mode():
            [rounds() for _ in range(12)]
            took = time.perf_counter() - t0
            compiled = [rounds() for _ in range(args.rounds)][10:]
        print(f"compiled layers and head: a round {ms(compiled)} ms (the first 12 rounds with the compile {took:.1f} s)")
    llm.shutdown()


def idle_work(args) -> None:
    prompts = read_prompts(DEFAULT_PROMPTS)
    stash_s: list = []
    keep = ContextStash.keep_step

    def timed_keep(self, *a, **kw):
        t = time.perf_counter()
        keep(self, *a, **kw)
        stash_s.append(time.perf_counter() - t)

    ContextStash.keep_step = timed_keep
    try:
        for rows in (8, 32):
            llm = LLM(config={**BASE, "speculative": {"method": "dspark", "draft_model": "tiny-dspark", "num_tokens": 6,
                                                      "schedule": "confidence"}})
            llm.engine.planner.draft_len = lambda num_rows: 0  # (idle: no step drafts)
            seen = spied(llm)
            stash_s.clear()
            llm.generate(prompts[:rows], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
            model = llm.engine.executor.worker.model
            step = next(s for s in reversed(seen) if s.query_lens.numel() == rows and int(s.query_lens.sum()) == rows)
            forward, times = forward_of(model, step), {(): [], (1, 2, 3): []}
            with torch.inference_mode():
                for i in range(args.rounds):
                    capture = ((), (1, 2, 3))[i % 2]
                    t = time.perf_counter()
                    forward(capture)
                    model.captured = None
                    times[capture].append(time.perf_counter() - t)
            print(f"{rows} rows, ms: a decode forward {ms(times[()][20:])}, capturing the exported layers "
                  f"{ms(times[(1, 2, 3)][20:])}; the stash's keep_step {ms(stash_s)} a step")
            llm.shutdown()
    finally:
        ContextStash.keep_step = keep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    drafter_parts(args)
    idle_work(args)


if __name__ == "__main__":
    main()
