"""Run reports: the summary numbers, a plain-text table, and the files a run leaves behind.

`summarize` turns per-request metrics and per-step stats into one flat dict, `format_summary`
prints it, and `write_report` writes report.json, requests.csv and three PNG plots (latency,
KV usage / batch size, step time) into a folder. Importable without Ray; matplotlib is only
imported (with the Agg backend) when plots are written.
"""

from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from .cost import format_ledger_rows

REQUEST_COLUMNS = (
    "request_id",
    "finish_reason",
    "arrival_s",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "num_prompt_tokens",
    "num_cached_tokens",
    "num_output_tokens",
    "num_preemptions",
    "num_draft_tokens",
    "num_accepted_tokens",
)


# ---- numbers ------------------------------------------------------------------------------------
def _clean(values: Iterable) -> list[float]:
    """Floats only: None and NaN are dropped."""
    out = []
    for v in values:
        if v is None:
            continue
        v = float(v)
        if not math.isnan(v):
            out.append(v)
    return out


def _pct(values: Iterable, q: float) -> float:
    values = _clean(values)
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(requests: list[dict], steps: list[dict], duration_s: float, kv_blocks_total: int,
              preemptions: int) -> dict:
    """One flat dict of run-level numbers; NaN where there is no data.

    TPOT is taken over requests with at least two output tokens (a one-token request has no
    time per output token; the engine reports 0.0 for it). ITL percentiles pool every gap
    between consecutive tokens of every request.
    """
    requests = requests or []
    steps = steps or []
    out_tokens = sum(int(r.get("num_output_tokens") or 0) for r in requests)
    ttft = [r.get("ttft_s") for r in requests]
    tpot = [r.get("tpot_s") for r in requests if (r.get("num_output_tokens") or 0) > 1]
    e2e = [r.get("e2e_s") for r in requests]
    itl = [x for r in requests for x in (r.get("itl_s") or ())]
    batch = _clean(s.get("num_seqs") for s in steps)
    return {
        "requests": len(requests),
        "duration_s": float(duration_s),
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / duration_s if duration_s and duration_s > 0 else float("nan"),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50),
        "tpot_p99_s": _pct(tpot, 99),
        "itl_p50_s": _pct(itl, 50),
        "itl_p99_s": _pct(itl, 99),
        "e2e_p50_s": _pct(e2e, 50),
        "e2e_p99_s": _pct(e2e, 99),
        "kv_blocks_total": kv_blocks_total,
        "kv_blocks_peak": max((int(s["kv_blocks_used"]) for s in steps if s.get("kv_blocks_used") is not None), default=0),
        "preemptions": preemptions,
        # prefix caching: prompt tokens whose KV was reused at admission, over all prompt tokens
        "prefix_cached_tokens": sum(int(r.get("num_cached_tokens") or 0) for r in requests),
        "prefix_cache_hit_rate": (sum(int(r.get("num_cached_tokens") or 0) for r in requests)
                                  / max(1, sum(int(r.get("num_prompt_tokens") or 0) for r in requests))),
        "steps": len(steps),
        "mean_batch_size": float(np.mean(batch)) if batch else float("nan"),
    }


def expert_max_over_mean(expert_load_total) -> float:
    """[layers][experts] tokens routed -> the busiest expert's load over the mean expert's, averaged
    over layers (1 = every expert equally busy)."""
    total = np.asarray(expert_load_total, dtype=float)
    return float(np.mean(total.max(axis=1) / np.maximum(total.mean(axis=1), 1e-9)))


def _num(value, scale: float = 1.0, fmt: str = ".1f") -> str:
    if value is None:
        return "n/a"
    try:
        v = float(value) * scale
    except (TypeError, ValueError):
        return str(value)
    return "n/a" if math.isnan(v) else format(v, fmt)


