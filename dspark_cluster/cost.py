"""Inference cost: what a run held and used, what it cost, and whether a change pays for itself.

Pure functions over plain dicts (no engine, no Ray), so a saved report can be re-costed or compared:

- `cost_ledger` turns the devices a run held (one dict per device, with its memory by kind), how
  long it held them, the busy seconds measured per role, the tokens and the bytes communicated into
  the ledger a report keeps under `cost`;
- `compare_runs` puts two reports side by side and computes the gain/cost figure: effective
  throughput gain divided by resource cost gain, with a verdict in three words' worth;
- `ledger_metrics` lists the ledger as Prometheus samples, one table for both metric sinks;
- `CostMeter` is the engine's side: the counters a running engine keeps for its ledger, the
  snapshots a run's ledger is the difference of, and the devices' memory by kind (it holds plain
  numbers and is handed the executor's and drafters' reports; it never calls them).
"""

from __future__ import annotations

import math
import time
from typing import Optional

# memory kinds a device may hold, in the order reports print them (weights_reordered, drafter_weights_reordered: the
# CPU's oneDNN copies of the linear weights, model/gemm.py)
MEMORY_KINDS = ("weights", "weights_reordered", "kv_pool", "kv_peak_used", "expert_staging", "context_stash", "drafter_weights",
                "drafter_weights_reordered", "drafter_kv", "calibrator_state")
# kinds that are held (allocated); kv_peak_used is a part of kv_pool, not more of it
HELD_KINDS = tuple(k for k in MEMORY_KINDS if k != "kv_peak_used")
COMM_KINDS = ("all_reduce", "all_gather", "all_to_all", "broadcast", "hidden_state_export")
TOKEN_KINDS = ("prompt", "output", "drafted", "accepted", "recomputed")
# two runs within this share of each other are "the same" (these machines are noisy)
NOISE = 0.03


def device_kind(device: str) -> str:
    """'cuda', 'cuda:0', 'gpu' -> 'gpu'; anything else -> 'cpu' (the keys of cost.price_per_device_hour)."""
    return "gpu" if str(device).split(":")[0] in ("cuda", "gpu") else "cpu"


def _div(a, b) -> float:
    return a / b if b else float("nan")


