"""Fitting the catalog's "cpu" entry on this machine, and checking the simulation against real runs.

The device terms come from the engine's own start-up step-cost profile (`speculative.controller.
profile_step_cost`: greedy verify steps of B tokens on the bundled tiny model, the fastest of 5):
the two roofline figures (achievable FLOP/s and bytes/s) that make `cost_model.profile_grid`
reproduce it, by a search in log space. The host terms come from a real `dspark run`'s step
records: the wall time between two steps' records less the step's execute time is the host's
(scheduling, building the step, handing out the tokens), fitted as a + b x sequences + c x tokens.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Optional

import numpy as np

from .hardware import CATALOG_PATH, get_device


def profile_here(overrides=()) -> tuple[list[int], list[float], object]:
    """The engine's StepCost profile of the bundled tiny model on this CPU (up to 512 tokens a step)."""
    from ..config import load_config
    from ..executor import LocalExecutor
    from ..model.spec import load_spec
    from ..speculative.controller import profile_step_cost
    from ..step_builder import profile_input

    cfg = load_config(None, ["speculative.num_tokens=7", *overrides])  # method none: the grid reaches 64 x 8
    spec = load_spec(cfg.model.path, cfg.model.dtype)
    ex = LocalExecutor(cfg, spec)
    try:
        cost = profile_step_cost(ex, cfg, 1)
        prefill = [(q, _time_step(ex, profile_input(1, q, cfg.scheduler.block_size, ex.num_blocks)))
                   for q in PREFILL_GRID]
    finally:
        ex.shutdown()
    return cost.x.astype(int).tolist(), cost.y.tolist(), cfg, prefill


# one row of q tokens (a prompt chunk's shape): the profile above stops at 8 tokens a row, where a
# CPU's GEMMs are far from their large-matrix speed
PREFILL_GRID = (128, 512, 1024, 2048)