def format_summary(summary: dict, cost: Optional[dict] = None) -> str:
    """Aligned two-column plain-text table of the headline numbers (and the cost ledger's, if given)."""
    s = summary
    rows = [
        ("requests", f"{s.get('requests', 'n/a')}"),
        ("output tokens/s", _num(s.get("output_tokens_per_s"))),
        ("TTFT p50 / p99 (ms)", f"{_num(s.get('ttft_p50_s'), 1e3)} / {_num(s.get('ttft_p99_s'), 1e3)}"),
        ("TPOT p50 / p99 (ms)", f"{_num(s.get('tpot_p50_s'), 1e3)} / {_num(s.get('tpot_p99_s'), 1e3)}"),
        ("KV blocks peak / total", f"{s.get('kv_blocks_peak', 'n/a')} / {s.get('kv_blocks_total', 'n/a')}"),
        ("preemptions", f"{s.get('preemptions', 'n/a')}"),
    ]
    if "prefix_cache_hit_rate" in s:
        rows.append(("prefix cache hits / tokens reused",
                     f"{_num(s['prefix_cache_hit_rate'], 100, '.1f')}% / {s.get('prefix_cached_tokens', 0)}"))
    if "expert_load_max_over_mean" in s:
        rows.append(("expert load max / mean (one rank)", _num(s["expert_load_max_over_mean"], 1, ".2f")))
    if "balancedness_mean" in s:
        rows.append(("expert balancedness (window)", f"{_num(s['balancedness_mean'], 1, '.3f')}, {s.get('rebalances', 0)} rebalances"))
    comp = s.get("compile")
    if comp and "error" in comp:
        rows.append(("model.compile", f"eager: the compile failed ({comp['error']})"))
    if comp and "draft_error" in comp:
        rows.append(("model.compile, the drafter", f"eager: the compile failed ({comp['draft_error']})"))
    if comp and "buckets" in comp:
        cuda, verify = comp.get("cuda_graphs_after_warm_up"), comp.get("compiled_verify_steps")
        rows.append(("model.compile", f"{len(comp['buckets'])} buckets, warm-up {_num(comp['warm_up_s'], 1, '.1f')} s "
                     f"({comp['warm_up_graphs']} graphs); after it {comp['recompiles_after_warm_up']} recompiles"
                     + ("" if cuda is None else f", {cuda} CUDA graphs")
                     + f", {comp['compiled_steps']} compiled steps"
                     + (f" ({verify} verifying drafts)" if verify else "")))
    if comp and "draft_rounds" in comp:
        rows.append(("model.compile, the drafter", f"warm-up {_num(comp['draft_warm_up_s'], 1, '.1f')} s; "
                     f"{comp['draft_rounds']} compiled rounds, {comp['draft_recompiles_after_warm_up']} recompiles"))
    spec = s.get("speculative")
    if spec:
        acc = " ".join(_num(a, 1, ".2f") for a in spec["acceptance_by_position"])
        rows += [
            ("accepted length tau", _num(spec["mean_accepted_length"], 1, ".2f")),
            ("acceptance by position", acc),
            ("mean confidence by position", " ".join(_num(c, 1, ".2f") for c in spec.get("mean_confidence_by_position", []))
             or "n/a"),
            ("draft / verify time (s)", f"{_num(spec['draft_time_s'], 1, '.2f')} / {_num(spec['verify_time_s'], 1, '.2f')}"),
            ("schedule, drafts verified", f"{spec.get('schedule', 'static')}, {_num(spec.get('verified_share'), 100, '.0f')}%"),
        ]
        cal = spec.get("calibration") or {}
        if cal.get("ece_after_by_position"):
            rows += [
                ("STS temperatures", " ".join(_num(t, 1, ".2f") for t in cal["temperatures"])),
                ("ECE by position raw (%)", " ".join(_num(e, 100, ".1f") for e in cal["ece_before_by_position"])),
                (f"ECE by position {cal.get('calibration_method', 'sts')} (%)",
                 " ".join(_num(e, 100, ".1f") for e in cal["ece_after_by_position"])),
                ("ECE noise floor (%)", " ".join(_num(e, 100, ".1f") for e in cal.get("ece_floor_by_position", []))),
            ]
        versions = spec.get("drafter_versions") or {}
        if versions:
            by_version = ", ".join(f"v{h['version']} {_num(h.get('live_tau'), 1, '.2f')} / {_num(h.get('live_acceptance'), 1, '.2f')}"
                                   for h in versions.get("history", []))
            rows += [
                ("drafter version serving", f"{versions.get('serving_version')}"
                 f"{' (held)' if versions.get('pinned') else ''}, {len(versions.get('events', []))} publish/rollback events"),
                ("tau / acceptance by version", by_version or "n/a"),
            ]
    if cost:
        rows += format_ledger_rows(cost)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def add_expert_summary(summary: dict, experts: Optional[dict], world_size: int) -> None:
    """The expert figures of a run's summary (dspark run, dspark simulate): with several ranks how
    balanced they were and how often EPLB moved experts; on one rank (balanced by definition) how
    uneven the experts themselves are."""
    if not experts:
        return
    if world_size > 1:
        summary["balancedness_mean"] = experts.get("balancedness_mean", 1.0)
        summary["rebalances"] = len(experts["rebalances"])
    else:
        summary["expert_load_max_over_mean"] = expert_max_over_mean(experts["expert_load_total"])