def cost_ledger(held_s: float, devices: list[dict], busy_s: dict, tokens: dict, comm_bytes: dict,
                prices: dict, num_requests: int) -> dict:
    """The cost ledger of one run.

    held_s: seconds the devices were held (the run's wall time).
    devices: one dict per device (or process, for a Router on a CPU core) held for held_s:
        {"role": "target" | "drafter" | "calibrator" | "router", "rank": int, "kind": "gpu" | "cpu",
         "memory": {kind: bytes}} with kinds from MEMORY_KINDS (missing = 0).
    busy_s: role -> seconds busy summed over that role's devices (forward time), or None where not
        measured; a role without devices of its own (a drafter in the target's process) may still
        appear: its busy time is then counted on the devices it shares.
    tokens: TOKEN_KINDS -> counts. comm_bytes: COMM_KINDS -> bytes sent over the run, summed over ranks.
    prices: device kind ("gpu", "cpu") -> price per device-hour.

    Returns {"held_s", "roles": {role: {devices, kind, device_seconds, busy_s, utilisation, cost}},
    "device_seconds", "cost", "cost_per_million_output_tokens", "cost_per_request", "prices",
    "memory": {"per_device": [...], "held_bytes", "by_kind", "max_device_bytes"}, "tokens",
    "comm_bytes", "comm_bytes_per_output_token"}; NaN where a ratio has no denominator.
    """
    roles: dict = {}
    for d in devices:
        r = roles.setdefault(d["role"], {"devices": 0, "kinds": set(), "cost": 0.0})
        r["devices"] += 1
        r["kinds"].add(d["kind"])
        r["cost"] += float(prices.get(d["kind"], 0.0)) * held_s / 3600.0
    for role in busy_s:
        roles.setdefault(role, {"devices": 0, "kinds": set(), "cost": 0.0})
    for role, r in roles.items():
        r["device_seconds"] = r["devices"] * held_s
        busy = busy_s.get(role)
        r["busy_s"] = None if busy is None else float(busy)
        r["utilisation"] = None if busy is None or not r["device_seconds"] else busy / r["device_seconds"]
        r["kind"] = "+".join(sorted(r.pop("kinds"))) or None
    per_device = []
    for d in devices:
        mem = {k: int(d.get("memory", {}).get(k, 0)) for k in MEMORY_KINDS}
        per_device.append({"role": d["role"], "rank": d.get("rank", 0), "kind": d["kind"], **mem,
                           "held_bytes": sum(mem[k] for k in HELD_KINDS)})
    output = int(tokens.get("output", 0))
    total_cost = sum(r["cost"] for r in roles.values())
    comm = {k: int(comm_bytes.get(k, 0)) for k in COMM_KINDS}
    comm["total"] = sum(comm.values())
    return {
        "held_s": float(held_s),
        "roles": roles,
        "device_seconds": sum(r["device_seconds"] for r in roles.values()),
        "prices": {k: float(v) for k, v in prices.items()},
        "cost": total_cost,
        "cost_per_million_output_tokens": _div(total_cost * 1e6, output),
        "cost_per_request": _div(total_cost, num_requests),
        "memory": {
            "per_device": per_device,
            "held_bytes": sum(d["held_bytes"] for d in per_device),
            "by_kind": {k: sum(d[k] for d in per_device) for k in MEMORY_KINDS},
            "max_device_bytes": max((d["held_bytes"] for d in per_device), default=0),
        },
        "tokens": {k: int(tokens.get(k, 0)) for k in TOKEN_KINDS},
        "comm_bytes": comm,
        "comm_bytes_per_output_token": {k: _div(v, output) for k, v in comm.items()},
    }


def _num(v, fmt) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _mib(n) -> str:
    return _num(None if n is None else n / 2**20, ".1f")


def format_ledger_rows(c: dict) -> list[tuple[str, str]]:
    """(label, value) rows of the ledger's headline numbers for the run summary."""
    roles = c["roles"]
    held = ", ".join(f"{role} {r['devices']} {r['kind'] or ''}".rstrip() for role, r in roles.items() if r["devices"])
    util = ", ".join(f"{role} {_num(None if r['utilisation'] is None else 100 * r['utilisation'], '.0f')}%"
                     for role, r in roles.items() if r["devices"] and r["utilisation"] is not None)
    mem = c["memory"]
    kinds = " + ".join(f"{k} {_mib(v)}" for k, v in mem["by_kind"].items() if v and k in HELD_KINDS)
    t = c["tokens"]
    prices = ", ".join(f"{k} {v:g}" for k, v in c["prices"].items())
    return [
        ("devices held", held or "n/a"),
        ("device-seconds / utilisation", f"{_num(c['device_seconds'], '.1f')} / {util or 'n/a'}"),
        ("memory held (MiB)", f"{_mib(mem['held_bytes'])} = {kinds or '0'}; max per device {_mib(mem['max_device_bytes'])}"),
        ("tokens prompt / output", f"{t['prompt']} / {t['output']}"),
        ("tokens drafted / accepted / recomputed", f"{t['drafted']} / {t['accepted']} / {t['recomputed']}"),
        ("comm bytes per output token", _num(c["comm_bytes_per_output_token"]["total"], ".0f")),
        (f"cost ({prices} per device-hour)",
         f"{_num(c['cost'], '.4g')}; per M output tokens {_num(c['cost_per_million_output_tokens'], '.4g')}, "
         f"per request {_num(c['cost_per_request'], '.3g')}"),
    ]


# ---- gain over cost ---------------------------------------------------------------------------
def cost_rate(c: dict) -> float:
    """Money per hour of what a run held (its devices at their prices)."""
    return _div(c["cost"] * 3600.0, c["held_s"])


