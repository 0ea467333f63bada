"""Kill one ShardWorker, or the Router (SIGKILL), at a random moment while requests stream, several times.

One Router (executor ray) serves every trial. A fault-free pass first gives the reference tokens
and the pass's duration; then each trial streams the same requests, kills a random target worker
at a random moment inside that duration, and records: requests completed, outputs identical to the
fault-free pass (greedy), and the pause clients saw: the longest silence from the kill on, i.e.
the restart (new workers, shards loaded, KV allocated) plus recomputing the requests' tokens so far.

With `--kill router` the Router actor is the one killed: the client (the driver's RouterClient)
starts a new Router and re-submits every request in flight after the tokens it has streamed.
`--speculative dspark` serves with the bundled DSpark drafter (a drafter actor group).

    python launch/bench_faults.py [--kill worker|router] [--trials 10] [--requests 64] [--tensor 2]
        [--speculative none|dspark] [--out runs/faults.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark_cluster import SamplingParams, load_config  # noqa: E402
from dspark_cluster.client import EngineClient  # noqa: E402
from dspark_cluster.workload import DEFAULT_PROMPTS, read_prompts  # noqa: E402

from dspark_cluster.report import machine_info  # noqa: E402


def worker_pids() -> list[int]:
    """The ALIVE ShardWorkers of the Ray this process is connected to, from its GCS (`list_actors()` without an
    address asks the instance started last on the machine, which need not be this one)."""
    from ray._private.state import state as gcs

    return [a["Pid"] for a in gcs.actor_table(None, actor_state_name="ALIVE").values()
            if a["ActorClassName"] == "ShardWorker"]


async def stream_all(client: EngineClient, prompts, params):
    """Every request's tokens and the arrival time of each of its pieces (driver clock)."""
    arrivals: list[float] = []

    async def one(p):
        rid = await client.submit(p, params)
        tokens = []
        async with contextlib.aclosing(client.stream(rid)) as pieces:
            async for piece in pieces:
                if piece.token_ids:
                    arrivals.append(time.monotonic())
                tokens += piece.token_ids
        return tokens

    results = await asyncio.gather(*(one(p) for p in prompts), return_exceptions=True)
    return results, arrivals


async def victim_pid(client, kill: str) -> int:
    if kill == "router":
        return await client.router.pid.remote()
    return random.choice(worker_pids())


async def trial(client, prompts, params, kill_after_s: float, kill: str = "worker"):
    killed = {}

    async def killer():
        await asyncio.sleep(kill_after_s)
        pid = await victim_pid(client, kill)
        killed["at"] = time.monotonic()
        os.kill(pid, signal.SIGKILL)

    task = asyncio.create_task(killer())
    t0 = time.monotonic()
    results, arrivals = await stream_all(client, prompts, params)
    await task
    # tokens of steps that finished before the kill still arrive just after it: the pause clients
    # saw is the longest silence (no token to any request) from the kill on
    times = [killed["at"]] + sorted(t for t in arrivals if t > killed["at"])
    pause = max((b - a for a, b in zip(times, times[1:])), default=None)
    return results, {"kill_at_s": killed["at"] - t0, "duration_s": time.monotonic() - t0, "recovery_s": pause}


def _s(x) -> str:
    return "-" if x is None else f"{x:.2f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="YAML (default: the bundled tiny config)")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tensor", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill", choices=["worker", "router"], default="worker")
    ap.add_argument("--speculative", choices=["none", "dspark"], default="none")
    ap.add_argument("--out", default="runs/faults.json")
    args = ap.parse_args()
    random.seed(args.seed)
    spec = [] if args.speculative == "none" else [
        "speculative.method=dspark", "speculative.draft_model=tiny-dspark", "speculative.num_tokens=4"]
    cfg = load_config(args.config, [f"parallel.executor=ray", f"parallel.tensor={args.tensor}",
                                    f"parallel.max_restarts={args.trials + 1}", "eplb.enabled=false", *spec])
    prompts = read_prompts(DEFAULT_PROMPTS)[: args.requests]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    client = EngineClient.start(cfg)
    rows = []
    try:
        base, _ = asyncio.run(stream_all(client, prompts, params))  # also warms up
        t0 = time.monotonic()
        base, _ = asyncio.run(stream_all(client, prompts, params))
        clean_s = time.monotonic() - t0
        print(f"fault-free pass: {len(prompts)} requests x {args.max_tokens} tokens in {clean_s:.2f} s", flush=True)
        for i in range(args.trials):
            kill_after = random.uniform(0.1, 0.9) * clean_s
            results, row = asyncio.run(trial(client, prompts, params, kill_after, args.kill))
            stats = asyncio.run(client.stats())
            restarts = stats.get("router_restarts", 0) if args.kill == "router" else stats["restarts"]
            row.update(trial=i + 1, completed=sum(not isinstance(r, BaseException) for r in results),
                       identical=sum(r == b for r, b in zip(results, base)), restarts=restarts,
                       state=stats["state"], kv_blocks_used=stats["kv_blocks_used"],
                       restart_teardown_s=(stats["last_restart"] or {}).get("teardown_s"),
                       restart_start_s=(stats["last_restart"] or {}).get("start_s"),
                       errors=sorted({type(r).__name__ for r in results if isinstance(r, BaseException)}))
            rows.append(row)
            if args.kill == "router":
                row["router_pause_s"] = (stats.get("last_router_restart") or {}).get("pause_s")
                row["restart_teardown_s"], row["restart_start_s"] = 0.0, row["router_pause_s"] or 0.0
            rec = f"{row['recovery_s']:.2f} s" if row["recovery_s"] is not None else "-"
            print(f"trial {i + 1:2d}: kill {args.kill} at {row['kill_at_s']:.2f} s, completed {row['completed']}/{len(prompts)}, "
                  f"identical {row['identical']}/{len(prompts)}, pause after the kill {rec}, "
                  f"(teardown {_s(row['restart_teardown_s'])} + new workers {_s(row['restart_start_s'])}), "
                  f"pass {row['duration_s']:.2f} s, restarts {row['restarts']}, KV used after {row['kv_blocks_used']}",
                  flush=True)
    finally:
        client.shutdown()
    recoveries = [r["recovery_s"] for r in rows if r["recovery_s"] is not None]
    summary = {
        "kill": args.kill, "speculative": args.speculative,
        "trials": len(rows), "requests_per_trial": len(prompts), "max_tokens": args.max_tokens,
        "tensor": args.tensor, "fault_free_pass_s": clean_s,
        "all_completed": all(r["completed"] == len(prompts) for r in rows),
        "all_identical": all(r["identical"] == len(prompts) for r in rows),
        "recovery_s_median": statistics.median(recoveries) if recoveries else None,
        "recovery_s_max": max(recoveries) if recoveries else None,
        "machine": machine_info(), "rows": rows,
    }
    print(json.dumps({k: v for k, v in summary.items() if k not in ("rows", "machine")}, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    sys.exit(0 if summary["all_completed"] and summary["all_identical"] else 1)


if __name__ == "__main__":
    main()
