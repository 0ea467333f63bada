"""The confidence schedule: the verify budget search, STS calibration and the cost models (pure
functions), and the engine with `speculative.schedule: confidence`."""

import numpy as np
import pytest
import torch
from prometheus_client import generate_latest

from dspark_cluster import LLM, SamplingParams
from dspark_cluster.report import format_summary, write_report
from dspark_cluster.http_edge import ServerMetrics
from dspark_cluster.workload import DEFAULT_PROMPTS, read_prompts
from dspark_cluster.speculative.records import Proposal
from dspark_cluster.speculative.confidence import (CALIBRATIONS, apply_calibration, apply_platt, apply_temperatures,
                                                   brier_by_position, ece, ece_by_position, fit_calibration,
                                                   fit_platt, fit_sts, survival)
from dspark_cluster.speculative.verify_budget import (VETO_ROUNDS, DraftCost, StepCost, VerifyPlanner, choose_verify_lengths,
                                                      draft_forwards)

A = [[0.9, 0.8, 0.3], [0.6, 0.2, 0.1]]


def steep_after(knee, slope):
    return lambda B: 1.0 + slope * np.maximum(np.asarray(B, dtype=float) - knee, 0)


@pytest.mark.parametrize("cost, lengths", [
    (steep_after(4, 1.0), [2, 0]),  # 2 rows free up to 4 tokens: 0.9, 0.8 fit; 0.6 would halve Theta
    (steep_after(100, 1.0), [3, 3]),  # a flat cost admits every slot that may survive
    (steep_after(2, 10.0), [0, 0]),  # every draft costs more than it can give: B = the rows alone
    (steep_after(3, 0.5), [1, 0]),  # 0.9 free; 0.8 pays less than the 50% it adds: 3.7 / 1.5 < 2.9
])
def test_budget_search_known_answers(cost, lengths):
    got = choose_verify_lengths(np.array(A), base_tokens=2, base_expected=2.0, step_time=cost)
    assert got.tolist() == lengths


def test_budget_skips_undrafted_positions_and_counts_draft_time():
    a = np.array([[0.9, np.nan, np.nan], [0.5, 0.4, 0.3]])
    assert choose_verify_lengths(a, 2, 2.0, steep_after(100, 1.0)).tolist() == [1, 3]
    # a long drafting call makes the step's fixed cost large: each slot then pays relative to it
    flat_then_linear = lambda B: 0.1 * np.asarray(B, dtype=float)  # noqa: E731
    assert choose_verify_lengths(np.array([[0.5]]), 1, 1.0, flat_then_linear, draft_s=0.0).tolist() == [0]
    assert choose_verify_lengths(np.array([[0.5]]), 1, 1.0, flat_then_linear, draft_s=1.0).tolist() == [1]


def test_a_slot_is_verified_whatever_the_slots_after_it_say():
    """Losslessness: whether slot (r, j) is verified may depend on a_{r, <=j} and other rows, never
    on a_{r, j+1..} (which read the token x_j). Changing a row's later confidences leaves the
    admission of its earlier slots alone. (Taking the best Theta over all cut points instead of
    stopping at the first fall breaks this on step-shaped costs: one of these 1000 cases fails it.)"""
    rng = np.random.default_rng(0)
    for trial in range(1000):
        N, K = rng.integers(1, 6), rng.integers(1, 6)
        c = rng.uniform(0.05, 0.99, size=(N, K))
        knee = int(rng.integers(N + 1, N * (K + 1) + 1))
        if trial % 2:
            cost = steep_after(knee, float(rng.uniform(0.01, 0.5)))
        else:  # a jump, then flat (real profiles have steps): Theta falls, then may rise again
            cost = (lambda kn, j: lambda B: 1.0 + j * (np.asarray(B, dtype=float) >= kn))(knee, float(rng.uniform(0.05, 0.5)))
        base = choose_verify_lengths(survival(c), N, float(N), cost)
        r, j = rng.integers(N), rng.integers(K)
        c2 = c.copy()
        c2[r, j + 1:] = rng.uniform(0.05, 0.99, size=K - j - 1)
        other = choose_verify_lengths(survival(c2), N, float(N), cost)
        assert min(other[r], j + 1) == min(base[r], j + 1), (trial, c, c2, base, other)


def synthetic_rounds(rng, R, temps_true):
    """Raw confidences and the verify outcomes they would have if the true conditional survival
    were sigmoid(logit(c) / T_true) at each position."""
    K = len(temps_true)
    raw = rng.uniform(0.05, 0.95, size=(R, K))
    p = apply_temperatures(raw, np.array(temps_true))
    alive = np.cumprod(rng.uniform(size=(R, K)) < p, axis=1)
    return raw, np.full(R, K), alive.sum(1)


def test_sts_recovers_known_temperatures_and_calibrates():
    rng = np.random.default_rng(1)
    true = [2.0, 0.5, 1.0, 3.0]
    raw, ver, acc = synthetic_rounds(rng, 20000, true)
    temps = fit_sts(raw, ver, acc)
    # late positions' survival products are small, so ECE barely tells temperatures apart there:
    # what must hold is calibration, and the early temperatures where the data decides them
    np.testing.assert_allclose(temps[:3], true[:3], rtol=0.25)
    fresh = synthetic_rounds(rng, 20000, true)  # scored on rounds it was not fitted on
    before = ece_by_position(survival(fresh[0]), fresh[1], fresh[2])
    after = ece_by_position(survival(apply_temperatures(fresh[0], temps)), fresh[1], fresh[2])
    assert max(after) <= 0.02, after
    assert before[0] > 0.05, before  # miscalibrated raw (later products partly cancel: T 2 then 0.5)
    floor = ece_by_position(survival(apply_temperatures(fresh[0], temps)), fresh[1], fresh[2], floor=True)
    assert max(floor) < 0.01 and all(a < f + 0.015 for a, f in zip(after, floor))  # at the noise floor


def test_sts_leaves_a_position_without_data_alone_and_ece_is_zero_when_calibrated():
    rng = np.random.default_rng(2)
    raw, ver, acc = synthetic_rounds(rng, 3000, [1.0, 1.0])
    ver[:] = 1  # position 2 never verified
    temps = fit_sts(raw, ver, np.minimum(acc, 1))
    assert temps[1] == 1.0
    assert ece(np.array([0.25, 0.25, 0.25, 0.25]), np.array([1.0, 0.0, 0.0, 0.0])) == 0.0


def shifted_rounds(rng, R, biases):
    """Raw confidences and their verify outcomes when the true conditional survival is
    sigmoid(logit(c) + b) at each position: a pure shift, which no temperature undoes."""
    K = len(biases)
    raw = rng.uniform(0.05, 0.95, size=(R, K))
    p = apply_platt(raw, (np.ones(K), np.array(biases)))
    alive = np.cumprod(rng.uniform(size=(R, K)) < p, axis=1)
    return raw, np.full(R, K), alive.sum(1), p


