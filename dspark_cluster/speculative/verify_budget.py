"""Confidence-scheduled verification: how many draft tokens to verify in a step, given the load.

Each (sequence r, draft position j) slot has a calibrated survival probability a_{r,j} (by default
the "isotonic_drift" calibration of `confidence.py`, STS fitted beside it for comparison). A step that
verifies B tokens in all takes T(B) seconds (`StepCost`: profiled at start-up, corrected by live step
times) after a drafting call of D seconds, and yields the sampling rows' one token each plus, in
expectation, the sum of the admitted slots' a. The budget admits slots greedily in decreasing a, and
stops at the first slot that does not raise the expected tokens per second Theta = E[tokens] /
(T(B) + D). B = the sampling rows alone is no speculation.

Lossless by construction: whether slot (r, j) is verified depends only on slots ranked above it, that
is on a_{r,i<=j} (known before its token is verified: a DSpark confidence reads x_{j-1}, not x_j) and
on other sequences, never on a slot below it. Maximising Theta over *all* cut points instead would
let a_{r,j+1}, which reads the token x_j, decide whether x_j is verified, and that biases the output
law (a token whose own confidence decides its verification is accepted more often than p allows;
`tests/test_verify_budget.py` shows it).

Before drafting, `VerifyPlanner.draft_len` picks how many positions to draft at all (0..K) from the
recent mean survival curve and the drafter's measured cost: at high load it drafts nothing, so the
step is plain decoding (and async scheduling may overlap it again). Until the first outcomes are in,
it drafts on a few rows only (the exploration's), so a fresh engine at high load pays for learning
on 4 rows, not on all of them. That choice uses only history
and the load, so it too leaves the output law alone.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
import time
from collections import deque
from typing import Callable, Optional

import numpy as np

from .confidence import (CALIBRATIONS, DRIFT_ROUNDS, REFRESHES, apply_calibration, brier_by_position, describe_params,
                         ece_by_position, fit_calibration, identity_params, survival)


# the rows a load's drafting steps must hold before what they delivered can stop drafting there
# (VerifyPlanner.delivery_vetoes)
VETO_ROUNDS = 32


def row_bucket(num_rows: int) -> int:
    """The power of 2 nearest num_rows (its log2): the loads the cost and delivery figures are kept by."""
    return int(round(math.log2(max(num_rows, 1))))


def choose_verify_lengths(a: np.ndarray, base_tokens: int, base_expected: float,
                          step_time: Callable[[np.ndarray], np.ndarray], draft_s: float = 0.0) -> np.ndarray:
    """Greedy prefix admission.

    a [N, K]: survival probability of each draft slot (non-increasing along each row; NaN where
    nothing was drafted). base_tokens: the step's tokens without drafts (prefill chunks and one per
    decode row); base_expected: the tokens it yields without drafts (its sampling rows).
    step_time(B [M]) -> seconds [M]. draft_s: the drafting call's time (already spent or planned).
    Returns lengths [N] (long): draft positions to verify per row, a prefix of each row."""
    N, K = a.shape
    flat = np.nan_to_num(a, nan=-1.0).reshape(-1)
    pos = np.tile(np.arange(K), N)
    order = np.lexsort((pos, -flat))  # decreasing a, earlier position first among ties
    order = order[flat[order] > 0]
    gains = flat[order]
    theta = (base_expected + np.concatenate([[0.0], np.cumsum(gains)])) / (
        step_time(base_tokens + np.arange(len(order) + 1)) + draft_s)
    falls = np.nonzero(theta[1:] <= theta[:-1])[0]
    m = int(falls[0]) if falls.size else len(order)  # stop at the first slot that does not pay
    return np.bincount(order[:m] // K, minlength=N).astype(np.int64)


def extrapolate_survival(mean: np.ndarray, counts: np.ndarray, min_count: int) -> np.ndarray:
    """The mean survival by position [K] where each position was drafted counts[j] times in the window;
    past the last position drafted min_count times, each further one keeps the last known conditional
    survival a_j / a_{j-1}. Read as 0 instead, positions a load once drafted too few of would never be
    chosen again (a planner that settled on 3 drafted 3 for good: their outcomes never come in)."""
    out = np.asarray(mean, dtype=np.float64).copy()
    known = np.asarray(counts) >= min_count
    if not known[0]:
        return np.where(known, out, 0.0)
    last = int(np.nonzero(~known)[0][0]) if not known.all() else len(out)
    if last == len(out):
        return out
    ratio = out[last - 1] / out[last - 2] if last >= 2 and out[last - 2] > 0 else out[last - 1]
    ratio = min(max(float(ratio), 0.0), 1.0)
    for j in range(last, len(out)):
        out[j] = out[j - 1] * ratio
    return out


class StepCost:
    """T(B): seconds for a step that runs B tokens. A profile over a grid of B (measured at start-up)
    times a correction per grid point, an exponential average of live time / profiled time near it.
    A grid point no live step has come near takes its nearest observed neighbours' correction: what
    made the steps that ran slower than profiled (longer contexts than the profile's, a loaded
    machine) applies to the larger steps drafting would make too. (Left at 1 there, drafting looked
    cheaper the longer the engine ran: at 48 rows the decode steps' correction reached 1.87 while
    the 240-token step of drafting for every row stayed at its profile.) Not to smaller ones in full:
    below the smallest size observed the correction falls, in log scale, to 1 at the grid's first point
    (a single token: its step reads the weights, whatever the contexts; 8 rows' 1.7x, their contexts'
    attention, made a 1-row step 2.5 ms against a real 1.5). A point's first observation is its own."""

    def __init__(self, tokens: list[int], seconds: list[float], alpha: float = 0.05):
        order = np.argsort(tokens)
        self.x = np.asarray(tokens, dtype=np.float64)[order]
        # a step never gets cheaper with more tokens: the lower envelope from the right (timing noise
        # only ever adds time)
        self.y = np.minimum.accumulate(np.asarray(seconds, dtype=np.float64)[order][::-1])[::-1]
        self.correction = np.ones_like(self.x)
        self.seen = np.zeros(len(self.x), dtype=bool)  # grid points a live step was observed near
        self.alpha = alpha
        self._xs, self._ys = self.x.tolist(), self.y.tolist()

    def _profile(self, B):
        B = np.asarray(B, dtype=np.float64)
        y = np.interp(B, self.x, self.y)
        if len(self.x) > 1:  # beyond the grid: the last segment's slope
            slope = (self.y[-1] - self.y[-2]) / max(self.x[-1] - self.x[-2], 1.0)
            y = np.where(B > self.x[-1], self.y[-1] + slope * (B - self.x[-1]), y)
        return y

    def __call__(self, B) -> np.ndarray:
        seen = self.seen
        if not seen.any():
            return self._profile(B)
        B = np.asarray(B, dtype=np.float64)
        xs, cs = self.x[seen], self.correction[seen]
        correction = np.interp(B, xs, cs)
        if xs[0] > self.x[0]:  # below the smallest size observed: toward 1 at the first grid point (see above)
            share = np.log(np.maximum(B, self.x[0]) / self.x[0]) / np.log(xs[0] / self.x[0])
            correction = np.where(B < xs[0], 1.0 + (cs[0] - 1.0) * share, correction)
        return self._profile(B) * correction

    def at_load_of(self, B, ref: int) -> np.ndarray:
        """T(B) with the correction at `ref` tokens (a plain step's) for every size: the profile's shape at
        this load's live speed. For decisions about steps no live step has run near: their own correction
        is only interpolated, between points (a short-context prompt step, long-context decode steps) that
        need not say anything about them."""
        seen = self.seen if self.seen.any() else np.ones_like(self.seen)
        return self._profile(B) * float(np.interp(float(ref), self.x[seen], self.correction[seen]))

    def observe(self, num_tokens: int, seconds: float) -> None:
        # scalar code: this runs every step
        xs, ys = self._xs, self._ys
        i = bisect.bisect_left(xs, num_tokens)
        if i == len(xs) or (i > 0 and math.log(num_tokens / xs[i - 1]) < math.log(xs[i] / num_tokens)):
            i -= 1  # the nearest grid point in log scale
        j = min(max(bisect.bisect_left(xs, num_tokens), 1), len(xs) - 1)  # the profile's segment (or the last)
        if len(xs) == 1:
            profiled = ys[0]
        else:
            x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
            profiled = y0 + (y1 - y0) * (max(num_tokens, x0) - x0) / max(x1 - x0, 1.0)
        ratio = min(seconds / max(profiled, 1e-9), 10.0)
        if not self.seen[i]:  # its first observation is its own (the neighbours' correction it stood in with
            # was measured at other row counts: 8 rows' 1.7x, their contexts' attention, made 1 row's 2.5 ms)
            self.correction[i], self.seen[i] = ratio, True
        self.correction[i] += self.alpha * (ratio - self.correction[i])

    def table(self) -> dict:
        return {"tokens": self.x.astype(int).tolist(), "profiled_s": self.y.tolist(),
                "live_s": self(self.x).tolist()}


