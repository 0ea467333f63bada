"""Before / after in one run: a benchmark command alternated between commits of this repository.

    python launch/ab.py --trees 86aa1bf,HEAD --rounds 2 --keys overhead.local_tpot_ms,overhead.ray_ratio \
        -- launch/bench_cluster.py --parts overhead --overhead-repeats 3 --json {json}

Each tree (a commit, or `.` for this working tree) is checked out once as a git worktree (under
--worktrees, kept for reuse). Each round runs the command once in every tree, the order rotating
between rounds, so that a drift of the machine's load lands on every arm. By default each tree runs
its own copy of the script (the scripts put their own tree first on sys.path); with --script-here
this tree's script runs against each tree's package (PYTHONPATH), for a script the older trees
lack. `{json}` is replaced by a per-run path; `--keys` are dotted paths into that JSON. Printed:
every run's values, then per key the median of each tree and its ratio to the first tree's. The
raw runs go to --out.
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
    """A worktree of `commit` (made once; reused when it is already there); `.`: this tree."""
    if commit == ".":
        return ROOT
    sha = subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", commit], text=True).strip()
    path = base / sha[:12]
    if not (path / ".git").exists():
        base.mkdir(parents=True, exist_ok=True)
        subprocess.check_call(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), sha])
    return path


def dig(data: dict, key: str):
    """The value at a dotted path (a number picks a list's item), or None where the tree's output has no
    such key (an arm an older tree lacks)."""
    for part in key.split("."):
        if isinstance(data, list) and part.isdigit() and int(part) < len(data):  # a list's item by index
            data = data[int(part)]
        elif isinstance(data, dict) and part in data:
            data = data[part]
        else:
            return None
    return data


def run_once(tree: Path, argv: list[str], out: Path, script_here: bool) -> tuple[dict, float]:
    args = [a.replace("{json}", str(out)) for a in argv]
    if script_here:
        args[0] = str((ROOT / args[0]).resolve())
    env = {**os.environ, "PYTHONPATH": str(tree)}  # this tree's package, whatever is installed
    t0 = time.perf_counter()
    subprocess.check_call([sys.executable] + args, cwd=tree, env=env, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text()), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", required=True, help="comma-separated commits (anything git rev-parse takes; . = here)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--keys", required=True, help="comma-separated dotted paths into the command's JSON")
    ap.add_argument("--script-here", action="store_true", help="run this tree's script against each tree's package")
    ap.add_argument("--worktrees", default="/tmp/dspark-ab")
    ap.add_argument("--out", default="/tmp/dspark-ab/result.json")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- script args (with {json} for its output)")
    args = ap.parse_args()
    argv = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not any("{json}" in a for a in argv):
        ap.error("the command must write its JSON to {json}")
    keys, names = args.keys.split(","), args.trees.split(",")
    trees = {name: worktree(name, Path(args.worktrees)) for name in names}
    runs = {name: [] for name in names}
    scratch = Path(args.worktrees) / "runs"
    scratch.mkdir(parents=True, exist_ok=True)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            data, wall = run_once(trees[name], argv, scratch / f"{name.replace('/', '_')}-{r}.json", args.script_here)
            values = {k: dig(data, k) for k in keys}
            runs[name].append({"round": r, "wall_s": wall, "values": values, "loadavg": os.getloadavg()[0]})
            print(f"round {r} {name:10s} ({wall:.0f} s, load {os.getloadavg()[0]:.1f}): "
                  + ", ".join(f"{k} {v:.4g}" for k, v in values.items() if v is not None), flush=True)
    summary = {}
    for k in keys:
        med = {name: statistics.median(vs) for name in names
               if (vs := [run["values"][k] for run in runs[name] if run["values"][k] is not None])}
        first = med.get(names[0])
        summary[k] = {name: {"median": v, "over_first": v / first if first else None} for name, v in med.items()}
        print(f"{k}: " + ", ".join(f"{name} {v:.4g}" + (f" ({v / first:.3f}x)" if first else "")
                                   for name, v in med.items()), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"trees": names, "command": argv, "runs": runs, "summary": summary},
                                         indent=1, default=str))


if __name__ == "__main__":
    main()
