"""The README's main job (`dspark run` on the bundled default config) end to end, two model.compile settings (issue
27, session 37: what `auto` would cost the default job on a CPU if it compiled there). Each run is a fresh `dspark run`
process, the settings alternating; its wall time, and the compile warm-up and throughput its report gives. `--cold`
gives every run of the second setting an empty inductor cache (a first run on a fresh machine); by default the cache is
the user's, warm after the first run.

    python launch/bench_default_run.py [--rounds 3] [--modes off,on] [--cold] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one_run(mode: str, out_dir: str, cold: bool) -> dict:
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="inductor-cold-") as cache:
        if cold:
            env["TORCHINDUCTOR_CACHE_DIR"] = cache
        t = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "dspark_cluster.cli", "run", "--set", f"model.compile={mode}",
                            "--set", f"report.out_dir={out_dir}", "--set", f"report.name=run_{mode}", "--no-progress"],
                           cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t
    if p.returncode:
        raise SystemExit(f"dspark run (model.compile={mode}) failed:\n{p.stderr[-4000:]}")
    report = json.loads(next(Path(out_dir).glob(f"run_{mode}*/report.json")).read_text())
    summary = report["summary"]
    comp = summary.get("compile") or {}
    return {"wall_s": wall, "warm_up_s": comp.get("warm_up_s"),
            "output_tokens_per_s": summary.get("output_tokens_per_s")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="off,on", help="the two model.compile settings")
    ap.add_argument("--cold", action="store_true", help="an empty inductor cache for every run of the second setting")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    a, b = args.modes.split(",")
    res = {a: [], b: []}
    for r in range(args.rounds):
        for mode in ((a, b) if r % 2 == 0 else (b, a)):
            with tempfile.TemporaryDirectory() as out_dir:
                o = one_run(mode, out_dir, args.cold and mode == b)
            res[mode].append(o)
            print(f"round {r} model.compile={mode}: wall {o['wall_s']:.1f} s, warm-up {o['warm_up_s']}, "
                  f"{o['output_tokens_per_s']} output tok/s", flush=True)
    med = {m: statistics.median(x["wall_s"] for x in v) for m, v in res.items()}
    print(f"wall median: {a} {med[a]:.1f} s, {b} {med[b]:.1f} s ({med[b] / med[a]:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
