"""A fresh engine's first decisions: `dspark run` throughput with each drafter against no speculation,
one process per run (a second run in one process is systematically faster or slower by more than the
effect: BENCHMARKS.md, issue 27's note), arms interleaved with a rotating order.

The workload is issue 28's: 48 synthetic requests at once, prompts 16-64 tokens, 64 greedy output
tokens, `num_tokens: 4`, the confidence schedule, no warm-up (the engine's own start-up profile only).
Throughput is output tokens over the workload's wall time (engine start excluded, as the report has it).

    python launch/bench_first_guess.py [--rounds 5] [--requests 48] [--out runs/first_guess.json]
    python launch/bench_first_guess.py --one ARM --json   # (one run; what each round spawns)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ARMS = {
    "none": ["speculative.method=none"],
    "draft_model": ["speculative.method=draft_model", "speculative.draft_model=tiny-draft"],
    "dspark": ["speculative.method=dspark", "speculative.draft_model=tiny-dspark"],  # placement auto: target
    "dspark_group": ["speculative.method=dspark", "speculative.draft_model=tiny-dspark", "speculative.placement=group"],
}


def one(arm: str, requests: int, out_dir: str) -> dict:
    from dspark_cluster.config import load_config
    from dspark_cluster.runner import run_experiment

    spec = [] if arm == "none" else ARMS[arm][1:] + ["speculative.num_tokens=4", "speculative.schedule=confidence"]
    cfg = load_config(str(REPO / "configs/tiny.yaml"), [
        "workload.kind=synthetic", f"workload.num_requests={requests}", "workload.prompt_len=[16,64]",
        "workload.output_len=[64,64]", "workload.temperature=0", f"report.out_dir={out_dir}", *ARMS[arm][:1], *spec])
    report = run_experiment(cfg, progress=False)
    s = report["summary"]
    sp = s.get("speculative") or {}
    return {"arm": arm, "output_tokens_per_s": s["output_tokens_per_s"], "steps": s.get("steps"),
            "drafted_positions": sp.get("num_drafted_positions")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--arms", default="none,draft_model,dspark")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="runs/first_guess.json")
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one, args.requests, "/tmp/dspark-first-guess")), flush=True)
        return
    arms = args.arms.split(",")
    rows = []
    for r in range(args.rounds):
        order = arms[r % len(arms):] + arms[: r % len(arms)]
        for arm in order:
            p = subprocess.run([sys.executable, __file__, "--one", arm, "--requests", str(args.requests)],
                               capture_output=True, text=True, cwd=REPO)
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{arm} failed:\n{p.stderr[-3000:]}")
            row = {**json.loads(line[7:]), "round": r + 1}
            rows.append(row)
            print(f"round {r + 1} {arm:12s} {row['output_tokens_per_s']:8.1f} tok/s, steps {row['steps']}, "
                  f"drafted positions {row['drafted_positions']}", flush=True)
    ratios = {}
    for arm in arms[1:]:
        per_round = [next(x for x in rows if x["round"] == r + 1 and x["arm"] == arm)["output_tokens_per_s"]
                     / next(x for x in rows if x["round"] == r + 1 and x["arm"] == arms[0])["output_tokens_per_s"]
                     for r in range(args.rounds)]
        ratios[arm] = {"median": statistics.median(per_round), "rounds": [round(x, 3) for x in per_round]}
        print(f"{arm} / {arms[0]}: median {ratios[arm]['median']:.3f}, rounds {ratios[arm]['rounds']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
