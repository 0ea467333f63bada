"""Calibrating draft confidences: Sequential Temperature Scaling (STS), three alternatives, and the ECE.

A drafter attaches to draft position j a raw confidence c_j, an estimate that token j survives
verification given that tokens 1..j-1 did. The scheduler needs the survival probability of the
whole prefix, a_j = prod_{i<=j} c_i, to be calibrated. Four calibrations, each fitted on earlier
rounds' outcomes and each giving a calibrated a'_j that reads only c_1..c_j (so whether slot j is
verified never depends on the token x_j or later ones: lossless), non-decreasing in c_j and
non-increasing along j:

- "sts": one temperature per position, left to right: c'_j = sigmoid(logit(c_j) / T_j), T_j chosen
  on a grid so that a'_j = prod_{i<=j} c'_i has the lowest ECE against the observed outcome "tokens
  1..j were all accepted", the temperatures of positions before j already fixed (DSpark, section on
  calibration).
- "platt" (and "platt_log_loss"): a temperature and a bias per position, c'_j = sigmoid(s_j logit(c_j)
  + b_j), fitted left to right as STS is, by ECE (or by the log loss of a'_j) on a grid. The scale is
  kept within [1/2, 2]: with a free bias, the lowest ECE is a near-constant c'_j at the base rate (scale
  -> 0), calibrated and useless to a scheduler (replayed live rounds: ECE 1-3%, a far worse Brier score).
- "isotonic": a'_j = min(a'_{j-1}, g_j(a_j)), g_j a non-decreasing map of the raw survival fitted per
  position (pooled adjacent violators over equal-count bins), linear between its knots in logit(a_j).
  The raw product's miscalibration is S-shaped (the easiest rounds survive more often than any
  product of per-position confidences says), which no per-position affine map of logit(c_j) bends.
- "isotonic_drift": the isotonic map (its shape, from the whole window), each position's a'_j then moved by
  one offset in logit space fitted on the latest DRIFT_ROUNDS rounds and refitted between the map's refits
  (`REFRESHES`): a live stream's difficulty drifts on a scale of ~1,500 rounds, which a 4,000-round map
  lags (its error at the late positions swung +-4 points over a run); one parameter a position follows it
  with little noise.

Pure functions over numpy arrays. Shapes: conf [R, K] raw confidences of R verify rounds (NaN where
position j was not drafted); verified [R] draft positions each round verified; accepted [R] of those
accepted (<= verified). Position j (0-based) of round r has an outcome only when verified[r] > j.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import numpy as np

TEMPERATURE_GRID = np.geomspace(0.2, 10.0, 61)
PLATT_SCALES = np.geomspace(0.5, 2.0, 21)  # includes 1 (the identity)
PLATT_BIASES = np.linspace(-1.5, 1.5, 31)  # includes 0; live fits stay within +-1
_EPS = 1e-6


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, _EPS, 1 - _EPS)
    return np.log(p / (1 - p))


def apply_temperatures(conf: np.ndarray, temps: np.ndarray) -> np.ndarray:
    """conf [..., K] in (0, 1), temps [K] -> calibrated confidences [..., K] (NaN stays NaN)."""
    c = np.clip(conf, _EPS, 1 - _EPS)
    return 1.0 / (1.0 + np.exp(-np.log(c / (1 - c)) / temps))


def survival(conf: np.ndarray) -> np.ndarray:
    """conf [..., K] -> a [..., K], a_j = prod_{i<=j} c_i (NaN after the first undrafted position)."""
    return np.cumprod(conf, axis=-1)


def ece(pred: np.ndarray, outcome: np.ndarray, num_bins: int = 10) -> float:
    """Expected calibration error of probabilities pred [N] against 0/1 outcomes [N]: the
    count-weighted mean over equal-width bins of |mean prediction - observed frequency|."""
    if pred.size == 0:
        return float("nan")
    bins = np.minimum((pred * num_bins).astype(np.int64), num_bins - 1)
    gap = np.bincount(bins, weights=pred, minlength=num_bins) - np.bincount(bins, weights=outcome, minlength=num_bins)
    return float(np.abs(gap).sum() / pred.size)


def _ece_many(pred: np.ndarray, outcome: np.ndarray, num_bins: int = 10) -> np.ndarray:
    """`ece` of each row of pred [G, n] against outcome [n] -> [G] (one bincount for all rows)."""
    G, n = pred.shape
    bins = (np.minimum((pred * num_bins).astype(np.int64), num_bins - 1) + num_bins * np.arange(G)[:, None]).ravel()
    gap = (np.bincount(bins, weights=pred.ravel(), minlength=G * num_bins)
           - np.bincount(bins, weights=np.broadcast_to(outcome, pred.shape).ravel(), minlength=G * num_bins))
    return np.abs(gap.reshape(G, num_bins)).sum(1) / n


def ece_floor(pred: np.ndarray, num_bins: int = 10, draws: int = 20, seed: int = 0) -> float:
    """The ECE that perfectly calibrated predictions pred [N] would still show on N outcomes (drawn
    from them): the sampling noise any measured ECE on this many rounds includes."""
    if pred.size == 0:
        return float("nan")
    rng = np.random.default_rng(seed)
    return float(np.mean([ece(pred, (rng.uniform(size=pred.size) < pred).astype(np.float64), num_bins)
                          for _ in range(draws)]))


def outcomes(verified: np.ndarray, accepted: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (observed [R, K] bool: position j was verified, survived [R, K] bool: tokens 1..j accepted)."""
    j = np.arange(K)[None, :]
    return j < verified[:, None], j < accepted[:, None]