def test_platt_and_isotonic_fix_a_shift_that_sts_cannot():
    rng = np.random.default_rng(4)
    true = [-1.0, 0.8, -0.6, 0.5]
    raw, ver, acc, _ = shifted_rounds(rng, 20000, true)
    scales, biases = fit_platt(raw, ver, acc)
    np.testing.assert_allclose(scales[:2], 1.0, rtol=0.15)  # later positions' products tell pairs apart less well
    np.testing.assert_allclose(biases[:2], true[:2], atol=0.15)
    fresh_raw, fresh_ver, fresh_acc, p_true = shifted_rounds(rng, 20000, true)  # scored on rounds not fitted on
    floor = ece_by_position(survival(p_true), fresh_ver, fresh_acc, floor=True)
    params = {"platt": (scales, biases), **{m: fit_calibration(m, raw, ver, acc) for m in ("sts", "isotonic")}}
    after = {m: ece_by_position(survival(apply_calibration(m, fresh_raw, params[m])), fresh_ver, fresh_acc)
             for m in params}
    assert max(floor) < 0.01
    for m in ("platt", "isotonic"):
        assert all(e < f + 0.01 for e, f in zip(after[m], floor)), (m, after[m], floor)
    assert max(after["sts"]) > 0.04, after["sts"]  # a temperature bends around 0.5, it does not shift
    assert max(ece_by_position(survival(fresh_raw), fresh_ver, fresh_acc)) > 0.1  # and raw is far off


def test_ece_fitted_platt_keeps_the_confidences_resolution():
    """With a free bias, the lowest ECE is a constant at the base rate (calibrated, and useless to a
    scheduler); the bounded scale keeps the fit near the truth in a proper score too."""
    rng = np.random.default_rng(5)
    raw, ver, acc, _ = shifted_rounds(rng, 20000, [-0.8, 0.6])
    params = fit_platt(raw, ver, acc)
    fresh_raw, fresh_ver, fresh_acc, p_true = shifted_rounds(rng, 20000, [-0.8, 0.6])
    fitted = brier_by_position(survival(apply_platt(fresh_raw, params)), fresh_ver, fresh_acc)
    truth = brier_by_position(survival(p_true), fresh_ver, fresh_acc)
    observed_rate = [(fresh_acc > j).mean() for j in range(2)]
    constant = brier_by_position(np.cumprod(np.broadcast_to(observed_rate, fresh_raw.shape), axis=1) /
                                 np.array([1.0, observed_rate[0]]), fresh_ver, fresh_acc)
    assert all(f < t + 0.003 for f, t in zip(fitted, truth)), (fitted, truth)
    assert all(c > t + 0.01 for c, t in zip(constant, truth)), (constant, truth)  # what collapsing would cost


@pytest.mark.parametrize("method", sorted(CALIBRATIONS))
def test_calibrated_survival_reads_only_earlier_positions_and_is_monotone(method):
    """Lossless: a'_j is a function of c_1..c_j (never of later positions, which read the token x_j),
    non-increasing along j, and non-decreasing in c_j (the order of slots by survival is kept)."""
    rng = np.random.default_rng(6)
    raw, ver, acc, _ = shifted_rounds(rng, 5000, [-0.5, 0.7, -0.3, 0.4])
    params = fit_calibration(method, raw, ver, acc)
    c = rng.uniform(0.02, 0.98, size=(500, 4))
    a = survival(apply_calibration(method, c, params))
    assert np.all(np.diff(a, axis=1) <= 1e-12)
    for j in range(4):
        later = c.copy()
        later[:, j + 1:] = rng.uniform(0.02, 0.98, size=(500, 3 - j))
        np.testing.assert_array_equal(survival(apply_calibration(method, later, params))[:, :j + 1], a[:, :j + 1])
        higher = c.copy()
        higher[:, j] = np.minimum(c[:, j] + rng.uniform(0, 0.3, size=500), 0.99)
        a_hi = survival(apply_calibration(method, higher, params))
        np.testing.assert_array_equal(a_hi[:, :j], a[:, :j])
        assert np.all(a_hi[:, j] >= a[:, j] - 1e-12)
    with_nan = c.copy()
    with_nan[:, 2:] = np.nan  # undrafted positions stay undrafted
    out = survival(apply_calibration(method, with_nan, params))
    assert np.isnan(out[:, 2:]).all() and np.isfinite(out[:, :2]).all()


def test_the_drift_offsets_follow_a_stream_whose_acceptance_moves():
    """A stream whose acceptance rises every 1,500 rounds (as a stream of prompts growing easier does): the
    map of the last 4,000 rounds lags it, and the offsets, refitted every 100 rounds on the latest 1,000,
    follow it. Scored live on the same rounds (each by the fits in force when it ran); on a stream that holds
    still they cost little. (Shifts to and fro cancel in part in a pooled ECE: each phase's error is in the
    same bins with opposite signs.)"""
    K, rng = 4, np.random.default_rng(11)
    base = np.array([-0.6, 0.5, -0.3, 0.2])

    def live_ece(shifts):
        p = VerifyPlanner(K, StepCost([1, 64], [0.01, 0.01]), "dspark", min_rounds=50, compare=("isotonic",))
        for shift in shifts:
            raw, ver, acc, _ = shifted_rounds(rng, 1500, base + shift)
            for i in range(0, len(raw), 4):
                p.observe(raw[i:i + 4], ver[i:i + 4], acc[i:i + 4])
        return p.calibration_report(floors=True)

    moving = live_ece([0.0, 0.3, 0.6, 0.9, 1.2, 1.5])
    drift, iso = moving["ece_by_method"]["isotonic_drift"], moving["ece_by_method"]["isotonic"]
    assert np.mean(drift) < np.mean(iso) - 0.01 and max(drift) < max(iso), (drift, iso)
    still = live_ece([0.0] * 6)
    drift, iso = still["ece_by_method"]["isotonic_drift"], still["ece_by_method"]["isotonic"]
    floor = still["ece_floor_by_method"]["isotonic"]
    assert all(d < f + 0.01 for d, f in zip(drift, floor)) and np.mean(drift) < np.mean(iso) + 0.003, (drift, iso)


def sequences_of_own_difficulty(rng, sequences, rounds, concurrent, K=4, spread=0.8):
    """Steps of `concurrent` sequences at a time, each verifying `rounds` rounds of K drafts: confidences from one
    law, but each sequence's true survival shifted by its own N(0, spread) in logit space (a text easier or harder
    than its confidences say). -> [(raw [N, K], verified [N], accepted [N], seq_ids [N])] in step order."""
    shift = rng.normal(0, spread, sequences)
    base = np.array([-0.4, 0.5, -0.2, 0.3])[:K]
    steps = []
    for first in range(0, sequences, concurrent):
        ids = np.arange(first, min(first + concurrent, sequences))
        for _ in range(rounds):
            raw = rng.uniform(0.05, 0.95, size=(len(ids), K))
            p = apply_platt(raw, (np.ones(K), base[None, :] + shift[ids][:, None]))
            acc = np.cumprod(rng.uniform(size=(len(ids), K)) < p, axis=1).sum(1)
            steps.append((raw, np.full(len(ids), K), acc, ids))
    return steps