def compare_runs(a: dict, b: dict) -> dict:
    """Run B against run A (two report dicts with `summary` and `cost`).

    Effective throughput gain: B's output tokens/s over A's. Resource cost gain: the larger of B's
    device cost per hour over A's and B's memory held over A's (the resource that binds: a change
    that doubles throughput and triples memory pays 2/3 per unit of memory). gain_over_cost =
    throughput gain / resource cost gain. Latency: TPOT p99 B / A.

    Verdict: "suits online serving" when gain_over_cost >= 1 (within NOISE) and TPOT p99 is not
    worse by more than 10%; "suits offline batches" when B gets more done per second (throughput
    gain > 1 + NOISE) but costs more per unit of it or hurts latency; otherwise "not worth it".
    """
    sa, sb, ca, cb = a["summary"], b["summary"], a["cost"], b["cost"]
    throughput_gain = _div(sb["output_tokens_per_s"], sa["output_tokens_per_s"])
    rate_gain = _div(cost_rate(cb), cost_rate(ca))
    memory_gain = _div(cb["memory"]["held_bytes"], ca["memory"]["held_bytes"])
    cost_gain = max(x for x in (rate_gain, memory_gain) if not math.isnan(x)) if not (
        math.isnan(rate_gain) and math.isnan(memory_gain)) else float("nan")
    gain_over_cost = _div(throughput_gain, cost_gain)
    latency = _div(sb.get("tpot_p99_s"), sa.get("tpot_p99_s"))
    latency_ok = math.isnan(latency) or latency <= 1.10
    if gain_over_cost >= 1 - NOISE and latency_ok:
        verdict = "suits online serving"
        why = (f"{_num(throughput_gain, '.2f')}x the throughput for {_num(cost_gain, '.2f')}x the resources, "
               f"TPOT p99 {_num(latency, '.2f')}x")
    elif throughput_gain > 1 + NOISE:
        verdict = "suits offline batches"
        why = (f"{_num(throughput_gain, '.2f')}x the throughput, but "
               + (f"{_num(cost_gain, '.2f')}x the resources" if gain_over_cost < 1 - NOISE
                  else f"TPOT p99 {_num(latency, '.2f')}x"))
    else:
        verdict = "not worth it"
        why = f"{_num(throughput_gain, '.2f')}x the throughput for {_num(cost_gain, '.2f')}x the resources"
        if latency <= 0.9:  # say what it does buy: the figure is about throughput per resource
            why += (f"; TPOT p99 {_num(latency, '.2f')}x, a latency win at {_num(1 / gain_over_cost, '.2f')}x the "
                    "cost per token")
    return {"throughput_gain": throughput_gain, "cost_rate_gain": rate_gain, "memory_gain": memory_gain,
            "resource_cost_gain": cost_gain, "gain_over_cost": gain_over_cost, "tpot_p99_ratio": latency,
            "verdict": verdict, "why": why}


