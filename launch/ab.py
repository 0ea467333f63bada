"""Before / after in one run: a benchmark command alternated between an earlier commit and this tree.

    python launch/ab.py --before 86aa1bf --rounds 3 --keys overhead.local_tpot_ms,overhead.ray_tpot_ms \
        -- launch/bench_cluster.py --parts overhead --overhead-repeats 3 --json {json}

The earlier commit (and --after, when given; else this working tree) is checked out once as a git worktree (under --worktrees, kept for reuse). Each
round runs the command in both trees, the order alternating between rounds (before/after, then
after/before, ...) so that a drift of the machine's load lands on both arms. Each tree runs its own
copy of the script (the scripts put their own tree first on sys.path), with `{json}` replaced by a
per-run path; `--keys` are dotted paths into that JSON. Printed: every run's values, then per key
the median of each arm and after / before. Everything goes to --out (a JSON with the raw runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worktree(commit: str, base: Path) -> Path:
    """A worktree of `commit` (made once; reused when it is already there)."""
    sha = subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", commit], text=True).strip()
    path = base / sha[:12]
    if not (path / ".git").exists():
        base.mkdir(parents=True, exist_ok=True)
        subprocess.check_call(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), sha])
    return path


def dig(data: dict, key: str):
    for part in key.split("."):
        data = data[part]
    return data


def run_once(tree: Path, argv: list[str], out: Path) -> tuple[dict, float]:
    cmd = [sys.executable] + [a.replace("{json}", str(out)) for a in argv]
    env = {**os.environ, "PYTHONPATH": str(tree)}  # this tree's package, whatever is installed
    t0 = time.perf_counter()
    subprocess.check_call(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text()), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the earlier commit (anything git rev-parse takes)")
    ap.add_argument("--after", default=None, help="the later commit (default: this working tree)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keys", required=True, help="comma-separated dotted paths into the command's JSON")
    ap.add_argument("--worktrees", default="/tmp/dspark-ab")
    ap.add_argument("--out", default="/tmp/dspark-ab/result.json")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- script args (with {json} for its output)")
    args = ap.parse_args()
    argv = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not any("{json}" in a for a in argv):
        ap.error("the command must write its JSON to {json}")
    keys = args.keys.split(",")
    trees = {"before": worktree(args.before, Path(args.worktrees)),
             "after": worktree(args.after, Path(args.worktrees)) if args.after else ROOT}
    runs = {"before": [], "after": []}
    scratch = Path(args.worktrees) / "runs"
    scratch.mkdir(parents=True, exist_ok=True)
    for r in range(args.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for arm in order:
            data, wall = run_once(trees[arm], argv, scratch / f"{arm}-{r}.json")
            values = {k: dig(data, k) for k in keys}
            runs[arm].append({"round": r, "wall_s": wall, "values": values, "loadavg": os.getloadavg()[0]})
            print(f"round {r} {arm:6s} ({wall:.0f} s, load {os.getloadavg()[0]:.1f}): "
                  + ", ".join(f"{k} {v:.4g}" for k, v in values.items()), flush=True)
    summary = {}
    for k in keys:
        b = statistics.median(run["values"][k] for run in runs["before"])
        a = statistics.median(run["values"][k] for run in runs["after"])
        summary[k] = {"before": b, "after": a, "after_over_before": a / b}
        print(f"{k}: before {b:.4g}, after {a:.4g}, after/before {a / b:.3f}x", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"before": args.before, "after": args.after or "working tree", "command": argv, "runs": runs, "summary": summary},
                                         indent=1, default=str))


if __name__ == "__main__":
    main()