def test_sequence_offsets_follow_each_sequences_own_difficulty():
    """Sequences whose survival sits above or below what their confidences say by an amount of their own: each
    one's offset, learned from its finished rounds, moves its raw survival before the map, which is fitted on the
    rounds as moved. The same rounds live, with and without offsets: as well calibrated (ECE), sharper (Brier); a
    finished sequence's offset goes; without `sequence_prior` nothing moves."""
    K, rng = 4, np.random.default_rng(12)
    steps = sequences_of_own_difficulty(rng, 600, 20, 8)

    def live(prior):
        p = VerifyPlanner(K, StepCost([1, 64], [0.01, 0.01]), "dspark", min_rounds=50, compare=(), sequence_prior=prior)
        for raw, ver, acc, ids in steps:
            p.observe(raw, ver, acc, ids)
        return p, p.calibration_report(floors=True)

    p, on = live(10.0)
    q, off = live(None)
    assert max(on["ece_after_by_position"]) < 0.015 and max(off["ece_after_by_position"]) < 0.015
    assert sum(on["brier_by_method"]["isotonic_drift"]) < sum(off["brier_by_method"]["isotonic_drift"]) - 0.015, \
        (on["brier_by_method"], off["brier_by_method"])
    assert not q._seq and p.summary()["sequences_with_offsets"] == len(p._seq) > 0
    offsets = p.sequence_offsets(list(p._seq))
    assert np.std(offsets) > 0.3 and np.abs(offsets).max() <= 3.0  # learned, not left at 0
    # the offset moves a sequence's raw survival in logit space before the map: a'_j non-decreasing in it
    c = rng.uniform(0.05, 0.95, size=(200, K))
    sid = max(p._seq, key=lambda i: p._seq[i][0])  # the sequence found easiest
    assert p.sequence_offsets([sid])[0] > 0
    moved, plain = p.calibrated_survival(c, offsets=p.sequence_offsets([sid] * 200)), p.calibrated_survival(c)
    assert np.all(moved >= plain - 1e-12) and np.any(moved > plain)
    assert np.all(np.diff(moved, axis=1) <= 1e-12)  # still non-increasing along j
    assert not p.sequence_offsets([10**6]).any()  # a sequence not seen: 0
    p.forget([sid])
    assert p.sequence_offsets([sid])[0] == 0 and sid not in p._seq
    np.testing.assert_array_equal(q.calibrated_survival(c, offsets=np.ones(200)), q.calibrated_survival(c))  # off
    # the rounds are kept as moved by the offsets their lengths were chosen with (async scheduling: a sequence's
    # offset may have moved since), and a sequence forgotten meanwhile learns nothing more
    other, gone = sorted(p._seq)[-2:]
    p.forget([gone])
    before = {i: list(st) for i, st in p._seq.items()}
    raw = rng.uniform(0.05, 0.95, size=(2, K))
    p.observe(raw, np.array([K, K]), np.array([K, 0]), [other, gone], np.array([0.5, -0.5]))
    for row, d in zip(list(p.window)[-2:], (0.5, -0.5)):
        a = np.cumprod(raw[0 if d > 0 else 1])
        np.testing.assert_allclose(survival(np.asarray(row[0])), 1 / (1 + np.exp(-(np.log(a / (1 - a)) + d))),
                                   rtol=1e-9)
    assert set(p._seq) == set(before) and p._seq[other][0] != before[other][0]


