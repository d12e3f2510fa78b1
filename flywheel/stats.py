"""The statistics the gate decides with, as pure functions of paired pass/fail counts.

Two models scored on the same ``n`` held-out items give a paired 2x2 table::

                       champion pass   champion fail
    challenger pass        both             wins
    challenger fail       losses         neither

Only the discordant items (``wins`` and ``losses``) carry information about which model is better;
the gate decides on them with an **exact** test and bounds the effect with a **score** interval,
both of which hold their level at the small sizes a held-out suite has. The percentile bootstrap
(:func:`paired_bootstrap`) is kept as a descriptive effect-size interval only: at small ``n`` it is
anti-conservative (3 wins and 1 loss on 4 items gives a bootstrap lower bound of 0 at 95%, and 4 wins
on 9 items one of +11%, while the exact test gives p = 0.31 and p = 0.0625).

- :func:`sign_test`: McNemar's exact test, one-sided: ``P(X >= wins)`` for ``X ~ Binomial(wins +
  losses, 1/2)`` (under "no difference" each discordant item is a fair coin). Computed by
  ``scipy.stats.binomtest(..., alternative="greater")``.
- :func:`newcombe_paired_interval`: Newcombe's hybrid score interval for the difference of paired
  proportions (Newcombe 1998, *Statistics in Medicine* 17:2635-2650, method 10; the "square-and-add"
  interval of Fagerland, Lydersen & Laake, *Statistical Analysis of Contingency Tables*, 2017,
  ch. 8): Wilson intervals of the two marginal pass rates combined with the correlation of the two
  models on the same items. It is closed-form, never leaves [-1, 1], and keeps close to nominal
  coverage down to n ~ 10 where Wald and the bootstrap do not.
- :func:`exact_power`, :func:`items_needed`, :func:`min_detectable_improvement`: the sign test's
  exact power under a multinomial model of the paired table (each item independently a win with
  probability ``p_win``, a loss with ``p_loss``), so the report can say how many items an observed
  effect would need and what a suite of this size can detect.
- :func:`wilson`: the Wilson score interval of one pass rate.
- :func:`paired_stats`: all of the above for two aligned pass/fail vectors, as the gate reports them
  (:class:`PairedStats`); :func:`compute_slices`: the paired pass rates, wins and losses per slice
  label (:class:`SliceResult`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as _st

__all__ = [
    "POWER",
    "BootstrapResult",
    "PairedItem",
    "PairedStats",
    "SliceResult",
    "compute_slices",
    "exact_power",
    "items_needed",
    "min_detectable_improvement",
    "newcombe_paired_interval",
    "paired_bootstrap",
    "paired_stats",
    "sign_test",
    "wilson",
]

# Rows of the bootstrap index matrix drawn per call: bounds memory at ~32 MiB of int64 indices
# (4,194,304 entries) whatever the suite size. Part of the algorithm's definition (see
# paired_bootstrap): the draws depend on it only when a suite has more than 2,097 items.
_BOOTSTRAP_CHUNK_ENTRIES = 1 << 22

# items_needed searches up to this many items; beyond it the effect is reported as out of reach.
MAX_ITEMS_SEARCHED = 100_000


def _z(confidence: float) -> float:
    return float(_st.norm.ppf(confidence))


def wilson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Two-sided Wilson score interval of a binomial proportion ``k / n`` at ``confidence``.

    Sane at 0 and n, unlike Wald (``wilson(0, 10)`` is ``(0.0, 0.278)``); ``(0.0, 1.0)`` when
    ``n == 0`` (nothing observed, nothing excluded).
    """
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= k <= n:
        raise ValueError(f"wilson needs 0 <= k <= n (got k={k}, n={n})")
    z = _z(1.0 - (1.0 - confidence) / 2.0)
    p = k / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    # At k = 0 (k = n) the lower (upper) limit is exactly 0 (1); floating point leaves ~1e-17.
    lo = 0.0 if k == 0 else max(0.0, centre - half)
    hi = 1.0 if k == n else min(1.0, centre + half)
    return lo, hi


