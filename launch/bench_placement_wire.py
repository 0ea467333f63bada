"""Bytes and rounds of a speculative step by where the DSpark drafter runs (issue 28): the StepInput and
StepOutput as pickled for the workers, the context rows a drafter group is sent, and the drafter call
(draft requests and proposals, with the draft laws of sampled rows), at batch 1 and 32, greedy and
temperature 1; the bundled tiny-moe and tiny-dspark, static k = 6, in process (the byte counts are those
the Ray path pickles: the same objects).

    python launch/bench_placement_wire.py

Per speculative step (median over the steps that verify drafts):
- placement group: one round to the workers (StepInput in, StepOutput out: in process the context rows
  ride in the StepOutput, on Ray the driver worker sends them to the drafter actor instead), plus one
  Router -> drafter call (DraftRequests out, Proposals back) before the step: 2 round trips.
- placement target: one round to the workers; the next step's proposals come back in the StepOutput.
"""

from __future__ import annotations

import os
import pickle
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dspark_cluster import LLM, SamplingParams  # noqa: E402
from dspark_cluster.config import ASSETS_DIR  # noqa: E402
from dspark_cluster.step import to_wire  # noqa: E402
from dspark_cluster.workload import DEFAULT_PROMPTS, read_prompts  # noqa: E402


def measure(placement: str, held) -> list[dict]:
    llm = LLM(config={"model": {"path": str(ASSETS_DIR / "tiny-moe"), "dtype": "float32"},
                      "parallel": {"executor": "local"}, "scheduler": {"prefix_caching": False},
                      "speculative": {"method": "dspark", "draft_model": str(ASSETS_DIR / "tiny-dspark"),
                                      "num_tokens": 6, "schedule": "static", "placement": placement}})
    eng, steps, calls = llm.engine, [], []
    submit = eng.executor.submit

    def spy_submit(step):
        out = submit(step)
        if step.num_draft is not None and int(step.num_draft.sum()) > 0:
            # the output without the context rows: on Ray those go from the worker to the drafter instead
            steps.append((len(to_wire(step)), len(to_wire(out)) - out.export_bytes, out.export_bytes))
        return out

    eng.executor.submit = spy_submit
    if placement == "group":
        group = eng.drafter.backend
        propose = group.propose

        def spy_propose(requests, version=0):
            proposals = propose(requests, version)
            calls.append(len(pickle.dumps(requests)) + len(pickle.dumps(proposals)))
            return proposals

        group.propose = spy_propose
    rows = []
    try:
        for batch in (1, 32):
            for temperature in (0.0, 1.0):
                steps.clear(), calls.clear()
                llm.generate(held[:batch], SamplingParams(max_tokens=32, temperature=temperature, seed=1, ignore_eos=True))
                med = lambda xs: int(statistics.median(xs)) if xs else 0  # noqa: E731
                row = {"placement": placement, "batch": batch, "temperature": temperature,
                       "input_B": med([s[0] for s in steps]), "output_B": med([s[1] for s in steps]),
                       "export_B": med([s[2] for s in steps]), "drafter_call_B": med(calls),
                       "rounds": 2 if placement == "group" else 1}
                row["total_B"] = row["input_B"] + row["output_B"] + row["export_B"] + row["drafter_call_B"]
                rows.append(row)
                print(" ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    finally:
        llm.shutdown()
    return rows


if __name__ == "__main__":
    torch.set_num_threads(1)
    prompts = read_prompts(DEFAULT_PROMPTS)
    for p in ("group", "target"):
        measure(p, prompts)