def ece_by_position(a: np.ndarray, verified: np.ndarray, accepted: np.ndarray, num_bins: int = 10,
                    floor: bool = False) -> list[float]:
    """ECE of the survival probabilities a [R, K] at each position, on the rounds that verified it
    (floor=True: the sampling noise floor of those predictions instead, see `ece_floor`)."""
    observed, survived = outcomes(verified, accepted, a.shape[1])
    if floor:
        return [ece_floor(a[observed[:, j], j], num_bins) for j in range(a.shape[1])]
    return [ece(a[observed[:, j], j], survived[observed[:, j], j].astype(np.float64), num_bins)
            for j in range(a.shape[1])]


def brier_by_position(a: np.ndarray, verified: np.ndarray, accepted: np.ndarray) -> list[float]:
    """Mean squared error of the survival probabilities a [R, K] at each position, on the rounds that
    verified it: a proper score (calibration and resolution together), which a constant prediction at
    the base rate, calibrated in ECE's eyes, does not win."""
    observed, survived = outcomes(verified, accepted, a.shape[1])
    return [float(np.mean((a[observed[:, j], j] - survived[observed[:, j], j]) ** 2)) if observed[:, j].any()
            else float("nan") for j in range(a.shape[1])]


def fit_sts(conf: np.ndarray, verified: np.ndarray, accepted: np.ndarray, min_rounds: int = 20,
            grid: np.ndarray = TEMPERATURE_GRID, num_bins: int = 10) -> np.ndarray:
    """Fit temperatures [K], position by position (a position with fewer than min_rounds verified
    outcomes keeps temperature 1)."""
    R, K = conf.shape
    observed, survived = outcomes(verified, accepted, K)
    temps = np.ones(K)
    prefix = np.ones(R)  # calibrated survival of positions before j
    for j in range(K):
        rows = observed[:, j] & ~np.isnan(conf[:, j])
        if rows.sum() >= min_rounds:
            # every grid temperature at once: [G, n] candidate survival probabilities
            cand = prefix[rows][None, :] * apply_temperatures(conf[rows, j][None, :], grid[:, None])
            y = survived[rows, j].astype(np.float64)
            errors = [ece(c, y, num_bins) for c in cand]
            temps[j] = grid[int(np.argmin(errors))]
        prefix = prefix * np.nan_to_num(apply_temperatures(conf[:, j], temps[j]), nan=0.0)
    return temps