def sign_test(wins: int, losses: int) -> float:
    """One-sided exact McNemar (sign) test p-value that the challenger is better.

    ``P(X >= wins)`` for ``X ~ Binomial(wins + losses, 1/2)``; 1.0 when there is no discordant item
    (no evidence either way). 4 wins and 0 losses give ``1/16 = 0.0625``; 12 wins and 1 loss give
    ``14/8192 = 0.0017``.
    """
    if wins < 0 or losses < 0:
        raise ValueError(f"wins and losses must be >= 0 (got {wins}, {losses})")
    n = wins + losses
    if n == 0:
        return 1.0
    return float(_st.binomtest(int(wins), int(n), 0.5, alternative="greater").pvalue)


def newcombe_paired_interval(
    both: int, wins: int, losses: int, neither: int, *, confidence: float = 0.95, sided: str = "two"
) -> tuple[float, float]:
    """Newcombe's hybrid score interval for ``challenger rate - champion rate`` on paired items.

    ``both``: items both models pass; ``wins``: challenger only; ``losses``: champion only;
    ``neither``: items both fail. ``sided="two"`` gives the two-sided interval at ``confidence``;
    ``sided="lower"`` gives the one-sided lower bound at ``confidence`` (the upper end is then the
    two-sided bound at ``2 * confidence - 1``, reported for completeness).

    With ``p1 = (both + wins) / n`` (challenger), ``p2 = (both + losses) / n`` (champion), their
    Wilson limits ``(l1, u1)``, ``(l2, u2)`` and the continuity-adjusted phi coefficient ``psi`` of
    the 2x2 table (0 when ``|both * neither - wins * losses| <= n / 2`` for positive association)::

        L = (p1 - p2) - sqrt((p1 - l1)^2 + (u2 - p2)^2 - 2 psi (p1 - l1)(u2 - p2))
        U = (p1 - p2) + sqrt((p2 - l2)^2 + (u1 - p1)^2 - 2 psi (p2 - l2)(u1 - p1))

    Worked example (Fagerland et al. 2017, table 8.x, Cavo et al. 2012): counts (59, 6, 16, 80)
    give -0.0621 with 95% interval (-0.1186, -0.0046).
    """
    counts = (both, wins, losses, neither)
    if any(c < 0 for c in counts):
        raise ValueError(f"counts must be >= 0 (got {counts})")
    if not 0.5 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0.5, 1) (got {confidence})")
    if sided not in ("two", "lower"):
        raise ValueError(f"sided must be 'two' or 'lower' (got {sided!r})")
    n = both + wins + losses + neither
    if n == 0:
        return float("nan"), float("nan")
    # A one-sided bound at c is the lower end of the two-sided interval at 2c - 1.
    level = confidence if sided == "two" else 2.0 * confidence - 1.0
    r1, r2 = both + wins, both + losses  # challenger passes, champion passes
    p1, p2 = r1 / n, r2 / n
    l1, u1 = wilson(r1, n, level)
    l2, u2 = wilson(r2, n, level)
    if r1 in (0, n) or r2 in (0, n):
        psi = 0.0
    else:
        a = both * neither - wins * losses
        denom = math.sqrt(r1 * (n - r1) * r2 * (n - r2))
        psi = (a - n / 2) / denom if a > n / 2 else (0.0 if a >= 0 else a / denom)
    d = p1 - p2
    lo = d - math.sqrt(max(0.0, (p1 - l1) ** 2 + (u2 - p2) ** 2 - 2 * psi * (p1 - l1) * (u2 - p2)))
    hi = d + math.sqrt(max(0.0, (p2 - l2) ** 2 + (u1 - p1) ** 2 - 2 * psi * (p2 - l2) * (u1 - p1)))
    return max(-1.0, lo), min(1.0, hi)


def _critical_wins(discordant: np.ndarray, alpha: float) -> np.ndarray:
    """Smallest win count ``k`` with ``P(X >= k | D, 1/2) <= alpha`` for each discordant count ``D``
    (``D + 1`` when even ``k = D`` is not enough: 4 discordant items can never reach 0.05).

    ``binom.isf(alpha, D, 1/2)`` is the smallest ``k`` with ``P(X > k) <= alpha``, so ``k + 1`` is the
    critical count (checked against a per-``D`` scan in the tests).
    """
    d = np.asarray(discordant)
    k = _st.binom.isf(alpha, d, 0.5) + 1
    k = np.where(d == 0, 1, k)
    return np.minimum(k, d + 1).astype(np.int64)