def save_report(report: dict, cfg, prefix: str) -> dict:
    """Write `report` under report.out_dir/<report.name or prefix-time>/ with its plots; sets its out_dir."""
    name = cfg.report.name or time.strftime(f"{prefix}-%Y%m%d-%H%M%S")
    out_dir = Path(cfg.report.out_dir) / name
    write_report(report, out_dir)
    if report.get("experts"):
        plot_expert_heatmaps(report["experts"], out_dir)
    report["out_dir"] = str(out_dir)
    return report


# ---- files --------------------------------------------------------------------------------------
def write_report(report: dict, out_dir) -> list[Path]:
    """Write report.json, requests.csv, latency.png, kv_usage.png and step_time.png into out_dir
    (created if missing). Returns the paths written, in that order."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    requests = list(report.get("requests") or [])
    steps = list(report.get("steps") or [])
    paths = []

    path = out_dir / "report.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    paths.append(path)

    path = out_dir / "requests.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=REQUEST_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        # arrival_s: seconds since the run's first arrival (the engine's arrival_time is a monotonic clock)
        t0 = min((r["arrival_time"] for r in requests if r.get("arrival_time") is not None), default=0.0)
        for r in requests:
            row = {k: ("" if r.get(k) is None else r.get(k)) for k in REQUEST_COLUMNS}
            if r.get("arrival_time") is not None:
                row["arrival_s"] = round(r["arrival_time"] - t0, 6)
            writer.writerow(row)
    paths.append(path)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kv_total = (report.get("summary") or {}).get("kv_blocks_total")
    plots = [("latency.png", _plot_latency), ("kv_usage.png", _plot_kv_usage), ("step_time.png", _plot_step_time)]
    if any(s.get("num_drafted") for s in steps):
        plots.append(("verify_budget.png", _plot_verify_budget))
    if len({s.get("drafter_version", 0) for s in steps}) > 1 or (
            (report.get("summary") or {}).get("speculative") or {}).get("drafter_versions"):
        plots.append(("drafter_versions.png", _plot_drafter_versions))
    for name, draw in plots:
        fig = draw(plt, requests, steps, kv_total)
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _no_data(ax, what: str = "no data") -> None:
    ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes, color="gray")


def _plot_latency(plt, requests, steps, kv_total):
    ttft = [v * 1e3 for v in _clean(r.get("ttft_s") for r in requests)]
    tpot = [v * 1e3 for v in _clean(r.get("tpot_s") for r in requests if (r.get("num_output_tokens") or 0) > 1)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    for ax, values, label in ((axes[0], ttft, "TTFT"), (axes[1], tpot, "TPOT")):
        ax.set_title(f"{label} ({len(values)} requests)")
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("requests")
        if not values:
            _no_data(ax)
            continue
        ax.hist(values, bins=min(30, max(5, len(values))), color="tab:blue", alpha=0.45, label="histogram")
        cdf = ax.twinx()
        xs = np.sort(values)
        cdf.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", color="tab:red", label="CDF")
        cdf.set_ylim(0, 1.02)
        cdf.set_ylabel("cumulative fraction")
        p50, p99 = np.percentile(values, [50, 99])
        ax.axvline(p50, color="black", ls="--", lw=1, label=f"p50 {p50:.1f} ms")
        ax.axvline(p99, color="black", ls=":", lw=1, label=f"p99 {p99:.1f} ms")
        handles = ax.get_legend_handles_labels()[0] + cdf.get_legend_handles_labels()[0]
        ax.legend(handles=handles, loc="center right", fontsize=8)
    fig.suptitle("Request latency: time to first token and time per output token")
    return fig


def _step_series(steps, key, scale=1.0):
    """(seconds since the first step, value) for steps where both are present."""
    t0 = next((s["time"] for s in steps if s.get("time") is not None), None)
    xs, ys = [], []
    for s in steps:
        if s.get("time") is None or s.get(key) is None:
            continue
        xs.append(s["time"] - t0)
        ys.append(s[key] * scale)
    return xs, ys


def _plot_kv_usage(plt, requests, steps, kv_total):
    """Blocks in use on their own scale (a run that uses 2% of the pool is not a flat line at 0), the
    peak as a share of the pool in the title; the pool's size is drawn only when it is on the scale."""
    fig, (ax_kv, ax_bs) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, layout="constrained")
    xs, used = _step_series(steps, "kv_blocks_used")
    peak = max(used, default=0)
    share = f", peak {peak:g} = {100 * peak / kv_total:.1f}% of {kv_total}" if kv_total else ""
    ax_kv.set_title(f"KV cache blocks in use{share}")
    ax_kv.set_ylabel("blocks")
    if xs:
        ax_kv.step(xs, used, where="post", color="tab:blue", label="used")
        ax_kv.axhline(peak, color="tab:blue", ls=":", lw=1, label=f"peak ({peak:g})")
    else:
        _no_data(ax_kv)
    top = max(peak * 1.25, 1)
    if kv_total is not None and kv_total <= top:
        ax_kv.axhline(kv_total, color="tab:red", ls="--", label=f"total ({kv_total})")
        top = kv_total * 1.3  # headroom for the legend above the line
    ax_kv.set_ylim(0, top)
    if ax_kv.get_legend_handles_labels()[0]:
        ax_kv.legend(loc="upper left", ncol=3, fontsize=8)
    xs, seqs = _step_series(steps, "num_seqs")
    ax_bs.set_title("Batch size (sequences scheduled per step)")
    ax_bs.set_ylabel("sequences")
    ax_bs.set_xlabel("time since first step (s)")
    if xs:
        ax_bs.step(xs, seqs, where="post", color="tab:green")
        ax_bs.set_ylim(bottom=0)
    else:
        _no_data(ax_bs)
    return fig