def _time_step(ex, inp, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        ex.wait(ex.submit(inp))
        times.append(time.perf_counter() - t)
    return min(times[1:])


def fit_device_terms(xs, ys, cfg, prefill=()) -> dict:
    """FLOP/s and bytes/s for which the cost model's T(B) (host terms off) matches the profile:
    least squares in log time over a log grid, refined once around the best point."""
    from ..model.spec import load_spec
    from .cost_model import StepShape, Topology, profile_grid, step_time
    from .engine import precision_for
    from .shapes import model_shapes

    spec = load_spec(cfg.model.path, cfg.model.dtype)
    m = model_shapes(spec)
    base = get_device("cpu").model_copy(update={"host_overhead_s": 0.0, "per_seq_overhead_s": 0.0,
                                                "per_token_overhead_s": 0.0})
    prec = precision_for(spec, "auto", base)
    topo = Topology(1, 1, 1, m.num_experts)
    meas = np.log(np.concatenate([np.asarray(ys), [t for _, t in prefill]]))
    rows = cfg.scheduler.max_num_seqs
    chunks = [StepShape(np.array([q], float), np.ones(1), np.ones(1), np.array([q * (q + 1) / 2.0]),
                        np.array([float(q)]), prefill_pairs=np.array([q * (q + 1) / 2.0]),
                        prefill_ctx=np.array([float(q)]))
              for q, _ in prefill]

    def err(f, b, lo):
        dev = base.model_copy(update={"flops": {k: f for k in base.flops}, "hbm_bandwidth": b,
                                      "layer_overhead_s": lo})
        px, py = profile_grid(m, topo, dev, prec, rows, max(xs), context=0)
        pred = list(np.interp(xs, px, py)) + [step_time(c, m, topo, dev, prec)["total"] for c in chunks]
        return float(np.mean((np.log(pred) - meas) ** 2))

    # the per-layer overhead from the smallest step (a few tokens: no roofline term matters yet), then
    # FLOP/s and bytes/s on a log grid, refined once around the best point
    best = None
    lo0 = ys[0] / m.num_layers
    for lo_f, hi_f, lo_b, hi_b, n in ((7.0, 12.0, 8.0, 13.0, 21), (None, None, None, None, 13)):
        if lo_f is None:
            f0, b0 = np.log10(best[1]), np.log10(best[2])
            lo_f, hi_f, lo_b, hi_b = f0 - 0.25, f0 + 0.25, b0 - 0.25, b0 + 0.25
        for f in np.logspace(lo_f, hi_f, n):
            for b in np.logspace(lo_b, hi_b, n):
                for lo in (0.5 * lo0, 0.75 * lo0, 0.9 * lo0, lo0):
                    e = err(f, b, lo)
                    if best is None or e < best[0]:
                        best = (e, f, b, lo)
    e, f, b, lo = best
    return {"flops": float(f), "hbm_bandwidth": float(b), "layer_overhead_s": float(lo),
            "rms_log_error": float(np.sqrt(e)), "profile_tokens": list(xs), "profile_s": list(ys)}


def fit_host_terms(steps: list[dict]) -> dict:
    """host seconds per step = a + b x sequences + c x tokens, from a run's step records (least
    squares; a negative coefficient is dropped and the rest refitted)."""
    t = np.array([s["time"] for s in steps])
    gap = np.diff(t)
    ex = np.array([s["execute_s"] for s in steps[1:]])
    host = gap - ex
    seqs = np.array([s["num_seqs"] for s in steps[1:]], dtype=float)
    toks = np.array([s["num_tokens"] for s in steps[1:]], dtype=float)
    keep = host > 0
    host, seqs, toks = host[keep], seqs[keep], toks[keep]
    cols = {"host_overhead_s": np.ones_like(seqs), "per_seq_overhead_s": seqs, "per_token_overhead_s": toks}
    names = list(cols)
    while True:
        A = np.stack([cols[n] for n in names], 1)
        coef, *_ = np.linalg.lstsq(A, host, rcond=None)
        if (coef >= 0).all() or len(names) == 1:
            break
        names.pop(int(np.argmin(coef)))
    out = {n: 0.0 for n in cols}
    out.update({n: float(max(c, 0.0)) for n, c in zip(names, coef)})
    out["host_median_s"] = float(np.median(host))
    out["steps"] = int(len(host))
    return out


def real_run(overrides=(), name: str = "fit") -> dict:
    """A real `dspark run` of the bundled config here (executor local), its report dict."""
    import tempfile

    from ..config import load_config
    from ..runner import run_experiment

    out = tempfile.mkdtemp()
    cfg = load_config(None, [f"report.out_dir={out}", f"report.name={name}", *overrides])
    return run_experiment(cfg, progress=False)


def fit_to_run(reports, overrides_per_run=None, separate_attention: bool = False) -> dict:
    """GEMM FLOP/s, attention FLOP/s, bytes/s and the per-layer overhead that make the cost model's
    device time of each step match that step's execute_s in real runs (one or more reports, each with
    the overrides of its config). The shapes are the simulation's own replay of each run's workload,
    step for step (the simulated scheduler makes the real one's decisions: tests/test_simulate.py), so
    the fit sees each step's real batch, chunks and context lengths. separate_attention: fit attention's
    FLOP/s apart from the GEMMs' (tried on a decode run plus a long-prompt run: it found attention
    negligible and validated worse, 17.6% / 30.1% against 15.8% / 18.2%; off by default)."""
    import tempfile

    from ..config import load_config
    from ..sequence import Sequence
    from .cost_model import step_time
    from .options import SimOptions
    from .run import build

    if isinstance(reports, dict):
        reports = [reports]
    overrides_per_run = overrides_per_run or [()] * len(reports)
    shapes, real, engine = [], [], None
    for report, overrides in zip(reports, overrides_per_run):
        cfg = load_config(None, [f"report.out_dir={tempfile.mkdtemp()}", *overrides])
        engine, requests = build(cfg, SimOptions(hardware="cpu", record_shapes=True))
        names = iter(range(len(requests)))
        engine.run(requests, lambda r: Sequence(f"f{next(names)}", list(r.prompt_ids), len(r.prompt_ids), r.params,
                                                engine.spec.eos_token_ids, arrival_time=r.arrival_s))
        # pair each simulated step with the real step of the same (sequences, tokens), in order: the real
        # run's first requests arrive while its first step starts (a real clock), so its first steps may
        # split what the replay admits at once
        pool: dict = {}
        for st in report["steps"]:
            pool.setdefault((st["num_seqs"], st["num_tokens"]), []).append(st["execute_s"])
        for sh in engine.shape_record:
            key = (int(sh.num_seqs.sum()), int(sh.tokens.sum()))
            if pool.get(key):
                shapes.append(sh)
                real.append(pool[key].pop(0))
    n = len(shapes)
    meas = np.log(np.asarray(real))
    base = engine.dev.model_copy(update={"host_overhead_s": 0.0, "per_seq_overhead_s": 0.0,
                                         "per_token_overhead_s": 0.0})

    def err(f, fa, b, lo):
        dev = base.model_copy(update={"flops": {**{k: f for k in ("fp32", "bf16", "fp8")}, "attention": fa},
                                      "hbm_bandwidth": b, "layer_overhead_s": lo})
        pred = [step_time(sh, engine.shapes, engine.topo, dev, engine.prec)["total"] for sh in shapes]
        return float(np.mean((np.log(pred) - meas) ** 2))

    best = None
    lo0 = float(np.min(real)) / engine.shapes.num_layers
    for lo_f, hi_f, lo_b, hi_b, k in ((8.5, 11.5, 8.5, 11.5, 7), (None, None, None, None, 5)):
        if lo_f is None:
            f0, fa0, b0 = np.log10(best[1]), np.log10(best[2]), np.log10(best[3])
            grid_f, grid_fa, grid_b = (np.logspace(x - 0.25, x + 0.25, k) for x in (f0, fa0, b0))
        else:
            grid_f = grid_fa = grid_b = np.logspace(lo_f, hi_f, k)
        for f in grid_f:
            for fa in (grid_fa if separate_attention else (None,)):
                for b in grid_b:
                    for lo in (0.25 * lo0, 0.5 * lo0, 0.75 * lo0, 0.9 * lo0):
                        e = err(f, fa or f, b, lo)
                        if best is None or e < best[0]:
                            best = (e, f, fa or f, b, lo)
    e, f, fa, b, lo = best
    return {"flops": float(f), "attention_flops": float(fa) if separate_attention else None,
            "hbm_bandwidth": float(b), "layer_overhead_s": float(lo),
            "rms_log_error": float(np.sqrt(e)), "fitted_steps": n}


# the runs the cpu entry is fitted to: the bundled default config
FIT_RUNS = ([],)


def fit_cpu(report: Optional[str] = None, repeats: int = 3, source: str = "run") -> dict:
    """source run: the device terms fitted to a real run's step times (shapes replayed by the
    simulation); profile: to the engine's start-up StepCost profile alone (no context lengths in it)."""
    if source == "run":
        if report:
            reps, runs = [json.loads(Path(report).read_text())], [()]
        else:
            reps, runs = [real_run(o, f"fit{i}") for i, o in enumerate(FIT_RUNS)], list(FIT_RUNS)
        out = fit_to_run(reps, runs)
        out.update(fit_host_terms(reps[0]["steps"]))
        out.update({"profile_tokens": [1, 1], "machine": _machine(), "date": time.strftime("%Y-%m-%d"),
                    "source": "run"})
        return out
    return _fit_cpu_profile(report, repeats)


def _machine() -> str:
    import platform

    return platform.processor() or platform.machine()


def _fit_cpu_profile(report: Optional[str] = None, repeats: int = 3) -> dict:
    runs = [profile_here() for _ in range(repeats)]  # a shared machine's noise only ever adds time: the minimum
    xs, cfg = runs[0][0], runs[0][2]
    ys = np.min([r[1] for r in runs], axis=0).tolist()
    prefill = [(q, min(r[3][i][1] for r in runs)) for i, (q, _) in enumerate(runs[0][3])]
    device = fit_device_terms(xs, ys, cfg, prefill)
    device["prefill_profile"] = prefill
    steps = json.loads(Path(report).read_text())["steps"] if report else real_run()["steps"]
    host = fit_host_terms(steps)
    import platform

    return {**device, **host, "machine": platform.processor() or platform.machine(),
            "date": time.strftime("%Y-%m-%d")}


def write_cpu_entry(fit: dict, path: Path = CATALOG_PATH) -> None:
    """Set the cpu entry's fitted figures in the catalog YAML in place (its comments kept)."""
    text = Path(path).read_text()
    head, sep, cpu = text.partition("\n  cpu:\n")
    f = fit["flops"]
    att = f", attention: {fit['attention_flops']:.4g}" if fit.get("attention_flops") else ""
    cpu = re.sub(r"flops: \{[^}]*\}", f"flops: {{fp32: {f:.4g}, bf16: {f:.4g}, fp8: {f:.4g}{att}}}", cpu, count=1)
    for key in ("hbm_bandwidth", "layer_overhead_s", "host_overhead_s", "per_seq_overhead_s", "per_token_overhead_s"):
        cpu = re.sub(rf"(\n    {key}: )[^\n]*", rf"\g<1>{fit[key]:.4g}", cpu, count=1)
    if fit.get("source") == "run":
        note = (f"fitted {fit['date']} on this machine by launch/bench_simulate.py fit-cpu: each step's execute_s of a "
                f"real dspark run of configs/tiny.yaml ({fit['fitted_steps']} steps, shapes replayed by the "
                f"simulation), "
                f"rms log error {fit['rms_log_error']:.3f}; host terms from the same run's gaps between steps")
    else:
        note = (f"fitted {fit['date']} on this machine by launch/bench_simulate.py fit-cpu: profile rms log error "
                f"{fit['rms_log_error']:.3f} over B = {fit['profile_tokens'][0]}..{fit['profile_tokens'][-1]} and "
                f"one-row "
                f"chunks of {', '.join(str(q) for q, _ in fit.get('prefill_profile', ()))} tokens; host terms "
                f"from {fit['steps']} steps of a real dspark run")
    cpu = re.sub(r'(\n    source_flops: )[^\n]*', rf'\g<1>"{note}"', cpu, count=1)
    cpu = re.sub(r'(\n    source_hbm_bandwidth: )[^\n]*', rf'\g<1>"{note}"', cpu, count=1)
    cpu = re.sub(r'(\n    source_host_overhead: )[^\n]*', rf'\g<1>"{note}"', cpu, count=1)
    Path(path).write_text(head + sep + cpu)


# ---- simulated against real, here --------------------------------------------------------------
VALIDATION_POINTS = {
    "default (64 seqs, out 16-64)": [],
    "max_num_seqs 8": ["scheduler.max_num_seqs=8"],
    "out 64-128": ["workload.output_len=[64,128]"],
    "synthetic prompts 200-400": ["workload.kind=synthetic", "workload.prompt_len=[200,400]",
                                  "workload.output_len=[32,64]"],
    "64 requests, 8 seqs": ["workload.num_requests=64", "scheduler.max_num_seqs=8"],
    "no prefix caching, 2 req/s": ["scheduler.prefix_caching=false", "workload.request_rate=2"],
    "synthetic 1000-1500, 16 seqs": ["workload.kind=synthetic", "workload.prompt_len=[1000,1500]",
                                     "scheduler.max_num_seqs=16", "workload.output_len=[16,32]"],
    "hot-spot experts": ["workload.hot_experts=[0,1]", "workload.hot_bias=2.0"],
    "dspark k=6, confidence schedule": ["speculative.method=dspark", "speculative.draft_model=tiny-dspark",
                                        "speculative.num_tokens=6"],
    "default again (the real run's own spread)": [],
}


def validate_cpu(which: str = "all") -> list[dict]:
    """Each point run for real and simulated with the fitted cpu entry; a markdown table with the
    absolute errors and their medians."""
    import tempfile

    from ..config import load_config
    from .options import SimOptions
    from .run import simulate

    wanted = which.split(";")
    points = VALIDATION_POINTS if which == "all" else {k: v for k, v in VALIDATION_POINTS.items() if k in wanted}
    rows = []
    print("| point | real tok/s | sim tok/s | err | real TPOT p50 ms | sim TPOT p50 ms | err | real steps | "
          "sim steps |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, overrides in points.items():
        real_report = real_run(overrides, "real")
        real = real_report["summary"]
        out = tempfile.mkdtemp()
        cfg = load_config(None, [f"report.out_dir={out}", *overrides])
        opts = SimOptions(hardware="cpu")
        if cfg.speculative.enabled:  # the survival curve measured by position in the real run (as the issue allows)
            opts = SimOptions(hardware="cpu", acceptance={"report": str(Path(real_report["out_dir"]) / "report.json")})
        sim = simulate(cfg, opts, write=False)["summary"]
        e_t = abs(sim["output_tokens_per_s"] / real["output_tokens_per_s"] - 1)
        e_p = abs(sim["tpot_p50_s"] / real["tpot_p50_s"] - 1)
        rows.append({"point": label, "err_throughput": e_t, "err_tpot": e_p})
        print(f"| {label} | {real['output_tokens_per_s']:.1f} | {sim['output_tokens_per_s']:.1f} | {100 * e_t:.0f}% | "
              f"{1e3 * real['tpot_p50_s']:.2f} | {1e3 * sim['tpot_p50_s']:.2f} | {100 * e_p:.0f}% | {real['steps']} | "
              f"{sim['steps']} |", flush=True)
    print(f"\nmedian absolute error: throughput {100 * np.median([r['err_throughput'] for r in rows]):.1f}%, "
          f"TPOT p50 {100 * np.median([r['err_tpot'] for r in rows]):.1f}% over {len(rows)} points")
    return rows
