"""Topology sweeps: run a config over a grid of overrides and compare the points by what they gave
and what they cost.

`parse_grid` reads `--grid key=v1,v2` arguments, `sweep_points` validates every combination
(an invalid one becomes a failed point, named by its overrides), `run_sweep` runs the points one
after another (each starts and stops its own engine: a fresh cluster per point), survives a point
that fails, and writes sweep.csv, sweep.md and three plots beside the points' own reports.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import yaml

from .config import Config, load_config
from .cost import compare_runs, cost_rate
from .errors import ConfigError, DSparkError
from .runner import prepare_backends, run_experiment

COLUMNS = ("point", "status", "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
           "devices", "memory_held_mib", "max_device_mib", "cost_per_hour", "cost_per_million_output_tokens",
           "gain_over_cost", "verdict", "pareto", "run_s", "overhead_s", "error")


@dataclass
class Point:
    index: int
    overrides: dict  # key.path -> value (a mapping merges under its key)
    cfg: Optional[Config] = None
    error: Optional[str] = None  # set when the overrides do not make a valid config
    report: Optional[dict] = None  # summary and cost once run
    wall_s: float = 0.0  # start to stop, the engine's start-up and teardown included
    out_dir: Optional[str] = None

    @property
    def label(self) -> str:
        return " ".join(f"{k.rsplit('.', 1)[-1]}={_short(v)}" for k, v in self.overrides.items())


def _short(value) -> str:
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_short(v)}" for k, v in value.items()) + "}"
    return Path(value).name if isinstance(value, str) and "/" in value else str(value)


def parse_grid(items: list[str]) -> list[tuple[str, list]]:
    """['scheduler.max_num_seqs=8,64', 'speculative=[{method: none}, {method: dspark, draft_model: tiny-dspark}]']
    -> [(key, values)]. Values are YAML scalars split on commas, or a YAML flow list when the
    text starts with '[' (for values with commas, or mappings that set several keys at once)."""
    grid, problems = [], []
    for item in items:
        key, sep, raw = str(item).partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not key or not raw:
            problems.append(f"--grid {item!r}: expected key.path=v1,v2,... e.g. scheduler.max_num_seqs=8,64")
            continue
        try:
            values = yaml.safe_load(raw) if raw.startswith("[") else [yaml.safe_load(v) for v in raw.split(",")]
        except yaml.YAMLError as e:
            problems.append(f"--grid {item!r}: values are not valid YAML ({e.__class__.__name__})")
            continue
        if not isinstance(values, list) or not values:
            problems.append(f"--grid {item!r}: expected at least one value")
            continue
        if key in (k for k, _ in grid):
            problems.append(f"--grid {key}: given twice; list all its values in one --grid")
            continue
        grid.append((key, values))
    if problems:
        raise ConfigError(problems)
    if not grid:
        raise ConfigError("--grid: none given; e.g. --grid parallel.tensor=1,2 --grid scheduler.max_num_seqs=8,64")
    return grid


def _flatten(key: str, value) -> dict:
    """A mapping value sets several keys under `key`."""
    if isinstance(value, dict):
        return {f"{key}.{k}": v for k, v in value.items()}
    return {key: value}


def sweep_points(config, grid: list[tuple[str, list]], overrides=None) -> list[Point]:
    """Every combination of the grid's values over `config` (a path, dict or Config) and `overrides`
    (--set), each validated: a combination that makes no valid config is a point with its error."""
    keys = [k for k, _ in grid]
    points = []
    for i, values in enumerate(itertools.product(*(v for _, v in grid))):
        point = Point(i, dict(zip(keys, values)))
        flat = {k2: v2 for k, v in point.overrides.items() for k2, v2 in _flatten(k, v).items()}
        try:  # the point's values after --set's, all read by config.parse_overrides (JSON is YAML)
            point.cfg = load_config(config, _as_sets(overrides) + _as_sets(flat))
        except DSparkError as e:
            point.error = f"{type(e).__name__}: {e}"
        points.append(point)
    return points


def _as_sets(overrides) -> list[str]:
    """--set items, or a {key.path: value} dict as such items."""
    if isinstance(overrides, dict):
        return [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    return list(overrides or [])


def run_sweep(config, grid: list[tuple[str, list]], overrides=None, name: Optional[str] = None,
              run: Optional[Callable] = None, log=None) -> dict:
    """Run every point of the grid and write the sweep's table and plots.

    run(cfg) -> report dict (default: runner.run_experiment without a progress bar); a point
    whose run raises is recorded with its error and the sweep goes on. Returns {"out_dir",
    "points": [row dicts], "baseline": index of the first point that ran}.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    points = sweep_points(config, grid, overrides)
    valid = [p for p in points if p.cfg is not None]
    base_cfg = valid[0].cfg if valid else load_config(config, _as_sets(overrides))
    name = name or base_cfg.report.name or time.strftime("sweep-%Y%m%d-%H%M%S")
    out_dir = Path(base_cfg.report.out_dir) / name
    out_dir.mkdir(parents=True, exist_ok=True)
    if run is None:  # a run of the caller's (a simulation) brings its own backends, or none
        prepare_backends([p.cfg for p in valid])  # one Ray instance for every point, sized for the largest
    run = run or (lambda cfg: run_experiment(cfg, progress=False))
    log(f"sweep: {len(points)} points ({len(valid)} valid) over {', '.join(k for k, _ in grid)} -> {out_dir}/")
    t_sweep = time.monotonic()
    for n, p in enumerate(points, 1):
        eta = ""
        done = [q.wall_s for q in points[: n - 1] if q.wall_s]
        if done:
            eta = f", about {sum(done) / len(done) * (len(points) - n + 1) / 60:.1f} min left"
        log(f"[{n}/{len(points)}] {p.label}{eta}")
        if p.cfg is None:
            log(f"[{n}/{len(points)}] skipped: {p.error}")
            continue
        p.cfg.report.out_dir = str(out_dir)
        p.cfg.report.name = f"p{p.index:02d}"
        t0 = time.monotonic()
        try:
            report = run(p.cfg)
            p.report = {"summary": report["summary"], "cost": report["cost"]}
            p.out_dir = report.get("out_dir")
            s = p.report["summary"]
            log(f"[{n}/{len(points)}] ok: {s['output_tokens_per_s']:.1f} tok/s, TPOT p99 "
                f"{1e3 * s['tpot_p99_s']:.1f} ms, {p.report['cost']['cost_per_million_output_tokens']:.4g} per M tokens")
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 -- a failed point is recorded; the sweep goes on
            p.error = f"{type(e).__name__}: {e}"
            log(f"[{n}/{len(points)}] failed: {p.error}")
            (out_dir / f"p{p.index:02d}.error.txt").write_text(traceback.format_exc())
        p.wall_s = time.monotonic() - t0
    rows = table(points)
    write_sweep(out_dir, grid, points, rows)
    log(f"sweep: done in {(time.monotonic() - t_sweep) / 60:.1f} min; {sum(r['status'] == 'ok' for r in rows)} of "
        f"{len(rows)} points ran; table {out_dir / 'sweep.md'}")
    baseline = next((p.index for p in points if p.report is not None), None)
    return {"out_dir": str(out_dir), "points": rows, "baseline": baseline}


