"""What speculation costs in process while it drafts nothing (issue 28, "an idle drafter costs nothing").

    python launch/bench_idle_speculation.py [--arms none,dspark,draft_model] [--rounds 5] [--json FILE]

One warm LLMEngine per arm in this process (the bundled config; arms as launch/bench_first_guess.py names
them, with num_tokens 4 and the confidence schedule, which at this load drafts only in the first run), then
--rounds runs of 48 synthetic prompts (16-64 tokens) x 64 greedy tokens on each, the arms interleaved (their
order rotating by round).
Per arm: ms per step, its ratio to `none`, and the ms per step in each part speculation adds (the
controller's per-step calls, the committed rows' selection, the context stash) beside the model's forward,
each timed by wrapping the function in this process.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # (after PYTHONPATH: launch/ab.py --script-here runs it on older trees)

from dspark_cluster import step_exec  # noqa: E402
from dspark_cluster.config import load_config  # noqa: E402
from dspark_cluster.engine import LLMEngine  # noqa: E402
from dspark_cluster.model.model import DecoderModel  # noqa: E402
from dspark_cluster.sampling import SamplingParams  # noqa: E402
from dspark_cluster.speculative.context import ContextStash  # noqa: E402
from dspark_cluster.speculative.controller import Speculation  # noqa: E402
from launch.bench_first_guess import ARMS  # noqa: E402

SECONDS: dict[str, float] = {}


def timed_parts() -> None:
    """Wrap the parts to time (module functions where step_exec looks them up, methods on their class)."""
    def wrap(owner, name, key):
        f = getattr(owner, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                SECONDS[key] = SECONDS.get(key, 0.0) + time.perf_counter() - t
        setattr(owner, name, timed)

    for name in ("plan", "attach", "step_fields", "collect", "observe", "step_stats", "free", "observe_step_cost",
                 "observe_delivery"):
        if not hasattr(Speculation, name):  # (observe_delivery since session 22: older trees through ab.py)
            continue
        wrap(Speculation, name, f"controller.{name}")
    wrap(ContextStash, "route", "stash.route")
    if hasattr(ContextStash, "keep_step"):  # (an idle step's log, since session 15)
        wrap(ContextStash, "keep_step", "stash.keep_step")
    wrap(step_exec, "committed_rows", "committed_rows")
    wrap(step_exec, "_execute_step", "worker step")
    wrap(DecoderModel, "forward", "model forward")


def run(engine: LLMEngine, seed: int) -> tuple[float, int]:
    rng = random.Random(seed)
    for _ in range(48):
        engine.add_request([rng.randrange(100, 2000) for _ in range(rng.randint(16, 64))],
                           SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    t, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return time.perf_counter() - t, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default="none,dspark,draft_model")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None, help="write {arm: {ms_per_step, ratio, parts}} here (launch/ab.py)")
    args = ap.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    timed_parts()
    engines = {}
    for arm in arms:
        spec = [] if arm == "none" else ARMS[arm][1:] + ["speculative.num_tokens=4", "speculative.schedule=confidence"]
        engines[arm] = LLMEngine(load_config(str(REPO / "configs/tiny.yaml"), [*ARMS[arm][:1], *spec]))
        run(engines[arm], 0)  # warm (and the planner's learning)
    per_step = {a: [] for a in arms}
    parts = {a: {} for a in arms}
    for r in range(args.rounds):
        # the order rotates by round: on this machine the first run of a round often reads a few percent slower
        for arm in arms[r % len(arms):] + arms[: r % len(arms)]:
            SECONDS.clear()
            seconds, steps = run(engines[arm], r + 1)
            per_step[arm].append(seconds / steps)
            for k, v in SECONDS.items():
                parts[arm].setdefault(k, []).append(v / steps)
    base = statistics.median(per_step["none"]) if "none" in per_step else None
    result = {}
    for arm in arms:
        ms = 1e3 * statistics.median(per_step[arm])
        sp = engines[arm].speculation
        ratio = f", none / arm {base / statistics.median(per_step[arm]):.3f}" if base else ""
        print(f"{arm}: {ms:.3f} ms a step{ratio}, positions drafted over all runs "
              f"{sp.num_drafted if sp is not None else 0}", flush=True)
        print("  " + ", ".join(f"{k} {1e3 * statistics.median(v):.3f}" for k, v in sorted(parts[arm].items())),
              flush=True)
        result[arm] = {"ms_per_step": ms, "ratio": base / statistics.median(per_step[arm]) if base else None,
                       "parts": {k: 1e3 * statistics.median(v) for k, v in parts[arm].items()}}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