def _plot_step_time(plt, requests, steps, kv_total):
    fig, ax = plt.subplots(figsize=(10, 4), layout="constrained")
    xs, ms = _step_series(steps, "step_time_s", 1e3)
    ax.set_title(f"Engine step time ({len(ms)} steps)")
    ax.set_xlabel("time since first step (s)")
    ax.set_ylabel("step time (ms)")
    if xs:
        ax.plot(xs, ms, ".", ms=3, color="tab:blue", alpha=0.6, label="step")
        if len(ms) >= 5:
            k = max(2, min(50, len(ms) // 20))
            smooth = np.convolve(ms, np.ones(k) / k, mode="valid")
            ax.plot(xs[k - 1:], smooth, color="tab:orange", lw=1.5, label=f"moving mean ({k} steps)")
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper right", fontsize=8)
    else:
        _no_data(ax)
    return fig


def _plot_verify_budget(plt, requests, steps, kv_total):
    """Tokens each decode step ran (the verify budget B: one per sequence plus the drafts verified)
    against its batch size, beside what verifying every drafted position would have run, and the
    line B = sequences (no speculation). Steps with prompt chunks are left out (their tokens are
    the prompts')."""
    fig, ax = plt.subplots(figsize=(7, 5), layout="constrained")
    pts = [(s["num_seqs"], s["verify_budget"], s["num_tokens"] + s["num_drafted"]) for s in steps
           if s.get("verify_budget") is not None and s.get("num_drafted") is not None
           and s.get("num_tokens") == s.get("num_seqs")]
    if not pts:
        _no_data(ax, "no decode steps")
        return fig
    n = np.array([p[0] for p in pts], dtype=float)
    ax.scatter(n, [p[2] for p in pts], s=10, alpha=0.3, color="tab:orange", marker="x", label="every drafted position verified")
    ax.scatter(n, [p[1] for p in pts], s=10, alpha=0.5, color="tab:blue", label="verify budget B (chosen)")
    top = max(n.max(), 1)
    ax.plot([0, top], [0, top], color="gray", ls="--", lw=1, label="no speculation (B = sequences)")
    ax.set_title("Verify budget against batch size (decode steps)")
    ax.set_xlabel("sequences in the step")
    ax.set_ylabel("tokens the step ran")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8)
    return fig


def _plot_drafter_versions(plt, requests, steps, kv_total):
    """Online calibration: tau (tokens per verify round) over time in bins of 20 steps with verify
    rounds, the serving drafter version in each bin, and a line at each change of version (publish:
    up, rollback: down)."""
    fig, ax = plt.subplots(figsize=(8, 4), layout="constrained")
    spec = [s for s in steps if s.get("spec_rounds")]
    if not spec:
        _no_data(ax, "no verify rounds")
        return fig
    t0 = steps[0]["time"]
    xs, ys, vs = [], [], []
    for i in range(0, len(spec), 20):
        part = spec[i : i + 20]
        xs.append(np.mean([s["time"] - t0 for s in part]))
        ys.append(sum(s["spec_tokens"] for s in part) / sum(s["spec_rounds"] for s in part))
        vs.append(part[-1].get("drafter_version", 0))
    ax.plot(xs, ys, color="tab:blue", marker=".", lw=1)
    prev = steps[0].get("drafter_version", 0)
    for s in steps:
        v = s.get("drafter_version", 0)
        if v != prev:
            up = v > prev
            ax.axvline(s["time"] - t0, color="tab:green" if up else "tab:red", alpha=0.6, lw=1)
            ax.annotate(f"{'publish' if up else 'rollback'} v{v}", (s["time"] - t0, max(ys)), fontsize=7, rotation=90,
                        va="top")
            prev = v
    ax.set_title("Tokens per verify round (tau) by drafter version")
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("tau (20 verify steps per point)")
    return fig


def plot_expert_heatmaps(experts: dict, out_dir) -> list[Path]:
    """Heat maps from a balancer summary: layer x expert tokens, and rank x time tokens with the
    rebalance commits marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out = Path(out_dir)
    paths = []
    total = np.asarray(experts.get("expert_load_total") or [[0]], dtype=float)
    fig, ax = plt.subplots(figsize=(8, 2.5 + 0.25 * total.shape[0]))
    im = ax.imshow(total, aspect="auto", cmap="magma", interpolation="nearest")
    ax.set(xlabel="logical expert", ylabel="MoE layer", title="tokens routed per expert (whole run)")
    _integer_ticks(ax, total.shape[1], total.shape[0])
    fig.colorbar(im, ax=ax, label="tokens")
    fig.tight_layout()
    paths.append(out / "expert_load_heatmap.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    history = experts.get("rank_history") or []
    if history and len(history[0][0]) > 1:
        fig, ax = plt.subplots(figsize=(9, 3))
        h = np.asarray(history, dtype=float).sum(axis=1).T  # [ranks, steps], all layers
        h = h / np.maximum(h.mean(axis=0, keepdims=True), 1e-9)  # share of the step's mean: 1 = even
        im = ax.imshow(h, aspect="auto", cmap="coolwarm", interpolation="nearest", vmin=0, vmax=2)
        for e in experts.get("rebalances", []):
            ax.axvline(e["committed_at_step"], color="black", lw=1)
        ax.set(xlabel="step (black: rebalance committed)", ylabel="rank", title="tokens per rank / mean rank, per step")
        _integer_ticks(ax, None, h.shape[0])
        fig.colorbar(im, ax=ax, label="load / mean (1 = balanced)")
        fig.tight_layout()
        paths.append(out / "rank_load_heatmap.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def _integer_ticks(ax, nx, ny) -> None:
    """Ticks on whole cells only (layers, experts, ranks), at most ~16 per axis."""
    for n, set_ticks in ((nx, ax.set_xticks), (ny, ax.set_yticks)):
        if n:
            set_ticks(list(range(0, n, max(1, -(-n // 16)))))


def machine_info() -> str:
    """One line naming the machine a measurement ran on, for BENCHMARKS.md."""
    import os
    import platform
    import subprocess

    import torch

    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lscpu if line.startswith("Model name"))
    except Exception:  # noqa: BLE001 - lscpu missing: fall back to what Python knows
        cpu = platform.processor() or platform.machine()
    return f"nproc={os.cpu_count()}, CPU: {cpu}, torch {torch.__version__}, Python {platform.python_version()}"


def loadavg() -> str:
    import os

    return " ".join(f"{x:.2f}" for x in os.getloadavg())
