"""Paired bootstrap: bounds derived by hand for small fixed cases, and the algorithm pinned."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from flywheel.stats import paired_bootstrap


def test_hand_computed_bounds_four_items():
    # champion [0,0,0,1], challenger [1,1,1,1] -> d = [1,1,1,0]: 3 wins, 0 losses, 1 tie, diff 0.75.
    # A resample of 4 items has mean K/4 with K ~ Binomial(4, 3/4):
    #   P(K=0) = 1/256 = 0.0039, P(K=1) = 12/256 = 0.0469 (cdf 0.0508), P(K=2) = 54/256 (cdf 0.262),
    #   P(K=3) = 108/256 (cdf 0.684), P(K=4) = 81/256 = 0.316.
    # 95% percentile bounds: the 2.5% quantile lies in the K=1 mass (0.0039 < 0.025 < 0.0508) -> 0.25;
    # the 97.5% quantile lies in the K=4 mass (0.684 < 0.975) -> 1.0. With B = 2000 resamples the
    # 2.5% order statistics (positions 49.975 and 50.975) are K=1 unless fewer than 51 of 2000 draws
    # have K <= 1 (expected 101.6, sd 9.8) or more than 49 have K = 0 (expected 7.8): both > 5 sd away,
    # so the bounds are [0.25, 1.0] for any seed; seed 0 is the documented case.
    r = paired_bootstrap([0, 0, 0, 1], [1, 1, 1, 1], samples=2000, confidence=0.95, seed=0)
    assert (r.lo, r.hi) == (0.25, 1.0)
    assert (r.n, r.wins, r.losses, r.ties) == (4, 3, 0, 1)
    assert r.diff == pytest.approx(0.75)
    assert (r.champion_rate, r.challenger_rate) == (0.25, 1.0)
    for seed in (1, 2, 3):
        r = paired_bootstrap([0, 0, 0, 1], [1, 1, 1, 1], samples=2000, confidence=0.95, seed=seed)
        assert (r.lo, r.hi) == (0.25, 1.0)


def test_hand_computed_bounds_ten_items_with_ties():
    # d = challenger - champion = [0,0,1,1,0,0,0,1,0,0]: 3 wins, 7 ties. Resample mean = K/10 with
    # K ~ Binomial(10, 0.3): cdf(0) = 0.028, cdf(1) = 0.149, cdf(4) = 0.850, cdf(5) = 0.953.
    # 90% bounds = 5% and 95% quantiles -> K = 1 and K = 5 -> [0.1, 0.5] (seed 7, B = 1000).
    champion = [1, 1, 0, 0, 1, 0, 1, 0, 0, 0]
    challenger = [1, 1, 1, 1, 1, 0, 1, 1, 0, 0]
    r = paired_bootstrap(champion, challenger, samples=1000, confidence=0.90, seed=7)
    assert (r.lo, r.hi) == pytest.approx((0.1, 0.5))
    assert (r.wins, r.losses, r.ties) == (3, 0, 7)
    assert r.diff == pytest.approx(0.3)


def test_equal_models_interval_straddles_zero():
    # d = [1,-1,1,-1]: resample mean = (2K - 4)/4 with K ~ Binomial(4, 1/2): values -1 (1/16),
    # -0.5 (4/16), 0 (6/16), 0.5 (4/16), 1 (1/16). 80% bounds: 10% quantile in the -0.5 mass
    # (cdf 0.0625 < 0.1 < 0.3125), 90% in the 0.5 mass (0.6875 < 0.9 < 0.9375) -> [-0.5, 0.5].
    r = paired_bootstrap([1, 0, 1, 0], [0, 1, 0, 1], samples=200, confidence=0.80, seed=3)
    assert (r.lo, r.hi) == (-0.5, 0.5)
    assert r.diff == 0.0 and r.wins == 2 and r.losses == 2


def test_matches_exact_bootstrap_distribution():
    # Exact bootstrap: all 4^4 = 256 index tuples. The Monte Carlo interval at B = 20000 must land
    # on the exact percentile values of that distribution (a discrete one, so exact equality).
    d = np.array([1.0, 0.0, -1.0, 1.0])
    exact = np.array([d[list(idx)].mean() for idx in itertools.product(range(4), repeat=4)])
    lo_e, hi_e = np.percentile(exact, [2.5, 97.5])
    r = paired_bootstrap([0, 1, 1, 0], [1, 1, 0, 1], samples=20000, confidence=0.95, seed=11)
    assert (r.lo, r.hi) == (lo_e, hi_e) == (-0.5, 1.0)


def test_algorithm_is_the_documented_one():
    # The docstring's algorithm, written out: same numbers for a suite small enough for one chunk.
    rng_champ = np.random.default_rng(5).integers(0, 2, 37)
    rng_chall = np.random.default_rng(6).integers(0, 2, 37)
    r = paired_bootstrap(rng_champ, rng_chall, samples=500, confidence=0.9, seed=42)
    d = (rng_chall - rng_champ).astype(float)
    idx = np.random.Generator(np.random.PCG64(42)).integers(0, 37, size=(500, 37))
    lo, hi = np.percentile(d[idx].mean(axis=1), [5.0, 95.0])
    assert (r.lo, r.hi) == (lo, hi)


def test_chunked_draws_bound_memory_and_stay_reproducible():
    # 5000 items x 2000 samples = 10M indices: drawn in chunks of 838 rows (4,194,304 // 5000).
    a = np.random.default_rng(0).random(5000) < 0.5
    b = np.random.default_rng(1).random(5000) < 0.6
    r1 = paired_bootstrap(a, b, samples=2000, seed=9)
    r2 = paired_bootstrap(a, b, samples=2000, seed=9)
    assert (r1.lo, r1.hi) == (r2.lo, r2.hi)
    assert r1.lo < r1.diff < r1.hi
    # the CI half-width of a paired difference of ~50%/60% rates on 5000 items is ~0.02
    assert 0.01 < (r1.hi - r1.lo) / 2 < 0.03


def test_empty_and_invalid_inputs():
    r = paired_bootstrap([], [], samples=100)
    assert r.n == 0 and math.isnan(r.lo) and math.isnan(r.hi)
    with pytest.raises(ValueError, match="equal length"):
        paired_bootstrap([1, 0], [1])
    with pytest.raises(ValueError, match="confidence"):
        paired_bootstrap([1], [1], confidence=1.0)