def pareto_front(points: list[tuple[float, float]]) -> list[bool]:
    """(throughput, latency) pairs -> whether each is on the front: no other point has at least
    its throughput and at most its latency, and is better in one."""
    front = []
    for i, (t, l) in enumerate(points):
        dominated = any(t2 >= t and l2 <= l and (t2 > t or l2 < l) for j, (t2, l2) in enumerate(points) if j != i)
        front.append(not dominated and not (math.isnan(t) or math.isnan(l)))
    return front


def table(points: list[Point]) -> list[dict]:
    """One row per point (COLUMNS, plus the grid's keys); gain/cost against the first point that ran."""
    ran = [p for p in points if p.report is not None]
    base = ran[0] if ran else None
    front = dict(zip((p.index for p in ran), pareto_front(
        [(p.report["summary"]["output_tokens_per_s"], p.report["summary"]["tpot_p99_s"]) for p in ran])))
    rows = []
    for p in points:
        row = {"point": p.index, **{k: _short(v) for k, v in p.overrides.items()}}
        if p.report is None:
            row.update(status="failed" if p.cfg is not None else "invalid", error=p.error or "", run_s=round(p.wall_s, 1))
            rows.append(row)
            continue
        s, c = p.report["summary"], p.report["cost"]
        g = compare_runs(base.report, p.report)
        row.update(
            status="ok", output_tokens_per_s=round(s["output_tokens_per_s"], 2),
            ttft_p50_ms=round(1e3 * s["ttft_p50_s"], 2), ttft_p99_ms=round(1e3 * s["ttft_p99_s"], 2),
            tpot_p50_ms=round(1e3 * s["tpot_p50_s"], 3), tpot_p99_ms=round(1e3 * s["tpot_p99_s"], 3),
            devices=" ".join(f"{r['devices']}{role[0]}" for role, r in c["roles"].items() if r["devices"]),
            memory_held_mib=round(c["memory"]["held_bytes"] / 2**20, 1),
            max_device_mib=round(c["memory"]["max_device_bytes"] / 2**20, 1),
            cost_per_hour=round(cost_rate(c), 4),
            cost_per_million_output_tokens=round(c["cost_per_million_output_tokens"], 4),
            gain_over_cost=round(g["gain_over_cost"], 3), verdict="baseline" if p is base else g["verdict"],
            pareto=front[p.index], run_s=round(s["duration_s"], 1),
            # what the sweep spent on the point beyond the run itself: start-up, teardown, the report
            overhead_s=round(p.wall_s - s["duration_s"], 1), error="")
        rows.append(row)
    return rows