def test_an_ngram_drafters_rows_differ_by_their_sequences_record():
    """An n-gram drafter gives no confidences: every row's raw ones are the window's acceptance rates. Each
    sequence's offset, learned from its own rounds, is then all that tells a text that repeats itself (its lookups
    keep being right) from one that does not: with offsets the easy sequences' rows are predicted to survive
    longer and get longer verify lengths than the hard ones' at the same step, the prediction sharper (Brier) and
    as calibrated (ECE); without, every row is alike."""
    K, rng = 4, np.random.default_rng(5)
    shift = np.random.default_rng(3).normal(0, 1.0, 400)  # how much more (or less) a text repeats itself
    base = np.array([0.0, 0.3, 0.3, 0.3])

    def live(prior):
        # (a step of 8 tokens costs what one of 1 does, each token past them ~0.36 ms: a slot pays from a ~0.5 survival)
        p = VerifyPlanner(K, StepCost([1, 8, 64], [0.01, 0.01, 0.03]), "ngram", min_rounds=50, compare=(),
                          sequence_prior=prior)
        gen = np.random.default_rng(6)  # the same outcomes in both runs
        lengths = []
        for first in range(0, 400, 8):
            ids = np.arange(first, first + 8)
            for _ in range(20):
                raw = p.raw_confidences([Proposal([7] * K, None, None)] * len(ids))
                d = p.sequence_offsets(ids)
                lengths.append((p.verify_lengths(raw, len(ids), len(ids), 0.0, d), shift[ids] > 0.5,
                                shift[ids] < -0.5))
                cond = 1 / (1 + np.exp(-(base[None, :] + shift[ids][:, None])))
                acc = np.cumprod(gen.uniform(size=(len(ids), K)) < cond, axis=1).sum(1)
                p.observe(raw, np.full(len(ids), K), acc, ids, d)
            p.forget(ids)
        return p, p.calibration_report(floors=True), lengths

    p, on, lengths = live(10.0)
    q, off, plain_lengths = live(None)
    # (the same rounds without offsets read 1.8-2.5%: their constant prediction, moved by the map's drift offsets)
    assert max(on["ece_after_by_position"]) < 0.015, on
    assert sum(on["brier_by_method"]["isotonic_drift"]) < 0.9 * sum(off["brier_by_method"]["isotonic_drift"]), \
        (on["brier_by_method"], off["brier_by_method"])
    late = lengths[len(lengths) // 2:]  # (once the window is fitted)
    easy = np.mean(np.concatenate([n[e] for n, e, _ in late]))
    hard = np.mean(np.concatenate([n[h] for n, _, h in late]))
    assert easy > hard + 0.5, (easy, hard)
    assert all(len(set(n.tolist())) == 1 for n, _, _ in plain_lengths)  # without offsets every row alike


def test_planner_calibrates_by_the_default_method_compares_sts_and_stays_lossless():
    """The planner's default calibration, fitted on live-like rounds, with the structural property of
    `test_a_slot_is_verified_whatever_the_slots_after_it_say` through `VerifyPlanner.verify_lengths`."""
    K = 4
    p = VerifyPlanner(K, StepCost([1, 64], [0.01, 0.01]), "dspark", min_rounds=50)
    assert p.calibration == "isotonic_drift" and p.methods == ("isotonic_drift", "sts")
    rng = np.random.default_rng(7)
    raw, ver, acc, _ = shifted_rounds(rng, 4000, [-0.8, 0.6, -0.4, 0.3])
    for i in range(0, len(raw), 8):  # 8 sequences' rounds a step, 40 rounds each: offsets of their own
        p.observe(raw[i:i + 8], ver[i:i + 8], acc[i:i + 8], np.arange(8) + 8 * (i // 320))
    summary = p.summary()
    assert summary["calibration_method"] == "isotonic_drift" and summary["compared_methods"] == ["sts"]
    assert len(summary["calibration_params"]["knots"]) == K and summary["calibration_params"]["knots"][0] is not None
    assert len(summary["calibration_params"]["offsets"]) == K
    assert set(summary["ece_by_method"]) == {"isotonic_drift", "sts"}
    assert summary["ece_after_by_position"] == summary["ece_by_method"]["isotonic_drift"]
    # scored on the same rounds: the shift defeats STS, not the isotonic map
    assert max(summary["ece_by_method"]["isotonic_drift"]) < max(summary["ece_by_method"]["sts"]) - 0.02
    for trial in range(300):
        N = int(rng.integers(1, 6))
        c = rng.uniform(0.05, 0.99, size=(N, K))
        knee = int(rng.integers(N + 1, N * (K + 1) + 1))
        if trial % 2:
            p.step_cost = steep_after(knee, float(rng.uniform(0.01, 0.5)))
        else:  # a jump, then flat
            p.step_cost = (lambda kn, h: lambda B: 1.0 + h * (np.asarray(B, dtype=float) >= kn))(
                knee, float(rng.uniform(0.05, 0.5)))
        seqs = rng.choice(np.arange(8) + 8 * (len(raw) // 320 - 1), N, replace=False)  # (their offsets set)
        base = p.verify_lengths(c, N, float(N), 0.0, p.sequence_offsets(seqs))
        r, j = rng.integers(N), rng.integers(K)
        c2 = c.copy()
        c2[r, j + 1:] = rng.uniform(0.05, 0.99, size=K - j - 1)
        other = p.verify_lengths(c2, N, float(N), 0.0, p.sequence_offsets(seqs))
        assert min(other[r], j + 1) == min(base[r], j + 1), (trial, c, c2, base, other)
    assert np.count_nonzero(p.sequence_offsets(np.arange(8) + 8 * (len(raw) // 320 - 1))) == 8
    with pytest.raises(ValueError, match="calibration method must be one of"):
        VerifyPlanner(K, StepCost([1, 64], [0.01, 0.01]), "dspark", calibration="vector")


def test_step_cost_profile_and_live_correction():
    cost = StepCost([1, 8, 64], [0.010, 0.012, 0.040])
    np.testing.assert_allclose(cost([1, 8, 36, 64, 120]), [0.010, 0.012, 0.026, 0.040, 0.040 + 56 * 0.028 / 56])
    assert StepCost([1, 2, 4], [0.01, 0.05, 0.02])(2) == pytest.approx(0.02)  # noise never makes more cheaper
    for _ in range(200):
        cost.observe(8, 0.024)  # live steps of 8 tokens take twice the profile
    assert cost(8) == pytest.approx(0.024, rel=0.01)
    # sizes no live step came near take the nearest observed correction (the larger steps drafting would
    # make are as much slower than their profile as the steps that ran); below the smallest size observed it
    # falls, in log scale, to 1 at a single token (whose step reads the weights whatever the contexts)
    assert cost(64) == pytest.approx(0.080, rel=0.01) and cost(1) == pytest.approx(0.010, rel=0.01)
    assert cost(4) == pytest.approx(float(cost._profile(4)) * (1 + np.log(4) / np.log(8)), rel=0.01)
    for _ in range(200):
        cost.observe(1, 0.010)  # ... until steps of their own size are seen
    assert cost(1) == pytest.approx(0.010, rel=0.01) and cost(8) == pytest.approx(0.024, rel=0.01)
    assert cost(64) == pytest.approx(0.080, rel=0.01)


def test_draft_cost_scales_with_forwards():
    d = DraftCost()
    assert d(4, 1) == 0.0  # unmeasured: drafting is tried
    d.observe(4, draft_forwards("draft_model", 4), 0.020)
    assert d(4, draft_forwards("draft_model", 2)) == pytest.approx(0.010)
    assert d(1, 1) == pytest.approx(0.005 / 4) and d(16, 1) == pytest.approx(0.020)  # outside: by rows
    assert draft_forwards("dspark", 6) == 1 and draft_forwards("dspark", 0) == 0
    # a two-pass DSpark drafter (draft_passes 2): a second forward from 2 tokens on
    assert [draft_forwards("dspark", k, 2) for k in (0, 1, 2, 6)] == [0, 1, 2, 2]


def test_the_planner_prices_a_two_pass_drafter_from_its_config(tmp_path):
    """The engine's planner reads the drafter's draft_passes, so a proposal of 2+ tokens costs two forwards."""
    import json

    from dspark_cluster.config import load_config
    from dspark_cluster.speculative.dspark_model import draft_passes_of

    for passes in (2, 1):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "dspark_drafter", "target_hidden_size": 8,
                                                          "vocab_size": 16, "target_layer_ids": [0],
                                                          "draft_passes": passes}))
        cfg = load_config(None, ["speculative.method=dspark", f"speculative.draft_model={tmp_path}",
                                 "parallel.device=cuda"])
        assert draft_passes_of(cfg) == passes  # auto: the drafter's own on CUDA
        assert draft_passes_of(cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"device": "cpu"})})) == 1
    assert draft_passes_of(load_config(None, [])) == 1
    from dspark_cluster.errors import ConfigError

    with pytest.raises(ConfigError, match="draft_passes: got 2.*trained for one pass"):  # the last one written: 1
        draft_passes_of(load_config(None, ["speculative.method=dspark", f"speculative.draft_model={tmp_path}",
                                           "speculative.draft_passes=2"]))
    planner = VerifyPlanner(4, StepCost([1, 8], [0.01, 0.02]), "dspark", draft_passes=2)
    planner.draft_cost.observe(4, draft_forwards("dspark", 4, planner.draft_passes), 0.004)
    assert planner.draft_cost(4, draft_forwards("dspark", 1, planner.draft_passes)) == pytest.approx(0.002)


def test_draft_cost_past_the_rows_measured_grows_as_the_target_step_does():
    """Measured on the exploration's 4 rows only, a drafter's cost at 128 rows follows the target's
    step-cost shape (flat while weight-bound, then linear), not the row count: a GPU drafter of ~1 ms
    is not taken for ~32 ms at 128 rows (the planner then stopped drafting where it paid)."""
    shape = StepCost([1, 64, 512, 2048], [0.010, 0.010, 0.020, 0.080])  # flat to 64 tokens, then linear
    d = DraftCost(shape=shape._profile, tokens_per_row=5)
    d.observe(4, 1, 0.001)
    assert d(4, 1) == pytest.approx(0.001)
    assert d(8, 1) == pytest.approx(0.001)  # 40 tokens: still flat
    assert d(128, 1) == pytest.approx(0.001 * float(shape._profile(640)) / 0.010)  # ~1.36 ms, not 32 ms
    assert d(2, 1) == pytest.approx(0.0005)  # below what was measured: by rows (drafting is tried, then measured)
    assert VerifyPlanner(4, shape, "dspark").draft_cost.tokens_per_row == 5
    assert VerifyPlanner(4, shape, "draft_model").draft_cost.tokens_per_row == 1


def test_planner_drafts_at_low_load_and_not_at_high_load():
    cost = StepCost([1, 16, 64, 256, 1024], [0.01, 0.01, 0.02, 0.08, 0.32])  # linear past 16 tokens
    p = VerifyPlanner(4, cost, "dspark", refit_every=50, min_rounds=50)
    assert p.draft_len(48) == 4 and p.exploring  # no history yet: learn, on a few rows (explore_rows) only
    assert p.draft_len(1) == 4 and p.exploring
    rng = np.random.default_rng(3)
    raw, ver, acc = synthetic_rounds(rng, 200, [1.0] * 4)
    for i in range(0, len(raw), 8):  # 8 rows a step
        p.observe(raw[i:i + 8], ver[i:i + 8], acc[i:i + 8])
    p.drafted(1, 4, 0.002)
    p.drafted(256, 4, 0.02)
    assert p.fitted and p.mean_survival is not None
    assert p.draft_len(1) == 4  # a free step: every position may pay
    assert p.draft_len(256) == 0  # a full step: each draft costs its full share
    assert {p.draft_len(256) for _ in range(p.explore_every - 1)} == {0}
    assert p.draft_len(256) == 4  # now and then it drafts anyway, to keep its estimates fresh
    summary = p.summary()
    assert len(summary["temperatures"]) == 4 and len(summary["ece_after_by_position"]) == 4


def test_planner_ngram_rates_come_from_outcomes():
    p = VerifyPlanner(2, StepCost([1, 2], [0.01, 0.01]), "ngram")
    two = [Proposal([5, 6]), Proposal([7, 8])]  # n-gram proposals: no confidences
    for _ in range(40):
        p.observe(p.raw_confidences(two), [2, 2], [2, 0])
    p.refit()  # rates are refreshed with each fit
    rates = p.raw_confidences(two)[0]
    bf16 = p.raw_confidences([Proposal([1], None, torch.tensor([0.5], dtype=torch.bfloat16))])[0]  # a bf16 drafter
    assert bf16[0] == 0.5 and np.isnan(bf16[1])
    assert rates[0] == pytest.approx(41 / 82) and rates[1] == pytest.approx(41 / 42)


# ---- the engine ------------------------------------------------------------------------------

ASSETS = "dspark_cluster/assets"


@pytest.mark.parametrize("method, draft", [("dspark", "tiny-dspark"), ("draft_model", "tiny-draft"), ("ngram", None)])
def test_greedy_identical_with_the_confidence_schedule(method, draft, tmp_path):
    bundled_prompts = read_prompts(DEFAULT_PROMPTS)[:4]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = LLM(f"{ASSETS}/tiny-moe", config={"parallel": {"executor": "local"}})
    base = [o.token_ids for o in plain.generate(bundled_prompts, params)]
    plain.shutdown()
    cfg = {"parallel": {"executor": "local"},
           "speculative": {"method": method, "draft_model": draft and f"{ASSETS}/{draft}", "num_tokens": 4,
                           "schedule": "confidence",
                           "prior_acceptance": None}}  # learn at this load (a typical drafter may not pay here)
    with LLM(f"{ASSETS}/tiny-moe", config=cfg) as llm:
        assert llm.engine.planner.prior_acceptance is None
        llm.engine.planner.refit_every = 20  # refit within this short run
        llm.engine.planner.min_rounds = 20
        outs = llm.generate(bundled_prompts, params)
        assert [o.token_ids for o in outs] == base
        planner = llm.engine.planner
        assert len(planner.window) > 0 and (planner.num_refits >= 1 or method == "ngram")
        assert not planner._seq  # every sequence's offset dropped when it finished (learned: the next test)
        steps = list(llm.engine.step_stats)
        assert sum(s["num_drafted"] for s in steps) >= sum(s["num_verified"] for s in steps) > 0
        spec = llm.engine.speculative_summary()
        assert spec["schedule"] == "confidence" and spec["calibration"]["window_rounds"] > 0
        assert 0 < spec["verified_share"] <= 1
        paths = write_report({"summary": {"speculative": spec}, "steps": steps, "requests": []}, tmp_path)
        assert tmp_path / "verify_budget.png" in paths
        text = format_summary({"speculative": spec})
        assert "schedule, drafts verified" in text and "confidence" in text
        metrics = ServerMetrics()  # what `dspark serve` exports at /metrics
        metrics.set_stats({"speculative": spec, "verify_budget": steps[-1]["verify_budget"]})
        prom = generate_latest(metrics.registry).decode()
        assert f"dspark_spec_verified_share {float(spec['verified_share'])}" in prom
        assert f"dspark_spec_verify_budget {float(steps[-1]['verify_budget'])}" in prom


def drafting_every_step(n: int, max_tokens: int, k: int, async_scheduling: bool = False):
    """n bundled prompts, their greedy sampling params and plain decoding's outputs, and an in-process DSpark LLM whose
    confidence planner drafts k positions every step and verifies them all (no timing decides): (prompts, params,
    base, llm, planner)."""
    from test_idle_drafter import PatternPlanner

    prompts = read_prompts(DEFAULT_PROMPTS)[:n]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    with LLM(f"{ASSETS}/tiny-moe", config={"parallel": {"executor": "local"}}) as plain:
        base = [o.token_ids for o in plain.generate(prompts, params)]
    llm = LLM(f"{ASSETS}/tiny-moe", config={"parallel": {"executor": "local"},
                                           "scheduler": {"async_scheduling": async_scheduling},
                                           "speculative": {"method": "dspark", "draft_model": f"{ASSETS}/tiny-dspark",
                                                           "num_tokens": k, "schedule": "confidence"}})
    planner = llm.engine.speculation.planner = PatternPlanner(llm.engine.planner, [k])
    return prompts, params, base, llm, planner


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engine_learns_each_sequences_offset_and_gives_back_the_one_each_round_was_chosen_with(async_scheduling):
    """Every step drafts 4 (a fixed pattern: no timing decides): each round's outcome reaches the planner with its
    sequence and the offset its verify length was chosen with; with async scheduling (Ray's default) a sequence's
    next round is chosen before this one's outcome moves its offset, so some come back with an older one than the
    sequence has then. The sequences learn offsets of their own, each goes when its sequence finishes (a round of
    it that comes back after learns nothing), and greedy output is plain decoding's."""
    prompts, params, base, llm, planner = drafting_every_step(4, 32, 4, async_scheduling)
    with llm:
        assert llm.engine.async_scheduling == async_scheduling
        planner.min_rounds = 8
        chosen, given, forgotten = {}, [], {}
        observe, forget, sequence_offsets = planner.observe, planner.forget, planner.sequence_offsets

        def watch_offsets(ids):  # (called where a step's verify lengths are chosen)
            d = sequence_offsets(ids)
            chosen.setdefault("all", []).append(dict(zip(ids, d.tolist())))
            return d

        def watch_observe(raw, verified, accepted, seq_ids=None, offsets=None):
            live = [i for i, sid in enumerate(seq_ids) if sid not in planner._forgotten]
            given.append((list(seq_ids), np.asarray(offsets), np.asarray(offsets)[live],
                          sequence_offsets([seq_ids[i] for i in live])))
            observe(raw, verified, accepted, seq_ids, offsets)

        def watch_forget(ids):
            forgotten.update({i: sequence_offsets([i])[0] for i in ids})
            forget(ids)
        planner.observe, planner.forget, planner.sequence_offsets = watch_observe, watch_forget, watch_offsets
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == base
        assert planner.fitted and len(given) > 10 and all(len(ids) == len(d) for ids, d, _, _ in given)
        # every offset given back is one the verify budget chose with
        choices = {(sid, d) for c in chosen["all"] for sid, d in c.items()}
        assert all((sid, d) in choices for ids, ds, _, _ in given for sid, d in zip(ids, ds.tolist()))
        older = sum(not np.array_equal(then, now) for _, _, then, now in given)
        assert older > 0 if async_scheduling else older == 0  # sync: each round comes back before the next is chosen
        assert len(forgotten) == 4 and sum(d != 0 for d in forgotten.values()) >= 3
        assert any(d.any() for _, d, _, _ in given) and not planner._seq
        assert llm.engine.speculative_summary()["learn_failures"] == 0


def test_a_failure_to_learn_from_a_step_loses_none_of_its_tokens():
    """The planner's learning raising (a defect there, or a bad round) after the step's tokens were committed: the
    requests still finish with plain decoding's output (raised, the events of the requests that step finished were
    lost and generate waited for ever), and the failures are counted."""
    prompts, params, base, llm, planner = drafting_every_step(3, 16, 3)
    with llm:
        def broken(*args, **kw):
            raise RuntimeError("a defect in the planner's learning")
        planner.observe = broken
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == base and all(o.finish_reason == "length" for o in outs)
        spec = llm.engine.speculative_summary()
        assert spec["learn_failures"] > 0
        metrics = ServerMetrics()  # what `dspark serve` exports at /metrics
        metrics.set_stats({"speculative": spec})
        prom = generate_latest(metrics.registry).decode()
        assert f"dspark_spec_learn_failures {float(spec['learn_failures'])}" in prom


def test_positions_drafted_too_rarely_are_extrapolated_not_zero():
    """A planner that settled on 3 drafts sees no outcomes of positions 4..6: they keep the last
    known conditional survival (else they read 0 and are never drafted again)."""
    from dspark_cluster.speculative.verify_budget import extrapolate_survival

    mean = np.array([0.8, 0.6, 0.45, 0.0, 0.0, 0.0])
    out = extrapolate_survival(mean, np.array([900, 900, 900, 3, 0, 0]), 20)
    assert out[:3].tolist() == [0.8, 0.6, 0.45]
    np.testing.assert_allclose(out[3:], 0.45 * 0.75 ** np.arange(1, 4))
    assert extrapolate_survival(mean, np.zeros(6), 20).tolist() == [0.0] * 6  # nothing known: nothing drafts
    full = extrapolate_survival(mean, np.full(6, 100), 20)
    assert full.tolist() == mean.tolist()
    # the planner then drafts past 3 where the step cost allows it
    planner = VerifyPlanner(6, StepCost([1, 64], [0.01, 0.0101]), "dspark")
    rng = np.random.default_rng(0)
    conf = np.full((400, 6), np.nan)
    conf[:, :3] = rng.uniform(0.7, 0.9, (400, 3))
    acc = (rng.uniform(size=(400, 3)) < conf[:, :3]).cumprod(1).sum(1)
    planner.observe(conf, np.full(400, 3), acc)
    assert planner.fitted and planner.draft_len(1) > 3


def test_a_drafting_step_pays_the_host_time_a_plain_step_hides():
    """With async scheduling a plain step hides the host's work; a drafting step cannot: the planner
    counts it against drafting (on Ray the Router's ~1-2 ms a step decided batch 8 here)."""
    planner = VerifyPlanner(4, StepCost([1, 8, 40], [0.004, 0.005, 0.009]), "dspark")
    planner.mean_survival = np.array([0.8, 0.6, 0.45, 0.3])
    planner.draft_cost.observe(8, 1, 0.001)
    assert planner.draft_len(8) > 0
    for _ in range(200):
        planner.observe_host(0.008)
    planner._memo.clear()
    assert planner.hidden_host_s == pytest.approx(0.008, rel=0.01) and planner.draft_len(8) == 0


def test_a_fresh_planner_stops_learning_where_a_typical_drafter_would_not_pay():
    """No outcomes yet: the first step learns on a few rows; once it has measured the drafter's cost, the
    planner keeps learning only at a load where a drafter of a typical survival would pay."""
    planner = VerifyPlanner(4, StepCost([1, 8, 64, 320], [0.002, 0.004, 0.012, 0.05]), "dspark")
    assert planner.draft_len(48) == 4 and planner.exploring  # learning: nothing is measured yet
    planner.drafted(4, 4, 0.05)  # the first call computes the prompts' context: slow
    assert planner.draft_len(48) == 4  # (one call is not a measurement)
    for _ in range(2):
        planner.drafted(4, 4, 0.006)  # then 6 ms for 4 rows
    assert planner.draft_len(48) == 0 and not planner.exploring  # at 48 rows it could not pay
    assert planner.draft_len(1) == 4 and planner.exploring  # at 1 row it could: keep learning


def test_a_closed_prior_gate_still_explores_at_the_paced_rate():
    """The gate is a guess from a cost measured once (a start-up profile on a busy machine reads the drafter
    slow): with no outcomes and the gate closed, the paced exploration still drafts on a few rows now and
    then, so a wrong guess is corrected by live calls."""
    planner = VerifyPlanner(4, StepCost([1, 8, 64, 320], [0.002, 0.004, 0.012, 0.05]), "dspark")
    planner.clock = lambda: 1000.0
    for rows in (1, 4, 16):
        planner.draft_cost.observe(rows, 1, 0.5)  # a profile taken while the machine was busy: 500 ms a call
    decisions = [planner.draft_len(1) for _ in range(planner.explore_every + 1)]
    assert decisions[:-1] == [0] * planner.explore_every  # closed, even at 1 row
    assert decisions[-1] == 4 and planner.exploring and not planner._learning  # then one paced exploring step
    for _ in range(3):
        planner.drafted(1, 4, 0.0005)  # the drafter's real cost at 1 row, from live calls: 0.5 ms
    assert planner.draft_len(1) == 4 and planner._learning  # the gate opens: learn at 1 row


def test_the_prior_gate_does_not_reopen_as_decode_steps_slow_down():
    """Before any outcome the gate decides at the plain step's own correction for every step size: the decode
    steps' point rising with their contexts (1.5x), a prompt step's point left at its profile, must not make a
    drafting step (its cost interpolated between them) look cheap enough to reopen the gate."""
    profile = StepCost([8, 64, 256, 320], [0.003, 0.004, 0.010, 0.012])
    planner = VerifyPlanner(4, profile, "dspark")
    planner.prior_acceptance = 0.7  # (the profile is made for a drafter of 0.7 a position)
    for rows in (1, 4, 16):
        planner.draft_cost.observe(rows, 1, 0.001)
    assert planner._prior_k(48) == 0
    profile.observe(320, float(profile(320)))  # a prompt step (its tokens beyond the grid): as profiled
    for _ in range(300):
        profile.observe(48, 1.5 * float(profile._profile(48)))  # decode steps at 48 rows, slower as contexts grow
    planner._prior_memo.clear()
    assert planner._prior_k(48) == 0
    # the interpolated costs alone would have reopened it
    assert planner._best_k(48, planner.prior_acceptance ** np.arange(1, 5)) > 0


def test_a_drafting_step_slower_than_its_profile_stops_drafting_at_once():
    """A drafting step is chosen from a cost no live step has confirmed: when the first ones run slower than
    profiled (through Ray a 56-token step profiled 6.0 ms took 7.6-9.5 ms), the planner believes them at
    once, not after ~20 steps of an exponential average and the memoised choice (47 steps at a loss)."""
    def planner_at_8_rows():
        profile = StepCost([1, 8, 16, 64], [0.0017, 0.0030, 0.0040, 0.0090])
        planner = VerifyPlanner(6, profile, "dspark")
        planner.mean_survival = np.array([0.8, 0.65, 0.55, 0.45, 0.35, 0.3])
        planner.draft_cost.observe(8, 1, 0.0015)
        for _ in range(100):  # plain decode steps at 8 rows run as profiled
            planner.observe_step(8, float(profile(8)), 8, drafting=False)
        return planner, profile
    planner, profile = planner_at_8_rows()
    k = planner.draft_len(8)
    assert k > 0  # the profile says drafting pays
    drafting_steps = 0
    while k and drafting_steps < 100:
        drafting_steps += 1
        tokens = 8 * (1 + k)
        planner.observe_step(tokens, 1.5 * float(profile._profile(tokens)), 8, drafting=True)
        k = planner.draft_len(8)
    assert drafting_steps <= 2
    # the ratio expires: after ratio_horizon steps step_cost decides again (a burst of slow drafting steps, e.g.
    # a few long contexts, must not stop drafting for good), and a loss stops it again as fast
    for _ in range(planner.ratio_horizon):
        planner.observe_step(8, float(profile(8)), 8, drafting=False)
        assert planner.draft_len(8) == 0 or planner._drafting_ratio(8) == 1.0
    assert planner.draft_len(8) > 0
    # one slow step, plain or drafting, does not move the choice
    planner, profile = planner_at_8_rows()
    planner.observe_step(8, 3 * float(profile(8)), 8, drafting=False)
    k = planner.draft_len(8)
    planner.observe_step(8 * (1 + k), 3 * float(profile(8 * (1 + k))), 8, drafting=True)
    for _ in range(20):
        assert planner.draft_len(8) > 0
        planner.observe_step(8 * (1 + k), float(profile(8 * (1 + k))), 8, drafting=True)


def test_the_prior_gate_leaves_the_drafting_steps_ratio_to_the_learned_choice():
    """The first drafting steps (learning) may run slower than profiled (cold, few); the prior gate asks
    only whether a good drafter could pay at this load, so their ratio does not close it (it did at batch
    1 in process, where tiny-dspark pays 1.2x); the learned choice, once outcomes are in, uses it."""
    profile = StepCost([1, 8, 16, 64], [0.0015, 0.0020, 0.0025, 0.0050])
    planner = VerifyPlanner(6, profile, "dspark")
    for rows in (1, 4, 16):
        planner.draft_cost.observe(rows, 1, 0.003)
    assert planner.draft_len(1) == 6 and planner._learning
    for _ in range(2):  # two learning steps at 2x their profile
        planner.observe_step(7, 2 * float(profile(7)), 1, drafting=True)
    planner._prior_memo.clear()
    assert planner.draft_len(1) == 6 and planner._learning
    planner.mean_survival = 0.8 ** np.arange(1, 7)  # outcomes in: a drafter that pays only as profiled
    assert planner._best_k(1, planner.mean_survival) == 0
    planner.drafting_ratio.clear()
    assert planner._best_k(1, planner.mean_survival) > 0


def test_learning_drafts_the_length_the_prior_chose():
    """Before any outcome a draft model learns at the length a good drafter would pay at (its k forwards at
    the full k made the first request at batch 1 run at 0.52x of plain decoding in process)."""
    planner = VerifyPlanner(6, StepCost([1, 8, 64], [0.0015, 0.0020, 0.0050]), "draft_model")
    assert planner.draft_len(1) == 6 and planner._learning  # nothing measured: the full k
    for rows in (1, 4, 16):
        planner.draft_cost.observe(rows, 4, 0.0025 * rows ** 0.5)  # ~0.6 ms a forward at 1 row
    k = planner.draft_len(1)
    assert planner._learning and 0 < k < 6 and k == planner._prior_k(1)


def test_a_plain_steps_cost_is_learned_on_plain_decode_steps_only():
    """A drafting step's excess over its profile (at batch 1 in process: 1.7x, the export, 7 rows of logits,
    the verification) belongs to drafting, and a prompt chunk is not the profile's shape: learned by
    step_cost, both reached the plain step's estimate through its neighbours' correction (2.1-2.5 ms against
    a real 1.5-1.7), and DSpark drafted at batch 1 at 0.73-0.77x of plain decoding (BENCHMARKS.md, session 17). And an exploring drafter call,
    which catches up on every token since drafting stopped, is not what drafting costs."""
    profile = StepCost([1, 8, 16, 64], [0.0015, 0.0020, 0.0025, 0.0050])
    planner = VerifyPlanner(6, profile, "dspark")
    planner.mean_survival = 0.7 ** np.arange(1, 7)
    for _ in range(9):
        planner.draft_cost.observe(1, 1, 0.002)
    assert planner.draft_len(1) > 0  # by the profile, drafting pays at batch 1 (a little over the margin)
    for _ in range(100):
        planner.observe_step(7, 1.7 * float(profile._profile(7)), 1, drafting=True)
        planner.observe_step(40, 1.8 * float(profile._profile(40)), 1)  # a prompt chunk
        planner.observe_step(1, 1.3 * float(profile._profile(1)), 1)  # a plain decode step amid drafting (cold)
    assert float(planner.step_cost(1)) == pytest.approx(float(profile._profile(1)))
    assert planner.draft_len(1) == 0  # drafting steps at 1.7x their profile do not pay
    for _ in range(planner.plain_warm + 1):  # a run of plain steps is learned from its plain_warm-th on
        planner.observe_step(1, 1.2 * float(profile._profile(1)), 1)
    assert float(planner.step_cost(1)) == pytest.approx(1.2 * float(profile._profile(1)))
    planner.exploring, planner._learning = True, False
    planner.drafted(1, 6, 0.006)  # an exploring call catching up: 3x a drafting call
    assert planner.draft_cost.per_forward_s(1) == pytest.approx(0.002)
    for _ in range(5):  # under half the belief: the belief was wrong (a profile read on a busy machine)
        planner.drafted(1, 6, 0.0008)
    assert planner.draft_cost.per_forward_s(1) == pytest.approx(0.0008)


def test_drafting_that_delivers_less_than_plain_decoding_stops_at_that_load():
    """The cost model says drafting pays at 8 rows; the steps say otherwise (tokens per second of the step
    period, drafter and host included: through Ray a fresh engine that learned at 8 rows drafted at 0.53-0.63x
    of plain decoding, BENCHMARKS.md session 22). Drafting stops at that load once drafting steps of VETO_ROUNDS
    rows in all (4 steps of 8 rows) delivered under 0.9x of the plain steps there (or, with no plain steps seen
    there, of the plain step's model), not at other loads, and is judged afresh when the evidence ages out
    (ratio_horizon steps)."""
    profile = StepCost([1, 8, 16, 64], [0.0015, 0.0020, 0.0025, 0.0050])
    planner = VerifyPlanner(6, profile, "dspark")
    planner.mean_survival = 0.9 ** np.arange(1, 7)
    for _ in range(9):
        planner.draft_cost.observe(8, 1, 0.001)
        planner.draft_cost.observe(1, 1, 0.0005)
    assert planner.draft_len(8) > 0 and planner.draft_len(1) > 0  # by the model, drafting pays at both
    plain_8 = 8 / 0.0020  # tokens/s of a plain step at 8 rows
    for _ in range(2):
        planner.observe_delivery(8, 8, 0.0020, drafting=False)
        planner.observe_delivery(8, 24, 0.0120, drafting=True)  # 2,000 tokens/s: half of plain's
    planner.observe_delivery(8, 24, 0.0120, drafting=True)
    assert not planner.delivery_vetoes(8)  # three are not yet evidence
    planner.observe_delivery(8, 24, 0.0120, drafting=True)
    assert planner.delivery_vetoes(8)  # against the model's plain step (2 measured plain steps are too few)
    planner.observe_delivery(8, 8, 0.0020, drafting=False)
    assert planner.delivery_vetoes(8) and plain_8 > 2000  # and against the measured ones
    planner._memo.clear()
    assert planner.draft_len(8) == 0 and planner.draft_len(6) == 0  # 6 rows: the nearest power of 2 is 8 too
    for _ in range(4):  # at 1 row drafting delivers about as much as plain decoding (0.93x): it goes on there
        # (4 one-row steps are no evidence either way)
        planner.observe_delivery(1, 1, 0.0015, drafting=False)
        planner.observe_delivery(1, 4, 0.0064, drafting=True)
    assert not planner.delivery_vetoes(1) and planner.draft_len(1) > 0
    # one row's steps vary with its acceptance (1 to k + 1 tokens): a hard stretch of text is not evidence
    # (in process 4 such steps at batch 1 stopped drafting for 256 steps where it paid 1.7x); VETO_ROUNDS rows are
    for _ in range(6):
        planner.observe_delivery(1, 1, 0.0060, drafting=True)  # 167 tokens/s against plain's 667
    assert not planner.delivery_vetoes(1)
    for _ in range(VETO_ROUNDS - 10):  # the rate is the steps' tokens over their seconds, 4 + 6 above included
        planner.observe_delivery(1, 2, 0.0060, drafting=True)
    assert planner.delivery_vetoes(1)
    for _ in range(VETO_ROUNDS):  # and a good stretch undoes it: 1,000 tokens/s
        planner.observe_delivery(1, 6, 0.0060, drafting=True)
    assert not planner.delivery_vetoes(1) and planner.draft_len(1) > 0
    for _ in range(planner.ratio_horizon):  # the evidence ages out: the model decides again
        planner.observe_delivery(1, 1, 0.0015, drafting=False)
    assert not planner.delivery_vetoes(8) and planner.draft_len(8) > 0


def test_learning_that_delivers_less_than_plain_decoding_stops_at_that_load():
    """Before any outcome the prior gate decides (a good drafter's acceptance, the start-up profile); where its
    learning steps deliver less than plain decoding, learning stops at that load as drafting does (through Ray
    the gate at 8 rows opens or not by the profile's noise, and learning there lost: BENCHMARKS.md session 22)."""
    profile = StepCost([1, 8, 16, 64], [0.0015, 0.0020, 0.0025, 0.0050])
    planner = VerifyPlanner(6, profile, "dspark")
    for _ in range(9):
        planner.draft_cost.observe(8, 1, 0.0005)
    assert planner.mean_survival is None and planner.draft_len(8) > 0 and planner._learning
    for _ in range(4):
        planner.observe_delivery(8, 12, 0.0100, drafting=True)  # 1,200 tokens/s against plain's 4,000
    assert planner.draft_len(8) == 0 and not planner._learning


def test_the_prior_gate_shut_at_fewer_rows_stays_shut_at_more():
    """Drafting pays less the more rows a step holds; a prior gate that reads open at 16 rows but shut at 8 and 4
    reads a bump in the start-up profile (through Ray one fresh engine's profile put the prior's gain at 1.31x at
    16 rows against 1.04x at 8), and learning there would draft at a loss: shut at 16 too."""
    profile = StepCost([1, 8, 16, 32, 64, 128], [0.0015, 0.0020, 0.0060, 0.0062, 0.0065, 0.0090])
    planner = VerifyPlanner(6, profile, "dspark")
    for rows, seconds in ((1, 0.0005), (2, 0.001), (4, 0.002), (8, 0.003), (16, 0.003)):
        for _ in range(9):
            planner.draft_cost.observe(rows, 1, seconds)
    gain = {n: planner.prior_gain(n) for n in (1, 2, 4, 8, 16)}
    assert gain[1] > gain[2] > 1.1 and gain[4] < 1.1 and gain[8] < 1.1 and gain[16] > 2  # the bump at 16
    assert planner.draft_len(1) > 0 and planner.draft_len(2) > 0 and planner._learning
    assert planner.draft_len(4) == 0 and planner.draft_len(8) == 0 and planner.draft_len(16) == 0
    assert not planner._learning