def exact_power(n: int, p_win: float, p_loss: float, alpha: float) -> float:
    """Probability that the one-sided sign test at ``alpha`` rejects on ``n`` paired items when each
    item is independently a win with probability ``p_win`` and a loss with ``p_loss``.

    Exact: ``sum_D P(D) * P(W >= k_alpha(D) | D)`` with ``D ~ Binomial(n, p_win + p_loss)`` discordant
    items and ``W | D ~ Binomial(D, p_win / (p_win + p_loss))``.
    """
    if n <= 0:
        return 0.0
    if p_win < 0 or p_loss < 0 or p_win + p_loss > 1 + 1e-12:
        raise ValueError(f"need p_win, p_loss >= 0 and p_win + p_loss <= 1 (got {p_win}, {p_loss})")
    psi = p_win + p_loss
    if psi <= 0:
        return 0.0
    ds = np.arange(n + 1)
    k = _critical_wins(ds, alpha)
    p_d = _st.binom.pmf(ds, n, min(psi, 1.0))
    p_reject = _st.binom.sf(k - 1, ds, p_win / psi)
    return float(np.clip(np.sum(p_d * p_reject), 0.0, 1.0))


def items_needed(p_win: float, p_loss: float, alpha: float, power: float = 0.8) -> int | None:
    """The smallest number of paired items at which the sign test reaches ``power`` for this effect.

    ``None`` when the effect is not an improvement (``p_win <= p_loss``) or needs more than
    :data:`MAX_ITEMS_SEARCHED` items. The exact power is not monotone in ``n`` (discreteness), so the
    answer is the first ``n`` from which it stays at or above ``power`` over the next 10 sizes.
    Brackets around Connor's normal approximation (Connor 1987, *Biometrics* 43:207-211), then
    bisects on the exact power.
    """
    delta, psi = p_win - p_loss, p_win + p_loss
    if delta <= 0 or psi <= 0:
        return None

    def powered(m: int) -> bool:
        return exact_power(m, p_win, p_loss, alpha) >= power

    za, zb = _z(1 - alpha), _z(power)
    approx = (za * math.sqrt(psi) + zb * math.sqrt(max(psi - delta * delta, 0.0))) ** 2 / (delta * delta)
    hi = max(1, math.ceil(approx))
    while not powered(hi):
        hi = math.ceil(hi * 1.25) + 1
        if hi > MAX_ITEMS_SEARCHED:
            return None
    lo = hi // 2
    while lo >= 1 and powered(lo):
        lo //= 2
    while hi - lo > 1:  # invariant: lo unpowered (or 0), hi powered
        mid = (lo + hi) // 2
        if powered(mid):
            hi = mid
        else:
            lo = mid
    n = hi
    while n <= MAX_ITEMS_SEARCHED:
        dips = [m for m in range(n + 1, n + 11) if not powered(m)]
        if not dips:
            return n
        n = dips[-1] + 1
    return None


def min_detectable_improvement(
    n: int, alpha: float, power: float = 0.8, *, discordance: float | None = None
) -> float | None:
    """The smallest improvement in pass rate the sign test detects with ``power`` on ``n`` items.

    ``discordance``: the share of items on which the two models disagree (``p_win + p_loss``),
    typically the observed one; the improvement ``delta = p_win - p_loss`` then ranges over
    ``(0, discordance]``. ``None`` (the default) assumes the most favourable case, no losses
    (``discordance = delta``), which is the floor below which no improvement can be shown at this
    size whatever the models do. Returns ``None`` when no improvement up to ``discordance`` reaches
    ``power``. Bisection to 1e-4.
    """
    if n <= 0:
        return None

    def pw(delta: float) -> float:
        if discordance is None:
            return exact_power(n, delta, 0.0, alpha)
        return exact_power(n, (discordance + delta) / 2, (discordance - delta) / 2, alpha)

    top = 1.0 if discordance is None else min(1.0, discordance)
    if top <= 0 or pw(top) < power:
        return None
    lo, hi = 0.0, top
    while hi - lo > 1e-4:
        mid = (lo + hi) / 2
        if pw(mid) >= power:
            hi = mid
        else:
            lo = mid
    return hi