def draft_forwards(method: str, k: int, passes: int = 1) -> int:
    """Drafter forwards per proposal of k tokens: DSpark runs its backbone once for the block (the
    Markov head's k steps are cheap), or twice from 2 tokens with `passes` 2 (its draft_passes); a draft
    model runs k forwards; n-gram lookup none worth a model."""
    return k if method == "draft_model" else min(k, passes)


class DraftCost:
    """Seconds per drafter forward against the number of rows drafted: the median of the latest
    `window` calls per power of 2 of rows (a slow call, e.g. a DSpark drafter computing a backlog of
    context rows after a pause, does not move it). Below the counts measured, proportional to the
    rows (optimistic: drafting is tried there, then measured). Above them, with `shape` (the
    target's step cost T(tokens)), as the target's step grows from the tokens measured to the tokens
    asked (a forward's cost grows with its tokens the same way whatever the model's size on one
    device: flat while the weights' reads bind, linear once the FLOPs do), `tokens_per_row` tokens a
    row; without it, proportional to the rows. (In proportion alone, a GPU drafter measured on the
    exploration's 4 rows at ~1 ms looked like ~40 ms at 128 rows, and drafting stopped where it paid:
    BENCHMARKS.md "Topology simulator".)"""

    def __init__(self, window: int = 9, shape=None, tokens_per_row: int = 1):
        self.samples: dict[int, deque] = {}
        self.per_forward: dict[int, float] = {}
        self.window = window
        self.shape, self.tokens_per_row = shape, tokens_per_row

    def observe(self, num_rows: int, forwards: int, seconds: float) -> None:
        if num_rows <= 0 or forwards <= 0:
            return
        b = row_bucket(num_rows)
        q = self.samples.setdefault(b, deque(maxlen=self.window))
        q.append(seconds / forwards)
        self.per_forward[b] = statistics.median(q)

    def __call__(self, num_rows: int, forwards: int) -> float:
        return forwards * self.per_forward_s(num_rows) if forwards > 0 else 0.0

    def per_forward_s(self, num_rows: int) -> float:
        if not self.per_forward or num_rows <= 0:
            return 0.0  # not measured yet: drafting is tried, then measured
        xs = sorted(self.per_forward)
        x = math.log2(num_rows)
        per = float(np.interp(x, xs, [self.per_forward[b] for b in xs]))
        if x < xs[0]:
            per *= num_rows / 2 ** xs[0]
        elif x > xs[-1]:
            measured = 2 ** xs[-1]
            if self.shape is None:
                per *= num_rows / measured
            else:
                t = self.tokens_per_row
                per *= float(self.shape(num_rows * t)) / max(float(self.shape(measured * t)), 1e-12)
        return per


