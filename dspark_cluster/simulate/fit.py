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


# the device figures a fit sets: achievable FLOP/s (GEMMs and attention alike), bytes/s, the per-layer
# and the per-row-per-layer overhead; CPU ops run their compute and memory one after the other (sum)
FITTED = ("flops", "hbm_bandwidth", "layer_overhead_s", "row_overhead_s")
_START = (3e10, 5e9, 5e-4, 1e-5)


def _device(base, x):
    f, b, lo, ro = np.exp(x)
    return base.model_copy(update={"flops": {k: float(f) for k in ("fp32", "bf16", "fp8")}, "hbm_bandwidth": float(b),
                                   "layer_overhead_s": float(lo), "row_overhead_s": float(ro), "roofline": "sum"})


def _least_squares(predict, measured, names=FITTED, start=_START) -> tuple[dict, float]:
    """The figures `names` that make predict(log figures) match measured seconds: least squares in
    log time with a soft-L1 loss (a shared machine's stalls are outliers that only ever add time)."""
    from scipy.optimize import least_squares

    meas = np.log(np.asarray(measured, dtype=np.float64))
    res = least_squares(lambda x: np.log(predict(x)) - meas, np.log(start), loss="soft_l1", f_scale=0.1)
    values = dict(zip(names, (float(v) for v in np.exp(res.x))))
    return values, float(np.sqrt(np.mean((np.log(predict(res.x)) - meas) ** 2)))


def fit_device_terms(xs, ys, cfg, prefill=()) -> dict:
    """The FITTED figures for which the cost model's T(B) (host terms off) matches the start-up
    profile: B tokens over min(B, max_num_seqs) rows, and one-row chunks of `prefill` tokens."""
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
    rows = cfg.scheduler.max_num_seqs
    chunks = [StepShape(np.array([q], float), np.ones(1), np.ones(1), np.array([q * (q + 1) / 2.0]),
                        np.array([float(q)]), prefill_pairs=np.array([q * (q + 1) / 2.0]),
                        prefill_ctx=np.array([float(q)]))
              for q, _ in prefill]

    def predict(x):
        dev = _device(base, x)
        px, py = profile_grid(m, topo, dev, prec, rows, max(xs), context=0)
        return np.array(list(np.interp(xs, px, py)) + [step_time(c, m, topo, dev, prec)["total"] for c in chunks])

    values, rms = _least_squares(predict, list(ys) + [t for _, t in prefill])
    return {**values, "rms_log_error": rms, "profile_tokens": list(xs), "profile_s": list(ys)}


def fit_host_terms(runs: list[list[dict]]) -> dict:
    """host seconds per step = a + b x sequences + c x tokens, from runs' step records (one list per
    run; least squares; a negative coefficient is dropped and the rest refitted)."""
    if runs and isinstance(runs[0], dict):
        runs = [runs]
    host, seqs, toks = [], [], []
    for steps in runs:
        t = np.array([s["time"] for s in steps])
        host.append(np.diff(t) - np.array([s["execute_s"] for s in steps[1:]]))
        seqs.append(np.array([s["num_seqs"] for s in steps[1:]], dtype=float))
        toks.append(np.array([s["num_tokens"] for s in steps[1:]], dtype=float))
    host, seqs, toks = np.concatenate(host), np.concatenate(seqs), np.concatenate(toks)
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


# the cpu entry is one core: every run it is fitted to or checked against gives each rank one thread,
# so that tensor 2 is two such devices (at the config's default, one process would take both cores);
# a Ray run starts its own instance (with `auto` it would join one that another user's tests started
# on this machine, and stop when they stop)
ONE_CORE = ("parallel.threads_per_worker=1", "parallel.ray_address=local")


def real_run(overrides=(), name: str = "fit") -> dict:
    """A real `dspark run` of the bundled config here (one thread a rank), its report dict."""
    import os
    import tempfile

    # Ray starts its workers at nice 15: on a machine shared with other work (at nice 0) a tensor-2
    # run's ranks then get only the cores that work leaves (measured: 2-7x slower prompt chunks at load
    # 3-5, while the one-process runs beside it take their fair share). At 0, the ranks, the Router
    # and a one-process run all compete as equals, as on a machine of their own
    os.environ.setdefault("RAY_worker_niceness", "0")

    from ..config import load_config
    from ..runner import run_experiment

    out = tempfile.mkdtemp()
    cfg = load_config(None, [f"report.out_dir={out}", f"report.name={name}", *ONE_CORE, *overrides])
    return run_experiment(cfg, progress=False)


