"""Host loss and `ray job submit` round trips on a real multi-host Ray cluster made of network
namespaces on this machine (tests/netns_cluster.py: a head of 0 CPUs and two worker hosts of 2
CPUs, token auth on, each host its own address and /tmp/ray). Needs root.

- submit round trip: `ray job submit --working-dir . -- python -c pass` (the CLI's start, the
  working dir's upload, the runtime env on the head, the driver's start and exit), and the same for
  launch/run.py on the bundled config at tensor 2 x data 2 (the run's own time in it, as printed);
- host loss, per trial: a launch/run.py job at tensor 2 x data 2; after its first request finished
  every process of one worker host is SIGKILLed and its Ray node started again (a reboot: empty
  /tmp/ray, a new node id); recorded: requests completed, outputs identical to the in-process run,
  the pause (the longest silence of the merged token stream from the kill on), the engine's
  restart lines (teardown, new workers ready), the node's `ray start` time, the job's round trip.

    sudo python launch/bench_multihost.py [--trials 3] [--submits 3] [--out runs/multihost.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import netns_cluster as nc  # noqa: E402

CONFIG = "configs/tiny.yaml"
WORKLOAD = ["workload.output_len=[32,128]"]
TOPOLOGY = ["parallel.executor=ray", "parallel.tensor=2", "parallel.data=2", "parallel.step_timeout_s=120",
            "parallel.max_restarts=20"]


def _stats(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return {}
    return {"p50": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=3, help="host-loss trials")
    ap.add_argument("--submits", type=int, default=3, help="trivial-job round trips")
    ap.add_argument("--out", default="runs/multihost.json")
    args = ap.parse_args(argv)
    why = nc.unavailable()
    if why:
        print(f"bench_multihost: {why}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-multihost-"))
    work.chmod(0o777)
    local = subprocess.Popen(nc.run_entrypoint(CONFIG, work, "local", "parallel.executor=local", *WORKLOAD)
                             + ["--no-progress"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    result = {"command": " ".join(["python", "launch/bench_multihost.py", *(argv or sys.argv[1:])]),
              "config": CONFIG, "overrides": TOPOLOGY + WORKLOAD, "hosts": "head 0 CPU + 2 worker hosts x 2 CPU",
              "submit": [], "run_jobs": [], "host_loss": []}
    with nc.NetnsCluster(workers=[2, 2], log=print) as cluster:
        result["cluster_up_s"] = sum(cluster.started_at.values())
        if local.wait(timeout=300) != 0:
            print("the in-process reference run failed", file=sys.stderr)
            return 1
        reference = nc.outputs(json.loads((work / "local" / "report.json").read_text()))
        for i in range(args.submits):
            rc, out, rt = cluster.submit(["python", "-c", "pass"], timeout_s=120)
            result["submit"].append({"rc": rc, "round_trip_s": rt})
            print(f"trivial job {i}: rc {rc}, round trip {rt:.2f} s", flush=True)
        rc, out, rt = cluster.submit(nc.run_entrypoint(CONFIG, work, "job", *TOPOLOGY, *WORKLOAD) + ["--no-progress"],
                                     timeout_s=300)
        rep = json.loads((work / "job" / "report.json").read_text()) if rc == 0 else None
        row = {"rc": rc, "round_trip_s": rt, "run_duration_s": rep["summary"]["duration_s"] if rep else None,
               "identical": rep is not None and nc.outputs(rep) == reference}
        result["run_jobs"].append(row)
        print(f"run job: {row}", flush=True)
        seen: Counter = Counter()
        for t in range(args.trials):
            host = 1 + t % 2
            name = f"loss{t}"
            loss = nc.host_loss_job(cluster, host, nc.run_entrypoint(CONFIG, work, name, *TOPOLOGY, *WORKLOAD),
                                    timeout_s=400)
            row = {"host": host, "rc": loss["rc"], "round_trip_s": loss["round_trip_s"],
                   "progress_at_kill": loss.get("progress_at_kill"), "killed": loss.get("killed"),
                   "node_restart_s": loss.get("restart_s"), "restart_error": loss.get("restart_error")}
            if loss["rc"] == 0 and "kill_at" in loss:
                rep = json.loads((work / name / "report.json").read_text())
                row.update(nc.pause_after(rep, loss["kill_at"]))
                row["completed"] = sum(r["finish_reason"] != "error" for r in rep["requests"])
                row["requests"] = len(rep["requests"])
                row["identical"] = nc.outputs(rep) == reference
            every = Counter(nc.restart_log(cluster))  # the head's logs of every job so far
            lines = list((every - seen).elements())  # this trial's
            seen.update(lines)
            ready = [re.search(r"teardown ([\d.]+) s, new workers ready ([\d.]+) s", x) for x in lines]
            ready = [m for m in ready if m]
            if ready:
                row["teardown_s"], row["new_workers_s"] = float(ready[-1].group(1)), float(ready[-1].group(2))
            row["restarts"] = len(ready)
            row["restart_attempts_failed"] = sum("failed" in x for x in lines)
            result["host_loss"].append(row)
            print(f"host loss {t} (host {host}): {row}", flush=True)
            cluster.wait_nodes(3, 120)
    result["summary"] = {
        "submit_round_trip_s": _stats([r["round_trip_s"] for r in result["submit"] if r["rc"] == 0]),
        "run_job_round_trip_s": _stats([r["round_trip_s"] for r in result["run_jobs"] if r["rc"] == 0]),
        "host_loss_pause_s": _stats([r.get("pause_s") for r in result["host_loss"]]),
        "host_loss_longest_gap_s": _stats([r.get("longest_gap_s") for r in result["host_loss"]]),
        "host_loss_new_workers_s": _stats([r.get("new_workers_s") for r in result["host_loss"]]),
        "host_loss_completed": f"{sum(r.get('completed', 0) for r in result['host_loss'])}/"
                               f"{sum(r.get('requests', 32) for r in result['host_loss'])}",
        "host_loss_identical": f"{sum(bool(r.get('identical')) for r in result['host_loss'])}/"
                               f"{len(result['host_loss'])}",
    }
    print(json.dumps(result["summary"], indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    ok = all(r["rc"] == 0 and r.get("identical") and r.get("completed") == r.get("requests")
             for r in result["host_loss"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
