"""Calibrating draft confidences: Sequential Temperature Scaling (STS) and the expected calibration error.

A drafter attaches to draft position j a raw confidence c_j, an estimate that token j survives
verification given that tokens 1..j-1 did. The scheduler needs the survival probability of the
whole prefix, a_j = prod_{i<=j} c_i, to be calibrated. STS fits one temperature per position, left
to right: c'_j = sigmoid(logit(c_j) / T_j), with T_j chosen on a grid so that a'_j = prod_{i<=j} c'_i
has the lowest ECE against the observed outcome "tokens 1..j were all accepted", the temperatures of
positions before j already fixed (DSpark, section on calibration).

Pure functions over numpy arrays. Shapes: conf [R, K] raw confidences of R verify rounds (NaN where
position j was not drafted); verified [R] draft positions each round verified; accepted [R] of those
accepted (<= verified). Position j (0-based) of round r has an outcome only when verified[r] > j.
"""

from __future__ import annotations

import numpy as np

TEMPERATURE_GRID = np.geomspace(0.2, 10.0, 61)
_EPS = 1e-6


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