# ---- a temperature and a bias per position ------------------------------------------------------

def apply_platt(conf: np.ndarray, params: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """conf [..., K] in (0, 1), params (scales [K] > 0, biases [K]) -> sigmoid(scale logit(c) + bias)
    [..., K] (NaN stays NaN)."""
    scales, biases = params
    return 1.0 / (1.0 + np.exp(-(scales * _logit(conf) + biases)))


def fit_platt(conf: np.ndarray, verified: np.ndarray, accepted: np.ndarray, min_rounds: int = 20,
              objective: str = "ece", scales: np.ndarray = PLATT_SCALES, biases: np.ndarray = PLATT_BIASES,
              num_bins: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Fit (scales [K], biases [K]) position by position, as `fit_sts`: each position's pair is the
    grid point whose a'_j = prefix * c'_j has the lowest ECE ("ece") or log loss ("log_loss") against
    "tokens 1..j accepted", the positions before j already fixed (a position with fewer than
    min_rounds verified outcomes keeps the identity)."""
    R, K = conf.shape
    observed, survived = outcomes(verified, accepted, K)
    s_grid, b_grid = np.repeat(scales, len(biases)), np.tile(biases, len(scales))  # [G] every pair
    out_s, out_b = np.ones(K), np.zeros(K)
    prefix = np.ones(R)  # calibrated survival of positions before j
    for j in range(K):
        rows = observed[:, j] & ~np.isnan(conf[:, j])
        if rows.sum() >= min_rounds:
            z = _logit(conf[rows, j])
            cand = prefix[rows][None, :] / (1.0 + np.exp(-(s_grid[:, None] * z[None, :] + b_grid[:, None])))  # [G, n]
            y = survived[rows, j].astype(np.float64)
            if objective == "ece":
                err = _ece_many(cand, y, num_bins)
            elif objective == "log_loss":
                c = np.clip(cand, 1e-9, 1 - 1e-9)
                err = -(y * np.log(c) + (1 - y) * np.log(1 - c)).mean(1)
            else:
                raise ValueError(f"fit_platt: objective must be 'ece' or 'log_loss', not {objective!r}")
            g = int(np.argmin(err))
            out_s[j], out_b[j] = s_grid[g], b_grid[g]
        prefix = prefix * np.nan_to_num(apply_platt(conf[:, j], (out_s[j], out_b[j])), nan=0.0)
    return out_s, out_b


# ---- a monotone map of the survival per position ------------------------------------------------

Knots = list  # K entries: None (the identity) or (x [m] increasing, in logit of the raw survival; a' [m])


def _pool_adjacent_violators(y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weighted isotonic regression of y [m] (in order) -> (block of each input [m], block values [b],
    strictly increasing)."""
    vals, wts, block = [], [], []
    for yi, wi in zip(y.tolist(), w.tolist()):
        vals.append(yi), wts.append(wi), block.append(len(vals) - 1)
        while len(vals) > 1 and vals[-2] >= vals[-1]:
            v, wt = vals.pop(), wts.pop()
            vals[-1] = (vals[-1] * wts[-1] + v * wt) / (wts[-1] + wt)
            wts[-1] += wt
            block = [min(b, len(vals) - 1) for b in block]
    return np.array(block), np.array(vals)


def fit_isotonic(conf: np.ndarray, verified: np.ndarray, accepted: np.ndarray, min_rounds: int = 200,
                 num_bins: int = 40) -> Knots:
    """Per position, a non-decreasing map from the raw survival a_j to "tokens 1..j accepted": the
    rounds sorted by a_j into num_bins equal-count bins (tied a_j in one bin), pooled adjacent violators
    over the bins' outcome rates, one knot per block at its mean logit(a_j) (values in (0, 1)). A position
    with fewer than min_rounds verified outcomes keeps the identity (a map of few rounds is mostly noise)."""
    R, K = conf.shape
    observed, survived = outcomes(verified, accepted, K)
    a = survival(np.clip(conf, _EPS, 1 - _EPS))
    knots: Knots = [None] * K
    for j in range(K):
        rows = observed[:, j] & ~np.isnan(conf[:, j])
        n = int(rows.sum())
        if n < min_rounds:
            continue
        x = _logit(a[rows, j])
        order = np.argsort(x, kind="stable")
        x, y = x[order], survived[rows, j][order].astype(np.float64)
        rank = np.searchsorted(x, x, side="left")  # ties share the rank of their first: one bin
        bins = np.unique(np.minimum(rank * num_bins // n, num_bins - 1), return_inverse=True)[1]
        count = np.bincount(bins).astype(np.float64)
        # each bin's rate with half a success and half a failure added: a small bin of all-failures does not
        # say "never" (a slot at a' = 0 would not be verified again at any load)
        block, vals = _pool_adjacent_violators((np.bincount(bins, weights=y) + 0.5) / (count + 1), count + 1)
        bw = np.bincount(block, weights=count)
        knots[j] = (np.bincount(block, weights=np.bincount(bins, weights=x)) / bw, vals)
    return knots


def apply_isotonic(conf: np.ndarray, knots: Knots) -> np.ndarray:
    """conf [..., K] raw, knots of `fit_isotonic` -> calibrated per-position confidences [..., K],
    c'_j = a'_j / a'_{j-1} with a'_j = min(a'_{j-1}, g_j(a_j)) (NaN stays NaN). a'_j reads c_1..c_j only,
    and is non-decreasing in c_j (strictly between the first and last knot)."""
    a = survival(np.clip(conf, _EPS, 1 - _EPS))
    cal = a.copy()
    for j, kn in enumerate(knots):
        if kn is not None:
            cal[..., j] = np.interp(_logit(a[..., j]), kn[0], kn[1])  # NaN in, NaN out
    cal = np.minimum.accumulate(cal, axis=-1)  # each g_j is fitted alone: keep a' non-increasing
    prev = np.concatenate([np.ones_like(cal[..., :1]), cal[..., :-1]], axis=-1)
    return cal / prev


# ---- the same map, following the stream's drift --------------------------------------------------

DRIFT_ROUNDS = 1000  # the latest rounds an offset is fitted on (about what a stream's difficulty holds still for)


def drift_offsets(knots: Knots, conf: np.ndarray, verified: np.ndarray, accepted: np.ndarray,
                  prior: float = 200.0, min_rounds: int = 50) -> np.ndarray:
    """Per position, the offset d_j in logit space that brings the mean of sigmoid(logit(a'_j) + d_j) over these
    rounds (the latest) to their observed survival, shrunk toward 0 as if `prior` more rounds had agreed with
    the map (a position with fewer than min_rounds verified outcomes, or no map, gets 0). -> [K]."""
    K = conf.shape[1]
    observed, survived = outcomes(verified, accepted, K)
    a = survival(apply_isotonic(conf, knots))
    out = np.zeros(K)
    for j in range(K):
        rows = observed[:, j] & ~np.isnan(a[:, j])
        if knots[j] is None or rows.sum() < min_rounds:
            continue
        z, y = _logit(a[rows, j]), survived[rows, j].astype(np.float64)
        target = (y.sum() + prior * (1 / (1 + np.exp(-z))).mean()) / (len(y) + prior)
        lo, hi = -2.0, 2.0
        for _ in range(30):  # the mean prediction rises with the offset: bisection
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if (1 / (1 + np.exp(-(z + mid)))).mean() < target else (lo, mid)
        out[j] = (lo + hi) / 2
    return out


def fit_isotonic_drift(conf: np.ndarray, verified: np.ndarray, accepted: np.ndarray, recent: int = DRIFT_ROUNDS,
                       prior: float = 200.0, **kw) -> tuple[Knots, np.ndarray]:
    """`fit_isotonic` on every round (the map's shape, from many rounds), then `drift_offsets` on the latest
    `recent` of them (the rows are in time order): one parameter a position, which few rounds fit, so it
    can follow the stream between refits of the shape (`refresh_isotonic_drift`)."""
    knots = fit_isotonic(conf, verified, accepted, **kw)
    return knots, drift_offsets(knots, conf[-recent:], verified[-recent:], accepted[-recent:], prior)


def refresh_isotonic_drift(params: tuple, conf: np.ndarray, verified: np.ndarray, accepted: np.ndarray,
                           prior: float = 200.0) -> tuple[Knots, np.ndarray]:
    """The same map with its offsets fitted again on these rounds (the latest `DRIFT_ROUNDS`)."""
    return params[0], drift_offsets(params[0], conf, verified, accepted, prior)


def apply_isotonic_drift(conf: np.ndarray, params: tuple) -> np.ndarray:
    """As `apply_isotonic`, each position's a'_j moved by its offset in logit space (then kept non-increasing
    along j): still reads c_1..c_j only, non-decreasing in c_j."""
    knots, offsets = params
    a = survival(apply_isotonic(conf, knots))
    cal = np.where(np.isnan(a), np.nan, 1 / (1 + np.exp(-(_logit(a) + offsets))))
    cal = np.minimum.accumulate(cal, axis=-1)
    prev = np.concatenate([np.ones_like(cal[..., :1]), cal[..., :-1]], axis=-1)
    return cal / prev


# ---- by name -------------------------------------------------------------------------------------

# name -> (fit(conf, verified, accepted) -> params, apply(conf, params) -> calibrated confidences)
CALIBRATIONS: dict[str, tuple[Callable, Callable]] = {
    "sts": (fit_sts, apply_temperatures),
    "platt": (fit_platt, apply_platt),
    "platt_log_loss": (partial(fit_platt, objective="log_loss"), apply_platt),
    "isotonic": (fit_isotonic, apply_isotonic),
    "isotonic_drift": (fit_isotonic_drift, apply_isotonic_drift),
}
# name -> refresh(params, conf, verified, accepted) of the latest DRIFT_ROUNDS rounds -> params: a cheap update
# between refits (the planner's refresh_every)
REFRESHES: dict[str, Callable] = {"isotonic_drift": refresh_isotonic_drift}


def identity_params(method: str, K: int):
    """The parameters of `method` that leave confidences as they are (before any fit)."""
    if method == "sts":
        return np.ones(K)
    if method in ("platt", "platt_log_loss"):
        return np.ones(K), np.zeros(K)
    if method == "isotonic":
        return [None] * K
    if method == "isotonic_drift":
        return [None] * K, np.zeros(K)
    raise ValueError(f"calibration method must be one of {sorted(CALIBRATIONS)}, not {method!r}")


def fit_calibration(method: str, conf: np.ndarray, verified: np.ndarray, accepted: np.ndarray):
    return CALIBRATIONS[method][0](conf, verified, accepted)


def apply_calibration(method: str, conf: np.ndarray, params) -> np.ndarray:
    """conf [..., K] raw -> calibrated per-position confidences [..., K] (their product: the survival)."""
    return CALIBRATIONS[method][1](conf, params)


def describe_params(method: str, params, digits: int = 3) -> Optional[dict]:
    """JSON-able parameters, for reports."""
    if method == "sts":
        return {"temperatures": np.round(params, digits).tolist()}
    if method in ("platt", "platt_log_loss"):
        return {"scales": np.round(params[0], digits).tolist(), "biases": np.round(params[1], digits).tolist()}
    if method == "isotonic_drift":
        return {**describe_params("isotonic", params[0], digits), "offsets": np.round(params[1], digits).tolist()}
    # isotonic: per position None (identity) or its knots, raw survival -> calibrated survival
    return {"knots": [None if kn is None else
                      [np.round(1 / (1 + np.exp(-kn[0])), digits).tolist(), np.round(kn[1], digits).tolist()]
                      for kn in params]}