def write_sweep(out_dir: Path, grid, points: list[Point], rows: list[dict]) -> list[Path]:
    keys = [k for k, _ in grid]
    fields = ["point", *keys, *COLUMNS[1:]]
    paths = [out_dir / "sweep.csv", out_dir / "sweep.md", out_dir / "sweep.json"]
    with paths[0].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in fields})
    paths[1].write_text(markdown_table(rows, keys))
    paths[2].write_text(json.dumps({"grid": [[k, v] for k, v in grid], "rows": rows,
                                    "reports": {p.index: p.out_dir for p in points}}, indent=1, default=str))
    paths += plot_sweep(out_dir, rows)
    return paths


def markdown_table(rows: list[dict], keys: list[str]) -> str:
    head = ["#", *(k.rsplit(".", 1)[-1] for k in keys), "tok/s", "TTFT p50 ms", "TPOT p50 / p99 ms", "devices",
            "mem MiB (max/device)", "cost/h", "cost/M tok", "gain/cost", "verdict vs #0", "Pareto", "run s", "overhead s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["status"] != "ok":
            error = " ".join(str(r.get("error", "")).split())  # one line: a table cell
            cells = [str(r["point"]), *(str(r.get(k, "")) for k in keys), f"{r['status']}: {error[:160]}"]
            cells += [""] * (len(head) - len(cells))
        else:
            cells = [str(r["point"]), *(str(r.get(k, "")) for k in keys), f"{r['output_tokens_per_s']:.1f}",
                     f"{r['ttft_p50_ms']:.0f}", f"{r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f}", r["devices"],
                     f"{r['memory_held_mib']:.0f} ({r['max_device_mib']:.0f})", f"{r['cost_per_hour']:.3f}",
                     f"{r['cost_per_million_output_tokens']:.3f}", f"{r['gain_over_cost']:.2f}", r["verdict"],
                     "yes" if r["pareto"] else "", f"{r['run_s']:.1f}", f"{r['overhead_s']:.1f}"]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def plot_sweep(out_dir: Path, rows: list[dict]) -> list[Path]:
    """pareto.png (throughput against TPOT p99, the front joined), cost.png (cost per million
    output tokens per point), memory.png (memory held per device, per point)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    paths = []
    fig, ax = plt.subplots(figsize=(7, 5), layout="constrained")
    if ok:
        ax.scatter([r["tpot_p99_ms"] for r in ok], [r["output_tokens_per_s"] for r in ok],
                   c=["tab:red" if r["pareto"] else "tab:blue" for r in ok], s=30)
        for r in ok:
            ax.annotate(f"#{r['point']}", (r["tpot_p99_ms"], r["output_tokens_per_s"]), fontsize=8,
                        xytext=(3, 3), textcoords="offset points")
        front = sorted((r for r in ok if r["pareto"]), key=lambda r: r["tpot_p99_ms"])
        ax.plot([r["tpot_p99_ms"] for r in front], [r["output_tokens_per_s"] for r in front], color="tab:red",
                lw=1, label="Pareto front (no point is faster and lower-latency)")
        ax.legend(loc="lower right", fontsize=8)
    ax.set(xlabel="TPOT p99 (ms)", ylabel="output tokens/s", title="Throughput against latency, per point")
    paths.append(out_dir / "pareto.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    labels = [f"#{r['point']}" for r in ok]
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(ok) + 2), 4), layout="constrained")
    ax.bar(labels, [r["cost_per_million_output_tokens"] for r in ok], color="tab:green")
    ax.set(ylabel="cost per million output tokens", title="Cost per million output tokens, per point")
    paths.append(out_dir / "cost.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(ok) + 2), 4), layout="constrained")
    ax.bar(labels, [r["max_device_mib"] for r in ok], color="tab:purple", label="the fullest device")
    ax.scatter(labels, [r["memory_held_mib"] for r in ok], color="black", marker="_", s=200, label="all devices")
    ax.set(ylabel="MiB held", title="Memory held per point (weights, KV pool, drafter, staging)")
    if ok:
        ax.legend(fontsize=8)
    paths.append(out_dir / "memory.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