def _paired_steps(runs, device=None):
    """(engine, shapes, seconds): each real step of runs [(overrides, [report, ...])] beside the
    simulation's replay of the same step (its StepShape); a step's time is the fastest of its repeats
    (noise here only adds time). The simulated scheduler makes the real one's decisions
    (tests/test_simulate.py), so each shape is the real step's batch, chunks, contexts and experts."""
    import tempfile

    from ..config import load_config
    from ..sequence import Sequence
    from .options import SimOptions
    from .run import build

    shapes, real, engine = [], [], None
    for overrides, reports in runs:
        cfg = load_config(None, [f"report.out_dir={tempfile.mkdtemp()}", *overrides])
        engine, requests = build(cfg, SimOptions(hardware="cpu", record_shapes=True))
        names = iter(range(len(requests)))
        engine.run(requests, lambda r: Sequence(f"f{next(names)}", list(r.prompt_ids), len(r.prompt_ids), r.params,
                                                engine.spec.eos_token_ids, arrival_time=r.arrival_s))
        # pair each simulated step with the real steps of the same (sequences, tokens), in order: the real
        # run's first requests arrive while its first step starts (a real clock), so its first steps may
        # split what the replay admits at once
        pools = []
        for report in reports:
            pool: dict = {}
            for st in report["steps"]:
                pool.setdefault((st["num_seqs"], st["num_tokens"]), []).append(st["execute_s"])
            pools.append(pool)
        for sh in engine.shape_record:
            key = (int(sh.num_seqs.sum()), int(sh.tokens.sum()))
            times = [p[key].pop(0) for p in pools if p.get(key)]
            if times:
                shapes.append((engine.topo, sh))
                real.append(min(times))
    return engine, shapes, real