def format_comparison(a: dict, b: dict, name_a: str = "A", name_b: str = "B") -> str:
    """The two runs side by side, B / A, and the gain/cost verdict."""
    sa, sb, ca, cb = a["summary"], b["summary"], a["cost"], b["cost"]

    def devices(c):
        return ", ".join(f"{r['devices']} {role}" for role, r in c["roles"].items() if r["devices"])

    rows = [  # label, A, B, scale, format
        ("output tokens/s", sa.get("output_tokens_per_s"), sb.get("output_tokens_per_s"), 1, ".1f"),
        ("TTFT p50 (ms)", sa.get("ttft_p50_s"), sb.get("ttft_p50_s"), 1e3, ".1f"),
        ("TTFT p99 (ms)", sa.get("ttft_p99_s"), sb.get("ttft_p99_s"), 1e3, ".1f"),
        ("TPOT p50 (ms)", sa.get("tpot_p50_s"), sb.get("tpot_p50_s"), 1e3, ".2f"),
        ("TPOT p99 (ms)", sa.get("tpot_p99_s"), sb.get("tpot_p99_s"), 1e3, ".2f"),
        ("memory held (MiB)", ca["memory"]["held_bytes"], cb["memory"]["held_bytes"], 2**-20, ".1f"),
        ("max memory per device (MiB)", ca["memory"]["max_device_bytes"], cb["memory"]["max_device_bytes"], 2**-20, ".1f"),
        ("device-seconds", ca["device_seconds"], cb["device_seconds"], 1, ".1f"),
        ("cost per hour held", cost_rate(ca), cost_rate(cb), 1, ".4g"),
        ("cost per M output tokens", ca["cost_per_million_output_tokens"], cb["cost_per_million_output_tokens"], 1, ".4g"),
    ]
    table = [("", name_a, name_b, "B / A"), ("devices", devices(ca), devices(cb), "")]
    for label, va, vb, scale, fmt in rows:
        fa = None if va is None else float(va) * scale
        fb = None if vb is None else float(vb) * scale
        ratio = _div(fb, fa) if fa is not None and fb is not None else None
        table.append((label, _num(fa, fmt), _num(fb, fmt), _num(ratio, ".2f")))
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in table]
    g = compare_runs(a, b)
    lines += ["", f"gain / cost: {_num(g['gain_over_cost'], '.2f')} (throughput {_num(g['throughput_gain'], '.2f')}x "
                  f"/ resources {_num(g['resource_cost_gain'], '.2f')}x: device cost per hour "
                  f"{_num(g['cost_rate_gain'], '.2f')}x, memory {_num(g['memory_gain'], '.2f')}x)",
              f"verdict: B {g['verdict']} ({g['why']})"]
    return "\n".join(lines)


# ---- Prometheus -------------------------------------------------------------------------------
def ledger_metrics(c: dict) -> list[tuple[str, str, dict, float]]:
    """(name, help, labels, value) for each gauge of a (live) ledger: the one table both metric
    sinks (`dspark serve`'s registry and the Ray Router's) declare their cost gauges from."""
    out = [
        ("dspark_cost", "Money for the devices held since the engine started (cost.price_per_device_hour)", {},
         c["cost"]),
        ("dspark_cost_per_million_output_tokens", "Money per million output tokens since the engine started", {},
         c["cost_per_million_output_tokens"]),
        ("dspark_memory_held_bytes", "Memory held over all devices (weights, KV pool, drafter, staging)", {},
         c["memory"]["held_bytes"]),
    ]
    for role, r in c["roles"].items():
        out.append(("dspark_device_seconds", "Device-seconds held since the engine started, by role", {"role": role},
                    r["device_seconds"]))
        if r["utilisation"] is not None:
            out.append(("dspark_device_utilisation", "Busy seconds / device-seconds held, by role", {"role": role},
                        r["utilisation"]))
    for kind in TOKEN_KINDS:
        out.append(("dspark_ledger_tokens", "Tokens since the engine started, by kind", {"kind": kind},
                    c["tokens"][kind]))
    return [(n, h, labels, 0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else float(v))
            for n, h, labels, v in out]


def label_names(name: str) -> tuple:
    """The label names of a gauge in `ledger_metrics` (to declare it before its first sample)."""
    return {"dspark_device_seconds": ("role",), "dspark_device_utilisation": ("role",),
            "dspark_ledger_tokens": ("kind",)}.get(name, ())