class VerifyPlanner:
    """The scheduler's state for `speculative.schedule: confidence`: a rolling window of verify
    outcomes, the confidence calibration fitted on it (refitted every `refit_every` rounds), the step
    and drafter cost models, and the choices per step.

    calibration: the method in force (a name of `confidence.CALIBRATIONS`; "isotonic_drift", isotonic's map
    with an offset a position that follows the stream, measured best on live rounds, BENCHMARKS.md "Calibration
    that follows the stream (session 22)"). compare: methods fitted on the same windows (at most every
    compare_refit_every rounds) and scored on the same live rounds beside it, never used to choose. window:
    4000 rounds for the map's shape (2000 left position 5 at 2.2-2.6% ECE; 3000-6000 read 1.5-1.7% there on
    prompts the window did not hold, BENCHMARKS.md session 16); refitted every refit_every rounds (250: 500
    lagged the stream's drift), with the cheap update of a method that has one (the drift offsets, on the
    latest `confidence.DRIFT_ROUNDS`) every refresh_every.

    sequence_prior: each sequence's own offset in logit space, learned from its finished rounds
    (`sequence_offsets`), moves its raw survival before the methods map it, and the window keeps the rounds as moved,
    so the maps are fitted on what they are applied to (calibrated by construction) and the offsets add what
    the confidences miss: how hard this text is (a stream's level moved +-4 points over ~1,500 rounds, which a
    window's map and its drift offsets follow late; within a request it holds). The offset's Gaussian prior has
    precision sequence_prior (10: of 5-60 on two live recordings, the lowest ECE at two passes and within 0.3 of the
    lowest at one, a Brier score within 0.4% of the best; BENCHMARKS.md session 35); None: off. It
    reads only finished rounds, so the choice of what to verify never reads a draft's tokens (lossless), and a'_j
    stays non-decreasing in c_j and non-increasing along j."""

    def __init__(self, k: int, step_cost: StepCost, method: str, window: int = 4000, refit_every: int = 250,
                 min_rounds: int = 50, explore_every: int = 256, explore_rows: int = 4,
                 calibration: str = "isotonic_drift", compare: tuple = ("sts",),
                 prior_acceptance: Optional[float] = 0.8, draft_passes: int = 1, refresh_every: int = 100,
                 compare_refit_every: int = 500, sequence_prior: Optional[float] = 10.0):
        self.k, self.step_cost, self.method, self.draft_passes = k, step_cost, method, draft_passes
        # seq_id -> [its offset, the sum of p(1 - p) over its scored positions] (`sequence_offsets`); dropped when it
        # finishes (`forget`)
        self.sequence_prior = sequence_prior
        self._seq: dict[int, list] = {}
        # the latest sequences forgotten: a round of one still in flight when it finished (async scheduling, an abort)
        # comes back after its `forget` and must not learn it an offset again
        self._forgotten: dict[int, None] = {}
        self._set_methods(calibration, compare)
        # a DSpark forward runs a block of k + 1 positions a row; a draft model's, one token a row
        self.draft_cost = DraftCost(shape=step_cost._profile, tokens_per_row=k + 1 if method == "dspark" else 1)
        # (raw confidences [K] NaN-padded, moved by the round's sequence offset; verified; accepted; that offset)
        self.window = deque(maxlen=window)
        # (raw a [K], calibrated a [M, K] by each of self.methods as predicted then, verified, accepted)
        self.live = deque(maxlen=20 * window)
        self.fitted = False
        self.refit_every, self.min_rounds, self.explore_every = refit_every, min_rounds, explore_every
        # a method with a cheap update (confidence.REFRESHES) takes it every refresh_every rounds between refits
        self.refresh_every, self._since_refresh = refresh_every, 0
        self.compare_refit_every, self._since_compare = compare_refit_every, 0
        self.min_position_rounds = 20  # a position drafted fewer times in the window is extrapolated
        # drafting must promise this much more throughput than plain decoding: the costs are measured, but a
        # drafting step also pays what they leave out (verification, bookkeeping), and a loss at load is
        # what the schedule must not make (measured: a predicted +2% at batch 8 was a real -23% on this CPU)
        self.draft_margin = 0.1
        # plain steps are learned from the plain_warm-th of a run on: after drafting steps the caches hold the
        # drafter's weights (at batch 1 on this CPU a run of plain steps went 2.4, 2.3, 2.0, ... 1.7 ms, against
        # 1.5-1.7 in an engine that never drafts)
        self.plain_warm = 8
        self._plain_run = 0
        # with async scheduling a plain step is scheduled while the one before runs, so the host's work per
        # step (scheduling, building, processing: on Ray the Router's) is hidden; a drafting step cannot be
        # (its drafts come from the step before): it pays that time. Measured on the steps that waited for it
        self.hidden_host_s = 0.0
        # a drafting step's live time over what step_cost predicted for it, by power of 2 of rows: what a
        # drafting step pays beyond a plain step of its tokens (through Ray a 56-token step at 8 rows profiled
        # 6.0 ms took 7.6-9.5 ms; step_cost's alpha believed it after ~20 steps, and the planner drafted at a
        # loss for 47). A short-term word on top of step_cost, which learns the same steps slowly: the median
        # of the latest ratios (at most 9, of the last ratio_horizon steps) and two of 1, so a consistent excess
        # stops drafting after 2-3 steps and a single slow step never does; expired, it leaves the decision to
        # step_cost again (kept, a burst of slow steps stopped drafting for good at batch 1, where it paid)
        self.drafting_ratio: dict[int, deque] = {}  # rows' power of 2 -> (step, ratio)
        self.ratio_horizon = 256
        # what steps delivered: tokens committed per second of the engine's step period (from the last step's end
        # to this one's: its drafter call, unhidden host time and all), drafting and plain, by rows' power of 2.
        # Where drafting's recent steps delivered clearly less than plain decoding's at those rows, it stops there
        # until they age out (ratio_horizon steps): the cost model's prediction, however it errs, is checked
        # against the outcome (through Ray a fresh engine that learned at 8 rows believed drafting paid there by
        # the model, and drafted at 0.53-0.63x of plain decoding, BENCHMARKS.md session 22)
        self.delivered: dict[int, dict[bool, deque]] = {}  # rows' power of 2 -> drafting? -> (step, rows, tokens, s)
        self._deliveries = 0  # steps observe_delivery saw (every step: its clock)
        self._steps_seen = 0
        # before any outcome: a good drafter's acceptance at each position given the one before (DSpark's and
        # EAGLE's first positions read 0.7-0.8): the gate asks whether learning could pay off at this load, and
        # a poorer drafter is found out by its outcomes (at 0.7 the gate closed at batch 1 in process, where
        # tiny-dspark pays, whenever the start-up profile read the drafter a little slow); None: learn first
        # at any load (speculative.prior_acceptance)
        self.prior_acceptance = prior_acceptance
        # a step that drafts only to keep the estimates fresh drafts for this many rows
        self.explore_rows = explore_rows
        self.exploring = False
        self._learning = False  # exploring because nothing is known yet (not paced)
        # exploring costs at most this share of the time spent not drafting (its backlog, a draft model's
        # catch-up over every token since it last drafted, is not in the figure: hence so small a share)
        self.explore_share = 0.002
        self._explore_s = 0.0  # what the last exploring step cost
        self._last_draft_t = 0.0
        self.clock = time.monotonic  # the exploration's pacing clock (the simulator gives its virtual one)
        self._memo: dict[int, tuple[int, int]] = {}  # rows -> (draft length, uses left)
        self._prior_memo: dict[int, tuple[int, int]] = {}  # the same, at the prior survival (no outcomes yet)
        self.memo_steps = 8
        self.mean_survival: Optional[np.ndarray] = None  # [K] calibrated, over the window
        self._since_fit = 0
        self._since_draft = 0
        self.num_refits = 0
        self._rates = np.full(k, 0.5)  # acceptance rate by position given the one before (n-gram confidences)
        self._report: dict = {}  # the calibration figures on live rounds, recomputed at most every 10 s
        self._report_t = -math.inf

    # ---- confidences ----------------------------------------------------------------------
    def raw_confidences(self, proposals) -> np.ndarray:
        """Proposals' confidences as [N, K] (NaN past each one's tokens); a drafter without any (n-gram)
        gets the window's acceptance rate of each position given the one before survived."""
        out = np.full((len(proposals), self.k), np.nan)
        for i, p in enumerate(proposals):
            n = len(p.tokens)
            # float(): a drafter running in bf16 gives bf16 confidences, which numpy has no type for
            out[i, :n] = self._rates[:n] if p.confidences is None else p.confidences[:n].float().numpy()
        return np.clip(out, 1e-4, 1 - 1e-4)

    def _position_rates(self, ver: np.ndarray, acc: np.ndarray) -> np.ndarray:
        j = np.arange(self.k)[None, :]
        tried = ((j < ver[:, None]) & (j <= acc[:, None])).sum(0)  # verified, and all before it accepted
        kept = (j < acc[:, None]).sum(0)
        return (kept + 1.0) / (tried + 2.0)

    def _arrays(self, last: Optional[int] = None):
        """The window's rounds (or its latest `last`) as (conf [R, K], verified [R], accepted [R], offsets [R])."""
        start = 0 if last is None else max(0, len(self.window) - last)
        rows = list(itertools.islice(self.window, start, None))
        return tuple(np.array([w[i] for w in rows]) for i in range(4))

    def _fit_confidences(self, conf: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """What a fit reads as confidences: an n-gram drafter's are the window's acceptance rates now (what its
        next rounds' raw confidences are), each round's moved by its sequence's offset as then; the others' their
        own as kept (moved already)."""
        if self.method != "ngram":
            return conf
        return self._shifted(np.where(np.isnan(conf), np.nan, self._rates[None, :]), offsets)

    def _set_methods(self, calibration: str, compare) -> None:
        for m in (calibration, *compare):
            if m not in CALIBRATIONS:
                raise ValueError(f"calibration method must be one of {sorted(CALIBRATIONS)}, not {m!r}")
        self.calibration = calibration
        self.methods = (calibration, *[m for m in dict.fromkeys(compare) if m != calibration])  # [0]: in force
        self.params = {m: identity_params(m, self.k) for m in self.methods}

    def reset_calibration(self, calibration: Optional[str] = None, compare: Optional[tuple] = None) -> None:
        """Forget the window, the live record and every fit (a fresh start for a measurement), and
        optionally change the method in force and the compared ones."""
        self._set_methods(calibration or self.calibration, self.methods[1:] if compare is None else compare)
        self.window.clear(), self.live.clear(), self._seq.clear(), self._forgotten.clear()
        self.fitted, self.num_refits, self._since_fit, self._report_t = False, 0, 0, -math.inf

    @property
    def temps(self) -> np.ndarray:
        """STS temperatures [K] (ones when STS is not fitted here): the figure reports have shown."""
        return self.params["sts"] if "sts" in self.params else np.ones(self.k)

    def calibrated_survival(self, raw: np.ndarray, method: Optional[str] = None, offsets=None) -> np.ndarray:
        """raw confidences [..., K] -> calibrated survival [..., K] (by the method in force unless named); with
        offsets [N] (raw [N, K]; `sequence_offsets` of the rows' sequences), each row's raw survival moved by its
        offset first (`_shifted`)."""
        m = method or self.calibration
        return survival(apply_calibration(m, self._shifted(raw, offsets), self.params[m]))

    def _shifted(self, raw: np.ndarray, offsets) -> np.ndarray:
        """raw [N, K], offsets [N] -> the confidences whose product is each row's raw survival moved by its offset in
        logit space (what the methods are fitted on and applied to; NaN stays NaN). An n-gram drafter's raw
        confidences are the same for every row (the window's acceptance rates): the offset is all a row has of
        its own, the sequence's record (a text that repeats itself keeps its lookups right)."""
        if offsets is None or not self.sequence_prior:
            return raw
        d = np.asarray(offsets, dtype=np.float64)
        if not d.any():
            return raw
        a = survival(np.clip(raw, 1e-9, 1 - 1e-9))
        a = 1 / (1 + np.exp(-(np.log(a / (1 - a)) + d[:, None])))
        prev = np.concatenate([np.ones_like(a[:, :1]), a[:, :-1]], axis=1)
        return a / prev

    def sequence_offsets(self, seq_ids) -> np.ndarray:
        """[N] each sequence's offset in logit space (0 before it has one): after each of its rounds it moves by
        sum(y - p) / (W + sequence_prior), y the positions' outcomes, p the survival predicted for them, W the
        sum of p(1 - p) over the sequence's positions so far (an online Newton step of a logistic offset with a
        Gaussian prior), within +-3."""
        return np.array([self._seq.get(sid, (0.0,))[0] for sid in seq_ids], dtype=np.float64)

    def forget(self, seq_ids) -> None:
        """Finished sequences: their offsets go (and a round of theirs that comes back later learns nothing)."""
        for sid in seq_ids:
            self._seq.pop(sid, None)
            self._forgotten[sid] = None
        while len(self._forgotten) > 4096:
            self._forgotten.pop(next(iter(self._forgotten)))

    # ---- choices ---------------------------------------------------------------------------
    def draft_len(self, num_rows: int) -> int:
        """How many positions to draft this step for num_rows speculative decode rows (0: none)."""
        self.exploring = self._learning = False
        if num_rows <= 0:
            return 0
        if self.mean_survival is None:
            # no outcomes yet: learn on a few rows (`explore_rows`, as the exploration below), never on
            # every row of a loaded step before anything says that drafting pays at that load; and once the
            # drafter's cost is known (measured at start-up, or 3 live calls: the first computes whole prompts'
            # context, a median of 3 leaves it out), only at a load where a drafter of a typical survival
            # (`prior_acceptance` a position) would pay; elsewhere the paced exploration learns (the gate
            # is a guess too: a start-up profile taken on a loaded machine reads the drafter slow)
            measured = sum(len(q) for q in self.draft_cost.samples.values())
            k = self._prior_k(num_rows) if self.prior_acceptance is not None and measured >= 3 else self.k
            if k and self.prior_acceptance is not None and self.delivery_vetoes(num_rows):
                k = 0  # learning here delivered less than plain decoding (prior_acceptance None: learn at any load)
            if k == 0:
                if self._explore_due():
                    self.exploring = True
                    return self.k
                self._since_draft += 1
                return 0
            # (learning is not paced as the exploration is; it drafts the length the prior chose: a draft
            # model's k forwards at the full k cost 2x at batch 1 for its 50 outcomes, where the prior drafts 1)
            self.exploring = self._learning = True
            return k
        if self._explore_due():
            self.exploring = True  # time to look again, on a few rows (at most explore_share of the time)
            return self.k
        k = self._memoised(self._memo, num_rows, self.mean_survival)
        if k and self.delivery_vetoes(num_rows):
            k = 0
        self._since_draft += k == 0
        return k

    def observe_delivery(self, num_rows: int, tokens: int, seconds: float, drafting: bool) -> None:
        """A step's delivery: the tokens it committed for num_rows rows in `seconds` of the engine's step period."""
        self._deliveries += 1
        if num_rows <= 0 or seconds <= 0:
            return
        by_kind = self.delivered.get(row_bucket(num_rows))
        if by_kind is None:  # drafting: enough steps for VETO_ROUNDS rows at 1 row a step
            by_kind = self.delivered[row_bucket(num_rows)] = {True: deque(maxlen=VETO_ROUNDS), False: deque(maxlen=9)}
        by_kind[bool(drafting)].append((self._deliveries, num_rows, tokens, seconds))

    def delivery_vetoes(self, num_rows: int) -> bool:
        """Whether drafting delivered less than plain decoding at this many rows (their power of 2) lately: the
        drafting steps of the last ratio_horizon steps, once they hold VETO_ROUNDS rows in all, delivered fewer
        tokens per second (their tokens over their seconds) than 0.9 x the plain steps' median there (at least 3
        of them), or, without those, than num_rows / step_cost(num_rows). (Evidence in rows, not steps: a
        step's tokens vary with its rows' acceptance, from 1 to k + 1 a row, so one row's steps need many to
        say anything, 8 rows' a few. Counted in steps, 4 drafting steps at batch 1 that met a hard stretch of
        text, 1-3 tokens each, stopped drafting in process for the next 256 steps where it paid 1.7x.)"""
        got = self.delivered.get(row_bucket(num_rows))
        if got is None:
            return False
        since = self._deliveries - self.ratio_horizon
        draft = [x for x in got[True] if x[0] > since]
        if sum(x[1] for x in draft) < VETO_ROUNDS:
            return False
        plain = [x[2] / x[3] for x in got[False] if x[0] > since]
        ref = statistics.median(plain) if len(plain) >= 3 else num_rows / max(float(self.step_cost(num_rows)), 1e-9)
        return sum(x[2] for x in draft) / sum(x[3] for x in draft) < 0.9 * ref

    def _explore_due(self) -> bool:
        """explore_every steps without drafting, and the last exploring step's cost at most explore_share of
        the time since."""
        return (self._since_draft >= self.explore_every
                and self.clock() - self._last_draft_t >= self._explore_s / self.explore_share)

    def _prior_k(self, num_rows: int) -> int:
        """_best_k at the prior survival (no outcomes yet), every step size at the plain step's correction (no
        drafting step has run: interpolated corrections drift with the contexts, and reopened the gate mid-run);
        0 where it is 0 at half the rows (drafting pays less the more rows a step holds: a gate open at 16 rows
        but shut at 8 reads a bump in the start-up profile, through Ray 1.31x at 16 rows against 1.04x at 8)."""
        k = self._memoised(self._prior_memo, num_rows, None, at_load=True)
        return k if k == 0 or num_rows <= 1 or self._prior_k(num_rows // 2) else 0

    def _memoised(self, memo: dict, num_rows: int, mean_survival: Optional[np.ndarray], at_load: bool = False) -> int:
        """_best_k, reused for memo_steps steps of the same load (it runs every step, and the estimates
        move slowly; a refit clears the learned memo, a new drafter cost measurement the prior's)."""
        got = memo.get(num_rows)
        if got is not None and got[1] > 0:
            memo[num_rows] = (got[0], got[1] - 1)
            return got[0]
        if mean_survival is None:  # the prior's (made here, on a miss: this runs every step)
            mean_survival = self._prior_survival()
        k = self._best_k(num_rows, mean_survival, at_load)
        memo[num_rows] = (k, self.memo_steps)
        return k

    def _best_k(self, num_rows: int, mean_survival: np.ndarray, at_load: bool = False) -> int:
        """The draft length that maximises the expected tokens per second at this load, given the mean
        survival by position [K]; 0 unless it beats plain decoding by the margin. at_load: every step size
        at the plain step's correction (StepCost.at_load_of)."""
        theta = self._theta(num_rows, mean_survival, at_load)
        k = int(np.argmax(theta))
        if k and theta[k] < theta[0] * (1 + self.draft_margin):  # a gain inside the model's error is a risk
            k = 0
        return k

    def _prior_survival(self) -> np.ndarray:
        """Survival by position [K] of a drafter accepted at prior_acceptance a position."""
        return self.prior_acceptance ** np.arange(1, self.k + 1)

    def prior_gain(self, num_rows: int) -> float:
        """The gain over plain decoding the prior gate predicts at this load (best k's tokens/s over plain's)."""
        theta = self._theta(num_rows, self._prior_survival(), at_load=True)
        return float(theta.max() / theta[0])

    def _theta(self, num_rows: int, mean_survival: np.ndarray, at_load: bool) -> np.ndarray:
        """Expected tokens per second [K + 1] with 0 .. K drafts a row (_best_k's arguments)."""
        a = np.concatenate([[0.0], np.cumsum(mean_survival)])  # expected accepted per row with k drafts
        ks = np.arange(self.k + 1)
        forwards = np.array([draft_forwards(self.method, int(k), self.draft_passes) for k in ks])
        sizes = num_rows * (1 + ks)
        if at_load:
            steps = self.step_cost.at_load_of(sizes, num_rows)
        else:  # (not the prior gate: it asks whether a good drafter could pay from the start-up profile; the
            # learning steps' own ratio, two or three cold steps, closed it at batch 1 where drafting paid)
            steps = self.step_cost(sizes)
            steps[1:] *= self._drafting_ratio(num_rows)
        cost = steps + forwards * self.draft_cost.per_forward_s(num_rows)
        cost[1:] += self.hidden_host_s  # a plain step hides the host's work (async scheduling); a drafting one waits
        return num_rows * (1 + a) / cost

    def verify_lengths(self, raw: np.ndarray, base_tokens: int, base_expected: float, draft_s: float,
                       offsets=None) -> np.ndarray:
        """raw [N, K] confidences of this step's drafts (offsets [N]: their sequences' `sequence_offsets`, which
        `observe` is given back with the rounds' outcomes) -> draft positions to verify per row [N]."""
        a = self.calibrated_survival(raw, offsets=offsets)
        return choose_verify_lengths(a, base_tokens, base_expected, self.step_cost, draft_s)

    # ---- observations ----------------------------------------------------------------------
    def observe_step(self, num_tokens: int, seconds: float, num_rows: int = 0, drafting: bool = False) -> None:
        """A live step's time. step_cost learns a plain decode step's (num_rows rows of one token; the
        start-up profile's shape); a drafting step's goes to the ratio of its time to step_cost's
        prediction, and if that moves the drafting cost by more than 5% the learned choices are made
        again now, not after their memo_steps. (Learned by step_cost too, the drafting steps' excess
        - the export, 7 rows of logits, verification: 1.7x their profile at batch 1 in process - reached
        the plain step's estimate through its neighbours' correction, as did prefill chunks', and a plain
        step read 2.1-2.5 ms against a real 1.5-1.7: DSpark drafted at batch 1 at 0.73-0.77x of plain
        decoding, BENCHMARKS.md session 17.)
        What drafting is compared with is a run of plain steps: the first plain_warm of a run are not
        learned either."""
        self._steps_seen += 1
        if drafting and num_rows > 0:
            ratio = min(max(seconds / max(float(self.step_cost(num_tokens)), 1e-9), 0.5), 3.0)
            before = self._drafting_ratio(num_rows)
            q = self.drafting_ratio.setdefault(row_bucket(num_rows), deque(maxlen=9))
            q.append((self._steps_seen, ratio))
            if abs(self._drafting_ratio(num_rows) - before) > 0.05 * before:
                self._memo.clear()
        self._plain_run = 0 if drafting else self._plain_run + 1
        if self._plain_run >= self.plain_warm and (num_rows == 0 or num_tokens <= num_rows):
            self.step_cost.observe(num_tokens, seconds)

    def _drafting_ratio(self, num_rows: int) -> float:
        """drafting_ratio at this many rows: at the nearest power of 2 with ratios of the last ratio_horizon
        steps, their median beside two of 1; 1 where there are none."""
        since = self._steps_seen - self.ratio_horizon
        live = {b: [r for t, r in q if t > since] for b, q in self.drafting_ratio.items()}
        live = {b: rs for b, rs in live.items() if rs}
        if not live:
            return 1.0
        x = math.log2(max(num_rows, 1))
        return statistics.median([1.0, 1.0] + live[min(live, key=lambda b: abs(b - x))])

    def observe_host(self, seconds: float, alpha: float = 0.05) -> None:
        """The host's time in a step that did not overlap the workers' (async scheduling on): what a plain
        step would have hidden."""
        self.hidden_host_s += alpha * (max(seconds, 0.0) - self.hidden_host_s)

    def drafted(self, num_rows: int, k: int, seconds: float) -> None:
        forwards = draft_forwards(self.method, k, self.draft_passes)
        exploring = self.exploring and not self._learning
        if exploring:  # its cost, against the time until the next one
            self._explore_s = seconds + float(self.step_cost(num_rows * (1 + k)) - self.step_cost(num_rows))
        # an exploring call catches up on every token since drafting stopped: an upper bound of what drafting
        # costs, taken only where it is under half what is believed (a start-up profile read on a busy
        # machine). Taken always, the exploration's calls, one in thousands of steps, became the drafter's
        # median cost after 9 of them, and drafting looked dearer the longer it had stopped
        believed = forwards * self.draft_cost.per_forward_s(num_rows)
        if not exploring or not believed or seconds < 0.5 * believed:
            self._prior_memo.clear()  # the drafter's cost measured again: the prior gate decides afresh
            self.draft_cost.observe(num_rows, forwards, seconds)
        self._since_draft = 0
        self._last_draft_t = self.clock()

    def observe(self, raw: np.ndarray, verified, accepted, seq_ids=None, offsets=None) -> None:
        """A step's verify outcomes: raw confidences [N, K] of all drafted positions (NaN past them),
        the positions verified [N] and how many of them were accepted [N], of sequences seq_ids [N] (None: no
        sequence offsets; one forgotten meanwhile learns nothing), with the offsets their verify lengths were
        chosen with (None: their offsets now; with async scheduling a sequence's next round may have been chosen,
        and its offset moved, before this one's outcome came)."""
        verified, accepted = np.asarray(verified), np.asarray(accepted)
        if offsets is None and seq_ids is not None:
            offsets = self.sequence_offsets(seq_ids)
        # (raw where there are no offsets; the window keeps it with the offset: an n-gram fit moves the current rates)
        shifted = self._shifted(raw, offsets)
        if self.fitted:  # scored now with the fits in force (made on earlier rounds), every method on the same rounds
            a_raw = survival(raw)
            a_cal = np.stack([survival(apply_calibration(m, shifted, self.params[m])) for m in self.methods], axis=1)
            self.live.extend((a_raw[i], a_cal[i], int(verified[i]), int(accepted[i]))
                             for i in np.nonzero(verified)[0].tolist())
            if seq_ids is not None and self.sequence_prior:
                self._observe_sequences(a_cal[:, 0], verified, accepted, seq_ids)
        d = np.zeros(len(raw)) if offsets is None else np.asarray(offsets, dtype=np.float64)
        self.window.extend(zip(shifted, verified.tolist(), accepted.tolist(), d.tolist()))
        self._since_fit += len(raw)
        self._since_refresh += len(raw)
        self._since_compare += len(raw)
        if (self._since_fit >= self.refit_every or not self.fitted) and len(self.window) >= self.min_rounds:
            self.refit()  # the first fit as soon as there is enough, then every refit_every rounds
        elif self.fitted and self._since_refresh >= self.refresh_every:
            self.refresh()

    def _observe_sequences(self, a: np.ndarray, verified, accepted, seq_ids) -> None:
        """Each sequence's offset (`sequence_offsets`) after this round: a [N, K] the survival the method in force
        predicted for it."""
        j = np.arange(self.k)[None, :]
        scored = (j < verified[:, None]) & ~np.isnan(a)
        p = np.where(scored, a, 0.0)
        resid = (np.where(scored & (j < accepted[:, None]), 1.0, 0.0) - p).sum(1)
        weight = (p * (1 - p)).sum(1)
        for sid, r, w, n in zip(seq_ids, resid.tolist(), weight.tolist(), scored.sum(1).tolist()):
            if n and sid not in self._forgotten:
                st = self._seq.setdefault(sid, [0.0, 0.0])  # [offset, W]
                st[1] += w
                st[0] = min(max(st[0] + r / (st[1] + self.sequence_prior), -3.0), 3.0)
        while len(self._seq) > 65536:  # (a sequence never forgotten: the oldest go)
            self._seq.pop(next(iter(self._seq)))

    def refresh(self) -> None:
        """The cheap update of the methods that have one, on the latest DRIFT_ROUNDS rounds of the window."""
        self._since_refresh = 0
        methods = [m for m in self.methods if m in REFRESHES]
        if not methods:
            return
        conf, ver, acc, d = self._arrays(DRIFT_ROUNDS)
        conf = self._fit_confidences(conf, d)
        for m in methods:  # (the draft length's mean survival stays the refit's: it reads the whole window)
            self.params[m] = REFRESHES[m](self.params[m], conf, ver, acc)

    def drafter_changed(self) -> None:
        """Another drafter version serves: its confidences are calibrated afresh from its own rounds
        (the fits in force stay until then)."""
        self.window.clear()
        self._seq.clear()
        self.fitted = False
        self._since_fit = 0
        self._memo.clear()

    def refit(self) -> None:
        conf, ver, acc, d = self._arrays()
        self._rates = self._position_rates(ver, acc)
        conf = self._fit_confidences(conf, d)
        # the compared methods (reports only) at most every compare_refit_every rounds: STS's grid is most of a
        # refit's time (~14 of ~21 ms at 4000 rounds), and a refit holds up the step loop it runs in
        compare = not self.fitted or self._since_compare >= self.compare_refit_every
        for m in self.methods if compare else self.methods[:1]:
            self.params[m] = fit_calibration(m, conf, ver, acc)
        self._since_compare = 0 if compare else self._since_compare
        self.fitted = True
        a = self.calibrated_survival(conf)
        drafted = ~np.isnan(a)  # the mean where drafted: shorter drafts (room, load) say nothing of later positions
        mean = np.nan_to_num(a, nan=0.0).sum(0) / np.maximum(drafted.sum(0), 1)
        self.mean_survival = extrapolate_survival(mean, drafted.sum(0), self.min_position_rounds)
        self._since_fit = self._since_refresh = 0
        self.num_refits += 1
        self._memo.clear()

    def summary(self) -> dict:
        out = {"calibration_method": self.calibration, "sequence_prior": self.sequence_prior,
               "sequences_with_offsets": len(self._seq),
               "calibration_params": describe_params(self.calibration, self.params[self.calibration]),
               "compared_methods": list(self.methods[1:]),
               "temperatures": self.temps.round(3).tolist(), "refits": self.num_refits,
               "window_rounds": len(self.window), "live_rounds": len(self.live),
               "mean_survival": None if self.mean_survival is None else self.mean_survival.round(4).tolist(),
               "step_cost": self.step_cost.table(),
               "drafting_step_ratio": {2 ** b: round(self._drafting_ratio(2 ** b), 3) for b in self.drafting_ratio},
               # what it believes a drafter forward costs by rows, and the host time a drafting step pays
               "draft_forward_ms": {n: round(1e3 * self.draft_cost.per_forward_s(n), 3) for n in (1, 8, 32, 64)}
               if self.draft_cost.samples else {},
               "hidden_host_ms": round(1e3 * self.hidden_host_s, 3),
               # the prior gate's predicted gain by rows (it opens where this beats 1 + the margin, here and at
               # every power of 2 below)
               "prior_gain": {n: round(self.prior_gain(n), 3) for n in (1, 2, 4, 8, 16)}
               if self.prior_acceptance is not None and self.draft_cost.samples else {}}
        if time.monotonic() - self._report_t > 10.0:  # /health and /metrics ask often: not every time
            self._report, self._report_t = self.calibration_report(), time.monotonic()
        return {**out, **self._report}

    def calibration_report(self, floors: bool = False) -> dict:
        """ECE by position of the live rounds, each scored with the fits in force when it ran: raw
        (before), the method in force (after), and the sampling noise floor at this many rounds; the
        ECE and the Brier score of every compared method on the same rounds (floors: their noise
        floors too, a few hundred ms at 40,000 rounds)."""
        live = list(self.live)  # a snapshot (the engine thread appends)
        if not live:
            return {}
        a_raw = np.array([x[0] for x in live])
        a_cal = np.array([x[1] for x in live])  # [n, M, K]
        ver = np.array([x[2] for x in live])
        acc = np.array([x[3] for x in live])
        r4 = lambda xs: [round(x, 4) for x in xs]  # noqa: E731
        ece = {m: r4(ece_by_position(a_cal[:, i], ver, acc)) for i, m in enumerate(self.methods)}
        return {"ece_before_by_position": r4(ece_by_position(a_raw, ver, acc)),
                "ece_after_by_position": ece[self.calibration],
                "ece_floor_by_position": r4(ece_by_position(a_cal[:, 0], ver, acc, floor=True)),
                "rounds_by_position": [int((ver > j).sum()) for j in range(self.k)],
                "ece_by_method": ece,
                **({"ece_floor_by_method": {m: r4(ece_by_position(a_cal[:, i], ver, acc, floor=True))
                                            for i, m in enumerate(self.methods)}} if floors else {}),
                "brier_by_method": {"raw": r4(brier_by_position(a_raw, ver, acc)),
                                    **{m: r4(brier_by_position(a_cal[:, i], ver, acc))
                                       for i, m in enumerate(self.methods)}}}