# ------------------------------------------------------------------------------ paired bootstrap


@dataclass(frozen=True)
class BootstrapResult:
    """Paired bootstrap of the difference in pass rate (challenger - champion) on the same items.

    ``wins``: items the challenger passes and the champion fails; ``losses``: the reverse;
    ``ties``: both pass or both fail. ``lo``/``hi`` are the percentile-method bounds at
    ``confidence``; NaN when there are no items.
    """

    n: int
    champion_rate: float
    challenger_rate: float
    diff: float
    lo: float
    hi: float
    confidence: float
    samples: int
    seed: int
    wins: int
    losses: int
    ties: int


def paired_bootstrap(
    champion: Sequence[float] | np.ndarray,
    challenger: Sequence[float] | np.ndarray,
    *,
    samples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> BootstrapResult:
    """Percentile-method paired bootstrap CI for mean(challenger - champion): an effect-size
    estimate for the report, never the decision (see the module docstring).

    Algorithm (exactly, so that a fixed seed gives fixed bounds):
    ``d = challenger - champion`` (per item, in {-1, 0, 1} for pass/fail);
    ``rng = numpy.random.Generator(numpy.random.PCG64(seed))``; resample item indices
    ``rng.integers(0, n, size=(rows, n))`` in consecutive chunks of
    ``rows = max(1, 4_194_304 // n)`` until ``samples`` rows are drawn; each row's statistic is
    ``d[idx].mean()``; the bounds are ``numpy.percentile(stats, [100 * (1 - c) / 2, 100 * (1 + c) / 2])``
    (linear interpolation, numpy's default). Resampling *pairs* keeps the correlation between the
    two models on the same item.
    """
    a = np.asarray(champion, dtype=np.float64)
    b = np.asarray(challenger, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired_bootstrap needs two 1-D arrays of equal length (got {a.shape} and {b.shape})")
    if samples < 1:
        raise ValueError(f"samples must be >= 1 (got {samples})")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1) (got {confidence})")
    n = int(a.shape[0])
    wins = int(np.sum(b > a))
    losses = int(np.sum(b < a))
    if n == 0:
        nan = float("nan")
        return BootstrapResult(0, nan, nan, nan, nan, nan, confidence, samples, seed, 0, 0, 0)
    d = b - a
    rng = np.random.Generator(np.random.PCG64(seed))
    rows = max(1, _BOOTSTRAP_CHUNK_ENTRIES // n)
    stats = np.empty(samples, dtype=np.float64)
    done = 0
    while done < samples:
        r = min(rows, samples - done)
        idx = rng.integers(0, n, size=(r, n))
        stats[done : done + r] = d[idx].mean(axis=1)
        done += r
    lo, hi = np.percentile(stats, [100.0 * (1.0 - confidence) / 2.0, 100.0 * (1.0 + confidence) / 2.0])
    return BootstrapResult(
        n=n,
        champion_rate=float(a.mean()),
        challenger_rate=float(b.mean()),
        diff=float(d.mean()),
        lo=float(lo),
        hi=float(hi),
        confidence=confidence,
        samples=samples,
        seed=seed,
        wins=wins,
        losses=losses,
        ties=n - wins - losses,
    )


# ------------------------------------------------------------------------------ the gate's paired table

POWER = 0.8  # of the "items needed" and "minimum detectable improvement" figures in the report


@dataclass(frozen=True)
class PairedStats:
    """Everything the gate measures on the paired held-out items (the methods: the functions above).

    ``p_value``: one-sided exact McNemar (sign) test of ``wins`` vs ``losses``. ``lower_bound``: the
    one-sided Newcombe hybrid-score lower bound of (challenger - champion) at ``confidence``;
    ``newcombe_lo``/``newcombe_hi``: the two-sided Newcombe interval. ``boot``: the paired
    percentile bootstrap, an effect-size estimate for the report only. ``mde``: the smallest
    improvement detectable with 80% power at this size in the most favourable case (no losses);
    ``mde_observed``: the same at the observed disagreement rate. ``items_needed``: paired items at
    which the observed win and loss rates would be detected with 80% power (``None`` when the
    observed effect is no improvement).
    """

    n: int
    both: int
    wins: int
    losses: int
    neither: int
    champion_rate: float
    challenger_rate: float
    diff: float
    p_value: float
    confidence: float
    lower_bound: float
    newcombe_lo: float
    newcombe_hi: float
    boot: BootstrapResult
    mde: float | None
    mde_observed: float | None
    items_needed: int | None

    @property
    def alpha(self) -> float:
        return round(1.0 - self.confidence, 12)  # 1 - 0.95 is 0.050000000000000044 in floats

    @property
    def ties(self) -> int:
        return self.both + self.neither


def paired_stats(
    champion: Sequence[bool | float], challenger: Sequence[bool | float], *, confidence: float = 0.95,
    bootstrap_samples: int = 2000, seed: int = 0,
) -> PairedStats:
    """The gate's statistics for two aligned pass/fail vectors (one entry per paired item)."""
    a = np.asarray(champion, dtype=bool)
    b = np.asarray(challenger, dtype=bool)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired_stats needs two 1-D arrays of equal length (got {a.shape} and {b.shape})")
    n = int(a.size)
    both, wins = int(np.sum(a & b)), int(np.sum(b & ~a))
    losses, neither = int(np.sum(a & ~b)), int(np.sum(~a & ~b))
    boot = paired_bootstrap(a.astype(float), b.astype(float), samples=bootstrap_samples,
                            confidence=confidence, seed=seed)
    alpha = 1.0 - confidence
    nan = float("nan")
    if n:
        lower, _ = newcombe_paired_interval(both, wins, losses, neither, confidence=confidence, sided="lower")
        nlo, nhi = newcombe_paired_interval(both, wins, losses, neither, confidence=confidence)
        discord = (wins + losses) / n
        mde_obs = min_detectable_improvement(n, alpha, POWER, discordance=discord) if discord > 0 else None
        needed = items_needed(wins / n, losses / n, alpha, POWER)
    else:
        lower = nlo = nhi = nan
        mde_obs = needed = None
    return PairedStats(
        n=n, both=both, wins=wins, losses=losses, neither=neither,
        champion_rate=float(a.mean()) if n else nan, challenger_rate=float(b.mean()) if n else nan,
        diff=(wins - losses) / n if n else nan, p_value=sign_test(wins, losses), confidence=confidence,
        lower_bound=lower, newcombe_lo=nlo, newcombe_hi=nhi, boot=boot,
        mde=min_detectable_improvement(n, alpha, POWER) if n else None, mde_observed=mde_obs, items_needed=needed,
    )


@dataclass(frozen=True)
class PairedItem:
    """One held-out item scored for both models. ``labels`` name the slices it belongs to."""

    task_id: str
    champion: bool
    challenger: bool
    labels: tuple[str, ...] = ()


@dataclass(frozen=True)
class SliceResult:
    name: str
    n: int
    champion_rate: float
    challenger_rate: float
    wins: int
    losses: int

    @property
    def delta(self) -> float:
        """challenger - champion (negative = regression)."""
        return self.challenger_rate - self.champion_rate


def compute_slices(items: Iterable[PairedItem]) -> list[SliceResult]:
    """Pass rates per slice label (an item may be in several slices), sorted by name."""
    acc: dict[str, list[int]] = {}
    for it in items:
        for label in dict.fromkeys(it.labels):  # an item counts once per slice
            s = acc.setdefault(label, [0, 0, 0, 0, 0])
            s[0] += 1
            s[1] += int(it.champion)
            s[2] += int(it.challenger)
            s[3] += int(it.challenger and not it.champion)
            s[4] += int(it.champion and not it.challenger)
    return [
        SliceResult(name, n, champ / n, chall / n, w, lo)
        for name, (n, champ, chall, w, lo) in sorted(acc.items())
    ]
