"""The gate's statistics against published worked examples, brute-force enumeration and scipy."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats as st

from flywheel.stats import (
    _critical_wins,
    exact_power,
    items_needed,
    min_detectable_improvement,
    newcombe_paired_interval,
    sign_test,
    wilson,
)


def test_wilson_known_values():
    # Classic values (Newcombe 1998a, table I): 0/10 -> [0, 0.2775], 5/10 -> [0.2366, 0.7634].
    assert wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson(0, 0) == (0.0, 1.0)
    assert wilson(0, 7)[0] == 0.0 and wilson(7, 7)[1] == 1.0  # exact at the ends, no float residue
    lo90, hi90 = wilson(5, 10, 0.90)
    assert 0.2366 < lo90 and hi90 < 0.7634  # a lower level gives a narrower interval
    with pytest.raises(ValueError):
        wilson(11, 10)


def test_newcombe_paired_worked_example():
    # Fagerland, Lydersen & Laake (2017), ch. 8, complete response before/after consolidation therapy
    # (Cavo et al. 2012): table [[59, 6], [16, 80]] -> -0.0621, 95% CI (-0.1186, -0.0046).
    lo, hi = newcombe_paired_interval(59, 6, 16, 80)
    assert (lo, hi) == pytest.approx((-0.1186, -0.0046), abs=5e-5)


def test_newcombe_properties():
    for both, wins, losses, neither in [(0, 4, 0, 5), (3, 12, 1, 24), (10, 0, 0, 10), (0, 0, 7, 3), (5, 5, 5, 5)]:
        n = both + wins + losses + neither
        d = (wins - losses) / n
        lo, hi = newcombe_paired_interval(both, wins, losses, neither)
        assert -1 <= lo <= d <= hi <= 1
        # Swapping the models mirrors the interval.
        mlo, mhi = newcombe_paired_interval(both, losses, wins, neither)
        assert (mlo, mhi) == pytest.approx((-hi, -lo), abs=1e-12)
        # A one-sided bound at 95% sits between the two-sided 95% lower end and the estimate.
        one, _ = newcombe_paired_interval(both, wins, losses, neither, sided="lower")
        assert lo <= one <= d
    assert all(math.isnan(x) for x in newcombe_paired_interval(0, 0, 0, 0))
    with pytest.raises(ValueError):
        newcombe_paired_interval(1, -1, 0, 0)


def test_sign_test_is_the_exact_binomial_tail():
    assert sign_test(4, 0) == pytest.approx(1 / 16, abs=1e-15)
    assert sign_test(12, 1) == pytest.approx(14 / 8192, abs=1e-15)
    assert sign_test(0, 0) == 1.0 and sign_test(0, 7) == 1.0
    for w, n in itertools.product(range(0, 25), range(1, 25)):
        if w <= n:
            assert sign_test(w, n - w) == pytest.approx(sum(math.comb(n, k) for k in range(w, n + 1)) / 2**n, abs=1e-12)


def test_critical_wins_match_a_scan():
    for alpha in (0.01, 0.05, 0.1):
        ds = np.arange(0, 200)
        crit = _critical_wins(ds, alpha)
        for d, k in zip(ds, crit, strict=True):
            if d == 0:
                continue
            scan = next((k2 for k2 in range(d + 1) if st.binom.sf(k2 - 1, d, 0.5) <= alpha), d + 1)
            assert k == scan, (alpha, d)


def _brute_power(n: int, p_win: float, p_loss: float, alpha: float) -> float:
    """Enumerate every (wins, losses) outcome of n items and add the probability of the rejecting ones."""
    total = 0.0
    p_tie = 1 - p_win - p_loss
    for w in range(n + 1):
        for loss in range(n + 1 - w):
            prob = math.factorial(n) / (math.factorial(w) * math.factorial(loss) * math.factorial(n - w - loss))
            prob *= p_win**w * p_loss**loss * p_tie ** (n - w - loss)
            if sign_test(w, loss) <= alpha:
                total += prob
    return total


def test_exact_power_equals_brute_force_enumeration():
    for n, pw, pl in [(9, 0.4, 0.0), (12, 0.3, 0.1), (20, 0.25, 0.05), (15, 0.1, 0.1)]:
        assert exact_power(n, pw, pl, 0.05) == pytest.approx(_brute_power(n, pw, pl, 0.05), abs=1e-10)
    assert exact_power(4, 1.0, 0.0, 0.05) == 0.0  # 4 wins of 4 give p = 1/16: never significant
    assert exact_power(5, 1.0, 0.0, 0.05) == pytest.approx(1.0)  # 5 of 5 give 1/32


def test_items_needed_and_minimum_detectable_improvement_are_consistent():
    need = items_needed(0.3, 0.05, 0.05)
    assert exact_power(need, 0.3, 0.05, 0.05) >= 0.8
    assert all(exact_power(m, 0.3, 0.05, 0.05) >= 0.8 for m in range(need, need + 11))
    assert exact_power(need - 1, 0.3, 0.05, 0.05) < 0.8
    assert items_needed(0.1, 0.1, 0.05) is None and items_needed(0.0, 0.2, 0.05) is None
    # The floor of what a 9-item suite can show: ~63 points with no losses; 40 items: ~16 points.
    mde9, mde40 = min_detectable_improvement(9, 0.05), min_detectable_improvement(40, 0.05)
    assert 0.6 < mde9 < 0.67 and 0.15 < mde40 < 0.17
    assert exact_power(40, mde40, 0.0, 0.05) >= 0.8 > exact_power(40, mde40 - 0.002, 0.0, 0.05)
    # At a fixed disagreement rate, the detectable improvement is larger than with no losses.
    assert min_detectable_improvement(40, 0.05, discordance=0.4) > mde40
    assert min_detectable_improvement(40, 0.05, discordance=0.05) is None  # 2 discordant items can't pass
