"""Calibration variants replayed on recorded live rounds (issue 28: ECE by position <= 2%).

    python launch/bench_schedule.py --drafters dspark --batches 1 --static "" --poisson "" --repeats 1 \\
        --calib-requests 512 --rounds-out runs/rounds          # writes runs/rounds.dspark.npz
    python launch/replay_calibration.py runs/rounds.dspark.npz [--variants isotonic,isotonic:num_bins=20,sts] \
        [--unseen-prompts] [--bins 5] [--json OUT]

Each variant is a calibration method of `speculative/confidence.py`, optionally with keyword arguments
for its fit and for the planner (`name:key=value:key=value@window=4000@refit_every=250`). The recorded steps are fed, in their order, to a fresh
`VerifyPlanner` (the engine's window and refit schedule) whose method in force is the variant, so every
round is scored with the fits in force when it ran, made on earlier rounds only, exactly as live; then
ECE by position, its noise floor and the Brier score, as `bench_schedule.py` part 3 prints them. The planner gets
each round's sequence (its per-sequence offsets, `VerifyPlanner.sequence_prior`; `@sequence_prior=0`: none;
not with --unseen-prompts, whose fits are made apart from the planner). The
verify lengths are the recorded ones (what the schedule in force then verified): a variant is compared
on the same rounds, not on the rounds it would have chosen. --unseen-prompts: each round scored with a fit made
without its own prompt's rounds (the benchmark cycles 131 prompts: a window longer than a cycle otherwise
holds the same prompt's identical greedy rounds). --budget BETA: on rounds recorded with every drafted position
verified (`bench_schedule.py --calib-draft-all verify`), the verify budget's own censoring simulated with its
feedback: each step verifies what `choose_verify_lengths` admits on the survival of the fits in force, with a step
time of 1 + BETA x (tokens - rows) decode steps and a drafter call of --budget-draft decode steps (batch 1 on this
CPU: BETA ~0.13, draft ~1.1), the recorded outcomes cut to it (--full-every N: every N-th round verified in full
instead); ECE is then read on the rounds the simulated budget verified, as live, and what the budget's choices
delivered is printed: tokens committed per decode step's time (plain decoding: 1).
--bins J: each variant's reliability table at position J (0-based;
the ECE's 10 equal-width bins: rounds, mean predicted survival, observed survival, and the bin's share of the ECE).
--drift-parts N: each variant's mean predicted minus observed survival by position over N equal runs of the
scored rounds (a level that moves with the stream). Each replay also prints the planner's observe time a step
(scoring, refits, refreshes: what it costs the step loop).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from functools import partial
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from dspark_cluster.speculative import confidence  # noqa: E402
from dspark_cluster.speculative.records import Proposal  # noqa: E402
from dspark_cluster.speculative.verify_budget import StepCost, VerifyPlanner, choose_verify_lengths  # noqa: E402


def parse_variant(text: str) -> tuple[str, dict, dict]:
    """`name:key=value...@key=value...` -> (method, its fit's keywords, the planner's keywords)."""
    method, *planner = text.split("@")
    name, *fit = method.split(":")
    kws = [{}, {}]
    for kw, items in zip(kws, (fit, planner)):
        for item in items:
            key, value = item.split("=")
            kw[key] = json.loads(value)
    return name, kws[0], kws[1]


def drafter_of(path: str) -> str:
    """The speculative method a recording is of: bench_schedule.py writes <name>.<drafter>.npz."""
    method = os.path.basename(path).rsplit(".", 2)[-2] if path.endswith(".npz") else ""
    return method if method in ("dspark", "draft_model", "ngram") else "dspark"


def replay(rounds: dict, variant: str, budget: Optional[tuple] = None, method: str = "dspark") -> tuple[dict, tuple]:
    """The planner's calibration report after feeding it the recorded steps, with `variant` in force, and
    the scored rounds (survival predictions [R, K] by the variant, verified [R], accepted [R]). budget:
    (beta, drafter cost, full_every) to cut the recorded (uncensored) outcomes to what a verify budget would
    have verified given the fits in force (see --budget); the report's "verified_share" is then the share of
    drafted positions verified. method: the drafter's (an n-gram drafter's confidences are the window's acceptance
    rates, which its fits read as they are now)."""
    name, kw, planner_kw = parse_variant(variant)
    fit, apply = confidence.CALIBRATIONS[name]
    patched = dict(confidence.CALIBRATIONS)
    try:
        if kw:  # the planner fits by name: the variant's keywords go in under the method's own name
            confidence.CALIBRATIONS[name] = (partial(fit, **kw), apply)
        conf, ver, acc, seqs = rounds["conf"], rounds["verified"], rounds["accepted"], sequence_ids(rounds)
        planner = VerifyPlanner(conf.shape[1], StepCost([1], [1e-3]), method, calibration=name, compare=(),
                                **planner_kw)
        start, verified, drafted, observe_s = 0, 0, 0, []
        tokens, step_time = 0, 0.0  # with a budget: tokens the simulated steps committed, their time in decode steps
        for n in rounds["step_rows"].tolist():
            c, v, a, ids = conf[start : start + n], ver[start : start + n], acc[start : start + n], seqs[start : start + n]
            if method == "ngram":  # its raw confidences are the rates of the moment: this planner's, as live
                c = planner.raw_confidences([Proposal([0] * int(m)) for m in (~np.isnan(c)).sum(1)])
            if budget is not None:
                beta, draft_s, full_every = budget
                lengths = choose_verify_lengths(planner.calibrated_survival(c, offsets=planner.sequence_offsets(ids)),
                                                n, float(n),
                                                lambda B: 1.0 + beta * (np.asarray(B) - n), draft_s)
                if full_every:
                    lengths = np.where((start + np.arange(n)) % full_every == 0, v, lengths)
                v = np.minimum(v, lengths)
                a = np.minimum(a, v)
                tokens += n + int(a.sum())
                step_time += 1.0 + beta * int(v.sum()) + draft_s
            verified, drafted = verified + int(v.sum()), drafted + int((~np.isnan(c)).sum())
            t = time.perf_counter()
            planner.observe(c, v, a, ids)  # (scoring, refits and refreshes: the planner's work in the step loop)
            observe_s.append(time.perf_counter() - t)
            start += n
        live = list(planner.live)
        preds = np.array([x[1][planner.methods.index(name)] for x in live])
        ver, acc = (np.array([x[i] for x in live]) for i in (2, 3))
        cost = {"observe_ms_mean": 1e3 * float(np.mean(observe_s)), "observe_ms_max": 1e3 * float(np.max(observe_s))}
        if budget is not None:  # what the budget's choices delivered: tokens per decode step's time (plain: 1)
            cost["tokens_per_decode_step"] = tokens / max(step_time, 1e-9)
        return ({**planner.calibration_report(floors=True), "verified_share": verified / max(drafted, 1), **cost},
                (preds, ver, acc))
    finally:
        confidence.CALIBRATIONS.clear()
        confidence.CALIBRATIONS.update(patched)


def sequence_ids(rounds: dict) -> np.ndarray:
    """[R] the sequence each round belongs to: as recorded (`seq_ids`), or, in a recording without them (before
    session 35: one request at a time), a new sequence wherever a step's prompt differs from the step before's."""
    if "seq_ids" in rounds and (rounds["seq_ids"] >= 0).all():
        return rounds["seq_ids"]
    prompt = rounds["step_prompt"]
    step_seq = np.cumsum(np.concatenate([[0], prompt[1:] != prompt[:-1]]))
    return np.repeat(step_seq, rounds["step_rows"])


def replay_unseen(rounds: dict, variant: str) -> dict:
    """As `replay`, but each round scored with a fit made on the window without its own prompt's rounds: the
    calibration a prompt unlike any in the window gets (the benchmark cycles its prompts; a window longer than
    a cycle otherwise holds the same prompt's identical greedy rounds). Needs the rounds' prompts
    (bench_schedule.py --rounds-out records them)."""
    name, kw, planner_kw = parse_variant(variant)
    fit, apply = confidence.CALIBRATIONS[name]
    fit = partial(fit, **kw)
    defaults = inspect.signature(VerifyPlanner).parameters  # the engine's window and refit schedule
    window, every, min_rounds = (planner_kw.get(k, defaults[k].default) for k in ("window", "refit_every", "min_rounds"))
    conf, ver, acc = rounds["conf"], rounds["verified"], rounds["accepted"]
    prompt = np.repeat(rounds["step_prompt"], rounds["step_rows"])
    held, snapshot, cache, since, scored = [], None, {}, 0, []
    start = 0
    for n in rounds["step_rows"].tolist():
        rows = range(start, start + n)
        if snapshot is not None:  # scored with the fits in force, made on earlier rounds
            for i in rows:
                if ver[i] == 0:
                    continue
                key = (id(snapshot), int(prompt[i]))
                if key not in cache:
                    others = snapshot[prompt[snapshot] != prompt[i]]
                    cache[key] = fit(conf[others], ver[others], acc[others])
                scored.append((i, confidence.survival(apply(conf[i : i + 1], cache[key]))[0]))
        held = (held + list(rows))[-window:]
        since += n
        start += n
        if (since >= every or snapshot is None) and len(held) >= min_rounds:
            snapshot, since, cache = np.array(held), 0, {}
    idx = np.array([i for i, _ in scored])
    a = np.stack([x for _, x in scored])
    return {"scored": (a, ver[idx], acc[idx]),
            "ece": confidence.ece_by_position(a, ver[idx], acc[idx]),
            "floor": confidence.ece_by_position(a, ver[idx], acc[idx], floor=True),
            "brier": confidence.brier_by_position(a, ver[idx], acc[idx]),
            "rounds_by_position": [int((ver[idx] > j).sum()) for j in range(conf.shape[1])]}


def bias_by_part(a: np.ndarray, verified: np.ndarray, accepted: np.ndarray, parts: int) -> list[list[float]]:
    """Mean predicted minus observed survival [parts][K] of the scored rounds (in the order they ran) cut into
    `parts` equal runs: a calibration's error that moves with the stream shows as a level that changes sign."""
    observed, survived = confidence.outcomes(verified, accepted, a.shape[1])
    out = []
    for idx in np.array_split(np.arange(len(a)), parts):
        o, y = observed[idx], survived[idx]
        out.append([float((a[idx, j][o[:, j]] - y[o[:, j], j]).mean()) if o[:, j].any() else float("nan")
                    for j in range(a.shape[1])])
    return out


def reliability(a: np.ndarray, verified: np.ndarray, accepted: np.ndarray, j: int, num_bins: int = 10) -> list[dict]:
    """Position j's reliability table (the bins `confidence.ece` sums over): survival predictions a [R, K]
    on the rounds that verified position j."""
    observed, survived = confidence.outcomes(verified, accepted, a.shape[1])
    pred, out = a[observed[:, j], j], survived[observed[:, j], j].astype(np.float64)
    bins = np.minimum((pred * num_bins).astype(np.int64), num_bins - 1)
    rows = []
    for b in range(num_bins):
        sel = bins == b
        if sel.any():
            gap = float(pred[sel].sum() - out[sel].sum())
            rows.append({"bin": [b / num_bins, (b + 1) / num_bins], "rounds": int(sel.sum()),
                         "predicted": float(pred[sel].mean()), "observed": float(out[sel].mean()),
                         "ece_share": abs(gap) / pred.size})
    return rows


def print_bins(rows: list[dict]) -> None:
    for r in rows:
        print(f"      [{r['bin'][0]:.1f}, {r['bin'][1]:.1f}) {r['rounds']:6d} rounds  predicted {r['predicted']:.3f}  "
              f"observed {r['observed']:.3f}  ECE share {100 * r['ece_share']:.2f}%")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rounds", nargs="+", help="npz files written by bench_schedule.py --rounds-out")
    ap.add_argument("--variants", default="isotonic,sts")
    ap.add_argument("--unseen-prompts", action="store_true",
                    help="score each round with a fit made without its own prompt's rounds (replay_unseen)")
    ap.add_argument("--bins", type=int, default=None, help="position (0-based) whose reliability table to print")
    ap.add_argument("--budget", type=float, default=None, metavar="BETA",
                    help="simulate the verify budget's censoring on uncensored rounds (see above)")
    ap.add_argument("--budget-draft", type=float, default=1.1, help="the drafter call, in decode steps")
    ap.add_argument("--full-every", type=int, default=0, help="with --budget: every N-th round verified in full")
    ap.add_argument("--drift-parts", type=int, default=0,
                    help="each variant's mean predicted - observed survival by position over this many runs of rounds")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.budget is not None and args.unseen_prompts:
        raise SystemExit("--budget replays the planner live: it does not combine with --unseen-prompts")
    budget = None if args.budget is None else (args.budget, args.budget_draft, args.full_every)
    out = {}
    pct = lambda xs: " ".join(f"{100 * x:4.1f}" for x in xs)  # noqa: E731
    for path in args.rounds:
        rounds = dict(np.load(path))
        print(f"{path}: {len(rounds['conf'])} rounds in {len(rounds['step_rows'])} steps", flush=True)
        out[path] = {}
        for i, v in enumerate(args.variants.split(",")):
            if args.unseen_prompts:
                r = replay_unseen(rounds, v)
                scored = r.pop("scored")
                out[path][v] = r
                if i == 0:
                    print(f"  {'rounds (unseen prompts)':28s} {out[path][v]['rounds_by_position']}")
                print(f"  {v:28s} ECE % {pct(out[path][v]['ece'])} | floor % {pct(out[path][v]['floor'])} | "
                      f"Brier sum {sum(out[path][v]['brier']):.4f}", flush=True)
            else:
                r, scored = replay(rounds, v, budget, drafter_of(path))
                name = parse_variant(v)[0]
                out[path][v] = {"ece": r["ece_by_method"][name], "floor": r["ece_floor_by_method"][name],
                                "brier": r["brier_by_method"][name], "rounds_by_position": r["rounds_by_position"]}
                if budget is not None:
                    out[path][v]["verified_share"] = r["verified_share"]
                    out[path][v]["tokens_per_decode_step"] = r["tokens_per_decode_step"]
                    print(f"  {v + ' (budget)':28s} verified share of drafted positions {r['verified_share']:.2f}, "
                          f"rounds by position {r['rounds_by_position']}, tokens per decode step's time "
                          f"{r['tokens_per_decode_step']:.3f}")
                elif i == 0:
                    print(f"  {'rounds':28s} {r['rounds_by_position']}")
                    print(f"  {'raw':28s} ECE % {pct(r['ece_before_by_position'])} | Brier sum "
                          f"{sum(r['brier_by_method']['raw']):.4f}")
                print(f"  {v:28s} ECE % {pct(out[path][v]['ece'])} | floor % {pct(out[path][v]['floor'])} | "
                      f"Brier sum {sum(out[path][v]['brier']):.4f}", flush=True)
                out[path][v].update({k: r[k] for k in ("observe_ms_mean", "observe_ms_max")})
                print(f"    the planner's observe: {r['observe_ms_mean']:.3f} ms a step on average, "
                      f"{r['observe_ms_max']:.1f} ms at most", flush=True)
            if args.drift_parts:
                out[path][v]["bias_by_part"] = bias_by_part(*scored, args.drift_parts)
                for i, row in enumerate(out[path][v]["bias_by_part"]):
                    points = " ".join(f"{100 * x:+.1f}" for x in row)
                    print(f"    part {i + 1}: predicted - observed, points: {points}")
            if args.bins is not None:
                out[path][v]["bins"] = reliability(*scored, args.bins)
                print(f"    position {args.bins}:")
                print_bins(out[path][v]["bins"])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