def host_cores() -> int:
    """The cores of this machine (what the ranks of a run here and its other processes share)."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# the figures of a multi-process run here: gloo's latency between worker processes (its bandwidth term
# is negligible at these sizes) and the busy processes besides the ranks on the host's cores (the
# Router, the driver, Ray's own, other work: each rank's device time is divided by its share)
SHARED = ("collective_latency_s", "host_procs")
_SHARED_START = (3e-4, 1.0)


def fit_to_run(runs, shared_runs=(), cores: Optional[int] = None) -> dict:
    """The FITTED figures that make the cost model's device time of each step match that step's
    execute_s in real runs [(overrides, [report, ...])] of one process (tensor 1). With shared_runs
    (tensor-parallel runs through Ray, on this host's `cores`) the SHARED figures too, all in one least
    squares: one process cannot tell the work a rank splits (GEMMs, attention heads) from the work every
    rank repeats (per-layer and per-row overheads); tensor 2 can. Its decode steps are mostly
    collectives, its prompt chunks mostly device time."""
    from .cost_model import step_time

    bare = {"host_overhead_s": 0.0, "per_seq_overhead_s": 0.0, "per_token_overhead_s": 0.0}
    engine, shapes, real = _paired_steps(runs)
    base = engine.dev.model_copy(update=bare)
    parts = [(engine, base, shapes)]
    if shared_runs:
        engine2, shapes2, real2 = _paired_steps(shared_runs)
        cores = float(cores or host_cores())
        parts.append((engine2, engine2.dev.model_copy(update={**bare, "host_cores": cores}), shapes2))
        real = list(real) + list(real2)
    n = len(FITTED)

    def predict(x):
        out = []
        for eng, b, shs in parts:
            dev = _device(b, x[:n])
            if len(x) > n:
                dev = dev.model_copy(update=dict(zip(SHARED, (float(v) for v in np.exp(x[n:])))))
            out += [step_time(sh, eng.shapes, topo, dev, eng.prec)["total"] for topo, sh in shs]
        return np.array(out)

    names, start = (FITTED + SHARED, _START + _SHARED_START) if shared_runs else (FITTED, _START)
    values, rms = _least_squares(predict, real, names, start)
    out = {**values, "rms_log_error": rms, "fitted_steps": len(shapes)}
    if shared_runs:
        x = np.log([values[k] for k in names])
        err = np.log(predict(x)[len(shapes):]) - np.log(real[len(shapes):])
        out.update({"host_cores": cores, "shared_rms_log_error": float(np.sqrt(np.mean(err ** 2))),
                    "shared_fitted_steps": len(shapes2)})
    return out


# the runs the cpu entry is fitted to (none of them a validation point): the bundled default config,
# a small batch (one and two rows: the fixed per-step costs) and long prompts (prefill chunks)
FIT_RUNS = {
    "default": [],
    "24 requests, 2 seqs": ["workload.num_requests=24", "scheduler.max_num_seqs=2", "workload.output_len=[32,64]"],
    "synthetic 600-800, 32 seqs": ["workload.kind=synthetic", "workload.prompt_len=[600,800]",
                                   "scheduler.max_num_seqs=32", "workload.output_len=[16,48]"],
}
# tensor 2 through Ray (two worker processes, gloo): 1 to 24 rows and prompt chunks of 100-300-token
# prompts, so that the fit tells the work a rank splits from the work it repeats, and the collectives
RAY_TP2 = ["parallel.tensor=2", "parallel.executor=ray"]
FIT_RUNS_TP2 = {"tensor 2, synthetic 100-300, 24 seqs": [
    *RAY_TP2, "workload.kind=synthetic", "workload.num_requests=48", "workload.prompt_len=[100,300]",
    "scheduler.max_num_seqs=24", "workload.output_len=[16,48]"]}


def real_runs(points: dict, repeats: int) -> dict:
    """label -> [report, ...]: each point run `repeats` times, the points interleaved, after one
    warm-up run (a process's first run here is up to 2x slower: allocator and kernel warm-up)."""
    real_run([], "warmup")
    out: dict = {label: [] for label in points}
    for i in range(repeats):
        for label, overrides in points.items():
            out[label].append(real_run(overrides, f"r{i}"))
    return out


def fit_cpu(report: Optional[str] = None, repeats: int = 3, source: str = "run", reals: Optional[dict] = None) -> dict:
    """source run: the device terms fitted to real runs' step times (FIT_RUNS, each `repeats` times;
    shapes replayed by the simulation) and the tensor-2 run's (FIT_RUNS_TP2: with it the collectives'
    latency and the host's other processes, fit_to_run), the host terms to the one-process runs' gaps
    between steps; with `report`, to that one run of the default config; with
    `reals` (label -> reports, as real_runs gives), to those runs. profile: the device terms fitted to
    the engine's start-up StepCost profile alone (no context lengths in it)."""
    if source != "run":
        return _fit_cpu_profile(report, repeats)
    if report:
        runs, tp2 = [([], [json.loads(Path(report).read_text())])], []
    else:
        reals = reals or real_runs({**FIT_RUNS, **FIT_RUNS_TP2}, repeats)
        runs = [(FIT_RUNS[label], reals[label]) for label in FIT_RUNS]
        tp2 = [(FIT_RUNS_TP2[label], reals[label]) for label in FIT_RUNS_TP2]
    out = fit_to_run(runs, tp2)
    out.update(fit_host_terms([r["steps"] for _, reps in runs for r in reps]))
    out.update({"machine": _machine(), "date": time.strftime("%Y-%m-%d"), "source": "run",
                "fit_runs": [len(reps) for _, reps in runs]})
    return out


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
    for key in ("hbm_bandwidth", "layer_overhead_s", "row_overhead_s", "collective_latency_s", "host_cores",
                "host_procs", "host_overhead_s", "per_seq_overhead_s", "per_token_overhead_s"):
        if key in fit:
            cpu = re.sub(rf"(\n    {key}: )[^\s#]*", rf"\g<1>{fit[key]:.4g}", cpu, count=1)
    if "collective_latency_s" in fit:
        shared = (f"fitted {fit['date']} by fit-cpu to the {fit['shared_fitted_steps']} steps of a tensor-2 run "
                  f"through Ray (fit.FIT_RUNS_TP2; gloo between two worker processes, nice 0), with the device "
                  f"figures; host_cores this machine's; rms log error {fit['shared_rms_log_error']:.3f}")
        cpu = re.sub(r'(\n    source_latency: )[^\n]*', rf'\g<1>"{shared}; network_latency_s not fitted"', cpu, count=1)
        cpu = re.sub(r'(\n    source_host_cores: )[^\n]*', rf'\g<1>"{shared}"', cpu, count=1)
    if fit.get("source") == "run":
        tp2 = (f" with the {fit['shared_fitted_steps']} steps of a tensor-2 run through Ray (fit.FIT_RUNS_TP2)"
               if fit.get("shared_fitted_steps") else "")
        note = (f"fitted {fit['date']} on this machine by launch/bench_simulate.py fit-cpu: each step's execute_s of "
                f"real dspark runs of configs/tiny.yaml and two variants (fit.FIT_RUNS, the fastest of "
                f"{max(fit.get('fit_runs') or [1])} repeats; {fit['fitted_steps']} steps, shapes replayed by the "
                f"simulation), rms log error {fit['rms_log_error']:.3f}{tp2}; host terms from the one-process runs' "
                f"gaps between steps")
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
    "tensor 2 (Ray)": RAY_TP2,
    "hot-spot experts, EPLB, tensor 2 (Ray)": [*RAY_TP2, "workload.hot_experts=[0,1]", "workload.hot_bias=2.0",
                                               "workload.output_len=[48,96]", "eplb.enabled=true",
                                               "eplb.num_redundant_experts=2", "eplb.window_steps=10",
                                               "eplb.interval_steps=20"],
}


def validate_cpu(which: str = "all", repeats: int = 3, fit: bool = False, write: bool = False) -> list[dict]:
    """Each point run for real `repeats` times (interleaved, after a warm-up) and simulated with the
    fitted cpu entry; a markdown table of the absolute errors against the best real run (the fastest
    throughput, the lowest TPOT p50: noise here only adds time, and the fit reads the fastest steps
    too), the median real run beside it, and the medians of the errors. fit: the fit's runs go in the
    same rounds (the machine as the points saw it) and the cpu entry is fitted from them first (write:
    into the catalog; else the simulation reads a copy)."""
    import shutil
    import tempfile

    from ..config import load_config
    from .options import SimOptions
    from .run import simulate

    wanted = which.split(";")
    points = VALIDATION_POINTS if which == "all" else {k: v for k, v in VALIDATION_POINTS.items() if k in wanted}
    catalog = None
    if fit:
        reals = real_runs({**FIT_RUNS, **FIT_RUNS_TP2, **points}, repeats)
        fitted = fit_cpu(repeats=repeats, reals=reals)
        print(json.dumps({k: v for k, v in fitted.items() if not isinstance(v, list)}), flush=True)
        catalog = CATALOG_PATH if write else Path(tempfile.mkdtemp()) / "hardware.yaml"
        if not write:
            shutil.copy(CATALOG_PATH, catalog)
        write_cpu_entry(fitted, catalog)
    else:
        reals = real_runs(points, repeats)
    rows = []
    print("| point | real tok/s, best (median) | sim tok/s | err | real TPOT p50 ms, best (median) | sim TPOT p50 ms | "
          "err | real steps | sim steps |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, overrides in points.items():
        reps = reals[label]
        tput = [r["summary"]["output_tokens_per_s"] for r in reps]
        tpot = [r["summary"]["tpot_p50_s"] for r in reps]
        cfg = load_config(None, [f"report.out_dir={tempfile.mkdtemp()}", *overrides])
        kw = {"hardware": "cpu", "hardware_file": str(catalog) if catalog else None}
        if cfg.speculative.enabled:  # the survival curve measured by position in a real run (as the issue allows)
            kw["acceptance"] = {"report": str(Path(reps[0]["out_dir"]) / "report.json")}
        opts = SimOptions(**kw)
        sim = simulate(cfg, opts, write=False)["summary"]
        e_t = abs(sim["output_tokens_per_s"] / max(tput) - 1)
        e_p = abs(sim["tpot_p50_s"] / min(tpot) - 1)
        rows.append({"point": label, "err_throughput": e_t, "err_tpot": e_p, "real_tok_s": tput, "real_tpot_s": tpot,
                     "sim_tok_s": sim["output_tokens_per_s"], "sim_tpot_s": sim["tpot_p50_s"]})
        print(f"| {label} | {max(tput):.1f} ({np.median(tput):.1f}) | {sim['output_tokens_per_s']:.1f} | "
              f"{100 * e_t:.0f}% | {1e3 * min(tpot):.2f} ({1e3 * np.median(tpot):.2f}) | {1e3 * sim['tpot_p50_s']:.2f} | "
              f"{100 * e_p:.0f}% | {reps[0]['summary']['steps']} | {sim['steps']} |", flush=True)
    print(f"\nmedian absolute error: throughput {100 * np.median([r['err_throughput'] for r in rows]):.1f}%, "
          f"TPOT p50 {100 * np.median([r['err_tpot'] for r in rows]):.1f}% over {len(rows)} points")
    return rows