class CostMeter:
    """A running engine's counters for its ledger. `usage` snapshots them; a run's ledger is the
    difference of two snapshots (`ledger`), so a server's live ledger and a run's report read the
    same counters."""

    def __init__(self, cfg, num_groups: int):
        self.ray = cfg.parallel.executor == "ray"
        self.world = cfg.parallel.world_size
        self.draft_workers = cfg.speculative.draft_workers
        self.prices = cfg.cost.price_per_device_hour.model_dump()
        self.forward_s = 0.0  # the driver ranks' forward seconds
        self.export_bytes = 0  # DSpark context rows sent to the drafters
        self.prompt_tokens = self.output_tokens = 0
        self.kv_peak_blocks = [0] * num_groups  # per data-parallel group
        self.reports: Optional[tuple] = None  # (the target's, the drafters') device reports as last read

    def step(self, stats: dict, blocks_used: list[int]) -> None:
        """One step's stats (engine.step_stats) and each group's KV blocks in use after it."""
        self.forward_s += stats["forward_s"]
        self.export_bytes += stats["export_bytes"]
        self.kv_peak_blocks = [max(a, b) for a, b in zip(self.kv_peak_blocks, blocks_used)]

    def usage(self, draft_s: float, tokens: dict, comm_ranks: Optional[list] = None) -> dict:
        """A snapshot: the counters, this process's CPU time (the Router's busy time on Ray), the
        drafters' proposal seconds, tokens by kind (prompt and output from here, the others given),
        and with comm_ranks (each rank's {"bytes": {kind: n}}) the bytes sent per collective kind."""
        comm = None
        if comm_ranks is not None:
            comm = {}
            for r in comm_ranks:
                for kind, n in r["bytes"].items():
                    comm[kind] = comm.get(kind, 0) + n
        return {"time": time.monotonic(), "process_cpu_s": time.process_time(), "forward_s": self.forward_s,
                "export_bytes": self.export_bytes, "draft_s": draft_s,
                "tokens": {"prompt": self.prompt_tokens, "output": self.output_tokens, **tokens}, "comm_bytes": comm}

    def devices(self, migrated: bool) -> list[dict]:
        """Every device (or process) held, with its memory by kind (`cost_ledger`'s devices), from the
        reports last read: the target's workers (KV peak from their group's peak blocks in use; expert
        staging where a rebalance staged weights), the drafter group and calibrator, and on Ray the
        Router's process (a CPU core)."""
        target, drafters = self.reports
        devices = []
        for d in target:
            staging = d.get("expert_staging_bytes", d["expert_bytes"] if migrated else 0)
            memory = {**d["memory"], "kv_peak_used": d["kv_bytes_per_block"] * self.kv_peak_blocks[d["group"]],
                      "expert_staging": staging}
            devices.append({"role": d["role"], "rank": d["rank"], "kind": d["kind"], "memory": memory})
        for d in drafters:
            if d.get("shares_device"):  # in process: on the target's device
                for kind, n in d["memory"].items():
                    devices[0]["memory"][kind] = devices[0]["memory"].get(kind, 0) + n
            else:
                devices.append(d)
        if self.ray:
            devices.append({"role": "router", "rank": 0, "kind": "cpu", "memory": {}})
        return devices

    def ledger(self, base: dict, now: dict, devices: list[dict], speculating: bool, num_requests: int = 0) -> dict:
        """The ledger between two snapshots. Busy seconds: the target's forward time on each of its
        devices; the drafters' proposal time (as the engine waits for it) on each drafter; on Ray the
        Router process's CPU time. In process the drafter's time is on the target's device."""
        forward = now["forward_s"] - base["forward_s"]
        draft = now["draft_s"] - base["draft_s"]
        if self.ray:
            busy = {"target": forward * self.world, "router": now["process_cpu_s"] - base["process_cpu_s"]}
            if speculating:
                busy["drafter"] = draft * self.draft_workers
        else:
            busy = {"target": forward + draft}
        comm_bytes = {}
        if now["comm_bytes"] is not None and base.get("comm_bytes") is not None:
            # max(0, ...): restarted workers count from zero again
            comm_bytes = {k: max(0, v - base["comm_bytes"].get(k, 0)) for k, v in now["comm_bytes"].items()}
        comm_bytes["hidden_state_export"] = now["export_bytes"] - base["export_bytes"]
        tokens = {k: v - base["tokens"].get(k, 0) for k, v in now["tokens"].items()}
        return cost_ledger(now["time"] - base["time"], devices, busy, tokens, comm_bytes, self.prices, num_requests)
